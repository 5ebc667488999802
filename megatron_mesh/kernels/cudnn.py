"""Tile kernel on torch's own cuDNN fused-attention op (`aten._scaled_dot_product_cudnn_attention`
and its backward): the cuDNN kernels Transformer Engine's fused attention calls, without TE.

fp16 / bf16 CUDA tensors on sm80 to sm121 with cuDNN >= 9, head dim a multiple of 8 up to
128 (`choice.cudnn_unsupported` says which inputs it takes). V may have its own head dim dv
(multi-latent attention; also a multiple of 8 up to 128): the op's schema has no head-dim
argument, and its meta function (torch/_meta_registrations.py) gives the output V's head
dim and dV V's shape, as its CUDA implementation (d_qk and d_v) does. K/V heads are repeated for GQA
inside the call: the op's acceptance of fewer K/V heads is not the same over the torch
releases this package supports (>= 2.5), so the kernel does not rely on it.

One layout: every tensor given to the op (q, k, v, and in the backward out and dout) is
the [b, h, s, d] view of a contiguous [s, b, h, d] tensor. torch caches the backward's
cuDNN graph on the shapes and strides of q, k and v only; with out and dout always laid
out like q, a cached graph is never reused for other strides.
"""
from __future__ import annotations

from typing import Any

import torch

from ..calls.tile_slices import DOCUMENTS, TileSlices
from .base import check_call
from .caps import KernelCaps, caps_of
from .choice import DeviceFacts, cudnn_unsupported
from .run_calls import DenseOp, slices_backward, slices_forward
from .torch_flash import sbhd, sum_kv_grad

aten = torch.ops.aten


def unsupported(device: torch.device, dtype: torch.dtype, head_dim: int,
                v_head_dim: int | None = None) -> str | None:
    """Why this kernel cannot run tiles of `dtype` with `head_dim` (and V's `v_head_dim`)
    on `device`, or None."""
    return cudnn_unsupported(DeviceFacts.of(device, want_te=False), dtype, head_dim, v_head_dim)


def one_layout(t: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """[s, b, h, d] (any strides) -> the [b, h * groups, s, d] view of a contiguous
    [s, b, h * groups, d] tensor (heads repeated `groups` times each); a copy only where
    `t` is not contiguous or heads are repeated."""
    if groups > 1:
        t = t.repeat_interleave(groups, dim=2)
    return t.contiguous().permute(1, 2, 0, 3)


_UNUSED: dict[torch.device, torch.Tensor] = {}


def _philox_unused(device: torch.device) -> torch.Tensor:
    """A 0-dim int64 tensor on `device`, made once: the philox seed / offset (no dropout)."""
    t = _UNUSED.get(device)
    if t is None:
        t = _UNUSED[device] = torch.zeros((), dtype=torch.int64, device=device)
    return t


class CudnnKernel:
    """The TileKernel of `kernels/base.py` on torch's cuDNN attention op (CUDA, fp16 / bf16):
    dense tiles, V of its own head dim, and a call's slices (packed documents, windows, masks
    given as slices) as runs (`run_calls`): dense calls, full or causal, and a window's row
    blocks with their block's bias (the op's `attn_bias`). Its causal is top-left aligned
    (torch's cuDNN graph sets cuDNN's causal mask, not the bottom-right one): no
    `bottom_right` for plain tiles; runs of more keys than queries split themselves.
    `documents`: a kernel with a variable-length op that takes packed documents instead (one
    call, not one per document), e.g. torch's flash op where the choice has it."""

    name = "cudnn"
    caps = KernelCaps(documents=True, tile_mask=True, window=True, v_head_dim=True)

    def __init__(self, documents: Any = None) -> None:
        self.documents = documents

    def forward(self, q, k, v, causal: bool, softmax_scale: float, *,
                slices: TileSlices | None = None):
        """out [sq, b, hq, dv] in q's dtype (dv: v's head dim), lse [b, hq, sq] fp32."""
        check_call(self, q, v, slices, causal)
        if self._varlen(slices):
            return self.documents.forward(q, k, v, causal, softmax_scale, slices=slices)
        if slices is not None:
            return slices_forward(q, k, v, softmax_scale, slices, self.dense_op)
        return self._dense_forward(q, k, v, causal, softmax_scale)

    def backward(self, dout, q, k, v, out, lse, causal: bool, softmax_scale: float, *,
                 slices: TileSlices | None = None):
        """dq [sq, b, hq, d], dk [sk, b, hkv, d], dv [sk, b, hkv, dv]; out / lse are the whole
        row's."""
        check_call(self, q, v, slices, causal)
        if self._varlen(slices):
            return self.documents.backward(dout, q, k, v, out, lse, causal, softmax_scale,
                                           slices=slices)
        if slices is not None:
            return slices_backward(dout, q, k, v, out, lse, softmax_scale, slices,
                                   self.dense_op)
        return self._dense_backward(dout, q, k, v, out, lse, causal, softmax_scale)

    def _varlen(self, slices: TileSlices | None) -> bool:
        return (slices is not None and slices.form == DOCUMENTS and self.documents is not None
                and not (slices.bottom_right and not caps_of(self.documents).bottom_right))

    @property
    def dense_op(self) -> DenseOp:
        """Its dense call for a call's runs: top-left causal, no window of its own."""
        return DenseOp(self._dense_forward, self._dense_backward)

    def _dense_forward(self, q, k, v, causal: bool, softmax_scale: float,
                       bias: torch.Tensor | None = None, window=None):
        """One dense call; `bias` [sq, sk] fp32 (a window block's) goes in as the op's
        attn_bias, in q's dtype, broadcast over batch and heads."""
        groups = q.shape[2] // k.shape[2]
        qb, kb, vb = one_layout(q), one_layout(k, groups), one_layout(v, groups)
        out, lse, *_ = aten._scaled_dot_product_cudnn_attention(
            qb, kb, vb, _bias(bias, q), True, 0.0, causal, False, scale=softmax_scale
        )
        sq, b, hq, _ = q.shape
        return sbhd(out), lse.reshape(b, hq, sq).float()

    def _dense_backward(self, dout, q, k, v, out, lse, causal: bool, softmax_scale: float,
                        bias: torch.Tensor | None = None, window=None):
        groups = q.shape[2] // k.shape[2]
        qb, kb, vb = one_layout(q), one_layout(k, groups), one_layout(v, groups)
        ob, dob = one_layout(out.to(q.dtype)), one_layout(dout.to(q.dtype))
        sq, b, hq, _ = q.shape
        stats = lse.float().reshape(b, hq, sq, 1).contiguous()  # as the forward returns it
        unused = _philox_unused(q.device)
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            dob, qb, kb, vb, ob, stats, unused, unused, _bias(bias, q), None, None, sq,
            k.shape[0], 0.0, causal, scale=softmax_scale,
        )
        return sbhd(dq), sbhd(sum_kv_grad(dk, groups)), sbhd(sum_kv_grad(dv, groups))


# cuDNN reads a bias row at an aligned stride: its rows start this many elements apart
BIAS_ALIGN = 16


def _bias(bias: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """A block's bias [sq, sk] fp32 as the op's attn_bias: q's dtype, its rows
    `BIAS_ALIGN` elements apart (zero columns past sk, which the op never reads: sk keys),
    [b, hq, sq, sk] (expanded, no copy)."""
    if bias is None:
        return None
    sq, sk = bias.shape
    padded = torch.nn.functional.pad(bias.to(q.dtype), (0, -sk % BIAS_ALIGN))
    return padded[:, :sk].expand(q.shape[1], q.shape[2], sq, sk)
