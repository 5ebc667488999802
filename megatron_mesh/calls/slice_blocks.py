"""The rank-blocks of any mask, from its slices: how a block's rows and calls are made
(`part_arrays.py` cuts the parts and `document_blocks.py` makes the calls of blocks of
documents with array operations, the same as these functions make part by part).

A rank's local rows are runs of contiguous positions of the whole sequence (`position_runs`:
its zigzag sub-chunks, its pieces of each packed document, its placed runs). Block (x, y) is
the mask's slices (`layout.mask_slices`) cut to x's runs as queries and y's runs as keys
(`block_parts`: each slice meeting a pair of runs gives at most two slices of it,
`Slice.cut`), moved to local rows. Its kernel calls (`block_calls`), each a few slices of
its own rows (`TileSlices`) in the form its kernel takes best:

    no part                  the block is empty: not computed, and the sparse exchange
                             (`schedules/sparse.py`) sends none of its rows
    parts that are one slice one call over their rows: full, causal (square), or a band
                             (flash-attention's window, bottom-right aligned)
    documents                parts linked by shared rows are a document; documents that are
                             each one full slice go in one variable-length call, those that
                             are each one causal square in another
    what is left             one call per part (a slice over its rows)

Calls under a sliding window keep their work near the band: on shares of more than
`ONE_CALL_ROWS` rows a band is cut into query slabs of `slab_rows`, and parts of short
documents (fewer than `SMALL_DOCUMENT_ROWS` query rows) go in groups of at least
`MIN_SLAB_ROWS` query rows, one call each; on shorter shares the block is one call. Every
call's rows see a key and its keys are seen, so the merge and the backward never meet a row
without one; a query row no slice reaches is in no call (output 0, no gradient). No call
holds a mask of its rows x keys; kernels that need one make it from the slices
(`TileSlices.additive_mask`).
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from ..masks.slices import Slice, SliceMask, pieces
from ..masks.zigzag import held_pieces
from .block import Block, DocRuns, SideRuns
from .part_arrays import RunArrays, cumsum
from .tile_slices import BAND, DOCUMENTS, Bound, TileSlices, slice_pairs

Run = tuple[int, int, int]  # (first local row, its position, rows) of contiguous positions

# A block under a window on shares of at most this many rows is one call; on taller shares
# its bands are cut into query slabs of `slab_rows` (at least MIN_SLAB_ROWS), and parts of
# documents of fewer than SMALL_DOCUMENT_ROWS query rows are grouped, consecutive ones, into
# calls of at least MIN_SLAB_ROWS query rows.
ONE_CALL_ROWS = 1024
MIN_SLAB_ROWS = 1024
SMALL_DOCUMENT_ROWS = 256


def position_runs(positions: torch.Tensor) -> tuple[Run, ...]:
    """The runs of contiguous positions of a rank's rows (`positions`: int64 [local rows],
    -1 on padding), sorted by position."""
    runs = position_run_arrays(positions)
    return tuple(zip(runs.row.tolist(), runs.pos.tolist(), runs.count.tolist()))


def position_run_arrays(positions: torch.Tensor) -> RunArrays:
    """`position_runs` as arrays (`part_arrays.RunArrays`)."""
    pos = positions.long().cpu().numpy()
    rows = np.flatnonzero(pos >= 0)
    at = pos[rows]
    new = np.ones(len(rows), dtype=bool)
    new[1:] = (rows[1:] != rows[:-1] + 1) | (at[1:] != at[:-1] + 1)
    starts = np.flatnonzero(new)
    count = np.diff(np.append(starts, len(rows)))
    order = np.argsort(at[starts], kind="stable")
    return RunArrays(rows[starts][order].astype(np.int64), at[starts][order].astype(np.int64),
                     count[order].astype(np.int64))


def document_run_arrays(cu_padded: tuple[int, ...], lengths: tuple[int, ...], ranks: int,
                        rank: int) -> RunArrays:
    """`position_run_arrays` of `rank`'s rows of packed documents (THD: each document's
    zigzag pieces, padded lengths `cu_padded`, actual `lengths`), from the pieces it holds
    (no pass over its rows)."""
    return documents_run_arrays(cu_padded, lengths, ranks, [rank])[0]


def documents_run_arrays(cu_padded: tuple[int, ...], lengths: tuple[int, ...], ranks: int,
                         of: list[int]) -> list[RunArrays]:
    """`document_run_arrays` of each rank in `of`, in one pass."""
    cu = np.array(cu_padded, dtype=np.int64)
    padded = np.diff(cu)
    piece = padded // (2 * ranks) if ranks > 1 else padded
    held = np.array([held_pieces(ranks, r) for r in of], dtype=np.int64)  # [ranks, h]
    n = len(of)
    length = np.array(lengths, dtype=np.int64)
    # each held piece of each document of each rank that holds a valid row, in row order
    # (rank, document, piece): its first row, position, valid rows (int64 each)
    valid = np.flatnonzero(length[None, :, None] > held[:, None, :] * piece[None, :, None])
    slot, valid = valid % held.shape[1], valid // held.shape[1]  # (np.nonzero, in one pass)
    rank, doc = valid // len(length), valid % len(length)
    size = piece[doc]
    offset = held[rank, slot] * size  # the piece's first row in its document
    row = (cumsum(padded // ranks) - padded // ranks)[doc] + slot * size
    pos = cu[doc] + offset
    count = np.minimum(length[doc] - offset, size)
    # a piece goes on the run before it where it follows it in rows and positions
    new = np.ones(len(row), dtype=bool)
    new[1:] = ((row[1:] != row[:-1] + count[:-1]) | (pos[1:] != pos[:-1] + count[:-1])
               | (rank[1:] != rank[:-1]))
    starts = np.flatnonzero(new)
    running = cumsum(count)  # each run's rows: the running sum at its last piece less before
    total = (running[np.append(starts[1:], len(count)) - 1] - running[starts] + count[starts]
             if len(starts) else running)
    row, pos, rank = row[starts], pos[starts], rank[starts]
    key = rank * (int(cu[-1]) + 1) + pos  # by rank, then position (zigzag: already so)
    if len(key) > 1 and not (key[1:] > key[:-1]).all():
        order = np.argsort(key, kind="stable")
        row, pos, total, rank = row[order], pos[order], total[order], rank[order]
    bounds = np.searchsorted(rank, np.arange(n + 1)).tolist()
    return [RunArrays(row[a:b], pos[a:b], total[a:b]) for a, b in zip(bounds, bounds[1:])]


def block_parts(mask: SliceMask, q_runs: tuple[Run, ...], k_runs: tuple[Run, ...]
                ) -> list[Slice]:
    """The pairs `mask` keeps of query runs x key runs, as slices of local rows (q_* rows of
    the query rank, k_* of the key rank): a sweep over the slices meeting each query run
    and the key runs meeting each slice, so it costs the parts it finds, not runs x runs."""
    table = _slice_index(mask)
    k_starts = [pos for _, pos, _ in k_runs]
    out = []
    for q_row, q_pos, q_len in q_runs:
        for s in table.meeting(q_pos, q_pos + q_len):
            first = max(0, bisect.bisect_right(k_starts, s.k_start) - 1)
            for k_row, k_first, k_len in k_runs[first:]:
                if k_first >= s.k_end:  # the runs past the slice's keys
                    break
                dq, dk = q_row - q_pos, k_row - k_first
                for part in s.cut(q_pos, q_pos + q_len, k_first, k_first + k_len):
                    out.append(Slice(part.q_start + dq, part.q_end + dq, part.k_start + dk,
                                     part.k_end + dk, part.kind, part.window))
    return out


@dataclass(frozen=True)
class _Index:
    """A mask's slices sorted by q_start, and the longest query range of one."""

    slices: tuple[Slice, ...]
    q_starts: tuple[int, ...]
    longest: int

    def meeting(self, q_lo: int, q_hi: int) -> list[Slice]:
        """The slices whose query range meets [q_lo, q_hi)."""
        first = bisect.bisect_right(self.q_starts, q_lo - self.longest)
        last = bisect.bisect_left(self.q_starts, q_hi)
        return [s for s in self.slices[first:last] if s.q_end > q_lo]


