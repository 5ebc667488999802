"""The array planner (`part_arrays`, `document_blocks`) makes exactly the blocks and calls of
the per-part one (`slice_blocks.block_parts`, `block_calls`) on random packed documents and
masks given as slices."""
from __future__ import annotations

import random

import document_join_reference
import numpy as np
import pytest
import torch

from megatron_mesh.calls import groups as groups_module
from megatron_mesh.calls import layout
from megatron_mesh.calls.block import Block
from megatron_mesh.calls.groups import group_calls
from megatron_mesh.calls.layout import (
    AttentionMask,
    block_for,
    blocks_for,
    global_positions,
    mask_slices,
    rank_runs,
    slab_rows,
)
from megatron_mesh.calls.part_arrays import (
    NO_HI,
    NO_LO,
    RunArrays,
    _runs_before,
    document_arrays,
    pair_counts,
    part_arrays,
    slice_arrays,
)
from megatron_mesh.calls.slice_blocks import (
    block_calls,
    block_parts,
    bound_of,
    document_run_arrays,
    documents_run_arrays,
    position_run_arrays,
    position_runs,
)
from megatron_mesh.common.caches import _CACHES, KEEP_DOCUMENTS
from megatron_mesh.masks.document_placement import DocumentPlacement
from megatron_mesh.masks.document_placer import place_documents
from megatron_mesh.masks.documents import Documents
from megatron_mesh.masks.slices import SliceMask, slice_pairs
from megatron_mesh.masks.window import Window
from megatron_mesh.runtime.grid import MeshGrid
from megatron_mesh.schedules.blocks import _tile_calls, plan_blocks


