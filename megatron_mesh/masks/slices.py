"""A mask as data: slices of the whole sequence's (query, key) positions. Torch-free.

A slice (q_start, q_end, k_start, k_end, kind) keeps query positions [q_start, q_end)
against key positions [k_start, k_end): every pair ("full"), or ("causal") the pairs of
flash-attention's causal mask of unequal lengths, aligned at the bottom right: query i sees
key j iff j - k_start <= i - q_start + (k_end - k_start) - (q_end - q_start), that is
j - i <= k_end - q_end (`Slice.diagonal`). A slice may carry a window band, flash-attention's
(left, right) aligned the same way: with d = k_end - q_end, query i sees key j only where
d - left <= j - i <= d + right (-1: unbounded on that side); a windowed slice is kind full,
its right bound 0 where it is causal (`as_slice` writes every slice so). `Slice.bounds`
gives a slice's rule as bounds on j - i; `seen.py` evaluates it on positions. A `SliceMask`
is slices that do not overlap; a query no slice gives a key sees nothing (output 0, no
gradient).

Mask kinds build slices (`prefix.py`, `window.windowed`); the mesh cuts them to each block's rows and columns
(`Slice.cut`, `SliceMask.cut`; `slice_blocks.py` makes the kernel calls). A cut slice is
again at most two slices of the same kinds, so the kernels see full, bottom-right causal and
band tiles only.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import heapq
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

FULL, CAUSAL = "full", "causal"
KINDS = (FULL, CAUSAL)


@dataclass(frozen=True)
class Slice:
    """Query positions [q_start, q_end) against key positions [k_start, k_end), `kind`
    "full" or "causal" (bottom-right aligned: query i sees key j iff j - i <= diagonal),
    and a window band (left, right) or None (module docstring)."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    kind: str = FULL
    window: tuple[int, int] | None = None

    @property
    def diagonal(self) -> int | None:
        """A causal slice's bound: query i sees key j iff j - i <= diagonal (None: full)."""
        return self.k_end - self.q_end if self.kind == CAUSAL else None

    @property
    def bounds(self) -> tuple[int | None, int | None]:
        """(lo, hi): query i sees key j of the slice's rectangle iff lo <= j - i <= hi (None:
        unbounded), from its kind and window."""
        d = self.k_end - self.q_end
        hi = d if self.kind == CAUSAL else None
        if self.window is None:
            return None, hi
        left, right = self.window
        if right >= 0:
            hi = d + right if hi is None else min(hi, d + right)
        return (d - left if left >= 0 else None), hi

    @property
    def as_tuple(self) -> tuple:
        """(q_start, q_end, k_start, k_end, kind), and the window where there is one."""
        plain = (self.q_start, self.q_end, self.k_start, self.k_end, self.kind)
        return plain if self.window is None else plain + (self.window,)

    def __str__(self) -> str:
        band = "" if self.window is None else f", {self.window}"
        return (f"({self.q_start}, {self.q_end}, {self.k_start}, {self.k_end}, "
                f"{self.kind!r}{band})")

    def cut(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> tuple[Slice, ...]:
        """The pairs this slice keeps of queries [q_lo, q_hi) x keys [k_lo, k_hi), as at most
        two slices whose every row sees a key and every key is seen: the rows that see only
        part of the keys (one causal slice, bottom-right aligned on the cut) and the rows
        below them that see all (one full slice); under a window that binds, one windowed
        slice (a band, bottom-right aligned on the cut)."""
        return pieces(max(self.q_start, q_lo), min(self.q_end, q_hi),
                      max(self.k_start, k_lo), min(self.k_end, k_hi), *self.bounds)

    def banded(self, lo: int | None, hi: int | None) -> tuple[Slice, ...]:
        """The pairs this slice keeps with lo <= j - i <= hi besides (None: unbounded), as
        `cut` gives them: a window laid on the slice's own rule."""
        own_lo, own_hi = self.bounds
        lo = own_lo if lo is None else lo if own_lo is None else max(lo, own_lo)
        hi = own_hi if hi is None else hi if own_hi is None else min(hi, own_hi)
        return pieces(self.q_start, self.q_end, self.k_start, self.k_end, lo, hi)

    @property
    def pairs(self) -> int:
        """How many (query, key) pairs the slice keeps."""
        total = 0
        for part in self.cut(self.q_start, self.q_end, self.k_start, self.k_end):
            sq, sk = part.q_end - part.q_start, part.k_end - part.k_start
            if part.window is not None:
                total += slice_pairs(part.q_start, part.q_end, part.k_start, part.k_end,
                                     *part.bounds)
            else:
                total += sq * sk - (sq * (sq - 1) // 2 if part.kind == CAUSAL else 0)
        return total


def pieces(a: int, b: int, c: int, e: int, lo: int | None, hi: int | None
           ) -> tuple[Slice, ...]:
    """The pairs of queries [a, b) x keys [c, e) with lo <= j - i <= hi (None: unbounded) as
    at most two slices whose rows each see a key and keys are each seen (`Slice.cut`)."""
    if lo is not None and hi is not None and lo > hi:
        return ()
    if hi is not None:
        a = max(a, c - hi)  # row i sees key c iff c - i <= hi
        e = min(e, b + hi)  # key j is seen by row b - 1 iff j - (b - 1) <= hi
    if lo is not None:
        b = min(b, e - lo)  # row i sees key e - 1 iff e - 1 - i >= lo
        c = max(c, a + lo)  # key j is seen by row a iff j - a >= lo
    if a >= b or c >= e:
        return ()
    if lo is not None and c - (b - 1) < lo:  # the lower bound binds: one band
        d = e - b
        right = -1 if hi is None or e - 1 - a <= hi else hi - d
        return (Slice(a, b, c, e, FULL, (d - lo, right)),)
    if hi is None or e - 1 - a <= hi:
        return (Slice(a, b, c, e, FULL),)
    split = min(max(e - hi, a), b)  # rows from here on see every key of [c, e)
    parts = []
    if split > a:
        parts.append(Slice(a, split, c, e, CAUSAL))  # e - split == hi: bottom-right
    if split < b:
        parts.append(Slice(split, b, c, e, FULL))
    return tuple(parts)


def slice_pairs(a: int, b: int, c: int, e: int, lo: int | None, hi: int | None) -> int:
    """How many pairs of queries [a, b) x keys [c, e) have lo <= j - i <= hi (None:
    unbounded), in closed form: row i's count, min(e - 1, i + hi) - max(c, i + lo) + 1, is
    linear between its break rows."""
    def count(i: int) -> int:
        first = c if lo is None else max(c, i + lo)
        last = e - 1 if hi is None else min(e - 1, i + hi)
        return max(0, last - first + 1)

    breaks = (None if hi is None else e - 1 - hi, None if lo is None else c - lo,
              None if hi is None else c - hi, None if lo is None else e - lo)
    cuts = sorted({a, b, *(x for x in breaks if x is not None and a < x < b)})
    total = 0
    for start, stop in zip(cuts, cuts[1:]):  # count is linear on [start, stop)
        first, last = count(start), count(stop - 1)
        total += (first + last) * (stop - start) // 2
    return total


def as_slice(item: object, index: int) -> Slice:
    """The checked `Slice` of item `index` of a slice list: a Slice or a tuple
    (q_start, q_end, k_start, k_end, kind[, (left, right)]); ValueError naming it otherwise.
    Written one way: a window that limits nothing is dropped, one of (-1, 0) is kind causal,
    and a causal slice's window is a full slice's of right bound 0."""
    if isinstance(item, Slice):
        item = item.as_tuple
    if not isinstance(item, (tuple, list)) or len(item) not in (5, 6):
        raise ValueError(f"slice {index} {item!r} must be (q_start, q_end, k_start, k_end, "
                         f"kind) with kind one of {KINDS}, or with a window (left, right) "
                         "after the kind")
    bounds, kind = item[:4], item[4]
    window = item[5] if len(item) == 6 else None
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in bounds):
        raise ValueError(f"slice {index} {tuple(item)!r}: its bounds must be ints")
    if kind not in KINDS:
        raise ValueError(f"slice {index} {tuple(item)!r}: kind {kind!r} is not one of {KINDS}")
    q_start, q_end, k_start, k_end = bounds
    if not (0 <= q_start < q_end and 0 <= k_start < k_end):
        raise ValueError(f"slice {index} {tuple(item)!r} must have 0 <= q_start < q_end and "
                         "0 <= k_start < k_end (no empty or negative range)")
    if window is not None:
        if (not isinstance(window, (tuple, list)) or len(window) != 2
                or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1
                           for w in window)):
            raise ValueError(f"slice {index} {tuple(item)!r}: its window {window!r} must be a "
                             "pair (left, right) of ints >= -1 (-1: unbounded)")
        left, right = window
        if kind == CAUSAL:
            kind, right = FULL, 0
        window = None if (left, right) == (-1, -1) else (left, right)
        if window == (-1, 0):
            kind, window = CAUSAL, None
    return Slice(q_start, q_end, k_start, k_end, kind, window)


