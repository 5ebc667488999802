"""The planner prices any mask from its slices (`planner/pricing/masked.py`): the generic counts
(rows each mesh rank needs, pairs per block) equal the closed forms that stand in for them
(a window, placed documents), and a mask with no closed form (prefix-LM, documents with a
window or slices) prices to the bytes the runtime's traffic model counts."""
from __future__ import annotations

import numpy as np
import pytest

import megatron_mesh as mm
from megatron_mesh.cost_models.sparse import sparse_traffic
from megatron_mesh.layer_plan import FP32_BYTES
from megatron_mesh.masks.document_placer import place_documents
from megatron_mesh.masks.window import Window
from megatron_mesh.planner.hardware import Cluster
from megatron_mesh.planner.methods.sparse import mask_estimate
from megatron_mesh.planner.pricing.masked import (
    _block_pairs,
    block_pair_counts,
    mask_counts,
    mesh_mask,
    mesh_totals,
    placement_counts,
)
from megatron_mesh.planner.pricing.tiles import window_blocks
from megatron_mesh.planner.pricing.windows import (
    RowSizes,
    kept_pairs,
    part_totals,
    peer_bytes,
    row_counts,
)
from megatron_mesh.planner.pricing.workload import Workload

MESHES = [(1, 4), (4, 1), (2, 2), (2, 4)]


def _off_diagonal(counts) -> tuple[np.ndarray, np.ndarray]:
    """The counts a peer sends (its own chunk never travels)."""
    mesh = counts.rows * counts.cols
    o = np.arange(mesh)
    q = np.where(o[None, :] % counts.cols == np.arange(counts.cols)[:, None], 0, counts.q)
    kv = np.where(o[None, :] // counts.cols == np.arange(counts.rows)[:, None], 0, counts.kv)
    return q, kv


@pytest.mark.parametrize("rows, cols", MESHES)
def test_window_closed_forms_equal_the_generic_counts(rows, cols):
    """A window on one dense sequence: `row_counts`, `kept_pairs` and `window_blocks` equal
    the counts from its slices."""
    seq = 32 * rows * cols
    for window, causal in ((Window(5, 0), True), (Window(40, 0), True), (Window(3, 9), False),
                           (Window(-1, 7), False), (Window(70, -1), False)):
        mask = mm.Mask(causal, window=window)
        generic = mask_counts(mask, seq, rows, cols)
        closed = row_counts(seq, rows, cols, window, causal)
        assert np.array_equal(generic.q, closed.q) and np.array_equal(generic.kv, closed.kv)
        block = block_pair_counts(mask, seq, rows, cols)
        assert sum(block.values()) == kept_pairs(seq, window, causal) == \
            mask.sequence_slices(seq).pairs
        assert max(mesh_totals({k: 1 for k, n in block.items() if n}, rows, cols)) == \
            window_blocks(seq, rows, cols, window, causal)


@pytest.mark.parametrize("heads, rows, cols", [(1, 2, 2), (1, 4, 1), (2, 2, 1), (2, 1, 2),
                                               (1, 2, 4)])
def test_placement_closed_forms_equal_the_generic_counts(heads, rows, cols):
    """Placed documents: `placement_counts` and the blocks' pairs equal the counts from
    the placement's slices, causal or not, on the mesh after a heads all-to-all."""
    p = heads * rows * cols
    cu = [0, 3, 70, 75, 140, 150, 64 * p]
    placement = place_documents(cu, p)
    for causal in (True, False):
        mask = mm.documents_mask(placement, causal=causal)
        generic = mask_counts(mask, placement.total, rows, cols, heads)
        closed = placement_counts(placement, rows, cols, heads, causal)
        for a, b in zip(_off_diagonal(generic), _off_diagonal(closed)):
            assert np.array_equal(a, b), (causal, a, b)
        want = {k: n for k, n in _block_pairs(placement, heads, causal).items() if n or k[0] == k[1]}
        assert block_pair_counts(mask, placement.total, rows, cols, heads) == want


@pytest.mark.parametrize("rows, cols", [(2, 2), (4, 1), (1, 4)])
def test_any_mask_prices_to_the_runtime_bytes(rows, cols):
    """Masks with no closed form (prefix-LM, THD documents with a window, documents with a
    user's slices): the generic counts give the bytes `cost_models.sparse.sparse_traffic` (the
    runtime's traffic model) counts for the rank sending most, and `mask_estimate` prices
    them with the busiest rank's pairs."""
    m = rows * cols
    seq = 16 * m
    docs = mm.Documents.from_cu_seqlens([0, 5, 5 + 6 * m, 8 * m + 5],
                                        [0, 2 * m, 8 * m, 16 * m])
    masks = {
        "prefix-LM": mm.Mask(False, slices=mm.prefix_lm_mask(seq, 7)),
        "documents & window": mm.documents_mask(docs) & mm.sliding_window_mask(5),
        "documents & prefix-LM": mm.documents_mask(docs, causal=False) & mm.prefix_lm_mask(seq, 9),
    }
    shape = mm.AttentionShape(seq, 1, 4, 2, 8, 2)
    w = Workload(seq, 4, 2, 8, dtype="bf16")
    cluster = Cluster(m, m)
    for name, mask in masks.items():
        counts = mask_counts(mask, seq, rows, cols)
        sizes = RowSizes.of(shape, FP32_BYTES, 2)
        totals = part_totals(*peer_bytes(counts, sizes)[:2])
        want = sparse_traffic(shape, 1, rows, cols, mesh_mask(mask, rows, cols), None,
                              FP32_BYTES, 2)
        assert int(totals.sum(0).max()) == want.total, name
        estimate = mask_estimate(w, cluster, mask, rows, cols)
        block = block_pair_counts(mask, seq, rows, cols)
        assert sum(block.values()) == mask.sequence_slices(seq).pairs, name
        assert estimate.time_s["forward"] > 0 and estimate.total_bytes > 0, name
