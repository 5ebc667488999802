"""A block's parts as arrays: the sweep of a mask's slices over two ranks' runs of positions
(`slice_blocks.block_parts`) in numpy operations, no Python loop per slice or run.

Runs and parts are int64 arrays. A part is a slice of local rows (q0, q1, k0, k1, lo, hi):
query row i sees key row j iff lo <= j - i <= hi, `NO_LO` / `NO_HI` where unbounded (the
values `slice_blocks.merged` reads None as).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..masks.slices import SliceMask

NO_LO, NO_HI = -(1 << 62), 1 << 62


class RunArrays(NamedTuple):
    """A rank's runs of contiguous positions, sorted by position: first local row, its
    position and rows, int64 [runs] each (`slice_blocks.Run`)."""

    row: np.ndarray
    pos: np.ndarray
    count: np.ndarray

    @classmethod
    def of(cls, runs: tuple[tuple[int, int, int], ...]) -> RunArrays:
        table = np.array(runs, dtype=np.int64).reshape(-1, 3)
        return cls(table[:, 0].copy(), table[:, 1].copy(), table[:, 2].copy())


class PartArrays(NamedTuple):
    """Slices of local rows, int64 [parts] each (module docstring): numpy arrays when
    planning, CPU tensors as a flex mask's pieces (`band_blocks.Pieces`)."""

    q0: np.ndarray | torch.Tensor
    q1: np.ndarray | torch.Tensor
    k0: np.ndarray | torch.Tensor
    k1: np.ndarray | torch.Tensor
    lo: np.ndarray | torch.Tensor
    hi: np.ndarray | torch.Tensor

    def __len__(self) -> int:
        return len(self.q0)

    def take(self, index) -> PartArrays:
        """The parts at `index` (a slice, mask or index array)."""
        return PartArrays(*(a[index] for a in self))

    def bounds(self) -> list[tuple]:
        """The parts as `tile_slices.Bound` tuples (None where unbounded)."""
        lo = [None if v == NO_LO else v for v in self.lo.tolist()]
        hi = [None if v == NO_HI else v for v in self.hi.tolist()]
        return list(zip(self.q0.tolist(), self.q1.tolist(), self.k0.tolist(),
                        self.k1.tolist(), lo, hi))


class SliceArrays(NamedTuple):
    """A mask's slices in order of (q_start, k_start), int64 [slices] each, with the running
    maximum of q_end (`reach`: no slice before index n ends past reach[n - 1])."""

    q0: np.ndarray
    q1: np.ndarray
    k0: np.ndarray
    k1: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    reach: np.ndarray


_TABLES: dict[int, tuple[SliceMask, SliceArrays]] = {}  # by id, with the mask held


def slice_arrays(mask: SliceMask) -> SliceArrays:
    """`mask`'s slices as arrays, kept for a few masks (layers of a model share one): found
    by identity, so a new micro-batch's mask costs no comparison with an old one's."""
    held, table = _TABLES.get(id(mask), (None, None))
    if held is not mask or table is None:
        if len(_TABLES) >= 16:
            _TABLES.pop(next(iter(_TABLES)))
        rows = [(s.q_start, s.q_end, s.k_start, s.k_end,
                 NO_LO if lo is None else lo, NO_HI if hi is None else hi)
                for s in mask.slices for lo, hi in (s.bounds,)]
        a = np.array(rows, dtype=np.int64).reshape(-1, 6)
        cols = [a[:, n].copy() for n in range(6)]
        table = SliceArrays(*cols, np.maximum.accumulate(cols[1]))
        _TABLES[id(mask)] = (mask, table)
    return table


def document_arrays(cu_padded: tuple[int, ...], lengths: tuple[int, ...], causal: bool
                    ) -> SliceArrays:
    """`slice_arrays` of `Documents.slices(causal)` (one square per non-empty document),
    made from the documents' arrays without the `SliceMask`."""
    start = np.array(cu_padded[:-1], dtype=np.int64)
    size = np.array(lengths, dtype=np.int64)
    start, end = start[size > 0], (start + size)[size > 0]
    lo = np.full(len(start), NO_LO)
    hi = np.zeros(len(start), dtype=np.int64) if causal else np.full(len(start), NO_HI)
    return SliceArrays(start, end, start.copy(), end.copy(), lo, hi, end.copy())