_INDEXES: dict[SliceMask, _Index] = {}


def _slice_index(mask: SliceMask) -> _Index:
    index = _INDEXES.get(mask)
    if index is None:
        if len(_INDEXES) >= 16:  # a few masks (layers of a model share one)
            _INDEXES.pop(next(iter(_INDEXES)))
        ordered = tuple(sorted(mask.slices, key=lambda s: (s.q_start, s.k_start)))
        index = _INDEXES[mask] = _Index(ordered, tuple(s.q_start for s in ordered),
                                        max((s.q_end - s.q_start for s in ordered), default=0))
    return index


def bound_of(s: Slice) -> Bound:
    """A slice of rows as (q0, q1, k0, k1, lo, hi): lo <= j - i <= hi on its rows."""
    return (s.q_start, s.q_end, s.k_start, s.k_end, *s.bounds)


def merged(parts: list[Bound]) -> Bound | None:
    """The one slice whose pairs are exactly the union of `parts` (disjoint slices whose rows
    each see a key), its rows each seeing a key, or None where there is none."""
    if len(parts) == 1:
        return parts[0]
    q0, q1 = min(p[0] for p in parts), max(p[1] for p in parts)
    k0, k1 = min(p[2] for p in parts), max(p[3] for p in parts)
    lo = min(max(k0p - (q1p - 1), -(1 << 62) if lop is None else lop)
             for q0p, q1p, k0p, k1p, lop, _ in parts)
    hi = max(min(k1p - 1 - q0p, 1 << 62 if hip is None else hip)
             for q0p, q1p, k0p, k1p, _, hip in parts)
    lo = None if lo <= k0 - (q1 - 1) else lo
    hi = None if hi >= k1 - 1 - q0 else hi
    if slice_pairs(q0, q1, k0, k1, lo, hi) != sum(slice_pairs(*p) for p in parts):
        return None
    trimmed = pieces(q0, q1, k0, k1, lo, hi)
    if (min(p.q_start for p in trimmed), max(p.q_end for p in trimmed),
            min(p.k_start for p in trimmed), max(p.k_end for p in trimmed)) != (q0, q1, k0, k1):
        return None
    return q0, q1, k0, k1, lo, hi


