"""The gathered schedule: collect the whole tile's Q and K/V, then compute every block.

Forward gathers first and computes after. Backward starts the gathers in the background
and computes the diagonal block meanwhile, and sends dQ around the row ring behind the
blocks (`backward`). A kernel taking whole tiles (`whole_tile.takes_whole_tiles`,
FlexAttention's) gets the row's C query chunks against the column in one call: forward the
whole tile, backward the tile but the diagonal; its dQ partials then go around the row ring
one after another (`whole_tile_backward`)."""
from __future__ import annotations

import torch

from ..calls.layout import AttentionMask
from ..common.merge import empty_accumulators, merge_into
from ..dtypes import FP32_GRADS, GradDtypes
from ..kernels import TileKernel
from ..layer_plan import COLUMN, ROW
from ..runtime import comm
from ..runtime.grid import MeshGrid
from .blocks import backward_tile, forward_tile, kv_grad_buffer, split_kv_grads
from .chunks import column_grad_keys, column_keys, diagonal_backward
from .delta import out_with_delta
from .rings import TrailingPartial
from .whole_tile import takes_whole_tiles


def finish_row_partials(accs: list, grid: MeshGrid, dtype: torch.dtype):
    """The fp32 (out, lse) of this rank's own rows from the per row member accumulators
    [(out [s, b, hq, dv], lse [b, hq, s]) fp32] (each entry is taken): on one column they
    are its own; else each goes to its member in `dtype` (`merge_row_partials`)."""
    if grid.cols == 1:
        return accs[0]
    out, lse = accs[0]
    partial_out = out.new_empty(grid.cols, *out.shape, dtype=dtype)
    partial_lse = torch.empty(grid.cols, *lse.shape, dtype=torch.float32, device=lse.device)
    for j in range(grid.cols):  # each fp32 accumulator goes as soon as it is copied
        (out, lse), accs[j] = accs[j], None
        partial_out[j].copy_(out)
        partial_lse[j].copy_(lse)
    del out, lse
    return merge_row_partials(partial_out, partial_lse, grid)


def merge_row_partials(partial_out, partial_lse, grid: MeshGrid):
    """Send each row member x its partial (out [s, b, hq, dv], lse [b, hq, s]) and merge the
    C partials of this rank's own chunk in fp32 -> (out, lse) fp32."""
    c, s, b, hq, d = partial_out.shape
    partial_out = comm.all_to_all(partial_out, grid.row_group, "forward", ROW, partial=True,
                                  order=grid.row_order)
    partial_lse = comm.all_to_all(partial_lse, grid.row_group, "forward", ROW, partial=True,
                                  order=grid.row_order)
    out_acc, lse_acc = empty_accumulators(s, b, hq, d, partial_out.device)
    for j in range(c):
        merge_into(out_acc, lse_acc, partial_out[j], partial_lse[j])
    return out_acc, lse_acc


def forward(q, k, v, grid: MeshGrid, mask: AttentionMask, scale: float, kernel: TileKernel):
    """q [s, b, hq, d], k [s, b, hkv, d], v [s, b, hkv, dv] -> (out [s, b, hq, dv],
    lse [b, hq, s]) of this rank's rows in fp32 (`attention` finishes them)."""
    s, b, hq, d = q.shape
    dv = v.shape[-1]
    q_row = comm.all_gather(q, grid.row_group, "forward", ROW, grid.row_order).view(
        grid.cols, s, b, hq, d)
    kv_col = comm.all_gather_stacked([k, v], grid.col_group, "forward", COLUMN,
                                    grid.col_order)

    column = column_keys(grid, kv_col)
    if grid.cols > 1 and takes_whole_tiles(kernel):  # the whole tile: one call
        accs = [empty_accumulators(s, b, hq, dv, q.device) for _ in range(grid.cols)]
        forward_tile(kernel, [(x, q_row[j], *accs[j]) for j, x in enumerate(grid.row_mesh_ranks)],
                     column, mask, scale)
        del q_row, kv_col, column  # used up: the partials do not hold them
        return finish_row_partials(accs, grid, q.dtype)
    if grid.cols > 1:  # partials of the other members' rows, sent in the input dtype
        partial_out = q.new_empty(grid.cols, s, b, hq, dv)
        partial_lse = torch.empty(grid.cols, b, hq, s, dtype=torch.float32, device=q.device)
    for j, x in enumerate(grid.row_mesh_ranks):  # a query chunk against the column: few calls
        out_acc, lse_acc = empty_accumulators(s, b, hq, dv, q.device)
        forward_tile(kernel, [(x, q_row[j], out_acc, lse_acc)], column, mask, scale)
        if grid.cols == 1:  # the only partial is the whole row's
            return out_acc, lse_acc
        partial_out[j].copy_(out_acc)
        partial_lse[j].copy_(lse_acc)
    del q_row, kv_col, column, out_acc, lse_acc  # used up: the merge does not hold them
    return merge_row_partials(partial_out, partial_lse, grid)


def start_row_grads_inputs(dout, q, delta, lse, grid: MeshGrid):
    """Start backward's row all-gathers in the background: by column index j, (Q [s, b, hq, d],
    dO [s, b, hq, dv]) and (lse, D) [b, hq, s] of row member j; read them after the returned
    `comm.Pending`'s wait()."""
    if grid.cols == 1:  # no other rank's rows: the kernel forms D from out
        return [(q, dout)], [(lse, None)], comm.Pending([])
    qdo, qdo_pending = comm.all_gather_stacked_async([q, dout], grid.row_group, "backward", ROW,
                                                      grid.row_order)
    stats, stats_pending = comm.all_gather_stacked_async([lse, delta], grid.row_group, "backward",
                                                         ROW, grid.row_order)
    return qdo, stats, comm.Pending.joined(qdo_pending, stats_pending)