@dataclass(frozen=True)
class SliceMask:
    """What every query sees, as slices over the whole sequence's positions (kept in order
    of (q_start, k_start)). `seq_len`: the sequence it was built for (None: any that holds
    its slices; `check_length`). ValueError on a bad slice or two that overlap, naming them.

        SliceMask([(0, 256, 0, 256, "full"), (256, 1024, 0, 256, "full"),
                   (256, 1024, 256, 1024, "causal")])
    """

    slices: tuple[Slice, ...]
    seq_len: int | None = None
    key: int = field(default=0, init=False, repr=False, compare=False)  # 63-bit digest

    def __post_init__(self) -> None:
        if isinstance(self.slices, (str, bytes)) or not isinstance(self.slices, Iterable):
            raise ValueError(f"a SliceMask takes a list of slices (q_start, q_end, k_start, "
                             f"k_end, kind), got {type(self.slices).__name__}")
        given = [as_slice(item, i) for i, item in enumerate(self.slices)]
        if self.seq_len is not None:
            if not isinstance(self.seq_len, int) or isinstance(self.seq_len, bool) \
                    or self.seq_len < 1:
                raise ValueError(f"seq_len={self.seq_len!r} must be a positive int or None")
            _check_bounds(given, self.seq_len)
        _check_overlaps(given)
        ordered = tuple(sorted(given, key=lambda s: (s.q_start, s.k_start)))
        object.__setattr__(self, "slices", ordered)
        data = repr((tuple(s.as_tuple for s in ordered), self.seq_len)).encode()
        digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
        object.__setattr__(self, "key", digest & 0x7FFF_FFFF_FFFF_FFFF)

    def __hash__(self) -> int:
        return self.key

    def __len__(self) -> int:
        return len(self.slices)

    def agreement_key(self) -> int:
        """The digest every rank of a CP group compares (`agreement.py`)."""
        return self.key

    def text(self, shown: int = 4) -> str:
        """The mask as it reads in a message: its slices (the first `shown`) and digest."""
        more = ", ..." if len(self.slices) > shown else ""
        length = "" if self.seq_len is None else f" of {self.seq_len} tokens"
        return (f"{len(self.slices)} slices{length} [{', '.join(map(str, self.slices[:shown]))}"
                f"{more}] (#{self.key:x})")

    @property
    def pairs(self) -> int:
        """How many (query, key) pairs the mask keeps."""
        return sum(s.pairs for s in self.slices)

    def check_length(self, seq_len: int) -> None:
        """ValueError unless the mask fits a sequence of `seq_len` tokens: the length it was
        built for, and every slice inside [0, seq_len), naming the first that is not."""
        if self.seq_len is not None and self.seq_len != seq_len:
            raise ValueError(f"the mask was built for a sequence of {self.seq_len} tokens, "
                             f"but the call's sequence has {seq_len} (local tokens x CP size)")
        _check_bounds(self.slices, seq_len)

    def with_length(self, seq_len: int) -> SliceMask:
        """This mask as one of a sequence of `seq_len` tokens (`check_length`'s ValueError
        where it does not fit): the same slices, its length known (RoPE reads it)."""
        self.check_length(seq_len)
        return self if self.seq_len == seq_len else SliceMask(self.slices, seq_len)

    def __and__(self, other: object) -> SliceMask:
        """The pairs both masks keep (`intersect`); another kind of mask composes through
        its own `&` (`mask.Mask`)."""
        if not isinstance(other, SliceMask):
            return NotImplemented
        return intersect(self, other)

    def leading(self, length: int) -> SliceMask:
        """The mask's pairs of the first `length` positions (queries and keys < length), as
        a mask of a sequence of `length` tokens: what a prompt of that length sees of a mask
        written for the whole generated sequence."""
        if self.seq_len is not None and length >= self.seq_len:
            return self if length == self.seq_len else SliceMask(self.slices, length)
        parts = [part.as_tuple for s in self.slices for part in s.cut(0, length, 0, length)]
        return SliceMask(parts, length)

    def cut(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int, unit: int) -> tuple[Slice, ...]:
        """The mask's pairs of queries [q_lo, q_hi) x keys [k_lo, k_hi) as slices (`Slice.cut`),
        looking at the slices that meet the range only: `unit` is the grid of chunks they
        are indexed by (a zigzag sub-chunk; any positive size is exact)."""
        table = _chunk_table(self, unit)
        found: dict[Slice, None] = {}  # the slices of the touched chunks, in mask order
        for qc in range(q_lo // unit, (q_hi - 1) // unit + 1):
            for kc in range(k_lo // unit, (k_hi - 1) // unit + 1):
                found.update(dict.fromkeys(table.get((qc, kc), ())))
        return tuple(part for s in found for part in s.cut(q_lo, q_hi, k_lo, k_hi))


def intersect(a: SliceMask, b: SliceMask) -> SliceMask:
    """The pairs that both `a` and `b` keep, as slices (each pair of slices that meets gives
    at most two: their common rectangle under both rules, `pieces`); seq_len: theirs
    (ValueError where both name one and they differ). Array work: the pairs that meet are
    found by blocks of `a` against all of `b`, and cut as `pieces` cuts them, all at once."""
    if a.seq_len is not None and b.seq_len is not None and a.seq_len != b.seq_len:
        raise ValueError(f"masks of {a.seq_len} and {b.seq_len} tokens cannot be composed: "
                         "build both for the same sequence")
    parts: list[tuple] = []
    if a.slices and b.slices:
        rules_a, rules_b = _rules(a.slices), _rules(b.slices)
        rows = max(1, _PAIRS_AT_ONCE // len(b.slices))
        for first in range(0, len(a.slices), rows):
            block = rules_a[first:first + rows]
            i, j = ((block[:, None, 0] < rules_b[None, :, 1])
                    & (rules_b[None, :, 0] < block[:, None, 1])
                    & (block[:, None, 2] < rules_b[None, :, 3])
                    & (rules_b[None, :, 2] < block[:, None, 3])).nonzero()
            s, t = block[i], rules_b[j]
            parts += _pieces_of(np.maximum(s[:, 0], t[:, 0]), np.minimum(s[:, 1], t[:, 1]),
                                np.maximum(s[:, 2], t[:, 2]), np.minimum(s[:, 3], t[:, 3]),
                                np.maximum(s[:, 4], t[:, 4]), np.minimum(s[:, 5], t[:, 5]))
    return SliceMask(parts, a.seq_len if a.seq_len is not None else b.seq_len)


_UNBOUNDED = 1 << 62  # a bound of j - i that is None in `Slice.bounds` (positions < 2^40)
_PAIRS_AT_ONCE = 1 << 20  # slice pairs `intersect` compares in one array


def _rules(slices: tuple[Slice, ...]) -> np.ndarray:
    """int64 [n, 6]: each slice's (q_start, q_end, k_start, k_end, lo, hi), its `bounds`
    with None as -/+ _UNBOUNDED."""
    table = np.array([(s.q_start, s.q_end, s.k_start, s.k_end) for s in slices],
                     dtype=np.int64)
    causal = np.array([s.kind == CAUSAL for s in slices])
    window = np.array([s.window or (-1, -1) for s in slices], dtype=np.int64)
    d = table[:, 3] - table[:, 1]
    hi = np.where(causal, d, _UNBOUNDED)
    hi = np.where(window[:, 1] >= 0, np.minimum(hi, d + window[:, 1]), hi)
    lo = np.where(window[:, 0] >= 0, d - window[:, 0], -_UNBOUNDED)
    return np.column_stack([table, lo, hi])


def _pieces_of(a: np.ndarray, b: np.ndarray, c: np.ndarray, e: np.ndarray, lo: np.ndarray,
               hi: np.ndarray) -> list[tuple]:
    """`pieces` of every (a, b, c, e, lo, hi) of the arrays (bounds -/+ _UNBOUNDED for
    None), as slice tuples."""
    free_lo, free_hi = lo <= -_UNBOUNDED, hi >= _UNBOUNDED
    a = np.maximum(a, c - hi)  # row i sees key c iff c - i <= hi
    e = np.minimum(e, b + hi)  # key j is seen by row b - 1 iff j - (b - 1) <= hi
    b = np.minimum(b, e - lo)  # row i sees key e - 1 iff e - 1 - i >= lo
    c = np.maximum(c, a + lo)  # key j is seen by row a iff j - a >= lo
    kept = (lo <= hi) & (a < b) & (c < e)
    band = kept & ~free_lo & (c - (b - 1) < lo)  # the lower bound binds: one band
    whole = kept & ~band & (free_hi | (e - 1 - a <= hi))  # every row sees every key
    split_rows = kept & ~band & ~whole
    split = np.minimum(np.maximum(e - hi, a), b)  # rows from here on see every key
    d = e - b
    right = np.where(free_hi | (e - 1 - a <= hi), -1, hi - d)
    parts: list[tuple] = []
    for q0, q1, k0, k1, left, r in zip(*(x[band].tolist() for x in (a, b, c, e, d - lo,
                                                                     right))):
        parts.append((q0, q1, k0, k1, FULL, (left, r)))
    for rows, q0, q1, kind in ((whole, a, b, FULL), (split_rows & (split > a), a, split, CAUSAL),
                               (split_rows & (split < b), split, b, FULL)):
        parts += [(*bounds, kind) for bounds in zip(*(x[rows].tolist()
                                                      for x in (q0, q1, c, e)))]
    return parts


def as_mask(mask: SliceMask | Iterable) -> SliceMask:
    """`mask` itself, or the `SliceMask` of a list of slices (ValueError where it is none)."""
    return mask if isinstance(mask, SliceMask) else SliceMask(mask)


def _check_bounds(slices: Iterable[Slice], seq_len: int) -> None:
    for s in slices:
        if s.q_end > seq_len or s.k_end > seq_len:
            raise ValueError(f"slice {s} reaches past the sequence of {seq_len} tokens: "
                             f"every bound must be at most {seq_len}")


def _check_overlaps(slices: list[Slice]) -> None:
    """ValueError naming two slices whose rectangles of (query, key) positions meet: a sweep
    over q_start. The slices whose query range is still open all hold the current query
    position, so until an overlap is found their key ranges are disjoint: they are kept
    sorted by k_start (bisect), and a new slice can only meet the open one starting last
    before its k_end. O(n log n) comparisons (the open list's inserts move memory only)."""
    order = sorted(range(len(slices)), key=lambda i: slices[i].q_start)
    starts: list[int] = []  # k_start of the open slices, ascending (disjoint key ranges)
    open_: list[int] = []  # their indices, in the same order
    closing: list[tuple[int, int]] = []  # heap of (q_end, index) of the open slices
    for i in order:
        s = slices[i]
        while closing and closing[0][0] <= s.q_start:
            _, j = heapq.heappop(closing)
            at = bisect.bisect_left(starts, slices[j].k_start)
            del starts[at], open_[at]
        at = bisect.bisect_left(starts, s.k_end)  # open slices starting before s's keys end
        if at and slices[open_[at - 1]].k_end > s.k_start:
            first, second = sorted((i, open_[at - 1]))
            raise ValueError(f"slices {first} {slices[first]} and {second} "
                             f"{slices[second]} overlap; each (query, key) pair may "
                             "belong to one slice only")
        starts.insert(at, s.k_start)
        open_.insert(at, i)
        heapq.heappush(closing, (s.q_end, i))


@functools.lru_cache(maxsize=16)  # a few masks' tables (layers of a model share one)
def _chunk_table(mask: SliceMask, unit: int) -> dict[tuple[int, int], tuple[Slice, ...]]:
    """(query chunk, key chunk) -> the slices whose rectangle meets that pair of chunks of
    `unit` positions."""
    table: dict[tuple[int, int], list[Slice]] = {}
    for s in mask.slices:
        for qc in range(s.q_start // unit, (s.q_end - 1) // unit + 1):
            for kc in range(s.k_start // unit, (s.k_end - 1) // unit + 1):
                table.setdefault((qc, kc), []).append(s)
    return {cell: tuple(found) for cell, found in table.items()}
