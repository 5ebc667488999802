"""Which keys a query sees, read from slices: the one rule of every mask kind on positions.

A slice keeps query position i and key position j iff i is in [q_start, q_end), j in
[k_start, k_end) and lo <= j - i <= hi (`Slice.bounds`: its causal diagonal and window).
`keeps` is that rule on tensors (kernel calls read their slices by it too,
`tile_slices.py`); `sees` applies a `SliceMask` to any query and key
positions (a rank's rows, a tile's, a cache's slots); `one_row` is decode's mask, one
one-row causal slice per sequence, as tensors on the device of its positions (no copy to
the host per step). A position < 0 (padding, an unwritten cache slot) is in no slice.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .slices import SliceMask

__all__ = ["UNBOUNDED", "Bounds", "band", "keeps", "one_row", "sees"]

UNBOUNDED = 1 << 62  # a bound that limits nothing (positions stay far below)


@dataclass(frozen=True)
class Bounds:
    """Slices as numbers (ints, or tensors that broadcast against the positions): query
    positions [q_start, q_end) x key positions [k_start, k_end), lo <= j - i <= hi."""

    q_start: torch.Tensor | int
    q_end: torch.Tensor | int
    k_start: torch.Tensor | int
    k_end: torch.Tensor | int
    lo: torch.Tensor | int = -UNBOUNDED
    hi: torch.Tensor | int = UNBOUNDED


def keeps(bounds: Bounds, i: torch.Tensor, j: torch.Tensor,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """bool, broadcast of i and j (and the bounds): the slice(s) `bounds` keep the pair
    (query i, key j); written into `out` (of the broadcast shape) where given, with no
    temporary of that shape but one."""
    delta = j - i
    if out is None:
        return ((i >= bounds.q_start) & (i < bounds.q_end) & (j >= bounds.k_start)
                & (j < bounds.k_end) & (delta >= bounds.lo) & (delta <= bounds.hi))
    torch.ge(delta, bounds.lo, out=out)
    out &= delta <= bounds.hi
    out &= (i >= bounds.q_start) & (i < bounds.q_end)
    out &= (j >= bounds.k_start) & (j < bounds.k_end)
    return out


def band(left: int, right: int) -> Bounds:
    """A sliding window on positions, no range: i - left <= j <= i + right (-1 unbounded)."""
    return Bounds(-UNBOUNDED, UNBOUNDED, -UNBOUNDED, UNBOUNDED,
                  -left if left >= 0 else -UNBOUNDED, right if right >= 0 else UNBOUNDED)


def sees(mask: SliceMask, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """bool [nq, nk]: query position q_pos[i] ([nq] int64) sees key position k_pos[j]
    ([nk], or [nq, nk]: each query its own keys) under `mask`. Vectorized by layers of
    slices whose query ranges do not meet (one layer for documents, more where slices share rows):
    each row looks its slice up by a binary search."""
    q_pos = q_pos.long()
    k = k_pos.long() if k_pos.dim() == 2 else k_pos.long()[None, :]
    seen = torch.zeros(q_pos.shape[0], k.shape[-1], dtype=torch.bool, device=q_pos.device)
    for table, starts in layers_on(mask, q_pos.device):
        index = torch.searchsorted(starts, q_pos, right=True) - 1
        row = table[index.clamp(min=0)]  # [nq, 6]: each row's candidate slice
        bounds = Bounds(*(row[:, n, None] for n in range(6)))
        seen |= keeps(bounds, q_pos[:, None], k) & (index >= 0)[:, None]
    return seen


def one_row(q_pos: torch.Tensor, window_left: int | None = None, window_right: int = 0
            ) -> Bounds:
    """Decode's mask: the new token of sequence b at q_pos[b] ([b] int64) sees its keys at
    positions 0 .. q_pos[b] (one causal slice of one row), within `window_left` keys
    before it when given (>= 0); `window_right` > 0 (or -1: unbounded) lets it see that
    many keys after it too (a mask that is not causal). [b, 1] tensors, for keys [b, n]."""
    p = q_pos.long()[:, None]
    lo = -window_left if window_left is not None and window_left >= 0 else -UNBOUNDED
    if window_right == 0:
        return Bounds(p, p + 1, 0, p + 1, lo, 0)
    return Bounds(p, p + 1, 0, UNBOUNDED, lo, window_right if window_right > 0 else UNBOUNDED)


@functools.lru_cache(maxsize=16)  # a few masks on a device or two (a model's layers share one)
def layers_on(mask: SliceMask, device: torch.device
              ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """The mask's tables (`_layers`) on `device`, each with its q_start column [n]
    (contiguous, for the binary search): copied to the device once per mask and device, not
    per call."""
    return tuple((t.to(device), t[:, 0].contiguous().to(device)) for t in _layers(mask))


@functools.lru_cache(maxsize=16)  # a few masks' tables (layers of a model share one)
def _layers(mask: SliceMask) -> tuple[torch.Tensor, ...]:
    """The mask's slices as int64 tables [n, 6] (q_start, q_end, k_start, k_end, lo, hi),
    sorted by q_start, in layers whose query ranges do not meet (first fit)."""
    layers: list[list[tuple[int, ...]]] = []
    ends: list[int] = []
    for s in sorted(mask.slices, key=lambda s: (s.q_start, s.k_start)):
        lo, hi = s.bounds
        row = (s.q_start, s.q_end, s.k_start, s.k_end, -UNBOUNDED if lo is None else lo,
               UNBOUNDED if hi is None else hi)
        for n, end in enumerate(ends):
            if end <= s.q_start:
                layers[n].append(row)
                ends[n] = s.q_end
                break
        else:
            layers.append([row])
            ends.append(s.q_end)
    return tuple(torch.tensor(rows, dtype=torch.int64) for rows in layers)