def random_slices(seq: int, count: int, rng: random.Random, windows: bool = False
                  ) -> list[tuple]:
    """Up to `count` random non-overlapping slices; `windows`: some with a band."""
    out: list[tuple] = []
    for _ in range(20 * count):
        q0, k0 = rng.randrange(seq), rng.randrange(seq)
        q1, k1 = rng.randint(q0 + 1, min(seq, q0 + max(1, seq // 2))), rng.randint(k0 + 1, seq)
        s = (q0, q1, k0, k1, rng.choice(("full", "causal")))
        if windows and rng.random() < 0.6:
            s += ((rng.randint(-1, seq // 4), rng.randint(-1, seq // 4)),)
        if len(out) < count and not any(a < q1 and q0 < b and c < k1 and k0 < d
                                        for a, b, c, d, *_ in out):
            out.append(s)
    return out


def reference_block(mask: AttentionMask, x: int, y: int, local: int) -> Block:
    """Block (x, y) part by part: the sweep over Slice objects and the general calls."""
    q_runs, k_runs = rank_runs(mask, x, local), rank_runs(mask, y, local)
    parts = block_parts(mask_slices(mask, local), q_runs, k_runs)
    return block_calls(parts, local, mask.window is not None,
                       slab_rows(mask.window, mask.causal), torch.device("cpu"), q_runs, k_runs)


def same_rows(a, b) -> bool:
    if isinstance(a, slice) or isinstance(b, slice):
        return a == b
    return a.dtype == b.dtype and torch.equal(a, b)


def same_tile(a, b) -> bool:
    if a is None or b is None:
        return a is b
    fields = ("shape", "slices", "form", "causal", "cu_q", "cu_kv", "flash_window")
    tensors = ("cu_q_tensor", "cu_kv_tensor")
    return all(getattr(a, f) == getattr(b, f) for f in fields) and all(
        (getattr(a, t) is None and getattr(b, t) is None)
        or torch.equal(getattr(a, t), getattr(b, t)) for t in tensors)


def same_block(a: Block, b: Block) -> bool:
    if (a.tiles is None) != (b.tiles is None):
        return False
    return (same_rows(a.q_rows, b.q_rows) and same_rows(a.kv_rows, b.kv_rows)
            and a.causal == b.causal and same_tile(a.slices, b.slices)
            and a.doc_runs == b.doc_runs
            and (a.tiles is None or (len(a.tiles) == len(b.tiles) and all(
                same_block(s, t) for s, t in zip(a.tiles, b.tiles)))))


def random_documents(rng: random.Random, ranks: int, units: int) -> Documents:
    """Documents of random padded lengths (multiples of 2P) filling `units` x 2P tokens,
    some shorter than padded, of one token or none."""
    unit = 2 * ranks
    count = rng.randint(1, units)
    cuts = sorted(rng.sample(range(1, units), count - 1)) if count > 1 else []
    sizes = [(b - a) * unit for a, b in zip([0, *cuts], [*cuts, units])]
    cu = [0]
    for n in sizes:
        cu.append(cu[-1] + n)
    lengths = [rng.choice([n, n, n - rng.randrange(n), 1, 0]) for n in sizes]
    lengths[-1] = lengths[-1] or 1  # a mask of no slice is refused
    return Documents(tuple(cu), tuple(lengths))


def masks(rng: random.Random, ranks: int) -> list[AttentionMask]:
    units = rng.choice([2, 3, 6, 12])
    docs = random_documents(rng, ranks, units)
    seq = docs.total
    out = [AttentionMask(causal, docs, ranks) for causal in (True, False)]
    out.append(AttentionMask(True, docs, ranks, Window(rng.randint(0, 9), 0)))
    out.append(AttentionMask(False, ranks=ranks, slices=docs.slices(rng.random() < 0.5)))
    out.append(AttentionMask(False, ranks=ranks, slices=SliceMask(random_slices(seq, 8, rng), seq)))
    out.append(AttentionMask(False, ranks=ranks, slices=SliceMask(
        random_slices(seq, 8, rng, windows=True), seq)))
    out.append(AttentionMask(rng.random() < 0.5, ranks=ranks))
    # documents with a mask given as slices (alone, or with windows)
    out.append(AttentionMask(True, docs, ranks, slices=SliceMask(random_slices(seq, 8, rng),
                                                                 seq)))
    out.append(AttentionMask(False, docs, ranks, slices=SliceMask(
        random_slices(seq, 8, rng, windows=True), seq)))
    # placed documents (`document_placer`), alone and with slices
    placement = random_placement(rng, ranks, units)
    out.append(AttentionMask(rng.random() < 0.5, ranks=ranks, placement=placement))
    out.append(AttentionMask(False, ranks=ranks, placement=placement, slices=SliceMask(
        random_slices(placement.total, 8, rng), placement.total)))
    return out


def random_placement(rng: random.Random, ranks: int, units: int) -> DocumentPlacement:
    """Documents of random lengths (at least one token) filling `units` x 2P tokens, placed
    over `ranks` ranks."""
    total = 2 * ranks * units
    count = rng.randint(1, min(total, 12))
    cuts = sorted(rng.sample(range(1, total), count - 1))
    return place_documents([0, *cuts, total], ranks)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_array_parts_equal_the_sweep(ranks):
    """`part_arrays` gives the parts `block_parts` gives, in its order."""
    rng = random.Random(ranks)
    for _ in range(15):
        for mask in masks(rng, ranks):
            local = (mask.documents.total if mask.documents else
                     mask.placement.total if mask.placement else
                     mask.slices.seq_len if mask.slices and mask.slices.seq_len else
                     8 * ranks) // ranks
            for x in range(ranks):
                for y in range(ranks):
                    q, k = rank_runs(mask, x, local), rank_runs(mask, y, local)
                    want = [bound_of(s) for s in block_parts(mask_slices(mask, local), q, k)]
                    got = part_arrays(mask_slices(mask, local), RunArrays.of(q), RunArrays.of(k))
                    assert got.bounds() == want, (mask, x, y)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_array_blocks_equal_the_per_part_blocks(ranks):
    """Every block of random documents (THD and placed, alone and with slices or a window)
    and slice masks is the reference's: the same calls, rows, slices and documents."""
    rng = random.Random(10 + ranks)
    for _ in range(12):
        for mask in masks(rng, ranks):
            seq = (mask.documents.total if mask.documents else
                   mask.placement.total if mask.placement else
                   mask.slices.seq_len if mask.slices is not None else 16 * ranks)
            local = seq // ranks
            pairs = [(x, y) for x in range(ranks) for y in range(ranks)]
            for cache in _CACHES:  # a new micro-batch: each query rank's blocks in one pass
                cache.cache_clear()
            for (x, y), got in zip(pairs, blocks_for(pairs, local, mask)):
                assert same_block(got, reference_block(mask, x, y, local)), (mask, x, y)
                assert same_block(block_for(x, y, local, mask), got)


def test_position_runs_equal_a_row_by_row_scan():
    """`position_runs` gives the runs a scan of the rows finds, sorted by position."""
    rng = random.Random(5)
    for _ in range(200):
        n = rng.randint(0, 30)
        pos = [rng.choice([-1, rng.randrange(50)]) for _ in range(n)]
        if rng.random() < 0.5:  # some contiguous stretches
            pos = sorted(set(pos))[::-1] + list(range(60, 60 + rng.randint(0, 5)))
        runs, last = [], None
        for row, p in enumerate(pos):
            if p < 0:
                last = None
                continue
            if last is not None and p == last + 1:
                runs[-1][2] += 1
            else:
                runs.append([row, p, 1])
            last = p
        want = tuple(sorted((tuple(r) for r in runs), key=lambda r: r[1]))
        assert position_runs(torch.tensor(pos, dtype=torch.int64)) == want, pos


def same_call(a, b) -> bool:
    pieces = lambda c, d: len(c) == len(d) and all(  # noqa: E731
        p.chunk == q.chunk and same_rows(p.rows, q.rows) for p, q in zip(c, d))
    places = lambda s, t: (s is None and t is None) or (  # noqa: E731
        s is not None and t is not None and torch.equal(s, t))
    return (pieces(a.q, b.q) and pieces(a.kv, b.kv) and a.causal == b.causal
            and same_tile(a.slices, b.slices) and places(a.q_place, b.q_place)
            and places(a.kv_place, b.kv_place))


@pytest.mark.parametrize("rows,cols", [(1, 2), (2, 2), (2, 1), (4, 2)])
def test_tile_calls_equal_the_per_document_join(rows, cols, monkeypatch):
    """The grouped calls of every rank's tile (query chunk by query chunk, and the row's
    chunks against one K/V chunk) equal those the per-document join makes, over THD and
    placed documents and documents with slices."""
    rng = random.Random(rows * 10 + cols)
    ranks = rows * cols
    for _ in range(6):
        docs = random_documents(rng, ranks, rng.choice([3, 8, 20]))
        placement = random_placement(rng, ranks, docs.total // (2 * ranks))
        for mask in (AttentionMask(True, docs, ranks), AttentionMask(False, docs, ranks),
                     AttentionMask(False, ranks=ranks, slices=docs.slices(True)),
                     AttentionMask(True, ranks=ranks, placement=placement),
                     AttentionMask(True, docs, ranks, slices=SliceMask(
                         random_slices(docs.total, 6, rng), docs.total))):
            local = docs.total // ranks
            for me in range(ranks):
                xs = [me // cols * cols + j for j in range(cols)]
                ys = [i * cols + me % cols for i in range(rows)]
                tiles = [([x], ys) for x in xs] + [(xs, [y]) for y in ys]
                for txs, tys in tiles:
                    for fold, limit in ((True, None), (False, 7), (True, 5)):
                        blocks = [(qi, ki, block_for(x, y, local, mask))
                                  for qi, x in enumerate(txs) for ki, y in enumerate(tys)]
                        got = group_calls(blocks, fold, True, limit)
                        with monkeypatch.context() as m:
                            m.setattr(groups_module, "document_calls",
                                      document_join_reference.document_calls)
                            want = group_calls(blocks, fold, True, limit)
                        assert len(got) == len(want)
                        assert all(same_call(a, b) for a, b in zip(got, want)), (mask, me)


def test_document_runs_equal_the_runs_of_their_positions():
    """A rank's runs of THD documents, made from the pieces it holds (one rank's, or
    several ranks' in one pass), are the runs a pass over its rows' positions finds."""
    rng = random.Random(8)
    for _ in range(60):
        ranks = rng.randint(1, 6)
        docs = random_documents(rng, ranks, rng.randint(1, 16))
        mask = AttentionMask(True, docs, ranks)
        of = rng.sample(range(ranks), rng.randint(1, ranks))
        every = documents_run_arrays(docs.cu_padded, docs.lengths, ranks, of)
        for rank, got in zip(of, every):
            want = position_run_arrays(global_positions(mask, rank, docs.total // ranks))
            one = document_run_arrays(docs.cu_padded, docs.lengths, ranks, rank)
            assert all(np.array_equal(a, b) for a, b in zip(one, want)), (docs, rank)
            assert all(np.array_equal(a, b) for a, b in zip(got, want)), (docs, of, rank)


def test_pair_counts_equal_the_slices_closed_form():
    """The array planner's pair counts are `slice_pairs`' on random slices and bounds."""
    rng = random.Random(9)
    rows = []
    for _ in range(400):
        q0, k0 = rng.randrange(20), rng.randrange(20)
        q1, k1 = q0 + rng.randint(1, 12), k0 + rng.randint(1, 12)
        lo = rng.choice([None, rng.randint(-15, 15)])
        hi = rng.choice([None, rng.randint(-15, 15)])
        rows.append((q0, q1, k0, k1, lo, hi))
    for bounded_below in (False, True):  # the one-bound form and the general one
        chosen = [r for r in rows if bounded_below or r[4] is None]
        table = np.array([(*r[:4], NO_LO if r[4] is None else r[4],
                           NO_HI if r[5] is None else r[5]) for r in chosen], dtype=np.int64)
        got = pair_counts(*table.T)
        assert got.tolist() == [slice_pairs(*r) for r in chosen]


def test_key_runs_counted_by_steps_equal_their_definition():
    """A pair's key runs (`part_arrays._runs_before`, stepping run by run, a search past a
    few steps or for few pairs) are the runs from its first on that start before its stop."""
    rng = np.random.default_rng(4)
    for pairs in (20, 3000):
        start = np.sort(rng.integers(0, 4000, 600))
        first = rng.integers(0, len(start), pairs)
        stop = start[first] + 1 + rng.integers(0, 40, pairs)
        want = [sum(1 for j in range(f, len(start)) if start[j] < e)
                for f, e in zip(first.tolist(), stop.tolist())]
        assert max(want) > 4 or pairs == 20  # some pairs past the steps
        assert _runs_before(start, first, stop).tolist() == want


def test_many_documents_blocks_equal_the_per_part_blocks():
    """A tile of many THD documents (one pass over many pairs and calls) is the
    reference's, block by block."""
    rng = random.Random(21)
    ranks = 4
    sizes = [2 * ranks * rng.randint(1, 3) for _ in range(200)]
    lengths = [rng.choice([n, n, n - rng.randrange(n), 1]) for n in sizes]
    docs = Documents(tuple(np.cumsum([0, *sizes]).tolist()), tuple(lengths))
    for causal in (True, False):
        mask = AttentionMask(causal, docs, ranks)
        local = docs.total // ranks
        pairs = [(x, y) for x in range(ranks) for y in range(ranks)]
        for cache in _CACHES:
            cache.cache_clear()
        for (x, y), got in zip(pairs, blocks_for(pairs, local, mask)):
            assert same_block(got, reference_block(mask, x, y, local)), (causal, x, y)


def test_document_arrays_equal_the_documents_slices():
    """Packed documents' slice arrays, made from their lengths, are their `SliceMask`'s."""
    rng = random.Random(7)
    for _ in range(50):
        docs = random_documents(rng, rng.randint(1, 4), rng.randint(1, 12))
        for causal in (True, False):
            got = document_arrays(docs.cu_padded, docs.lengths, causal)
            want = slice_arrays(docs.slices(causal))
            assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_a_micro_batch_is_planned_once_for_all_its_layers(monkeypatch):
    """Every layer of a micro-batch builds its own mask value of the same documents: its
    blocks are cut once, and the caches keep the last few micro-batches only."""
    made = []
    cut = layout.tile_parts
    monkeypatch.setattr(layout, "tile_parts", lambda *args: made.append(1) or cut(*args))
    rng = random.Random(3)
    for batch in range(KEEP_DOCUMENTS + 3):
        docs = random_documents(rng, 2, 10)
        before = len(made)
        for _ in range(4):  # layers, forward and backward alike
            mask = AttentionMask(True, Documents(docs.cu_padded, docs.lengths), 2)
            _tile_calls(mask, (0,), (0, 1), docs.total // 2, torch.device("cpu"),
                        frozenset(), True, True, None)
        assert len(made) - before == 1, batch  # blocks (0, 0) and (0, 1): one pass
    for cache in (_tile_calls, layout._block, layout.run_arrays, layout.mask_arrays):
        assert len(cache.by_documents) <= KEEP_DOCUMENTS


def test_blocks_planned_ahead_serve_every_tile(monkeypatch):
    """`plan_blocks` makes a rank's blocks before the first layer: its tiles cut none."""
    rng = random.Random(4)
    docs = random_documents(rng, 4, 12)
    mask, local = AttentionMask(True, docs, 4), docs.total // 4
    grid = MeshGrid(2, 2, 3, (0, 1, 2, 3), None, None)
    for cache in _CACHES:
        cache.cache_clear()
    plan_blocks(mask, grid, local)
    made = []
    cut = layout.tile_parts
    monkeypatch.setattr(layout, "tile_parts", lambda *args: made.append(1) or cut(*args))
    for x in grid.row_mesh_ranks:
        _tile_calls(mask, (x,), tuple(grid.col_mesh_ranks), local, torch.device("cpu"),
                    frozenset(), True, True, None)
    assert not made
