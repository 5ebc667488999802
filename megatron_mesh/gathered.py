"""The gathered schedule: collect the whole tile's Q and K/V, then compute every block."""
from __future__ import annotations

import torch

from . import comm
from .blocks import backward_block, forward_block, kv_grad_buffer, kv_grads, split_kv_grads
from .delta import attention_delta, out_with_delta
from .dtypes import FP32_GRADS, GradDtypes
from .grid import MeshGrid
from .kernels import TileKernel
from .layout import AttentionMask
from .merge import empty_accumulators, merge_into


def merge_row_partials(partial_out, partial_lse, grid: MeshGrid, dtype: torch.dtype):
    """Send each row member x its partial (out [s, b, hq, dv], lse [b, hq, s]) and merge the
    C partials of this rank's own chunk in fp32 -> out in `dtype`, lse fp32."""
    c, s, b, hq, d = partial_out.shape
    if c == 1:  # the only partial is already the whole row's
        return partial_out[0], partial_lse[0]
    partial_out = comm.all_to_all(partial_out, grid.row_group, "forward", "row")
    partial_lse = comm.all_to_all(partial_lse, grid.row_group, "forward", "row")
    out_acc, lse_acc = empty_accumulators(s, b, hq, d, partial_out.device)
    for j in range(c):
        merge_into(out_acc, lse_acc, partial_out[j], partial_lse[j])
    return out_acc.to(dtype), lse_acc


def forward(q, k, v, grid: MeshGrid, mask: AttentionMask, scale: float, kernel: TileKernel):
    """q [s, b, hq, d], k [s, b, hkv, d], v [s, b, hkv, dv] -> out [s, b, hq, dv],
    lse [b, hq, s] fp32."""
    s, b, hq, d = q.shape
    dv = v.shape[-1]
    q_row = comm.all_gather(q, grid.row_group, "forward", "row").view(grid.cols, s, b, hq, d)
    kv_col = comm.all_gather_stacked([k, v], grid.col_group, "forward", "column")

    partial_out = q.new_empty(grid.cols, s, b, hq, dv)
    partial_lse = torch.empty(grid.cols, b, hq, s, dtype=torch.float32, device=q.device)
    for j, x in enumerate(grid.row_mesh_ranks):
        out_acc, lse_acc = empty_accumulators(s, b, hq, dv, q.device)
        for i, y in enumerate(grid.col_mesh_ranks):
            forward_block(kernel, q_row[j], kv_col[i][0], kv_col[i][1], x, y, mask, scale,
                          out_acc, lse_acc)
        partial_out[j].copy_(out_acc)
        partial_lse[j].copy_(lse_acc)
    del q_row, kv_col, out_acc, lse_acc  # used up: the merge does not hold them
    return merge_row_partials(partial_out, partial_lse, grid, q.dtype)


def gather_row_grads_inputs(dout, q, out, lse, grid: MeshGrid):
    """Row all-gathers of backward, by column index j: (Q [s, b, hq, d], dO [s, b, hq, dv]) and (lse, D)
    [b, hq, s] of row member j, and its output or a stand-in with the same D."""
    qdo = comm.all_gather_stacked([q, dout], grid.row_group, "backward", "row")
    if grid.cols == 1:  # no other rank's rows: D is not needed, the kernel forms it from out
        return qdo, [(lse, None)], [out]
    delta = attention_delta(dout, out)
    stats = comm.all_gather_stacked([lse, delta], grid.row_group, "backward", "row")
    outs = [out if j == grid.col_index else out_with_delta(qdo[j][1], stats[j][1])
            for j in range(grid.cols)]
    return qdo, stats, outs


def backward(dout, q, k, v, out, lse, grid: MeshGrid, mask: AttentionMask, scale: float,
             kernel: TileKernel, grad_dtypes: GradDtypes = FP32_GRADS):
    """Gradients dq [s, b, hq, d], dk [s, b, hkv, d], dv [s, b, hkv, dv] in the inputs'
    dtype; partials are
    summed locally in fp32 and reduce-scattered in grad_dtypes (dq, dkv)."""
    s, b, hq, d = q.shape
    qdo, stats, outs = gather_row_grads_inputs(dout.contiguous(), q, out, lse, grid)
    kv_col = comm.all_gather_stacked([k, v], grid.col_group, "backward", "column")

    dq_part = torch.zeros(grid.cols, s, b, hq, d, dtype=torch.float32, device=q.device)
    dkv_part = kv_grad_buffer(k, v, grid.rows)
    for j, x in enumerate(grid.row_mesh_ranks):
        for i, y in enumerate(grid.col_mesh_ranks):
            backward_block(kernel, qdo[j][1], qdo[j][0], outs[j], stats[j][0], kv_col[i][0],
                           kv_col[i][1], x, y, mask, scale, dq_part[j],
                           kv_grads(dkv_part[i], k, v))
    del qdo, stats, outs, kv_col  # used up: the reductions do not hold them
    dq = comm.reduce_scatter(dq_part.to(grad_dtypes.dq), grid.row_group, "backward", "row")
    dkv = comm.reduce_scatter(dkv_part.to(grad_dtypes.dkv), grid.col_group, "backward", "column")
    return (dq.view(s, b, hq, d).to(q.dtype), *split_kv_grads(dkv, k, v))
