"""Dense calls of one shape and rule as one op call: the calls as the batch entries.

Dense calls (`Call`) of equal query and key counts, one key range each and the same
rule (causal, flash's window, a block's bias), whose query rows start `q_step` rows apart
and whose key rows start `k_step` rows apart (steps at least their lengths: no row in two)
are one `Batch`: on tensors of batch 1 the rows of its calls are a strided view
[rows, calls, h, d] of the tensor (`strided_rows`, no copy), which the op takes as a batch
of that many entries; its outputs and gradients go back through the same views. Packed
documents of one length in a row (a micro-batch of equal lengths, or equal ones side by
side) become one call; a window run's inner blocks share their edge calls.

Shapes: t [s, 1, h, d] -> view [rows, n, h, d]; lse [1, h, s] -> view [n, h, rows].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Range = tuple[int, int]  # key rows [c, e)


@dataclass(frozen=True)
class Call:
    """One dense call: query rows [q0, q1) against the concatenated key `ranges`, causal
    (aligned as the op aligns it: only square ones where it is top-left), flash's `window`,
    or `band`: (d, left, right) of a block's bias, read as j - i - d in [-left, right]."""

    q0: int
    q1: int
    ranges: tuple[Range, ...]
    causal: bool = False
    window: tuple[int, int] | None = None
    band: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Batch:
    """Calls of one shape and rule (`calls`, in order): call n's query rows start at
    calls[0].q0 + n * q_step, its keys at its first key row + n * k_step (one call: steps
    0)."""

    calls: tuple[Call, ...]
    q_step: int = 0
    k_step: int = 0

    @property
    def first(self) -> Call:
        return self.calls[0]

    @property
    def rows(self) -> int:
        return self.first.q1 - self.first.q0

    @property
    def keys(self) -> int:
        return sum(e - c for c, e in self.first.ranges)


def _shape_rule(call: Call) -> tuple:
    return (call.q1 - call.q0, call.ranges[0][1] - call.ranges[0][0], call.causal,
            call.window, call.band)


def batches_of(calls: list[Call]) -> tuple[Batch, ...]:
    """`calls` in batches (module docstring): each call joins the open batch of its shape
    and rule where it continues that batch's steps, else opens one; calls of several key
    ranges stay alone."""
    open_: dict[tuple, list[Call]] = {}
    done: list[list[Call]] = []
    for call in calls:
        if len(call.ranges) != 1:
            done.append([call])
            continue
        key = _shape_rule(call)
        found = open_.get(key)
        if found is not None and _continues(found, call):
            found.append(call)
            continue
        if found is not None:
            done.append(found)
        open_[key] = [call]
    done += open_.values()
    return tuple(_batch(found) for found in done)


def _continues(found: list[Call], call: Call) -> bool:
    """Whether `call` is the next of `found`'s calls, its rows and keys one step further
    (the steps at least the calls' lengths)."""
    last = found[-1]
    q_step, k_step = call.q0 - last.q0, call.ranges[0][0] - last.ranges[0][0]
    if q_step < last.q1 - last.q0 or k_step < last.ranges[0][1] - last.ranges[0][0]:
        return False
    if len(found) == 1:
        return True
    before = found[-2]
    return (q_step, k_step) == (last.q0 - before.q0, last.ranges[0][0] - before.ranges[0][0])


def _batch(calls: list[Call]) -> Batch:
    if len(calls) == 1:
        return Batch((calls[0],))
    a, b = calls[0], calls[1]
    return Batch(tuple(calls), b.q0 - a.q0, b.ranges[0][0] - a.ranges[0][0])


def strided_rows(t: torch.Tensor, start: int, step: int, n: int, length: int) -> torch.Tensor:
    """Rows start + i * step + [0, length) of t [s, 1, ...] for i < n, as a view
    [length, n, ...] (the batch entries in dim 1; writable where the rows do not meet)."""
    base = t.select(1, 0)
    stride = base.stride()
    return base.as_strided((length, n, *base.shape[1:]), (stride[0], step * stride[0], *stride[1:]),
                           base.storage_offset() + start * stride[0])


def strided_lse(lse: torch.Tensor, start: int, step: int, n: int, length: int) -> torch.Tensor:
    """The same rows of lse [1, h, s] as a view [n, h, length]."""
    base = lse.select(0, 0)
    s_h, s_s = base.stride()
    return base.as_strided((n, base.shape[0], length), (step * s_s, s_h, s_s),
                           base.storage_offset() + start * s_s)
