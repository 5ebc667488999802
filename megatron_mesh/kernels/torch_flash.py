"""Tile kernels from torch's own fused attention ops (aten), on CPU and CUDA.

CPU: _scaled_dot_product_flash_attention_for_cpu (+ _backward): any float dtype, GQA.
CUDA: _scaled_dot_product_flash_attention (fp16 / bf16, sm80+; GQA natively: the flash
kernel takes fewer K/V heads and returns dK / dV with hkv heads) or the memory-efficient op
(fp32, or GPUs older than sm80), which needs as many K/V heads as query heads: there K/V
heads are repeated inside the kernel call (after all communication) and dK / dV summed back.
Which CUDA op runs is decided by `choice.choose` and given to the kernel (`flash`).
Inputs of any strides: a copy is made only where the head dim is not dense.
"""
from __future__ import annotations

import torch

from .base import dense_last_dim

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


class TorchFlashKernel:
    """The TileKernel of `kernels/base.py` on torch's aten attention ops.

    CPU tensors take the CPU flash op; any other device (CUDA; 'meta' for checking shapes
    without a GPU) takes the CUDA ops: the flash op for fp16 / bf16 when `flash` (the GPU
    takes it), else the memory-efficient op.
    """

    name = "torch"

    def __init__(self, flash: bool = True) -> None:
        self.flash = flash

    def _uses_flash(self, q: torch.Tensor) -> bool:
        return self.flash and q.dtype in (torch.float16, torch.bfloat16)

    def forward(self, q, k, v, causal: bool, softmax_scale: float):
        qb, kb, vb = bhsd(q), bhsd(k), bhsd(v)
        if q.device.type == "cpu":
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                qb, kb, vb, 0.0, causal, scale=softmax_scale
            )
            return sbhd(out), lse
        sq = q.shape[0]
        if self._uses_flash(q):
            out, lse, *_ = aten._scaled_dot_product_flash_attention(
                qb, kb, vb, 0.0, causal, False, scale=softmax_scale
            )
            return sbhd(out), lse  # [b, hq, sq] fp32, dense
        groups = q.shape[2] // k.shape[2]
        kb, vb = repeat_kv(kb, groups), repeat_kv(vb, groups)
        out, lse, *_ = aten._scaled_dot_product_efficient_attention(
            qb, kb, vb, None, True, 0.0, causal, scale=softmax_scale
        )
        return sbhd(out), lse[..., :sq].contiguous()  # kept padded to 32 rows by the op

    def backward(self, dout, q, k, v, out, lse, causal: bool, softmax_scale: float):
        qb, kb, vb, ob, dob = bhsd(q), bhsd(k), bhsd(v), bhsd(out), bhsd(dout)
        lse = lse.contiguous()
        if q.device.type == "cpu":
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dob, qb, kb, vb, ob, lse, 0.0, causal, scale=softmax_scale
            )
            return sbhd(dq), sbhd(dk), sbhd(dv)
        sq, sk = q.shape[0], k.shape[0]
        if self._uses_flash(q):
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
            dob, qb, kb, vb, None, ob, lse, unused, unused, 0.0, [True, True, True, False],
            causal, scale=softmax_scale,
        )
        return sbhd(dq), sbhd(sum_kv_grad(dk, groups)), sbhd(sum_kv_grad(dv, groups))


_PHILOX: dict[torch.device, torch.Tensor] = {}


def _empty_philox(device: torch.device) -> torch.Tensor:
    """An empty int64 tensor on `device`, made once (the philox seed / offset of a call
    without dropout)."""
    t = _PHILOX.get(device)
    if t is None:
        t = _PHILOX[device] = torch.empty(0, dtype=torch.int64, device=device)
    return t
