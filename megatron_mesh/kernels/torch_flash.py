"""Tile kernels from torch's own fused attention ops (aten), on CPU and CUDA.

CPU: _scaled_dot_product_flash_attention_for_cpu (+ _backward): any float dtype, GQA.
CUDA: _scaled_dot_product_flash_attention (fp16 / bf16, sm80+; GQA natively: the flash
kernel takes fewer K/V heads and returns dK / dV with hkv heads) or the memory-efficient op
(fp32, or GPUs older than sm80), which needs as many K/V heads as query heads: there K/V
heads are repeated inside the kernel call (after all communication) and dK / dV summed back.
Which CUDA op runs is decided by `choice.choose` and given to the kernel (`flash`).
V may have its own head dim (multi-latent attention): zero-padded where an op needs one
head dim (`padded_head_dim`).
Inputs of any strides: a copy is made only where the head dim is not dense.
"""
from __future__ import annotations

import functools

import torch

from ..calls.tile_slices import BAND, DOCUMENTS, SLICES, TileSlices
from .base import check_call, dense_last_dim
from .caps import KernelCaps
from .run_calls import DenseOp, slices_backward, slices_forward
from .varlen_runs import Pack, packs_of, varlen_runs_backward, varlen_runs_forward

aten = torch.ops.aten


def bhsd(t: torch.Tensor) -> torch.Tensor:
    """[s, b, h, d] -> [b, h, s, d] view, its last dim made dense if it is not."""
    return dense_last_dim(t).permute(1, 2, 0, 3)


def sbhd(t: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] -> [s, b, h, d] view."""
    return t.permute(2, 0, 1, 3)


def repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, hkv, s, d] -> [b, hkv * groups, s, d]; query head h uses kv head h // groups."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def sum_kv_grad(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, hkv * groups, s, d] -> [b, hkv, s, d], summing each kv head's query group."""
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


def padded_head_dim(q: torch.Tensor, v: torch.Tensor) -> int | None:
    """The head dim to pad q, k, v to when V's head dim differs from Q's and K's (multi-
    latent attention) and the op needs them equal: the CPU flash op and CUDA's flash op
    (dense and variable-length) do, CUDA's memory-efficient op (fp32) takes V's own.
    None when nothing is padded. Zero columns are exact: padding V adds zero output
    columns (sliced off), padding Q and K adds nothing to the scores (the softmax scale
    is passed explicitly)."""
    d, dv = q.shape[-1], v.shape[-1]
    if d == dv or (q.device.type != "cpu" and q.dtype not in (torch.float16, torch.bfloat16)):
        return None
    return max(d, dv)


def pad_head_dim(t: torch.Tensor, width: int) -> torch.Tensor:
    """t [..., d] with zero columns appended up to `width` (t itself when d == width)."""
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


