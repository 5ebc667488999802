"""Mesh attention: exact attention over a CP group laid out as an R x C grid.

Rank (i, j) gathers the Q chunks of its row and the K/V chunks of its column, computes
the R * C rank-blocks of that tile (one kernel call each, see `layout.block_for`), merges
partials per query chunk, and sends each partial (out, lse) back to the chunk's owner.
Backward gathers Q, dO, lse and D over the row and K/V over the column, then
reduce-scatters dQ over the row and dK, dV over the column, in fp32.
"""
from __future__ import annotations

import torch

from . import comm
from .checks import check_inputs
from .delta import attention_delta, out_with_delta
from .grid import MeshGrid
from .kernels import TileKernel, get_kernel
from .layout import block_for
from .merge import empty_accumulators, merge_into


def _forward(q, k, v, grid: MeshGrid, causal: bool, scale: float, kernel: TileKernel):
    """q [s, b, hq, d], k / v [s, b, hkv, d] -> out [s, b, hq, d], lse [b, hq, s] fp32."""
    s, b, hq, d = q.shape
    q_row = comm.all_gather(q, grid.row_group, "forward", "row").view(grid.cols, s, b, hq, d)
    kv_col = comm.all_gather(torch.stack([k, v]), grid.col_group, "forward", "col")
    kv_col = kv_col.view(grid.rows, 2, *k.shape)

    partial_out = q.new_empty(grid.cols, s, b, hq, d)
    partial_lse = torch.empty(grid.cols, b, hq, s, dtype=torch.float32, device=q.device)
    for j, x in enumerate(grid.row_cp_ranks):
        out_acc, lse_acc = empty_accumulators(s, b, hq, d, q.device)
        for i, y in enumerate(grid.col_cp_ranks):
            blk = block_for(x, y, s, causal)
            out, lse = kernel.forward(
                q_row[j, blk.q_rows], kv_col[i, 0, blk.kv_rows], kv_col[i, 1, blk.kv_rows],
                blk.causal, scale,
            )
            merge_into(out_acc, lse_acc, out, lse, blk.q_rows)
        partial_out[j].copy_(out_acc)
        partial_lse[j].copy_(lse_acc)

    partial_out = comm.all_to_all(partial_out, grid.row_group, "forward", "row")
    partial_lse = comm.all_to_all(partial_lse, grid.row_group, "forward", "row")
    out_acc, lse_acc = empty_accumulators(s, b, hq, d, q.device)
    for j in range(grid.cols):
        merge_into(out_acc, lse_acc, partial_out[j], partial_lse[j])
    return out_acc.to(q.dtype), lse_acc


def _backward(dout, q, k, v, out, lse, grid: MeshGrid, causal: bool, scale: float,
              kernel: TileKernel):
    """Gradients dq [s, b, hq, d], dk, dv [s, b, hkv, d] in the inputs' dtype."""
    s, b, hq, d = q.shape
    dout = dout.contiguous()
    delta = attention_delta(dout, out)
    qdo_row = comm.all_gather(torch.stack([q, dout]), grid.row_group, "backward", "row")
    qdo_row = qdo_row.view(grid.cols, 2, s, b, hq, d)
    stats_row = comm.all_gather(torch.stack([lse, delta]), grid.row_group, "backward", "row")
    stats_row = stats_row.view(grid.cols, 2, b, hq, s)
    kv_col = comm.all_gather(torch.stack([k, v]), grid.col_group, "backward", "col")
    kv_col = kv_col.view(grid.rows, 2, *k.shape)

    dq_part = torch.zeros(grid.cols, s, b, hq, d, dtype=torch.float32, device=q.device)
    dkv_part = torch.zeros(grid.rows, 2, *k.shape, dtype=torch.float32, device=q.device)
    for j, x in enumerate(grid.row_cp_ranks):
        q_x, dout_x = qdo_row[j, 0], qdo_row[j, 1]
        lse_x, delta_x = stats_row[j, 0], stats_row[j, 1]
        out_x = out if x == grid.cp_rank else out_with_delta(dout_x, delta_x)
        for i, y in enumerate(grid.col_cp_ranks):
            blk = block_for(x, y, s, causal)
            rows, kv_rows = blk.q_rows, blk.kv_rows
            dq, dk, dv = kernel.backward(
                dout_x[rows], q_x[rows], kv_col[i, 0, kv_rows], kv_col[i, 1, kv_rows],
                out_x[rows], lse_x[..., rows], blk.causal, scale,
            )
            dq_part[j, rows] += dq
            dkv_part[i, 0, kv_rows] += dk
            dkv_part[i, 1, kv_rows] += dv

    dq = comm.reduce_scatter(dq_part, grid.row_group, "backward", "row").view(s, b, hq, d)
    dkv = comm.reduce_scatter(dkv_part, grid.col_group, "backward", "col").view(2, *k.shape)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class MeshAttentionFunction(torch.autograd.Function):
    """Autograd over `_forward` / `_backward`; saves only local tensors and the lse."""

    @staticmethod
    def forward(ctx, q, k, v, grid, causal, scale, kernel):
        out, lse = _forward(q, k, v, grid, causal, scale, kernel)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.grid, ctx.causal, ctx.scale, ctx.kernel = grid, causal, scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.grid, ctx.causal, ctx.scale, ctx.kernel)
        return dq, dk, dv, None, None, None, None


def mesh_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: MeshGrid,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Exact attention of this rank's zigzag share over the whole CP sequence.

    q [s, b, hq, d], k / v [s, b, hkv, d] (Megatron's sbhd; s = S / P, sub-chunks r and
    2P-1-r of 2P for CP rank r) -> out [s, b, hq, d] in q's dtype, differentiable in q, k, v.
    Only the hkv heads travel; GQA / MQA are expanded inside the tile kernels.
    """
    check_inputs(q, k, v, grid, softmax_scale, backend)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    kernel = get_kernel(backend, q.device)
    return MeshAttentionFunction.apply(q, k, v, grid, bool(causal), float(scale), kernel)
