"""Tile kernels from torch's own fused attention ops (aten), on CPU and CUDA.

CPU: _scaled_dot_product_flash_attention_for_cpu (+ _backward): any float dtype, GQA.
CUDA: _scaled_dot_product_flash_attention (fp16 / bf16) or the memory-efficient op (fp32);
K/V heads are repeated for GQA inside the kernel call, after all communication.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    """[s, b, h, d] -> [b, h, s, d] view."""
    return t.permute(1, 2, 0, 3)


def _sbhd(t: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] -> [s, b, h, d] view."""
    return t.permute(2, 0, 1, 3)


def _repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, hkv, s, d] -> [b, hkv * groups, s, d]; query head h uses kv head h // groups."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_kv_grad(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, hkv * groups, s, d] -> [b, hkv, s, d], summing each kv head's query group."""
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


class TorchFlashKernel:
    """The TileKernel of `kernels/base.py` on torch's aten attention ops."""

    name = "torch"

    def forward(self, q, k, v, causal: bool, softmax_scale: float):
        qb, kb, vb = _bhsd(q), _bhsd(k), _bhsd(v)
        if q.device.type == "cpu":
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                qb, kb, vb, 0.0, causal, scale=softmax_scale
            )
            return _sbhd(out), lse
        groups = q.shape[2] // k.shape[2]
        kb, vb = _repeat_kv(kb, groups), _repeat_kv(vb, groups)
        sq = q.shape[0]
        if q.dtype in (torch.float16, torch.bfloat16):
            out, lse, *_ = aten._scaled_dot_product_flash_attention(
                qb, kb, vb, 0.0, causal, False, scale=softmax_scale
            )
        else:
            out, lse, *_ = aten._scaled_dot_product_efficient_attention(
                qb, kb, vb, None, True, 0.0, causal, scale=softmax_scale
            )
        return _sbhd(out), lse[..., :sq].contiguous()

    def backward(self, dout, q, k, v, out, lse, causal: bool, softmax_scale: float):
        qb, kb, vb, ob, dob = _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), _bhsd(dout)
        lse = lse.contiguous()
        if q.device.type == "cpu":
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dob, qb, kb, vb, ob, lse, 0.0, causal, scale=softmax_scale
            )
            return _sbhd(dq), _sbhd(dk), _sbhd(dv)
        groups = q.shape[2] // k.shape[2]
        kb, vb = _repeat_kv(kb, groups), _repeat_kv(vb, groups)
        sq, sk = q.shape[0], k.shape[0]
        none = torch.empty(0, dtype=torch.int64, device=q.device)
        if q.dtype in (torch.float16, torch.bfloat16):
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                dob, qb, kb, vb, ob, lse, none, none, sq, sk, 0.0, causal, none, none,
                scale=softmax_scale,
            )
        else:
            pad = -sq % 32  # the memory-efficient op keeps lse padded to 32 rows
            lse = torch.nn.functional.pad(lse, (0, pad))
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                dob, qb, kb, vb, None, ob, lse, none, none, 0.0, [True, True, True, False],
                causal, scale=softmax_scale,
            )
        return _sbhd(dq), _sbhd(_sum_kv_grad(dk, groups)), _sbhd(_sum_kv_grad(dv, groups))
