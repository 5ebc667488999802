"""Any mask priced from its slices: the one path of the planner's sparse exchange.

A `Mask` (documents, THD or placed, a window, a user's slices, composed) on a heads x
rows x cols grid gives, from its slices cut to each mesh rank's runs of positions
(`layout.mask_slices`, `slice_blocks.block_parts`):

    rows each mesh rank needs of each peer's chunk  (`mask_counts`: `masks.needed_rows`)
    (query, key) pairs of every block (x, y)          (`block_pair_counts`: `Slice.pairs`)

and `mask_estimate` prices the sparse exchange of those rows beside the busiest mesh
rank's pairs, whatever the kind. Closed forms stand in for the generic counts only where a
test shows them equal (tests/unit/test_planner_masks.py) and they are what scales to a
planner's sequence lengths: a window over one dense sequence (`windows.row_counts`) and
placed documents alone (`placed.placement_counts`, `placed._block_pairs`).
"""
from __future__ import annotations

import numpy as np

from megatron_mesh.layer_plan import BACKWARD_FLOPS_RATIO
from megatron_mesh.masks.layout import AttentionMask, mask_slices, rank_runs
from megatron_mesh.masks.mask import Mask
from megatron_mesh.masks.needed_rows import needed_rows
from megatron_mesh.masks.placed import mesh_placement
from megatron_mesh.masks.slice_blocks import block_parts
from megatron_mesh.planner.cost import Estimate, price
from megatron_mesh.planner.hardware import Cluster
from megatron_mesh.planner.methods.sparse import exchange_transfers
from megatron_mesh.planner.windows import RowCounts, row_counts
from megatron_mesh.planner.workload import Workload


def mesh_mask(mask: Mask, rows: int, cols: int, heads: int = 1) -> AttentionMask:
    """`mask` on the R x C mesh of an heads x rows x cols grid (a placement's runs as the
    mesh ranks hold them after the heads all-to-all, `placed.mesh_placement`)."""
    placement = None if mask.placement is None else mesh_placement(mask.placement, heads)
    return AttentionMask(mask.causal, mask.documents, rows * cols, mask.window, placement,
                         mask.slices)


def mask_counts(mask: Mask, seq_len: int, rows: int, cols: int, heads: int = 1) -> RowCounts:
    """`RowCounts` of `mask` over a sequence of `seq_len` tokens: q[j, o] query rows of mesh
    rank o's chunk that the rank of o's row in column j uses, kv[i, o] key rows of o's
    chunk that the rank of o's column in row i uses (its own chunk: every row), from the
    mask's slices (`needed_rows`)."""
    inner, mesh = mesh_mask(mask, rows, cols, heads), rows * cols
    local = seq_len // mesh
    q = np.zeros((cols, mesh), dtype=np.int64)
    kv = np.zeros((rows, mesh), dtype=np.int64)
    for o in range(mesh):
        i, j = divmod(o, cols)
        for c in range(cols):
            me = i * cols + c
            q[c, o] = local if me == o else len(needed_rows(inner, rows, cols, local, me, o, "q"))
        for r in range(rows):
            me = r * cols + j
            kv[r, o] = local if me == o else len(needed_rows(inner, rows, cols, local, me, o,
                                                             "kv"))
    return RowCounts(rows, cols, q, kv)


def block_pair_counts(mask: Mask, seq_len: int, rows: int, cols: int, heads: int = 1
                      ) -> dict[tuple[int, int], int]:
    """(query, key) pairs of every block (x, y) of the mesh (the own blocks always), from
    the mask's slices cut to the two ranks' runs (`block_parts`, `Slice.pairs`)."""
    inner, mesh = mesh_mask(mask, rows, cols, heads), rows * cols
    local = seq_len // mesh
    slices = mask_slices(inner, local)
    runs = [rank_runs(inner, rank, local) for rank in range(mesh)]
    out = {}
    for x in range(mesh):
        for y in range(mesh):
            n = sum(part.pairs for part in block_parts(slices, runs[x], runs[y]))
            if n or x == y:
                out[x, y] = n
    return out


def _closed_form(mask: Mask) -> str | None:
    """The kind whose closed forms equal the generic counts (tested), None: generic."""
    if mask.slices is not None or mask.documents is not None:
        return None
    if mask.placement is not None:
        return "placed" if mask.window is None else None
    return "window" if mask.window is not None else None


def counts_of(mask: Mask, seq_len: int, rows: int, cols: int, heads: int = 1) -> RowCounts:
    """The rows of `mask`'s sparse exchange (`mask_counts`, or its closed form)."""
    from megatron_mesh.planner.placed import placement_counts  # placed prices through here

    kind = _closed_form(mask)
    if kind == "window":
        return row_counts(seq_len, rows, cols, mask.window, mask.causal)
    if kind == "placed":
        return placement_counts(mask.placement, rows, cols, heads, mask.causal)
    return mask_counts(mask, seq_len, rows, cols, heads)


def pairs_of(mask: Mask, seq_len: int, rows: int, cols: int, heads: int = 1
             ) -> dict[tuple[int, int], int]:
    """The pairs of `mask`'s blocks (`block_pair_counts`, or its closed form)."""
    from megatron_mesh.planner.placed import _block_pairs

    if _closed_form(mask) == "placed":
        return _block_pairs(mask.placement, heads, mask.causal)
    return block_pair_counts(mask, seq_len, rows, cols, heads)


def mesh_totals(block: dict[tuple[int, int], int], rows: int, cols: int) -> list[int]:
    """Each mesh rank's sum of its blocks (x in its row, y in its column)."""
    out = []
    for me in range(rows * cols):
        i, j = divmod(me, cols)
        out.append(sum(block.get((i * cols + c, r * cols + j), 0)
                       for c in range(cols) for r in range(rows)))
    return out


def pair_flops(workload: Workload, heads: int = 1) -> float:
    """Forward FLOPs of one (query, key) pair on one GPU of an `heads`-way all-to-all."""
    return 4.0 * workload.batch * (workload.num_heads / heads) * workload.head_dim


def mask_estimate(workload: Workload, cluster: Cluster, mask: Mask, rows: int, cols: int,
                  heads: int = 1) -> Estimate:
    """`mask` on a heads x rows x cols grid: the sparse exchange of its rows (the inbound
    ones under the least own block) plus the busiest mesh rank's pairs (`workload` gives
    the shape: its seq_length is the (packed) sequence the mask covers)."""
    from megatron_mesh.planner.tiles import mesh_calls

    seq = workload.seq_length
    counts = counts_of(mask, seq, rows, cols, heads)
    transfers = exchange_transfers(workload, cluster, counts, heads)
    block = pairs_of(mask, seq, rows, cols, heads)  # walked once for both
    busiest = max(mesh_totals(block, rows, cols))
    own = min(block[m, m] for m in range(rows * cols)) * pair_flops(workload, heads)
    fwd = busiest * pair_flops(workload, heads)
    label = f"mesh {rows}x{cols}" if heads == 1 else f"mesh {heads}x{rows}x{cols}"
    calls = None if cluster.gpu is None else mesh_calls(  # what a GPU profile prices
        workload, cluster.gpus, rows, cols, heads, blocks=max(
            mesh_totals({k: 1 for k, n in block.items() if n}, rows, cols)),
        backend=cluster.gpu.backend)
    return price("mesh", label, transfers, workload, cluster, True, (rows, cols), heads,
                 flops={"forward": fwd, "backward": BACKWARD_FLOPS_RATIO * fwd},
                 own_block_flops={"forward": own, "backward": BACKWARD_FLOPS_RATIO * own},
                 calls=calls)
