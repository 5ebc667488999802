"""The tile-kernel interface every backend implements.

A tile is one (query chunk x key/value chunk) attention call. Tensors use Megatron's
sbhd layout: q [sq, b, hq, d], k / v [sk, b, hkv, d] with hq % hkv == 0 (GQA / MQA are
handled by the kernel; K/V are never expanded by the caller).
"""
from __future__ import annotations

from typing import Protocol

import torch


class TileKernel(Protocol):
    """Forward and backward of one attention tile."""

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns out [sq, b, hq, d] in q's dtype and lse [b, hq, sq] in fp32.

        `causal` is top-left aligned and only used with sq == sk.
        """
        ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns dq [sq, b, hq, d], dk, dv [sk, b, hkv, d] in the inputs' dtype.

        `out` [sq, b, hq, d] and `lse` [b, hq, sq] (fp32) are those of the WHOLE attention
        row, not of this tile: then the tile's gradients are exact partial sums. The
        kernel uses `out` only through D = rowsum(dout * out) (see `delta.py`).
        """
        ...


def dense_last_dim(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is dense (stride 1), else a contiguous copy.

    torch's fused attention ops read the head dim as dense without checking it: a view
    such as x[..., ::2] (stride 2) or an expanded gradient (stride 0) would be read wrong.
    Other strides (transposed [s, b] views, broadcast batches) they handle as they are.
    """
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()
