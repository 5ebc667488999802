"""A block's calls from its parts as arrays where its parts form documents: the fast path of
`slice_blocks.block_calls` (the same calls), in numpy operations over the parts.

It applies to a block without a sliding window whose parts (`part_arrays.PartArrays`) are
unbounded below and whose groups (parts linked by shared rows, `slice_blocks._components`)
each make one full slice or one causal square once their rows are gathered in the order of
their positions: packed documents, and masks given as slices of such documents. Then the
block is its documents in at most two variable-length calls (full ones, causal ones), or
one slice (`slice_blocks.merged`). Elsewhere `document_block` gives None and the caller
takes the general path.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from ..masks.slices import pieces
from .block import Block, DocRuns, SideRuns
from .part_arrays import (
    NO_HI,
    NO_LO,
    PartArrays,
    RunArrays,
    TileParts,
    cumsum,
    pair_counts,
    spans,
)
from .slice_blocks import _block, _one_slice
from .tile_slices import TileSlices


def document_block(tile: TileParts, local_len: int, device: torch.device,
                   squares: bool = False) -> Block | None:
    """The block of `tile`'s parts (one block, non-empty, no window) as
    `slice_blocks.block_calls` makes it, or None where the fast path does not apply (module
    docstring; `squares` as in `document_blocks`)."""
    return document_blocks(tile, 1, local_len, device, squares)[0]


def document_blocks(tile: TileParts, count: int, local_len: int, device: torch.device,
                    squares: bool = False) -> list[Block | None]:
    """`document_block` of `count` blocks in one pass: block b's parts are those where
    tile.block == b (consecutive, non-empty); None for a block the fast path does not
    take. `squares`: the mask's slices are document squares apart from one another
    (`part_arrays.document_arrays`), so a block's parts of one slice are one group."""
    parts, block = tile.parts, tile.block
    out: list[Block | None] = [None] * count
    first = np.searchsorted(block, np.arange(count), side="left")
    size = np.searchsorted(block, np.arange(count), side="right") - first
    if len(parts) == 0 or (size == 0).any():
        return out
    bounded = np.logical_or.reduceat(parts.lo != NO_LO, first)
    q0, q1 = np.minimum.reduceat(parts.q0, first), np.maximum.reduceat(parts.q1, first)
    k0, k1 = np.minimum.reduceat(parts.k0, first), np.maximum.reduceat(parts.k1, first)
    lo = np.minimum.reduceat(parts.k0 - parts.q1 + 1, first)
    hi = np.maximum.reduceat(np.minimum(parts.k1 - 1 - parts.q0, parts.hi), first)
    # `slice_blocks.merged` of each block's parts (unbounded below): the one slice they
    # are where it keeps their pairs and they fill its rows
    lo = np.where(lo <= k0 - (q1 - 1), NO_LO, lo)
    hi = np.where(hi >= k1 - 1 - q0, NO_HI, hi)
    merged = pair_counts(q0, q1, k0, k1, lo, hi)
    # the parts' pairs are at most their boxes': where those are fewer, not one slice
    same = ~bounded & (np.add.reduceat((parts.q1 - parts.q0) * (parts.k1 - parts.k0), first)
                       >= merged)
    if same.any():
        same &= np.add.reduceat(pair_counts(*parts), first) == merged
    rest = []
    for b in np.flatnonzero(~bounded).tolist():
        whole = False
        if size[b] == 1:
            whole = parts.take(slice(first[b], first[b] + 1)).bounds()[0]
        elif same[b]:
            whole = _whole(*(int(v[b]) for v in (q0, q1, k0, k1, lo, hi)))
        if whole is not False:
            out[b] = _block([_one_slice(whole)], local_len, device)
        else:
            rest.append(b)
    if rest:
        _documents_of(tile, first, size, rest, local_len, device, out, squares)
    return out


