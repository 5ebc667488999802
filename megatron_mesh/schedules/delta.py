"""D = rowsum(dout * out): the only way attention backward depends on the output.

The backward kernels take `out`, but only ever use it to form D. A rank that computes
gradients for another rank's queries receives D (one fp32 value per row) instead of the
whole output chunk, and hands the kernel a stand-in output with the same D.
"""
from __future__ import annotations

import torch

from ..common.merge import bhs_to_sbh1


def attention_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """dout, out [s, b, h, d] -> D [b, h, s] in fp32 (one fp32 temporary of dout's size)."""
    product = dout.to(torch.float32, copy=True).mul_(out)
    return product.sum(-1).permute(1, 2, 0).contiguous()


def out_with_delta(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A tensor like dout [s, b, h, d] whose rowsum(dout * result) equals delta [b, h, s].

    result = u * D / rowsum(dout * u) with u = dout / max|dout| (scaled so that tiny
    gradients do not underflow); rows with dout == 0 give 0, and there D is 0 too.
    Its norm is |D| / |dout| <= |out|, so it is as well scaled as the real output.
    Memory: u is the only tensor of dout's size made in fp32 (rowsum(dout * u) =
    max|dout| * |u|^2), and it becomes the result in place.
    """
    amax = dout.abs().amax(-1, keepdim=True).float()
    u = torch.div(dout, amax.clamp_min(torch.finfo(torch.float32).tiny))
    dot = torch.linalg.vector_norm(u, dim=-1, keepdim=True).square_().mul_(amax)
    d = bhs_to_sbh1(delta)
    scale = torch.where(dot > 0, d / dot.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return u.mul_(scale).to(dout.dtype)