class TorchFlashKernel:
    """The TileKernel of `kernels/base.py` on torch's aten attention ops.

    CPU tensors take the CPU flash op; any other device (CUDA; 'meta' for checking shapes
    without a GPU) takes the CUDA ops: the flash op for fp16 / bf16 when `flash` (the GPU
    takes it), else the memory-efficient op. Takes everything `KernelCaps` names.
    Causal tiles of more keys than queries (`bottom_right`): CUDA's flash op aligns its
    causal mask at the bottom right itself; the CPU flash op and CUDA's memory-efficient op
    align theirs at the top left, so there the tile is the runs of `TileSlices.band(sq, sk,
    -1, 0)`: a full call on the first sk - sq keys and a causal square, no mask (`run_calls`).
    Grouped tiles fold a causal diagonal into such a call only where it is one call
    (`bottom_right_mask_free`), or everywhere with `band_bottom_right` (to check the folded
    calls on the CPU). Slices: on CUDA's flash op documents as one variable-length call and
    other slices as packed variable-length calls of their runs (`varlen_runs.py`);
    elsewhere as runs (`calls/tile_runs.py`) on the dense op.
    """

    name = "torch"
    caps = KernelCaps(documents=True, tile_mask=True, window=True, v_head_dim=True,
                      bottom_right=True)

    def __init__(self, flash: bool = True, band_bottom_right: bool = False) -> None:
        self.flash = flash
        self.band_bottom_right = band_bottom_right

    def _uses_flash(self, q: torch.Tensor) -> bool:
        return self.flash and q.dtype in (torch.float16, torch.bfloat16)

    def bottom_right_mask_free(self, q: torch.Tensor) -> bool:
        """Whether causal calls of more keys than queries on tensors like q [sq, b, hq, d]
        run as one op call: on CUDA's flash op (its own causal); elsewhere they are two (a
        full call and a causal square), folded only when built with `band_bottom_right`
        (then one call with the band's mask, made once per shape: `_folded_band`)."""
        return self.band_bottom_right or (q.device.type != "cpu" and self._uses_flash(q))

    def _bottom_right_band(self, q: torch.Tensor, k: torch.Tensor, causal: bool
                           ) -> TileSlices | None:
        """The band of a causal tile of sq < sk keys (bottom-right aligned) where the op
        aligns its own causal mask at the top left (CPU, memory-efficient op), else None."""
        sq, sk = q.shape[0], k.shape[0]
        if not causal or sq == sk:
            return None
        if q.device.type != "cpu" and self._uses_flash(q):
            return None  # the flash op's causal is bottom-right aligned
        return bottom_right_band(sq, sk)

    def forward(self, q, k, v, causal: bool, softmax_scale: float, *,
                slices: TileSlices | None = None):
        check_call(self, q, v, slices, causal)
        slices = slices or self._bottom_right_band(q, k, causal)
        width = padded_head_dim(q, v)
        if width:  # V of its own head dim where the op takes one: pad, exactly
            out, lse = self.forward(pad_head_dim(q, width), pad_head_dim(k, width),
                                    pad_head_dim(v, width), causal, softmax_scale,
                                    slices=slices)
            return out[..., :v.shape[-1]], lse
        if slices is None:
            return self._dense_forward(q, k, v, causal, softmax_scale)
        if self._folded_band(q, slices):
            return self._dense_forward(q, k, v, False, softmax_scale,
                                       slices.additive_mask(q.device))
        if self._varlen(q, slices):
            return varlen_forward(q, k, v, softmax_scale, slices)
        if self._packed(q, slices):
            return varlen_runs_forward(q, k, v, softmax_scale, *packs_on(slices, q.device),
                                       flash_varlen)
        return slices_forward(q, k, v, softmax_scale, slices, self.dense_op(q))

    def backward(self, dout, q, k, v, out, lse, causal: bool, softmax_scale: float, *,
                 slices: TileSlices | None = None):
        check_call(self, q, v, slices, causal)
        slices = slices or self._bottom_right_band(q, k, causal)
        width = padded_head_dim(q, v)
        if width:  # the padded columns' gradients are dropped
            dq, dk, dv = self.backward(*(pad_head_dim(t, width) for t in (dout, q, k, v, out)),
                                       lse, causal, softmax_scale, slices=slices)
            d = q.shape[-1]
            return dq[..., :d], dk[..., :d], dv[..., :v.shape[-1]]
        if slices is None:
            return self._dense_backward(dout, q, k, v, out, lse, causal, softmax_scale)
        if self._folded_band(q, slices):
            return self._dense_backward(dout, q, k, v, out, lse, False, softmax_scale,
                                        slices.additive_mask(q.device))
        if self._varlen(q, slices):
            return varlen_backward(dout, q, k, v, out, lse, softmax_scale, slices)
        if self._packed(q, slices):
            return varlen_runs_backward(dout, q, k, v, out, lse, softmax_scale,
                                        *packs_on(slices, q.device), flash_varlen_backward)
        return slices_backward(dout, q, k, v, out, lse, softmax_scale, slices,
                               self.dense_op(q))

    def _folded_band(self, q: torch.Tensor, slices: TileSlices) -> bool:
        """Whether a bottom-right causal call (the band (-1, 0)) is one call with the band's
        mask, kept per shape: built with `band_bottom_right` on an op whose causal is
        top-left, to check on the CPU what CUDA's flash op runs as one call."""
        return (self.band_bottom_right and slices.form == BAND
                and slices.flash_window == (-1, 0) and not self.dense_op(q).bottom_right)

    def _varlen(self, q: torch.Tensor, slices: TileSlices) -> bool:
        """Whether CUDA's flash op takes the call's documents as one variable-length call."""
        return (slices.form == DOCUMENTS and q.device.type != "cpu" and self._uses_flash(q))

    def _packed(self, q: torch.Tensor, slices: TileSlices) -> bool:
        """Whether a call of slices (not one band) goes to CUDA's flash op as variable-length
        calls of its runs (`varlen_runs`)."""
        return slices.form == SLICES and q.device.type != "cpu" and self._uses_flash(q)

    def dense_op(self, q: torch.Tensor) -> DenseOp:
        """The dense call the runs of a call on tensors like q go to (`run_calls`): CUDA's
        flash op aligns causal at the bottom right and takes windows; the CPU flash op and
        the memory-efficient op neither."""
        flash = q.device.type != "cpu" and self._uses_flash(q)
        return DenseOp(self._dense_forward, self._dense_backward, bottom_right=flash,
                       window=flash)

    def _dense_forward(self, q, k, v, causal: bool, softmax_scale: float,
                       bias: torch.Tensor | None = None,
                       window: tuple[int, int] | None = None):
        """One dense call: out [sq, b, hq, dv], lse [b, hq, sq] fp32; `bias` [sq, sk] fp32
        (the CPU op and the memory-efficient op), `window` (flash's, bottom-right)."""
        qb, kb, vb = bhsd(q), bhsd(k), bhsd(v)
        if q.device.type == "cpu":
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                qb, kb, vb, 0.0, causal, attn_mask=_cpu_bias(bias), scale=softmax_scale
            )
            return sbhd(out), lse
        sq = q.shape[0]
        if self._uses_flash(q):
            if window is not None:
                left, right = window
                out, lse, *_ = aten._flash_attention_forward(
                    _bshd(q), _bshd(k), _bshd(v), None, None, sq, k.shape[0], 0.0, causal,
                    False, scale=softmax_scale, window_size_left=left,
                    window_size_right=right)
                return out.transpose(0, 1), lse
            out, lse, *_ = aten._scaled_dot_product_flash_attention(
                qb, kb, vb, 0.0, causal, False, scale=softmax_scale
            )
            return sbhd(out), lse  # [b, hq, sq] fp32, dense
        groups = q.shape[2] // k.shape[2]
        kb, vb = repeat_kv(kb, groups), repeat_kv(vb, groups)
        out, lse, *_ = aten._scaled_dot_product_efficient_attention(
            qb, kb, vb, _cuda_bias(bias, q), True, 0.0, causal, scale=softmax_scale
        )
        return sbhd(out), lse[..., :sq].contiguous()  # kept padded to 32 rows by the op

    def _dense_backward(self, dout, q, k, v, out, lse, causal: bool, softmax_scale: float,
                        bias: torch.Tensor | None = None,
                        window: tuple[int, int] | None = None):
        """Gradients of `_dense_forward`'s call; out and lse are the whole row's."""
        qb, kb, vb, ob, dob = bhsd(q), bhsd(k), bhsd(v), bhsd(out), bhsd(dout)
        lse = lse.contiguous()
        if q.device.type == "cpu":
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dob, qb, kb, vb, ob, lse, 0.0, causal, attn_mask=_cpu_bias(bias),
                scale=softmax_scale
            )
            return sbhd(dq), sbhd(dk), sbhd(dv)
        sq, sk = q.shape[0], k.shape[0]
        if self._uses_flash(q):
            if window is not None:
                left, right = window
                no_dropout = torch.empty(0, dtype=torch.uint64, device=q.device)
                dq, dk, dv = aten._flash_attention_backward(
                    _bshd(dout), _bshd(q), _bshd(k), _bshd(v), _bshd(out), lse, None, None,
                    sq, sk, 0.0, causal, no_dropout, no_dropout, scale=softmax_scale,
                    window_size_left=left, window_size_right=right)
                return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)
            # Dense (not varlen) call without dropout: the cumulative lengths and the philox
            # seed / offset are undefined tensors (None), as the op's autograd passes them.
            # GQA: dk, dv come back with hkv heads (the kernel sums each group).
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                dob, qb, kb, vb, ob, lse, None, None, sq, sk, 0.0, causal, None, None,
                scale=softmax_scale,
            )
            return sbhd(dq), sbhd(dk), sbhd(dv)
        groups = q.shape[2] // k.shape[2]
        kb, vb = repeat_kv(kb, groups), repeat_kv(vb, groups)
        pad = -sq % 32  # the memory-efficient op keeps lse padded to 32 rows
        lse = torch.nn.functional.pad(lse, (0, pad))
        unused = _empty_philox(q.device)  # no dropout: never read
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dob, qb, kb, vb, _cuda_bias(bias, q), ob, lse, unused, unused, 0.0,
            [True, True, True, False], causal, scale=softmax_scale,
        )
        return sbhd(dq), sbhd(sum_kv_grad(dk, groups)), sbhd(sum_kv_grad(dv, groups))