def block_calls(parts: list[Slice], local_len: int, windowed: bool, slab_rows: int,
                device: torch.device, q_runs: tuple[Run, ...] = (),
                k_runs: tuple[Run, ...] = ()) -> Block:
    """Block of `parts` (slices of local rows) with its kernel calls (module docstring);
    `windowed`: a sliding window is laid on the mask, its bands cut into `slab_rows` query
    rows on shares of more than `ONE_CALL_ROWS`. `q_runs` / `k_runs`: the two ranks' runs
    of positions (`position_runs`); a call gathers each document's rows in the order of
    their positions (local order where not given)."""
    return bounds_calls([bound_of(s) for s in parts], local_len, windowed, slab_rows, device,
                        q_runs, k_runs)


def bounds_calls(bounds: list[Bound], local_len: int, windowed: bool, slab_rows: int,
                 device: torch.device, q_runs: tuple[Run, ...] = (),
                 k_runs: tuple[Run, ...] = ()) -> Block:
    """`block_calls` of parts given as `Bound` tuples (`bound_of`)."""
    _group = functools.partial(_gather_group, q_order=_Order(q_runs), k_order=_Order(k_runs))
    if not bounds:
        return Block(slice(0, 0), slice(0, 0), tiles=())
    whole = merged(bounds)
    if whole is not None and not (windowed and local_len > ONE_CALL_ROWS):
        return _block([_one_slice(whole)], local_len, device)
    if windowed and local_len <= ONE_CALL_ROWS:
        return _block([gathered_call([_group(bounds)], device)], local_len, device)
    calls: list[Block] = []
    documents: dict[bool, list[_Group]] = {True: [], False: []}
    small: list[_Group] = []
    for component in _components(bounds):
        group = _group(component)
        one = group.one
        if one is not None and one[4] is None and (
                one[5] is None or (one[5] == 0 and one[1] - one[0] == one[3] - one[2])):
            documents[one[5] is not None].append(group)  # full, or a causal square
        elif windowed and group.q_count < SMALL_DOCUMENT_ROWS:
            small.append(group)
            if sum(g.q_count for g in small) >= MIN_SLAB_ROWS:
                calls.append(gathered_call(small, device))
                small = []
        elif one is not None and (not windowed or one[1] - one[0] <= slab_rows):
            calls.append(gathered_call([group], device))
        else:
            for part in component:
                calls += [_one_slice(s) for s in _slabs(part, slab_rows if windowed else None)]
    if small:
        calls.append(gathered_call(small, device))
    if documents[True]:  # a document of one query and one key is causal as well as full
        one_pair = [g.q_count == 1 and g.one[3] - g.one[2] == 1 for g in documents[False]]
        documents[True] += [g for g, one in zip(documents[False], one_pair) if one]
        documents[False] = [g for g, one in zip(documents[False], one_pair) if not one]
    for causal in (True, False):
        if documents[causal]:
            groups = sorted(documents[causal], key=lambda g: g.q_runs[0][0])
            calls.append(gathered_call(groups, device))
    return _block(calls, local_len, device)


