"""One rank-block's kernel calls, shared by every schedule."""
from __future__ import annotations

import torch

from .kernels import TileKernel
from .layout import block_for
from .merge import merge_into


def forward_block(
    kernel: TileKernel,
    q_x: torch.Tensor,
    k_y: torch.Tensor,
    v_y: torch.Tensor,
    x: int,
    y: int,
    causal: bool,
    scale: float,
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
) -> None:
    """Attention of Q(x) [s, b, hq, d] over K/V(y) [s, b, hkv, d], merged into x's fp32
    accumulators out_acc [s, b, hq, d] and lse_acc [b, hq, s]."""
    blk = block_for(x, y, q_x.shape[0], causal)
    out, lse = kernel.forward(q_x[blk.q_rows], k_y[blk.kv_rows], v_y[blk.kv_rows], blk.causal, scale)
    merge_into(out_acc, lse_acc, out, lse, blk.q_rows)


def backward_block(
    kernel: TileKernel,
    dout_x: torch.Tensor,
    q_x: torch.Tensor,
    out_x: torch.Tensor,
    lse_x: torch.Tensor,
    k_y: torch.Tensor,
    v_y: torch.Tensor,
    x: int,
    y: int,
    causal: bool,
    scale: float,
    dq_acc: torch.Tensor,
    dkv_acc: torch.Tensor,
) -> None:
    """Gradients of block (x, y) added (fp32) into dq_acc [s, b, hq, d] of x and
    dkv_acc [2, s, b, hkv, d] of y. out_x / lse_x are x's whole-row output (or a stand-in
    with the same D) and lse."""
    blk = block_for(x, y, q_x.shape[0], causal)
    rows, kv_rows = blk.q_rows, blk.kv_rows
    dq, dk, dv = kernel.backward(
        dout_x[rows], q_x[rows], k_y[kv_rows], v_y[kv_rows], out_x[rows], lse_x[..., rows],
        blk.causal, scale,
    )
    dq_acc[rows] += dq
    dkv_acc[0, kv_rows] += dk
    dkv_acc[1, kv_rows] += dv