@functools.lru_cache(maxsize=64)  # a layer's grouped tiles take a few shapes
def bottom_right_band(sq: int, sk: int) -> TileSlices:
    """The band of a causal call of sq < sk keys aligned at the bottom right, one object per
    shape: its dense calls are made once (`run_calls.call_plan`), not per call."""
    return TileSlices.band(sq, sk, -1, 0)


# A call's slices (`TileSlices`): on CUDA's flash op (fp16 / bf16, where the kernel's choice
# allows flash) documents as one variable-length call over their rows (per batch entry: the
# op reads one packed sequence; no work across documents, GQA as it is) and other slices as
# packed variable-length calls of their runs (`varlen_runs`); elsewhere the runs of
# `calls/tile_runs.py` on the dense op (`run_calls`): no bias but a window block's where the
# op has no window of its own.


def _cpu_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A block's additive bias [sq, sk] fp32 as the CPU op takes it: [1, 1, sq, sk]."""
    return None if bias is None else bias[None, None]


def _cuda_bias(bias: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """A block's additive bias [sq, sk] fp32 as the memory-efficient op takes it: in q's
    dtype, its rows padded to 16 elements (the op reads them aligned), expanded to
    [b, hq, sq, sk]."""
    if bias is None:
        return None
    sq, sk = bias.shape
    bias = torch.nn.functional.pad(bias.to(q.dtype), (0, -sk % 16))[:, :sk]
    return bias.expand(q.shape[1], q.shape[2], sq, sk)


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """[s, b, h, d] -> [b, s, h, d] view, its last dim made dense."""
    return dense_last_dim(t).transpose(0, 1)


def packs_on(slices: TileSlices, device: torch.device) -> tuple[tuple[Pack, ...], list[dict]]:
    """The call's packs (`packs_of` of its runs) and each pack's index and length tensors
    on `device`, made once per call and device and kept with the call
    (`TileSlices.made_on`): every layer of a micro-batch and the backward read the ones
    its first forward made."""
    def make(on: torch.device) -> tuple[tuple[Pack, ...], list[dict]]:
        packs = packs_of(slices.runs)
        return packs, [p.tensors(on) for p in packs]
    return slices.made_on("packs", device, make)


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool,
                 window: tuple[int, int] | None, scale: float):
    """CUDA's flash op on sequences: q [tq, hq, d], k / v [tk, hkv, d] -> out [tq, hq, d],
    lse [hq, tq] fp32; `causal` bottom-right, or flash's `window` (left, right)."""
    left, right = window if window is not None else (None, None)
    out, lse, *_ = aten._flash_attention_forward(
        dense_last_dim(q), dense_last_dim(k), dense_last_dim(v), cu_q, cu_k, max_q, max_k,
        0.0, causal, False, scale=scale, window_size_left=left, window_size_right=right)
    return out, lse


