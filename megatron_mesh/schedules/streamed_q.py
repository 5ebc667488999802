"""The Q-streamed schedule, the mirror of `streamed_kv`: Q chunks travel around the row ring
while blocks are computed.

Rank (i, j) gathers its column's K/V while it computes its diagonal block; at ring step t it
holds the Q chunk of row position j - t, passes it on and computes that chunk's R blocks (one
per K/V chunk of the column) while the next arrives. Each chunk's partial output (out, lse;
fp32) travels one hop behind its Q, merged by log-sum-exp at each row member, and lands at its
owner after C-1 hops, in place of the all-to-all. Backward: Q, dO, lse and D take the same
ring with the dQ partials behind them (the own chunk's last off-diagonal blocks run after the
last step, while its dQ partial makes its last hop); dK, dV are reduce-scattered over the
column at the end. Bytes: the other schedules', but the partial outputs travel in fp32
(`layer_plan.Schedule.partial_out_bytes`); Q memory two chunks instead of C, K/V R chunks. A
one-column grid has no row ring and runs the gathered code (`MeshPlan.runner`).
"""
from __future__ import annotations

import torch

from ..calls.layout import AttentionMask
from ..common.merge import empty_accumulators, merge_into
from ..dtypes import FP32_GRADS, GradDtypes
from ..kernels import TileKernel
from ..layer_plan import COLUMN, ROW
from ..runtime import comm
from ..runtime.flat import pack, views
from ..runtime.grid import MeshGrid
from .blocks import backward_tile, forward_tile, kv_grad_buffer, split_kv_grads
from .chunks import column_grad_keys, column_keys, diagonal_backward, diagonal_forward
from .delta import out_with_delta
from .rings import TrailingPartial, held_at, ring_steps


def merge_partial(mine, arriving) -> None:
    """Fold for partial outputs (out, lse): log-sum-exp merge in place (fp32)."""
    merge_into(*mine, *arriving)


def forward(q, k, v, grid: MeshGrid, mask: AttentionMask, scale: float, kernel: TileKernel):
    """q [s, b, hq, d], k [s, b, hkv, d], v [s, b, hkv, dv] -> (out [s, b, hq, dv],
    lse [b, hq, s]) of this rank's rows in fp32 (`attention` finishes them)."""
    s, b, hq, _ = q.shape
    dv = v.shape[-1]
    kv_col, kv_pending = comm.all_gather_stacked_async([k, v], grid.col_group, "forward", COLUMN,
                                                       grid.col_order)
    neighbors = grid.row_neighbors()
    own = empty_accumulators(s, b, hq, dv, q.device)
    # fp32 partials: rounding the running merge at every hop would add up
    trailing = TrailingPartial(*neighbors, grid.row_group, "forward", ROW, merge_partial)
    for t, (q_x,) in ring_steps((q,), grid.cols, *neighbors, grid.row_group, "forward", ROW):
        x = held_at(grid.row_mesh_ranks, grid.col_index, t)
        acc = own if t == 0 else empty_accumulators(s, b, hq, dv, q.device)
        if t == 0:  # this rank's own block needs nothing from anyone
            diagonal_forward(kernel, q, k, v, grid, mask, scale, *acc)
            kv_pending.wait()
            column = column_keys(grid, kv_col)
        # the arrived query chunk against the column: few calls
        forward_tile(kernel, [(x, q_x, *acc)], column, mask, scale,
                     skip=((x, grid.mesh_rank),) if t == 0 else ())
        if t >= 1:  # chunk x's partial goes on behind its Q (the send holds it)
            trailing.pass_on(acc)
        acc = None  # not held while the next one is made
    del kv_col, column, q_x  # the column's K/V and the last Q chunk: used up
    trailing.land(own)  # this rank's own chunk, back from its C-1 hops
    return own


def own_blocks_later(grid: MeshGrid) -> list[int]:
    """Row indices i of the own query chunk's off-diagonal blocks kept for after the last
    ring step, to run while the last dQ partial travels: all but the first (R - 1) // 2
    (those run at step 0, while the first Q chunk arrives)."""
    off = [i for i in range(grid.rows) if i != grid.row_index]
    return off[(grid.rows - 1) // 2:]


def backward(dout, q, k, v, out, lse, delta, grid: MeshGrid, mask: AttentionMask, scale: float,
             kernel: TileKernel, grad_dtypes: GradDtypes = FP32_GRADS):
    """Gradients dq [s, b, hq, d], dk, dv [s, b, hkv, d] in the inputs' dtype; partials are
    summed in fp32 and travel (dQ around the ring, dK, dV in the reduce-scatter) in grad_dtypes."""
    my_row = grid.row_index
    kv_col, kv_pending = comm.all_gather_stacked_async([k, v], grid.col_group, "backward", COLUMN,
                                                       grid.col_order)
    dout = dout.contiguous()
    # D's temporary comes and goes before the gradient buffers are made
    # Q and dO back to back in one flat buffer (dO has V's head dim)
    rows_in = (pack([q, dout]), torch.stack([lse, delta]))
    neighbors = grid.row_neighbors()
    dq_own = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv_part = kv_grad_buffer(k, v, grid.rows)
    trailing = TrailingPartial(*neighbors, grid.row_group, "backward", ROW)
    ring = ring_steps(rows_in, grid.cols, *neighbors, grid.row_group, "backward", ROW)
    del rows_in  # (Q, dO), (lse, D): only the ring holds them, for as long as they travel
    later = own_blocks_later(grid)
    for t, (qdo_flat, stats_x) in ring:
        qdo_x = views(qdo_flat, (q.shape, dout.shape))
        x = held_at(grid.row_mesh_ranks, grid.col_index, t)
        dq = dq_own if t == 0 else torch.zeros_like(dq_own)
        if t == 0:  # own block first, while the column's K/V arrive
            diagonal_backward(kernel, dout, q, out, lse, k, v, grid, mask, scale, dq,
                              dkv_part[my_row])
            kv_pending.wait()
            column = column_grad_keys(grid, kv_col, dkv_part, k, v)
        out_x = out if t == 0 else out_with_delta(qdo_x[1], stats_x[1])
        # the arrived query chunk against the column: few calls
        skip = [(x, column[i][0]) for i in [my_row, *later]] if t == 0 else ()
        backward_tile(kernel, [(x, qdo_x[1], qdo_x[0], out_x, stats_x[0], dq)], column, mask,
                      scale, skip=skip)
        if t >= 1:  # chunk x's dQ partial goes on behind its Q (the send holds what it needs)
            trailing.pass_on((dq,), grad_dtypes.dq)
        dq = out_x = None  # not held while the next step's are made
    del qdo_x, qdo_flat, stats_x  # used up: the rest does not hold them
    # the own chunk's last blocks, while its dQ partial makes its last hop
    backward_tile(kernel, [(grid.mesh_rank, dout, q, out, lse, dq_own)],
                  [column[i] for i in later], mask, scale)
    del kv_col, column  # used up: the reduce-scatter does not hold it
    dkv, dkv_pending = comm.reduce_scatter_async(dkv_part.to(grad_dtypes.dkv), grid.col_group,
                                                 "backward", COLUMN, grid.col_order)
    trailing.land((dq_own,))  # this rank's own chunk, back from its C-1 hops, meanwhile
    dkv_pending.wait()
    return (dq_own.to(q.dtype), *split_kv_grads(dkv, k, v))