def _components(bounds: list[Bound]) -> list[list[Bound]]:
    """`bounds` in groups linked by shared query rows or shared key rows, in order of their
    first query row."""
    parent = list(range(len(bounds)))

    def find(n: int) -> int:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for side in (0, 2):  # query rows, then key rows: sweep the ranges in order
        order = sorted(range(len(bounds)), key=lambda n: bounds[n][side])
        reach, owner = -1, -1
        for n in order:
            start, end = bounds[n][side], bounds[n][side + 1]
            if start < reach:
                parent[find(n)] = find(owner)
            if end > reach:
                reach, owner = end, n
    groups: dict[int, list[Bound]] = {}
    for n, b in enumerate(bounds):
        groups.setdefault(find(n), []).append(b)
    return sorted(groups.values(), key=lambda g: min(b[0] for b in g))


class _Group(NamedTuple):
    """Slices of local rows gathered for one call: their query row runs and key row runs
    (sorted, disjoint), the slices moved to the rows of those runs concatenated, the one
    slice they are there (None: none), and the query rows."""

    q_runs: list[tuple[int, int]]
    k_runs: list[tuple[int, int]]
    slices: list[Bound]
    one: Bound | None
    q_count: int


class _Order:
    """A rank's runs of positions, to lay rows in the order of their positions: `ranges`
    cuts row ranges at the runs' bounds and sorts the pieces by position."""

    def __init__(self, runs: tuple[Run, ...]) -> None:
        by_row = sorted(runs)
        self.starts = [row for row, _, _ in by_row]
        self.runs = by_row

    def ranges(self, rows: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Disjoint sorted row ranges, cut at run bounds, in order of position."""
        if not self.runs:
            return rows
        out = []
        for start, end in rows:
            while start < end:
                n = bisect.bisect_right(self.starts, start) - 1
                first, pos, count = self.runs[n] if n >= 0 else (start, start, end - start)
                stop = min(end, first + count) if n >= 0 else end
                out.append((pos + start - first, start, stop))
                start = stop
        return [(a, b) for _, a, b in sorted(out)]


def _gather_group(component: list[Bound], q_order: _Order, k_order: _Order) -> _Group:
    """A group's rows gathered for one call, each side's in the order of positions."""
    q_runs = q_order.ranges(_union([(b[0], b[1]) for b in component]))
    k_runs = k_order.ranges(_union([(b[2], b[3]) for b in component]))
    if len(q_runs) == 1 and len(k_runs) == 1:  # contiguous: moved by the runs' starts
        q_at = lambda row: row - q_runs[0][0]  # noqa: E731
        k_at = lambda row: row - k_runs[0][0]  # noqa: E731
    else:
        q_at, k_at = _offsets(q_runs), _offsets(k_runs)
    moved = []
    for q0, q1, k0, k1, lo, hi in component:
        dq, dk = q_at(q0) - q0, k_at(k0) - k0
        shift = dk - dq  # j - i grows by it
        moved.append((q0 + dq, q1 + dq, k0 + dk, k1 + dk, None if lo is None else lo + shift,
                      None if hi is None else hi + shift))
    return _Group(q_runs, k_runs, moved, merged(moved), sum(b - a for a, b in q_runs))


def gathered_call(groups: list[_Group], device: torch.device) -> Block:
    """One call over groups of slices: each group's query rows (and key rows) concatenated,
    the groups one after another, with the slices of the call (`TileSlices.of`)."""
    q_rows, k_rows, slices, nq, nk = [], [], [], 0, 0
    for group in groups:
        shift = nk - nq
        for q0, q1, k0, k1, lo, hi in [group.one] if group.one is not None else group.slices:
            slices.append((q0 + nq, q1 + nq, k0 + nk, k1 + nk, None if lo is None else lo + shift,
                           None if hi is None else hi + shift))
        q_rows += group.q_runs
        k_rows += group.k_runs
        nq += group.q_count
        nk += sum(b - a for a, b in group.k_runs)
    tile = TileSlices.of(slices, (nq, nk), device)
    rows_q, rows_k = _rows_of(q_rows), _rows_of(k_rows)  # on the CPU until `_block`
    if tile.form == DOCUMENTS and len(tile.cu_q) == 2 and not tile.bottom_right:
        return Block(rows_q, rows_k, causal=tile.causal)  # one document: a plain call
    if tile.form == BAND and (tile.flash_window == (-1, -1) or (
            tile.flash_window == (-1, 0) and nq == nk)):
        return Block(rows_q, rows_k, causal=tile.flash_window == (-1, 0))  # plain
    doc_runs = None
    if tile.form == DOCUMENTS and all(g.one is not None for g in groups):
        doc_runs = DocRuns(SideRuns.of([g.q_runs for g in groups]),
                           SideRuns.of([g.k_runs for g in groups]))
    return Block(rows_q, rows_k, causal=tile.causal, slices=tile, doc_runs=doc_runs)


def _one_slice(b: Bound) -> Block:
    """One slice of contiguous local rows as one kernel call."""
    q0, q1, k0, k1, lo, hi = b
    rows, cols = slice(q0, q1), slice(k0, k1)
    sq, sk = q1 - q0, k1 - k0
    if lo is None and hi is None:
        return Block(rows, cols)
    if lo is None and hi == k0 - q0 and sq == sk:
        return Block(rows, cols, causal=True)
    return Block(rows, cols,
                 slices=TileSlices.of([(0, sq, 0, sk, None if lo is None else lo - (k0 - q0),
                                        None if hi is None else hi - (k0 - q0))], (sq, sk),
                                      torch.device("cpu")))


def _slabs(b: Bound, slab_rows: int | None) -> list[Bound]:
    """A slice cut into query slabs of at most `slab_rows` rows where its window's lower
    bound binds (each trimmed to the keys it sees), else the slice itself."""
    q0, q1, k0, k1, lo, hi = b
    if slab_rows is None or lo is None or q1 - q0 <= slab_rows:
        return [b]
    out = []
    for start in range(q0, q1, slab_rows):
        parts = [bound_of(s) for s in pieces(start, min(start + slab_rows, q1), k0, k1, lo, hi)]
        if parts:
            out.append(merged(parts) or parts[0])
            out += [] if merged(parts) is not None else parts[1:]
    return out


def _block(calls: list[Block], local_len: int, device: torch.device) -> Block:
    """A block of `calls` (rows on the CPU): the union of their rows, every index tensor
    moved to `device`."""
    on_device = lambda rows: rows if isinstance(rows, slice) else rows.to(device)  # noqa: E731
    if len(calls) == 1:
        (call,) = calls
        return replace(call, q_rows=on_device(call.q_rows), kv_rows=on_device(call.kv_rows))
    q_used = torch.zeros(local_len, dtype=torch.bool)
    kv_used = torch.zeros(local_len, dtype=torch.bool)
    for call in calls:
        q_used[call.q_rows] = True
        kv_used[call.kv_rows] = True
    calls = [replace(c, q_rows=on_device(c.q_rows), kv_rows=on_device(c.kv_rows))
             for c in calls]
    return Block(on_device(_used_rows(q_used)), on_device(_used_rows(kv_used)),
                 tiles=tuple(calls))


def _used_rows(used: torch.Tensor) -> slice | torch.Tensor:
    """The rows of a bool vector: a slice where they follow one another, else an int64
    index (on the CPU)."""
    rows = used.nonzero().flatten()
    if rows.numel() == 0:
        return slice(0, 0)
    first, last = int(rows[0]), int(rows[-1]) + 1
    return slice(first, last) if last - first == rows.numel() else rows


def _offsets(runs: list[tuple[int, int]]):
    """Row -> its index in the runs concatenated in the order given (rows inside a run)."""
    before, at_start = 0, []
    for a, b in runs:
        at_start.append((a, before))
        before += b - a
    at_start.sort()
    starts = [a for a, _ in at_start]

    def at(row: int) -> int:
        n = bisect.bisect_right(starts, row) - 1
        return at_start[n][1] + row - starts[n]
    return at


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of [start, end) ranges as sorted disjoint runs."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _rows_of(ranges: list[tuple[int, int]]) -> slice | torch.Tensor:
    """The rows of [start, end) ranges in the order given: a slice where they follow one
    another, else an int64 index (on the CPU)."""
    if not ranges:
        return slice(0, 0)
    if all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])):
        return slice(ranges[0][0], ranges[-1][1])
    return torch.cat([torch.arange(start, end) for start, end in ranges])
