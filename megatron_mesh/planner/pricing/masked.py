"""Any mask priced from its slices: the one path of the planner's sparse exchange.

A `Mask` (documents, THD or placed, a window, a user's slices, composed) on a heads x
rows x cols grid gives, from its slices cut to each mesh rank's runs of positions
(`layout.mask_slices`, `slice_blocks.block_parts`):

    rows each mesh rank needs of each peer's chunk  (`mask_counts`: `masks.needed_rows`)
    (query, key) pairs of every block (x, y)          (`block_pair_counts`: `Slice.pairs`)

and `methods.sparse.mask_estimate` prices the sparse exchange of those rows beside the
busiest mesh rank's pairs, whatever the kind. Closed forms stand in for the generic counts
only where a test shows them equal (tests/unit/test_planner_masks.py) and they are what
scales to a planner's sequence lengths: a window over one dense sequence
(`windows.row_counts`) and placed documents alone (`placement_counts`, `_block_pairs`, the
formulas of `planner/pricing/placed_documents.py`'s docstring).
"""
from __future__ import annotations

import numpy as np

from megatron_mesh.calls.layout import AttentionMask, mask_slices, rank_runs
from megatron_mesh.calls.needed_rows import needed_rows
from megatron_mesh.calls.slice_blocks import block_parts
from megatron_mesh.masks.document_placement import DocumentPlacement, run_pairs
from megatron_mesh.masks.mask import Mask
from megatron_mesh.masks.placed_documents import mesh_placement
from megatron_mesh.planner.pricing.windows import RowCounts, row_counts
from megatron_mesh.planner.pricing.workload import Workload


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


def _doc_runs(placement: DocumentPlacement) -> dict[int, list[tuple[int, int, int]]]:
    """Per document held by more than one rank: its runs as (rank, first position, tokens)."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for rank, runs in enumerate(placement.runs):
        for doc, first, n in runs:
            if len(placement.groups[doc]) > 1:
                out.setdefault(doc, []).append((rank, first, n))
    return out


def placement_counts(placement: DocumentPlacement, rows: int, cols: int, heads: int = 1,
                     causal: bool = True) -> RowCounts:
    """`RowCounts` of `placement` on a heads x rows x cols grid: q[j, o] query rows of mesh
    rank o's chunk that column j's ranks use, kv[i, o] key rows of o's chunk that row i's
    ranks use (module docstring; the diagonal block never travels)."""
    mp = mesh_placement(placement, heads)
    mesh = rows * cols
    q = np.zeros((cols, mesh), dtype=np.int64)
    kv = np.zeros((rows, mesh), dtype=np.int64)
    for runs in _doc_runs(mp).values():
        for o, p, n in runs:
            for j in range(cols):
                keys = [k for y, k, _ in runs if y % cols == j and y != o
                        and (not causal or k < p + n)]
                if keys:
                    q[j, o] += n if not causal else p + n - max(p, min(keys))
            for i in range(rows):
                ends = [k + m for x, k, m in runs if x // cols == i and x != o
                        and (not causal or k + m > p)]
                if ends:
                    kv[i, o] += n if not causal else min(n, max(ends) - p)
    return RowCounts(rows, cols, q, kv)


def _block_pairs(placement: DocumentPlacement, heads: int, causal: bool
                 ) -> dict[tuple[int, int], int]:
    """Pairs of every non-empty block (x, y) of the mesh placement (the own blocks always)."""
    mp = mesh_placement(placement, heads)
    block: dict[tuple[int, int], int] = {}
    for rank, runs in enumerate(mp.runs):
        whole = {d for d, _, _ in runs if len(mp.groups[d]) == 1}  # all its runs are here
        block[rank, rank] = sum(run_pairs(0, n, 0, n, causal)
                                for n in (mp.lengths[d] for d in whole))
    for runs in _doc_runs(mp).values():
        for x, p, n in runs:
            for y, k, m in runs:
                key = (x, y)
                block[key] = block.get(key, 0) + run_pairs(p, n, k, m, causal)
    return block


def _closed_form(mask: Mask) -> str | None:
    """The kind whose closed forms equal the generic counts (tested), None: generic."""
    if mask.slices is not None or mask.documents is not None:
        return None
    if mask.placement is not None:
        return "placed" if mask.window is None else None
    return "window" if mask.window is not None else None


def counts_of(mask: Mask, seq_len: int, rows: int, cols: int, heads: int = 1) -> RowCounts:
    """The rows of `mask`'s sparse exchange (`mask_counts`, or its closed form)."""
    kind = _closed_form(mask)
    if kind == "window":
        return row_counts(seq_len, rows, cols, mask.window, mask.causal)
    if kind == "placed":
        return placement_counts(mask.placement, rows, cols, heads, mask.causal)
    return mask_counts(mask, seq_len, rows, cols, heads)


def pairs_of(mask: Mask, seq_len: int, rows: int, cols: int, heads: int = 1
             ) -> dict[tuple[int, int], int]:
    """The pairs of `mask`'s blocks (`block_pair_counts`, or its closed form)."""
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