def _documents_of(tile, first, size, rest, local_len, device, out, squares) -> None:
    """Blocks `rest` as documents where each is (into `out`): their rows laid apart, block b
    at rows b x local_len on, so one pass finds every block's groups."""
    # every block: all the parts, in order (no copy)
    take = slice(None) if len(rest) == len(first) else spans(first[rest], size[rest])
    parts, block = tile.parts.take(take), tile.block[take]
    shift = block * local_len
    parts = PartArrays(parts.q0 + shift, parts.q1 + shift, parts.k0 + shift, parts.k1 + shift,
                       parts.lo, parts.hi)
    q_all, q_in = _laid_apart(tile.q_run, take, shift)
    k_all, k_in = _laid_apart(tile.k_run, take, shift)
    comp = _squares(block, tile.slice_of[take]) if squares else None
    if comp is None:
        comp = _components(parts)
    q = _gathered(parts.q0, parts.q1, comp, q_all, q_in)
    k = _gathered(parts.k0, parts.k1, comp, k_all, k_in)
    if q is None or k is None:
        return
    dq, dk = q.moved - parts.q0, k.moved - parts.k0
    hi = np.where(parts.hi == NO_HI, NO_HI, parts.hi + dk - dq)
    kind, ok = _documents(parts.q0 + dq, parts.q1 + dq, parts.k0 + dk, parts.k1 + dk, hi, comp,
                          q.count, k.count)
    groups = len(kind)
    comp_block = np.zeros(groups, dtype=np.int64)
    comp_block[comp] = block
    good = np.ones(len(out), dtype=bool)
    good[comp_block[~ok]] = False  # a block with a group of neither kind
    one_pair = (q.count == 1) & (k.count == 1)
    has_causal = np.zeros(len(out), dtype=bool)
    has_causal[comp_block[kind == 1]] = True
    # a document of one query and one key is causal as well as full
    causal = (kind == 1) | (one_pair & has_causal[comp_block])
    taken = np.flatnonzero(good[comp_block])
    if len(taken) == 0:
        return
    # the calls: per block its causal documents, then its full ones, each by first row
    order = taken[np.lexsort((q.first_row[taken], ~causal[taken], comp_block[taken]))]
    call_block, call_causal = comp_block[order], causal[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (call_block[1:] != call_block[:-1]) | (call_causal[1:] != call_causal[:-1])
    first = np.flatnonzero(new)
    size = np.diff(np.append(first, len(order)))
    real = np.logical_or.reduceat((kind[order] == 1) & ~one_pair[order], first) & call_causal[first]
    row = call_block * local_len
    qs, ks = _CallSide(q, order, row), _CallSide(k, order, row)
    stop = first + size
    q_rows, k_rows = qs.rows_of(first, stop), ks.rows_of(first, stop)
    one_kind = kind[order[first]].astype(bool).tolist()
    several_docs = size > 1
    q_docs = iter(qs.documents(first[several_docs], stop[several_docs]))
    k_docs = iter(ks.documents(first[several_docs], stop[several_docs]))
    calls: dict[int, list[Block]] = {}
    for n, (many, b, is_real) in enumerate(zip(several_docs.tolist(),
                                               call_block[first].tolist(), real.tolist())):
        if not many:  # one document: a plain call, full or a causal square
            call = Block(q_rows[n], k_rows[n], causal=one_kind[n])
        else:
            call = _documents_call(next(q_docs), next(k_docs), q_rows[n], k_rows[n], is_real,
                                   device)
        calls.setdefault(b, []).append(call)
    several = [b for b, made in calls.items() if len(made) > 1]
    q_used, k_used = qs.used(call_block, several, local_len), ks.used(call_block, several,
                                                                       local_len)
    for b, made in calls.items():
        out[b] = _on_device(made[0], device) if len(made) == 1 else Block(
            _on_device(q_used[b], device), _on_device(k_used[b], device),
            tiles=tuple(_on_device(c, device) for c in made))


def _on_device(item, device: torch.device):
    """A call with its index tensors on `device`, or rows (a slice or an index) there."""
    if isinstance(item, Block):
        if device.type == "cpu":
            return item
        return replace(item, q_rows=_on_device(item.q_rows, device),
                       kv_rows=_on_device(item.kv_rows, device))
    return item if isinstance(item, slice) else item.to(device)


def _laid_apart(runs: RunArrays, take: np.ndarray | slice, shift: np.ndarray
                ) -> tuple[RunArrays, np.ndarray]:
    """The runs parts `take` (an index, or slice(None): all) lie in, each once, their rows
    moved by `shift` (the parts' blocks laid apart), sorted by row; and int64 [parts] the
    run each part lies in."""
    row = runs.row[take] + shift
    new = np.ones(len(row), dtype=bool)
    new[1:] = row[1:] != row[:-1]
    if len(row) > 1 and not (row[1:] >= row[:-1]).all():
        row, first, inside = np.unique(row, return_index=True, return_inverse=True)
    else:  # in row order already (block after block, runs in order): no sort
        first = np.flatnonzero(new)
        row, inside = row[first], cumsum(new) - 1
    if not isinstance(take, slice):
        first = take[first]
    return RunArrays(row, runs.pos[first], runs.count[first]), inside


def _whole(q0: int, q1: int, k0: int, k1: int, lo: int, hi: int):
    """The one slice (q0, q1, k0, k1, lo, hi) of a block's parts that keeps their pairs
    (`NO_LO` / `NO_HI`: unbounded) where its pieces fill its rows, else False."""
    lo, hi = (None if lo == NO_LO else lo), (None if hi == NO_HI else hi)
    trimmed = pieces(q0, q1, k0, k1, lo, hi)
    if not trimmed or (min(p.q_start for p in trimmed), max(p.q_end for p in trimmed),
                       min(p.k_start for p in trimmed), max(p.k_end for p in trimmed)
                       ) != (q0, q1, k0, k1):
        return False
    return q0, q1, k0, k1, lo, hi


def _components(parts: PartArrays) -> np.ndarray:
    """int64 [parts]: each part's group (parts linked by shared query or key rows), numbered
    in order of the groups' first query row."""
    label = np.arange(len(parts))
    sides = [_clusters(parts.q0, parts.q1), _clusters(parts.k0, parts.k1)]
    while True:  # the least part of each cluster, spread until nothing changes
        before = label
        for cluster in sides:
            least = np.full(cluster.max() + 1, len(parts))
            np.minimum.at(least, cluster, label)
            label = least[cluster]
        if np.array_equal(label, before):
            break
    first = np.full(len(parts), np.iinfo(np.int64).max)
    np.minimum.at(first, label, parts.q0)
    roots = np.flatnonzero(label == np.arange(len(parts)))  # each group's least part
    order = roots[np.argsort(first[roots], kind="stable")]
    number = np.empty(len(parts), dtype=np.int64)
    number[order] = np.arange(len(order))
    return number[label]


def _squares(block: np.ndarray, slice_of: np.ndarray) -> np.ndarray | None:
    """`_components` of parts cut from document squares apart from one another: a block's
    parts of one square share its first key row's run (causal) or every row of a side
    (full), so they are one group, and parts of two squares share no row. None where the
    parts are not in order of (block, square) (`_components` then numbers them)."""
    key = block * (int(slice_of.max()) + 1) + slice_of
    if not (key[1:] >= key[:-1]).all():
        return None
    new = np.ones(len(key), dtype=bool)
    new[1:] = key[1:] != key[:-1]
    return cumsum(new) - 1


def _clusters(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """int64 [n]: each range's cluster of overlapping ranges [start, end)."""
    in_order = bool((start[1:] >= start[:-1]).all())
    order = None if in_order else np.argsort(start, kind="stable")
    s, e = (start, end) if in_order else (start[order], end[order])
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] >= reach[:-1]
    if in_order:
        return cumsum(new) - 1
    out = np.empty(len(s), dtype=np.int64)
    out[order] = cumsum(new) - 1
    return out


class _Side:
    """One side's rows of every group, gathered in the order of their positions: the pieces
    (start, end) of each group (`group_start` indexes its first in `start` / `end`), its
    rows `count`, its first piece's row, and each part's first row in the gathered rows."""

    def __init__(self, start, end, group_start, count, first_row, moved) -> None:
        self.start, self.end, self.group_start = start, end, group_start
        self.count, self.first_row, self.moved = count, first_row, moved


def _gathered(r0: np.ndarray, r1: np.ndarray, comp: np.ndarray, runs: RunArrays,
              inside: np.ndarray) -> _Side | None:
    """`slice_blocks._gather_group`'s rows of one side ([r0, r1) per part) for every group:
    each group's union of ranges, cut at the runs' bounds (`runs` sorted by row; `inside`:
    the run each part lies in), sorted by position."""
    span = int(r1.max()) + 1
    key = comp * span + r0
    order = None if (key[1:] >= key[:-1]).all() else np.argsort(key, kind="stable")
    g, a, b, run_of = (comp, r0, r1, inside) if order is None else (
        comp[order], r0[order], r1[order], inside[order])
    reach = np.maximum.accumulate(g * span + b) - g * span
    new = np.ones(len(a), dtype=bool)
    new[1:] = (g[1:] != g[:-1]) | (a[1:] > reach[:-1])
    seg_start = a.compress(new)
    seg_first = np.flatnonzero(new)
    seg_last = np.append(seg_first[1:], len(a)) - 1
    seg_end = reach[seg_last]  # the reach at a segment's last part
    # run_of: each part's run (runs are sorted by row: a segment's first and last run)
    seg_group = g.compress(new)
    run_row, run_pos = runs.row, runs.pos
    run_end = run_row + runs.count
    first = run_of[seg_first]
    count = None
    if (seg_end <= run_end[first]).all():  # each segment within its first part's run
        start, end, group, n = seg_start, seg_end, seg_group, first
    else:
        count = run_of[seg_last] - first + 1  # the runs each meets
        cut_at = cumsum(count) - count  # each segment's first piece
        ri = np.repeat(np.arange(len(seg_start)), count)
        n = np.arange(len(ri)) - (cut_at - first)[ri]  # spans(first, count)
        start = np.maximum(seg_start[ri], run_row[n])
        end = np.minimum(seg_end[ri], run_end[n])
        covered = np.zeros(len(seg_start), dtype=np.int64)
        np.add.at(covered, ri, np.maximum(end - start, 0))
        if not np.array_equal(covered, seg_end - seg_start):
            return None  # rows outside the runs: the general path decides
        group = seg_group[ri]
    pos = run_pos[n] + start - run_row[n]
    key = group * (int(pos.max()) + 1) + pos
    by_pos = None if (key[1:] >= key[:-1]).all() else np.argsort(key, kind="stable")
    if by_pos is not None:
        start, end, group = start[by_pos], end[by_pos], group[by_pos]
    size = end - start
    total = cumsum(size)
    before = total - size
    new_group = np.ones(len(group), dtype=bool)
    new_group[1:] = group[1:] != group[:-1]
    group_start = np.flatnonzero(new_group)  # every group has a piece, in group order
    group_rows = total[np.append(group_start[1:], len(group)) - 1] - before[group_start]
    offset = before - before[group_start][group]  # rows before the piece in its group
    # each part's piece: its segment's first piece and as many on as runs (then by position)
    seg = cumsum(new) - 1  # each part's segment
    at = seg if count is None else cut_at[seg] + run_of - first[seg]
    if order is not None:
        part, at = at, np.empty(len(order), dtype=np.int64)
        at[order] = part
    if by_pos is not None:
        placed = np.empty(len(by_pos), dtype=np.int64)
        placed[by_pos] = np.arange(len(by_pos))
        at = placed[at]
    return _Side(start, end, group_start, group_rows, start[group_start],
                 offset[at] + r0 - start[at])


def _documents(q0, q1, k0, k1, hi, comp, q_count, k_count) -> tuple[np.ndarray, np.ndarray]:
    """(kind, ok) per group: kind 0 where its gathered parts are one full slice, 1 one
    causal square (`slice_blocks.merged`); ok False where it is neither."""
    groups = len(q_count)
    lo_least = np.full(groups, np.iinfo(np.int64).max)
    np.minimum.at(lo_least, comp, k0 - q1 + 1)
    top = np.full(groups, np.iinfo(np.int64).min)
    np.maximum.at(top, comp, np.minimum(k1 - 1 - q0, hi))
    first_q = np.full(groups, np.iinfo(np.int64).max)
    first_k = first_q.copy()
    np.minimum.at(first_q, comp, q0)
    np.minimum.at(first_k, comp, k0)
    full = top >= k_count - 1
    causal = ~full & (top == 0) & (q_count == k_count)
    ok = (first_q == 0) & (first_k == 0) & (lo_least <= 1 - q_count) & (full | causal)
    # the pairs a group's parts keep against its slice's: a group of one part is its slice
    # where the checks above hold, so only groups of several parts are counted
    several = np.bincount(comp, minlength=groups) > 1
    g = np.flatnonzero(several & ok)
    if len(g):
        p = np.flatnonzero((several & ok)[comp])
        got = np.zeros(groups, dtype=np.int64)
        np.add.at(got, comp[p], pair_counts(q0[p], q1[p], k0[p], k1[p],
                                            np.full(len(p), NO_LO), hi[p]))
        qc, kc, full_g = q_count[g], k_count[g], full[g]
        zero = np.zeros_like(qc)
        want = np.where(full_g, qc * kc, pair_counts(
            zero, qc, zero, kc, np.full(len(g), NO_LO), np.where(full_g, NO_HI, top[g])))
        ok[g] = want == got[g]
    return causal.astype(np.int8), ok


class _CallSide:
    """One side of the documents calls, their groups in call order: each group's pieces
    [start, end) of local rows (`at`: its first piece; `at[-1]` all pieces), its rows
    (`count`) and rows before it (`cum`, and all); `rows`: every piece's rows in order (from
    `rows_at`), `gap`: pieces not starting where the one before ends (int64 / bool arrays)."""

    def __init__(self, side: _Side, order: np.ndarray, row: np.ndarray) -> None:
        ends = np.append(side.group_start[1:], len(side.start))
        if len(order) == len(side.count) and (order[1:] > order[:-1]).all():  # every group
            count = ends - side.group_start  # in order: the pieces as they are
            shift = np.repeat(row, count)
            self.start, self.end = side.start - shift, side.end - shift
        else:
            count = ends[order] - side.group_start[order]
            index = spans(side.group_start[order], count)
            shift = np.repeat(row, count)
            self.start, self.end = side.start[index] - shift, side.end[index] - shift
        self.at = np.zeros(len(order) + 1, dtype=np.int64)
        self.at[1:] = cumsum(count)
        self.count = side.count[order]
        self.cum = np.zeros(len(order) + 1, dtype=np.int64)  # rows before each group
        self.cum[1:] = cumsum(self.count)
        self.gap = np.ones(len(self.start), dtype=bool)
        self.gap[1:] = self.start[1:] != self.end[:-1]
        self.gaps = cumsum(self.gap)
        self.rows = spans(self.start, self.end - self.start)  # every piece's rows, in order
        self.rows_at = np.zeros(len(self.start) + 1, dtype=np.int64)
        self.rows_at[1:] = cumsum(self.end - self.start)

    def documents(self, first: np.ndarray, stop: np.ndarray
                  ) -> list[tuple[np.ndarray, SideRuns]]:
        """Per call of groups first[n] .. stop[n] - 1: int64 [groups + 1] the rows before
        each of its groups, and all, and its documents' runs (`SideRuns`); in one pass
        where there are many calls."""
        if len(first) < 8:  # a few calls: each its own slices
            return [(self.cum[c0:c1 + 1] - self.cum[c0],
                     SideRuns(self.start[p0:p1], self.end[p0:p1], self.at[c0:c1 + 1] - p0))
                    for c0, c1 in zip(first.tolist(), stop.tolist())
                    for p0, p1 in ((int(self.at[c0]), int(self.at[c1])),)]
        size = stop - first + 1
        index = spans(first, size)
        lead = np.repeat(first, size)
        cu, at = self.cum[index] - self.cum[lead], self.at[index] - self.at[lead]
        ends = cumsum(size).tolist()
        p0, p1 = self.at[first].tolist(), self.at[stop].tolist()
        out = []
        b = 0
        for n, e in enumerate(ends):
            out.append((cu[b:e], SideRuns(self.start[p0[n]:p1[n]], self.end[p0[n]:p1[n]],
                                          at[b:e])))
            b = e
        return out

    def rows_of(self, first: np.ndarray, stop: np.ndarray) -> list[slice | torch.Tensor]:
        """Each call's rows (groups first[n] .. stop[n] - 1): a slice where its pieces
        follow one another, else an index."""
        p0, p1 = self.at[first], self.at[stop]
        whole = (self.gaps[p1 - 1] == self.gaps[p0]).tolist()
        a, b = self.start[p0].tolist(), self.end[p1 - 1].tolist()
        ra, rb = self.rows_at[p0].tolist(), self.rows_at[p1].tolist()
        rows = self.rows
        return [slice(a[n], b[n]) if whole[n] else torch.from_numpy(rows[ra[n]:rb[n]])
                for n in range(len(whole))]

    def used(self, group_block: np.ndarray, blocks: list[int], local_len: int
             ) -> dict[int, slice | torch.Tensor]:
        """The rows each block of `blocks` uses on this side (all its calls' rows, in order):
        a slice where they follow one another, else an index (on the CPU)."""
        if not blocks:
            return {}
        pieces = np.repeat(group_block, np.diff(self.at)) * local_len
        edges = np.zeros((int(group_block.max()) + 1) * local_len + 1, dtype=np.int64)
        np.add.at(edges, pieces + self.start, 1)
        np.add.at(edges, pieces + self.end, -1)
        mark = cumsum(edges[:-1]) > 0  # rows inside some piece
        out = {}
        for b in blocks:
            rows = np.flatnonzero(mark[b * local_len:(b + 1) * local_len])
            first, last = int(rows[0]), int(rows[-1]) + 1
            out[b] = slice(first, last) if last - first == len(rows) else torch.from_numpy(rows)
        return out


def _documents_call(q: tuple[np.ndarray, SideRuns], k: tuple[np.ndarray, SideRuns], q_rows,
                    k_rows, causal: bool, device: torch.device) -> Block:
    """`slice_blocks.gathered_call` of several documents (`_CallSide.documents` of a call,
    on `q_rows` x `k_rows`)."""
    tile = TileSlices.documents(q[0], k[0], causal, device)
    return Block(q_rows, k_rows, causal=tile.causal, slices=tile, doc_runs=DocRuns(q[1], k[1]))