def flash_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int,
                          causal: bool, window: tuple[int, int] | None, scale: float):
    """Gradients of `flash_varlen`'s call; lse [hq, tq] is the rows' whole lse."""
    left, right = window if window is not None else (None, None)
    no_dropout = torch.empty(0, dtype=torch.uint64, device=q.device)
    return aten._flash_attention_backward(
        dense_last_dim(dout), dense_last_dim(q), dense_last_dim(k), dense_last_dim(v),
        dense_last_dim(out), lse, cu_q, cu_k, max_q, max_k, 0.0, causal, no_dropout,
        no_dropout, scale=scale, window_size_left=left, window_size_right=right)


def varlen_forward(q, k, v, softmax_scale: float, slices: TileSlices):
    """Documents on CUDA's flash op, one variable-length call per batch entry: q [sq, b, hq,
    d], k / v [sk, b, hkv, d] -> out [sq, b, hq, d], lse [b, hq, sq] fp32."""
    outs, lses = [], []
    for n in range(q.shape[1]):
        out, lse, *_ = aten._flash_attention_forward(
            dense_last_dim(q[:, n]), dense_last_dim(k[:, n]), dense_last_dim(v[:, n]),
            slices.cu_q_tensor, slices.cu_kv_tensor, slices.max_q, slices.max_kv,
            0.0, slices.causal, False, scale=softmax_scale)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0].unsqueeze(1), lses[0].unsqueeze(0)
    return torch.stack(outs, 1), torch.stack(lses)


def varlen_backward(dout, q, k, v, out, lse, softmax_scale: float, slices: TileSlices):
    """Gradients of `varlen_forward`'s call: dq [sq, b, hq, d], dk, dv [sk, b, hkv, d];
    lse [b, hq, sq] is the whole row's."""
    no_dropout = torch.empty(0, dtype=torch.uint64, device=q.device)
    grads = []
    for n in range(q.shape[1]):
        grads.append(aten._flash_attention_backward(
            dense_last_dim(dout[:, n]), dense_last_dim(q[:, n]), dense_last_dim(k[:, n]),
            dense_last_dim(v[:, n]), dense_last_dim(out[:, n]), lse[n].contiguous(),
            slices.cu_q_tensor, slices.cu_kv_tensor, slices.max_q, slices.max_kv,
            0.0, slices.causal, no_dropout, no_dropout, scale=softmax_scale))
    return tuple(g[0].unsqueeze(1) if len(g) == 1 else torch.stack(g, 1) for g in zip(*grads))


_PHILOX: dict[torch.device, torch.Tensor] = {}


def _empty_philox(device: torch.device) -> torch.Tensor:
    """An empty int64 tensor on `device`, made once (the philox seed / offset of a call
    without dropout)."""
    t = _PHILOX.get(device)
    if t is None:
        t = _PHILOX[device] = torch.empty(0, dtype=torch.int64, device=device)
    return t