def stand_in_outputs(qdo, stats, out, grid: MeshGrid) -> list[torch.Tensor]:
    """Per row member j, its output [s, b, hq, dv] for the backward kernel: this rank's own,
    or a stand-in with j's D (`delta.out_with_delta`)."""
    return [out if j == grid.col_index else out_with_delta(qdo[j][1], stats[j][1])
            for j in range(grid.cols)]


def row_order(grid: MeshGrid) -> list[int]:
    """Column indices of the row's query chunks in the order their dQ partials leave on the
    row ring (`rings.TrailingPartial`): j - 1, j - 2, ..., j + 1, then this rank's own j."""
    me = grid.col_index
    return [(me - t) % grid.cols for t in range(1, grid.cols)] + [me]


def whole_tile_backward(kernel: TileKernel, own: tuple, qdo, stats, column, grid: MeshGrid,
                        mask: AttentionMask, scale: float) -> list[torch.Tensor]:
    """The row's query chunks against the column but the diagonal block, in one call of a
    kernel taking whole tiles; own = (dout, q, out, lse, dq_own) of this rank's chunk, qdo /
    stats the row's gathered inputs (`start_row_grads_inputs`) -> the dQ partials of the
    row's chunks (fp32 [s, b, hq, d] each; this rank's own is dq_own)."""
    me = grid.col_index
    dq = [own[4] if j == me else torch.zeros_like(own[4]) for j in range(grid.cols)]
    outs = stand_in_outputs(qdo, stats, own[2], grid)
    queries = [(grid.mesh_rank, *own) if j == me
               else (x, qdo[j][1], qdo[j][0], outs[j], stats[j][0], dq[j])
               for j, x in enumerate(grid.row_mesh_ranks)]
    backward_tile(kernel, queries, column, mask, scale, skip=((grid.mesh_rank,) * 2,))
    return dq


def backward(dout, q, k, v, out, lse, delta, grid: MeshGrid, mask: AttentionMask, scale: float,
             kernel: TileKernel, grad_dtypes: GradDtypes = FP32_GRADS):
    """Gradients dq [s, b, hq, d], dk [s, b, hkv, d], dv [s, b, hkv, dv] in the inputs'
    dtype; partials are summed locally in fp32 and travel in grad_dtypes (dq, dkv).

    The diagonal block runs while the row's and the column's chunks are gathered; then
    each other query chunk's R blocks, whose dQ partial goes on around the row ring (one hop
    behind, `rings.TrailingPartial`) while the next chunk's blocks run; the own chunk's
    other blocks run last, while its own dQ partial travels (a kernel taking whole tiles:
    `whole_tile_backward`); dK, dV are reduce-scattered over the column at the end."""
    dout = dout.contiguous()
    me, my_row = grid.mesh_rank, grid.row_index
    qdo, stats, row_pending = start_row_grads_inputs(dout, q, delta, lse, grid)
    kv_col, kv_pending = comm.all_gather_stacked_async([k, v], grid.col_group, "backward",
                                                       COLUMN, grid.col_order)
    dq_own = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv_part = kv_grad_buffer(k, v, grid.rows)
    # the diagonal block needs nothing from anyone
    diagonal_backward(kernel, dout, q, out, lse, k, v, grid, mask, scale, dq_own,
                      dkv_part[my_row])
    kv_pending.wait()
    row_pending.wait()
    trailing = TrailingPartial(*grid.row_neighbors(), grid.row_group, "backward", ROW)
    column = column_grad_keys(grid, kv_col, dkv_part, k, v)
    if grid.cols > 1 and takes_whole_tiles(kernel):  # the tile but the diagonal: one call
        dq = whole_tile_backward(kernel, (dout, q, out, lse, dq_own), qdo, stats, column, grid,
                                 mask, scale)
        del qdo, stats  # the row's inputs: used up
        for j in row_order(grid)[:-1]:  # each partial one hop behind the one before
            trailing.pass_on((dq[j],), grad_dtypes.dq)  # the send holds what it needs
            dq[j] = None
    else:
        for j in row_order(grid)[:-1]:  # each query chunk against the column: few calls
            x = grid.row_mesh_ranks[j]
            dq = torch.zeros_like(dq_own)
            out_x = out_with_delta(qdo[j][1], stats[j][1])
            backward_tile(kernel, [(x, qdo[j][1], qdo[j][0], out_x, stats[j][0], dq)], column,
                          mask, scale)
            trailing.pass_on((dq,), grad_dtypes.dq)  # the send holds what it needs
            dq = out_x = None  # not held while the next ones are made
        del qdo, stats  # the row's inputs: used up
        # the own chunk's other blocks
        backward_tile(kernel, [(me, dout, q, out, lse, dq_own)], column, mask, scale,
                      skip=((me, me),))
    del kv_col, column  # used up: the reduction does not hold it
    dkv, dkv_pending = comm.reduce_scatter_async(dkv_part.to(grad_dtypes.dkv), grid.col_group,
                                                 "backward", COLUMN, grid.col_order)
    trailing.land((dq_own,))  # this rank's own chunk's dQ, back from its C-1 hops, meanwhile
    dkv_pending.wait()
    return (dq_own.to(q.dtype), *split_kv_grads(dkv, k, v))