# from this many elements on, `cumsum` runs through torch: numpy's int64 cumsum goes element
# by element, several times slower on the tens of thousands of parts and rows a tile plans
# (with it the plan measured about 1.5 ms slower at 8x8, 1000 documents)
_TORCH_CUMSUM = 2048


def cumsum(a: np.ndarray) -> np.ndarray:
    """int64 [n]: the running sums of `a` (int64 or bool [n]), as np.cumsum gives them."""
    if len(a) < _TORCH_CUMSUM:
        return np.cumsum(a, dtype=np.int64)
    return torch.cumsum(torch.from_numpy(np.ascontiguousarray(a)), 0).numpy()


def spans(first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """first[n] + 0 .. count[n] - 1 for every n, concatenated (int64)."""
    total = int(count.sum())
    starts = cumsum(count) - count
    return np.arange(total, dtype=np.int64) - np.repeat(starts - first, count)


def part_arrays(mask: SliceMask | SliceArrays, q_runs: RunArrays, k_runs: RunArrays
                ) -> PartArrays:
    """The parts `slice_blocks.block_parts` finds, in its order: query runs in order, the
    slices meeting each (mask order), the key runs meeting each slice, a slice's causal
    piece before its full one. `mask`: its slices, or their arrays (`slice_arrays`)."""
    return tile_parts(mask, [q_runs], [k_runs]).parts


class TileParts(NamedTuple):
    """The parts of several blocks (block after block), int64 [parts] the block of each,
    the query run and key run each part lies in (`RunArrays` of [parts]) and the mask's
    slice each part is cut from (int64 [parts])."""

    parts: PartArrays
    block: np.ndarray
    q_run: RunArrays
    k_run: RunArrays
    slice_of: np.ndarray


def tile_parts(mask: SliceMask | SliceArrays, q_runs: list[RunArrays], k_runs: list[RunArrays]
               ) -> TileParts:
    """`part_arrays` of blocks (x_b, y_b), b = 0 .. len(k_runs) - 1, in one pass: the parts
    of every block (block after block, each in `part_arrays`' order). `q_runs[b]`: x_b's
    runs, `k_runs[b]`: y_b's (blocks of one rank share its runs: each distinct one is swept
    once); each block once."""
    t = mask if isinstance(mask, SliceArrays) else slice_arrays(mask)
    q, q_of = _stacked(q_runs)
    k, k_of = _stacked(k_runs)
    # each query run of each distinct rank against the slices meeting it
    q_lo, q_hi = q.pos, q.pos + q.count
    first = np.searchsorted(t.reach, q_lo, side="right")
    count = np.maximum(np.searchsorted(t.q0, q_hi, side="left") - first, 0)
    qi = np.repeat(np.arange(len(q_lo)), count)
    si = spans(first, count)
    keep = t.q1[si] > q_lo[qi]
    qi, si = qi.compress(keep), si.compress(keep)
    # the key runs of block b's key rank meeting each slice where the query run sees them
    # (keys from q_lo + lo to q_hi - 1 + hi: runs outside give no part): first, per (key
    # rank, slice), the rank's first key at or after the slice's first; a block without one
    # before k1 has no part there (a table of ranks x slices against the distinct query
    # ranks' pairs, so the searches below run only for the blocks' pairs that may meet)
    span = int(max(t.k1.max(initial=0), (k.pos + k.count).max(initial=0))) + 1
    k_end = k.pos + k.count
    base = k.rank * span
    k1 = np.minimum(t.k1[si], q_hi[qi] + t.hi[si])
    ranks = np.arange(len(k.first))
    at = np.searchsorted(base + k_end, (ranks[:, None] * span + t.k0[None, :]).ravel(),
                         side="right").reshape(len(ranks), -1)
    inside = np.append(k.rank, -1)[at] == ranks[:, None]
    first_key = np.where(inside, np.maximum(np.append(k.pos, 0)[at], t.k0[None, :]), NO_HI)
    meets = np.flatnonzero(first_key[:, si] < k1[None, :])  # [key ranks, pairs], flat
    kr = meets // len(si)
    entry = meets - kr * len(si)
    blocks = np.full((len(q.first), len(ranks)), -1, dtype=np.int64)
    blocks[q_of, k_of] = np.arange(len(q_of))
    if (blocks >= 0).sum() < len(q_of):
        raise ValueError(f"tile_parts takes each block once, got {len(q_of)} blocks of "
                         f"{int((blocks >= 0).sum())} distinct (query, key) runs")
    block = blocks[q.rank[qi[entry]], kr]
    kept = block >= 0
    entry, block = entry.compress(kept), block.compress(kept)
    by_block = np.argsort(block * len(qi) + entry, kind="stable")
    block, entry = block[by_block], entry[by_block]
    qi, si, kr, k1 = qi[entry], si[entry], k_of[block], k1[entry]
    unbounded_below = bool((t.lo == NO_LO).all())
    if unbounded_below:  # k0 is the slice's first key: its first run from the table
        k_first = at[kr, si]
        count = _runs_before(base + k.pos, k_first, kr * span + k1)
    else:
        k0 = np.maximum(t.k0[si], q_lo[qi] + t.lo[si])
        k_first = np.searchsorted(base + k_end, kr * span + k0, side="right")  # ends past k0
        count = np.maximum(np.searchsorted(base + k.pos, kr * span + k1, side="left") - k_first,
                           0)
    ki = spans(k_first, count)
    qi, si, block = np.repeat(qi, count), np.repeat(si, count), np.repeat(block, count)
    a = np.maximum(t.q0[si], q_lo[qi])
    b = np.minimum(t.q1[si], q_hi[qi])
    c = np.maximum(t.k0[si], k.pos[ki])
    e = np.minimum(t.k1[si], k_end[ki])
    parts = _pieces(a, b, c, e, t.lo[si], t.hi[si])
    qi, ki = qi[parts.cut], ki[parts.cut]
    q_run = RunArrays(q.row[qi], q.pos[qi], q.count[qi])
    k_run = RunArrays(k.row[ki], k.pos[ki], k.count[ki])
    dq, dk = q_run.row - q_run.pos, k_run.row - k_run.pos
    lo, hi = parts.lo, parts.hi
    return TileParts(PartArrays(parts.q0 + dq, parts.q1 + dq, parts.k0 + dk, parts.k1 + dk,
                                lo if unbounded_below else np.where(lo == NO_LO, NO_LO,
                                                                    lo + dk - dq),
                                np.where(hi == NO_HI, NO_HI, hi + dk - dq)), block[parts.cut],
                     q_run, k_run, si[parts.cut])


def _runs_before(start: np.ndarray, first: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """int64 [n]: how many of the runs first[n], first[n] + 1, ... start before stop[n]
    (`start` sorted; run first[n] does): np.searchsorted(start, stop) - first, stepping
    run by run where few meet (a document's pair meets one key run or two), searched past
    a few steps."""
    if len(first) < 512:  # few pairs: one search costs less than the steps' calls
        return np.searchsorted(start, stop, side="left") - first
    ahead = np.append(start, np.iinfo(np.int64).max)  # no run starts before past the last
    count = np.ones(len(first), dtype=np.int64)
    live = np.flatnonzero(ahead[first + 1] < stop)
    for _ in range(3):
        if len(live) == 0:
            return count
        count[live] += 1
        live = live[ahead[first[live] + count[live]] < stop[live]]
    count[live] = np.searchsorted(start, stop[live], side="left") - first[live]
    return count


def pair_counts(q0: np.ndarray, q1: np.ndarray, k0: np.ndarray, k1: np.ndarray,
                lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """int64 [n]: how many pairs of queries [q0, q1) x keys [k0, k1) have lo <= j - i <= hi
    (`NO_LO` / `NO_HI`: unbounded), each in closed form (`masks.slices.slice_pairs`' rule:
    a row's count is linear between the rows where a bound starts or stops binding)."""
    if (lo == NO_LO).all():  # one break: the rows before e - 1 - hi see fewer keys
        start = np.clip(k0 - hi, q0, q1)  # the first row that sees a key
        whole = np.clip(k1 - 1 - hi, q0, q1)  # the first row that sees every key
        n = whole - start
        return n * (hi - k0 + 1) + (start + whole - 1) * n // 2 + (q1 - whole) * (k1 - k0)
    cuts = np.sort(np.stack([q0, q1] + [np.clip(x, q0, q1) for x in (
        k1 - 1 - hi, k0 - lo, k0 - hi, k1 - lo)], axis=1), axis=1)

    def count(i):
        return np.maximum(np.minimum(k1 - 1, i + hi) - np.maximum(k0, i + lo) + 1, 0)

    total = np.zeros(len(q0), dtype=np.int64)
    for n in range(5):  # count is linear on [cuts[n], cuts[n + 1])
        start, stop = cuts[:, n], cuts[:, n + 1]
        total += np.where(stop > start, (count(start) + count(stop - 1)) * (stop - start) // 2,
                          0)
    return total


class _Stacked(NamedTuple):
    """Distinct ranks' runs concatenated: `rank` [runs] the rank of each, `first` [ranks]
    the first run of each."""

    row: np.ndarray
    pos: np.ndarray
    count: np.ndarray
    rank: np.ndarray
    first: np.ndarray


def _stacked(runs: list[RunArrays]) -> tuple[_Stacked, np.ndarray]:
    """The distinct runs of `runs` (by identity) stacked, and int64 [len(runs)] the rank
    of each."""
    index: dict[int, int] = {}
    of = np.array([index.setdefault(id(r), len(index)) for r in runs], dtype=np.int64)
    distinct = list({id(r): r for r in runs}.values())
    sizes = np.array([len(r.row) for r in distinct], dtype=np.int64)
    return _Stacked(np.concatenate([r.row for r in distinct]),
                    np.concatenate([r.pos for r in distinct]),
                    np.concatenate([r.count for r in distinct]),
                    np.repeat(np.arange(len(distinct)), sizes),
                    cumsum(sizes) - sizes), of


class _Pieces(NamedTuple):
    """The pieces of the cuts, int64 [pieces] each, in order of their cuts (a cut's causal
    piece before its full one), and the cut each comes from."""

    q0: np.ndarray
    q1: np.ndarray
    k0: np.ndarray
    k1: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    cut: np.ndarray


def _pair(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """[n, 2]: x[i], y[i] side by side."""
    out = np.empty((len(x), 2), dtype=x.dtype)
    out[:, 0], out[:, 1] = x, y
    return out


def _pieces(a, b, c, e, lo, hi) -> _Pieces:
    """`slices.pieces` of every cut at once, as bounds (lo, hi) of the pieces' rules: a
    cut's first piece the band, the full slice or the causal piece; its second the full
    piece after a causal one."""
    # an unbounded side's NO_LO / NO_HI bind nothing below (no bound checks needed)
    a = np.maximum(a, c - hi)
    e = np.minimum(e, b + hi)
    if (lo == NO_LO).all():  # no cut bounded below (documents): no band, lo <= hi
        some = (a < b) & (c < e)
        band = None
    else:
        b = np.minimum(b, e - lo)
        c = np.maximum(c, a + lo)
        some = (lo <= hi) & (a < b) & (c < e)
        band = c - (b - 1) < lo
    fits = e - 1 - a <= hi  # every row sees every key under the upper bound
    split = np.minimum(np.maximum(e - hi, a), b)
    if band is None:
        cut = ~fits  # a causal piece and a full one
        first_hi = np.where(cut, e - split, NO_HI)
        first_lo = lo
    else:
        band_hi = np.where(~fits & (hi >= e - b), hi, NO_HI)
        cut = ~band & ~fits
        first_hi = np.where(band, band_hi, np.where(cut, e - split, NO_HI))
        first_lo = np.where(band, lo, NO_LO)
    first_q1 = np.where(cut, split, b)
    first = some & (~cut | (split > a))
    second = some & cut & (split < b)
    if not second.any():  # one piece per cut at most
        at = np.flatnonzero(first)
        return _Pieces(a[at], first_q1[at], c[at], e[at], first_lo[at], first_hi[at], at)
    at = np.flatnonzero(_pair(first, second))
    return _Pieces(*(x.ravel()[at] for x in (
        _pair(a, split), _pair(first_q1, b), _pair(c, c), _pair(e, e),
        _pair(first_lo, np.full_like(lo, NO_LO)), _pair(first_hi, np.full_like(hi, NO_HI)))),
        at // 2)
