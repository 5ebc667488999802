"""A call's slices as runs: what a kernel without a mask argument can take.

A run is query rows [q0, q1) of a call against the concatenation of some of its key ranges
(`keys`, in order, adjacent ranges joined), with at most one rule, aligned at the bottom
right of the concatenation as flash-attention aligns it:

    full     every query sees every key
    causal   query i (of sq) sees key j (of sk) iff j <= i + sk - sq (sq <= sk)
    window   flash-attention's band (left, right): -left <= j - i - (sk - sq) <= right

Every slice (`TileSlices`, `lo <= j - i <= hi` on a rectangle) is cut at every query
boundary of the call (`masks.slices.pieces`: full, bottom-right causal or band pieces whose
rows each see a key; again at the boundaries cutting makes, `_on_stretches`); on each
stretch of rows the full pieces' keys and one causal piece's (last) make one run, other
causal pieces and each band a run of their own. Consecutive stretches whose runs continue
each other are joined again. A row in several runs is merged by log-sum-exp; its backward
runs per run with the whole row's lse. Documents are one run each; a call under a
bidirectional prefix two (the prefix against itself, then the other rows causal against all
keys). Plain ints, no tensors: made once per call (`TileSlices.runs`).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..masks.slices import CAUSAL, pieces

FULL, CAUSAL_RUN, WINDOW = "full", "causal", "window"

Range = tuple[int, int]


@dataclass(frozen=True)
class Run:
    """Query rows [q0, q1) against the concatenated key ranges `keys`, under `rule` (full,
    causal or window, bottom-right aligned on the concatenation; `window` (left, right),
    -1: unbounded)."""

    q0: int
    q1: int
    keys: tuple[Range, ...]
    rule: str = FULL
    window: tuple[int, int] | None = None

    @property
    def sq(self) -> int:
        return self.q1 - self.q0

    @property
    def sk(self) -> int:
        return sum(e - c for c, e in self.keys)


def _joined(ranges: list[Range]) -> tuple[Range, ...]:
    """Ranges in their order, adjacent ones joined."""
    out: list[Range] = []
    for c, e in ranges:
        if out and out[-1][1] == c:
            out[-1] = (out[-1][0], e)
        else:
            out.append((c, e))
    return tuple(out)


def _stretch_runs(a: int, b: int, parts: list) -> list[Run]:
    """The runs of rows [a, b) from the pieces (`masks.slices.Slice`) that cover them all."""
    full = sorted((p.k_start, p.k_end) for p in parts if p.kind != CAUSAL and p.window is None)
    causal = sorted((p.k_start, p.k_end) for p in parts if p.kind == CAUSAL)
    out = []
    if causal:
        out.append(Run(a, b, _joined(full + [causal[0]]), CAUSAL_RUN))
        out += [Run(a, b, (r,), CAUSAL_RUN) for r in causal[1:]]
    elif full:
        out.append(Run(a, b, _joined(full), FULL))
    out += [Run(a, b, ((p.k_start, p.k_end),), WINDOW, p.window)
            for p in parts if p.window is not None]
    return out


def _continues(first: Run, then: Run) -> Run | None:
    """The one run of `first`'s rows followed by `then`'s (adjacent), or None: equal keys
    without a rule, or a causal run whose last key range grows with its rows."""
    if first.q1 != then.q0 or first.rule != then.rule or first.rule == WINDOW:
        return None
    if first.rule == FULL:
        return Run(first.q0, then.q1, first.keys, FULL) if first.keys == then.keys else None
    *head, (c, e) = first.keys
    *head2, (c2, e2) = then.keys
    if head == head2 and c == c2 and e2 - e == then.q1 - first.q1:
        return Run(first.q0, then.q1, then.keys, CAUSAL_RUN)
    return None


def _on_stretches(parts: list) -> tuple[list, list[int]]:
    """`parts` (`masks.slices.Slice`) cut at every query boundary of any of them, and those
    boundaries: each part then spans exactly one stretch of rows between two cuts. A band
    cut to a stretch can come back as a causal piece over its first rows and a full one
    below (`pieces`), a boundary no part had: cut again until none is new."""
    while True:
        cuts = sorted({x for p in parts for x in (p.q_start, p.q_end)})
        out, cut = [], False
        for p in parts:
            first, last = bisect.bisect_left(cuts, p.q_start), bisect.bisect_left(cuts, p.q_end)
            if last == first + 1:
                out.append(p)
                continue
            cut = True
            for n in range(first, last):
                out += pieces(cuts[n], cuts[n + 1], p.k_start, p.k_end, *p.bounds)
        if not cut:
            return out, cuts
        parts = out


def runs_of(slices: tuple, shape: tuple[int, int]) -> tuple[Run, ...]:
    """The runs of a call's slices ((q0, q1, k0, k1, lo, hi), lo <= j - i <= hi, None:
    unbounded) over `shape` (sq, sk) rows, ordered by q0 (module docstring)."""
    parts, cuts = _on_stretches([p for s in slices for p in pieces(*s)])
    stretches: dict[int, list] = {}
    for p in parts:
        stretches.setdefault(bisect.bisect_left(cuts, p.q_start), []).append(p)
    out: list[Run] = []
    open_: list[Run] = []  # the previous stretch's runs, which the next may continue
    for n in sorted(stretches):
        now = []
        for run in _stretch_runs(cuts[n], cuts[n + 1], stretches[n]):
            for at, before in enumerate(open_):
                joined = _continues(before, run)
                if joined is not None:
                    del open_[at]
                    run = joined
                    break
            now.append(run)
        out += open_
        open_ = now
    out += open_
    return tuple(sorted(out, key=lambda r: (r.q0, r.q1)))
