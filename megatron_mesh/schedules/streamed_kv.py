"""The K/V-streamed schedule: K/V chunks travel around the column ring while blocks are computed.

Rank (i, j) gathers its row's Q while it computes its diagonal block; at ring step t it holds
the K/V chunk of column position i - t, passes it on and computes that chunk's C blocks (one
per query chunk of the row) while the next arrives: each arrival unlocks C blocks and nothing
else unlocks any, so this order is greedy. Backward: the row's Q, dO, lse and D are gathered
during the diagonal block; K/V take the same ring, each chunk's dK/dV partial one hop behind,
landing at its owner after R-1 hops; at the last step each query chunk's dQ, final once its
block has run, goes around the row ring the same way while the next block runs. Bytes: the
gathered schedule's (`traffic.py`); K/V memory two chunks (plus two dK/dV partials) instead of
R. A one-row grid has no column ring and runs the gathered code (`MeshPlan.runner`).
"""
from __future__ import annotations

import torch

from ..calls.layout import AttentionMask
from ..common.merge import empty_accumulators
from ..dtypes import FP32_GRADS, GradDtypes
from ..kernels import TileKernel
from ..layer_plan import COLUMN, ROW
from ..runtime import comm
from ..runtime.grid import MeshGrid
from .blocks import backward_tile, forward_tile, kv_grad_buffer, kv_grads, split_kv_grads
from .chunks import diagonal_backward, diagonal_forward
from .gathered import finish_row_partials, row_order, stand_in_outputs, start_row_grads_inputs
from .rings import TrailingPartial, held_at, ring_steps


def forward(q, k, v, grid: MeshGrid, mask: AttentionMask, scale: float, kernel: TileKernel):
    """q [s, b, hq, d], k [s, b, hkv, d], v [s, b, hkv, dv] -> (out [s, b, hq, dv],
    lse [b, hq, s]) of this rank's rows in fp32 (`attention` finishes them)."""
    s, b, hq, _ = q.shape
    dv = v.shape[-1]
    me = grid.col_index
    q_row, q_pending = comm.all_gather_async(q, grid.row_group, "forward", ROW,
                                                grid.row_order)
    accs = [empty_accumulators(s, b, hq, dv, q.device) for _ in range(grid.cols)]
    ring = ring_steps((k, v), grid.rows, *grid.col_neighbors(), grid.col_group, "forward", COLUMN)
    for t, (k_y, v_y) in ring:
        y = held_at(grid.col_mesh_ranks, grid.row_index, t)
        if t == 0:  # this rank's own block needs nothing from anyone
            diagonal_forward(kernel, q, k_y, v_y, grid, mask, scale, *accs[me])
            q_pending.wait()
            q_row = q_row.view(grid.cols, *q.shape)
        # the row's query chunks against the arrived chunk: few calls
        forward_tile(kernel, [(x, q_row[j], *accs[j]) for j, x in enumerate(grid.row_mesh_ranks)],
                     [(y, k_y, v_y)], mask, scale, skip=((grid.mesh_rank, y),) if t == 0 else ())
    del q_row, k_y, v_y  # the row's Q and the last K/V chunk: used up
    return finish_row_partials(accs, grid, q.dtype)


def backward(dout, q, k, v, out, lse, delta, grid: MeshGrid, mask: AttentionMask, scale: float,
             kernel: TileKernel, grad_dtypes: GradDtypes = FP32_GRADS):
    """Gradients dq [s, b, hq, d], dk, dv [s, b, hkv, d] in the inputs' dtype; partials are
    summed in fp32 and travel (dK, dV around the column ring, dQ around the row ring) in
    grad_dtypes.

    The diagonal block runs while the row's Q, dO, lse and D are gathered. At the last ring
    step each query chunk's dQ is final once its block has run: the blocks run in the order
    the dQ partials leave on the row ring (`gathered.row_order`), each partial goes on one
    hop behind (`rings.TrailingPartial`) while the next block runs, the own chunk's last.
    Each block goes to the kernel with its own calls: the row's query chunks are not
    grouped (see the loop)."""
    dout = dout.contiguous()
    me = grid.col_index
    qdo, stats, row_pending = start_row_grads_inputs(dout, q, delta, lse, grid)
    dq_part = [torch.zeros(q.shape, dtype=torch.float32, device=q.device)
               for _ in range(grid.cols)]
    neighbors = grid.col_neighbors()
    dkv_own = kv_grad_buffer(k, v)  # flat: dK, dV of this rank's chunk
    trailing = TrailingPartial(*neighbors, grid.col_group, "backward", COLUMN)
    dq_ring = TrailingPartial(*grid.row_neighbors(), grid.row_group, "backward", ROW)
    order = row_order(grid)
    for t, (k_y, v_y) in ring_steps((k, v), grid.rows, *neighbors, grid.col_group, "backward", COLUMN):
        y = held_at(grid.col_mesh_ranks, grid.row_index, t)
        dkv = dkv_own if t == 0 else torch.zeros_like(dkv_own)
        if t == 0:  # this rank's own block needs nothing from anyone
            diagonal_backward(kernel, dout, q, out, lse, k, v, grid, mask, scale, dq_part[me], dkv)
            row_pending.wait()
            outs = stand_in_outputs(qdo, stats, out, grid)
        last = t == grid.rows - 1
        arrived = [(y, k_y, v_y, kv_grads(dkv, k, v))]
        rows = [(grid.row_mesh_ranks[j], qdo[j][1], qdo[j][0], outs[j], stats[j][0], j)
                for j in order]  # each with its dQ partial's index
        # one query chunk at a time: grouping the row's chunks into one call would copy
        # their Q, dO, stand-in outputs and lse (more than the K/V this schedule saves);
        # at the last step each dQ leaves once final
        for *r, j in rows:
            if not (t == 0 and j == me):
                backward_tile(kernel, [(*r, dq_part[j])], arrived, mask, scale)
            if last and j != me:  # chunk j's dQ is final: on around the row ring
                dq_ring.pass_on((dq_part[j],), grad_dtypes.dq)
                dq_part[j] = None  # the send holds what it needs
        rows = arrived = None
        if t >= 1:  # chunk y's partial goes on behind its K/V (the send holds what it needs)
            trailing.pass_on((dkv,), grad_dtypes.dkv)
        dkv = None  # not held while the next one is zeroed
    del qdo, stats, outs, k_y, v_y  # the row's inputs and the last K/V chunk: used up
    trailing.land((dkv_own,))  # this rank's own chunk, back from its R-1 hops
    dq_ring.land((dq_part[me],))  # this rank's own query chunk, back from its C-1 hops
    return (dq_part[me].to(q.dtype), *split_kv_grads(dkv_own, k, v))
