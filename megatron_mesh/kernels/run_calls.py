"""A call's runs (`calls/tile_runs.py`) on a kernel's dense op: no mask of the call's size.

Each run becomes the dense calls its op takes: the run itself where the op aligns causal
at the bottom right and takes flash-attention's window; elsewhere a causal run of more
keys than queries is a full call on its first sk - sq keys and a causal square on the last
sq (top-left and bottom-right alike), and a window run is cut into blocks of `BAND_ROWS`
rows: the keys all rows of a block see are one full call, the triangles before and after
them (with one shared key each, so every row sees a key in every call) a call with the
block's bias [rows, <= rows] (0 / -inf) and a causal square (a bias where the last keys
cut it); a block whose rows share fewer than two keys is one call with its bias [rows,
< 2 rows]. No bias grows with the window. A short window run (at most `BAND_ROWS` rows,
its bias at most `SMALL_BIAS_BYTES`) is one call with its bias, and so is a call with a
window whose bias is that small (`one_block`). Block biases are kept per shape while they
fit in `BAND_MASK_BYTES`. Key ranges that are not adjacent are concatenated (a copy of
those keys only).

A call's dense calls are made once (`call_plan`, kept with the call: the forward, the next
layers and the backward read them) and grouped into batches (`call_batches`): calls of one
shape and rule at equal steps (equal documents, a window's inner edge blocks) are one op
call on tensors of batch 1. Rows of one call are written as they come; rows in several
calls are merged by log-sum-exp (`common.merge`). The backward runs each call with the
whole row's out and lse and adds its gradients into the rows it read.

Shapes: q [sq, b, hq, d], k [sk, b, hkv, d], v [sk, b, hkv, dv], lse [b, hq, sq] fp32.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from ..calls.tile_runs import CAUSAL_RUN, FULL, WINDOW, Range, Run
from ..calls.tile_slices import BAND_MASK_BYTES, UNBOUNDED, Bounds, TileSlices, additive, keeps
from ..common.caches import BytesLRU
from ..common.merge import merge_into
from .call_batches import Batch, Call, batches_of, strided_lse, strided_rows

BAND_ROWS = 128  # rows of one block of a window run
SMALL_BIAS_BYTES = 1 << 20  # a call with a window and a bias this small is one call

# forward(q, k, v, causal, scale, bias, window) -> out, lse; bias [sq, sk] fp32 or None
DenseForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# backward(dout, q, k, v, out, lse, causal, scale, bias, window) -> dq, dk, dv
DenseBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class DenseOp:
    """A kernel's dense call: `forward` / `backward` as above; `bottom_right`: its causal
    with sq < sk is aligned at the bottom right; `window`: it takes flash-attention's
    window (left, right) itself."""

    forward: DenseForward
    backward: DenseBackward
    bottom_right: bool = False
    window: bool = False


def _split(ranges: tuple[Range, ...], at: int) -> tuple[tuple[Range, ...], tuple[Range, ...]]:
    """Concatenated `ranges` cut after `at` keys."""
    head, tail, seen = [], [], 0
    for c, e in ranges:
        n = e - c
        if seen + n <= at:
            head.append((c, e))
        elif seen >= at:
            tail.append((c, e))
        else:
            head.append((c, c + at - seen))
            tail.append((c + at - seen, e))
        seen += n
    return tuple(head), tuple(tail)


def calls_of(run: Run, op: DenseOp) -> list[Call]:
    """The dense calls of `run` on `op` (module docstring)."""
    sq, sk = run.sq, run.sk
    if run.rule == FULL:
        return [Call(run.q0, run.q1, run.keys)]
    if run.rule == CAUSAL_RUN:
        if sq == sk or op.bottom_right:
            return [Call(run.q0, run.q1, run.keys, causal=True)]
        full, square = _split(run.keys, sk - sq)
        return [Call(run.q0, run.q1, full), Call(run.q0, run.q1, square, causal=True)]
    if op.window:
        return [Call(run.q0, run.q1, run.keys, window=run.window)]
    (c, _), (left, right) = run.keys[0], run.window
    if sq <= BAND_ROWS and sq * sk * 4 <= SMALL_BIAS_BYTES:  # one block: all the run's keys
        return [Call(run.q0, run.q1, run.keys, band=(sk - sq, left, right))]
    out: list[Call] = []
    for t0 in range(0, sq, BAND_ROWS):
        out += _block_calls(run.q0, c, t0, min(sq, t0 + BAND_ROWS), sq, sk, left, right)
    return out


def _block_calls(q0: int, c: int, t0: int, t1: int, sq: int, sk: int, left: int, right: int
                 ) -> list[Call]:
    """The calls of rows [t0, t1) of a window run (rows from q0, keys from c, sq x sk,
    window (left, right) at the bottom right). Where the rows share keys: the triangle of
    keys before the shared ones with the first shared key (a bias [rows, <= rows]), the
    shared ones full, the last shared key with the triangle after (a causal square; a bias
    where the last keys cut it): every row sees a key in each call. Else one call with the
    block's bias [rows, < 2 rows]."""
    d = sk - sq
    lo = (lambda t: 0) if left < 0 else (lambda t: max(0, t + d - left))  # noqa: E731
    hi = (lambda t: sk) if right < 0 else (lambda t: min(sk, t + d + right + 1))  # noqa: E731
    a, b = lo(t0), hi(t1 - 1)  # the keys some row of the block sees
    m0, m1 = lo(t1 - 1), hi(t0)  # the keys every row sees
    rows = (q0 + t0, q0 + t1)
    if m1 - m0 < 2:
        return [Call(*rows, ((c + a, c + b),), band=(t0 + d - a, left, right))]
    x0, x1 = m0 + (a < m0), m1 - (b > m1)  # the shared keys no edge call takes
    out = []
    if a < m0:  # row t sees key x >= t + d - left
        out.append(Call(*rows, ((c + a, c + m0 + 1),), band=(t0 + d - left - a, 0, -1)))
    if x1 > x0:
        out.append(Call(*rows, ((c + x0, c + x1),)))
    if b > m1 and b == t1 + d + right:  # row t sees key x <= t + d + right: a causal square
        out.append(Call(*rows, ((c + m1 - 1, c + b),), causal=True))
    elif b > m1:  # the last keys cut the causal edge
        out.append(Call(*rows, ((c + m1 - 1, c + b),), band=(t0 + d + right - m1 + 1, -1, 0)))
    return out


def _band_bias(call: Call, device: torch.device) -> torch.Tensor:
    """fp32 [rows, keys] of a window block: 0 where -left <= x - t - d <= right."""
    rows, keys = call.q1 - call.q0, sum(e - c for c, e in call.ranges)
    return _block_bias(rows, keys, *call.band, torch.device(device))


@functools.partial(BytesLRU, max_bytes=BAND_MASK_BYTES)
def _block_bias(rows: int, keys: int, d: int, left: int, right: int, device: torch.device
                ) -> torch.Tensor:
    """A window block's bias, kept per shape and offset while the kept ones fit in
    `BAND_MASK_BYTES` (a layer's blocks take a few: the inner ones share one)."""
    i = torch.arange(rows, device=device)[:, None]
    j = torch.arange(keys, device=device)[None, :]
    bounds = Bounds(0, rows, 0, keys, d - left if left >= 0 else -UNBOUNDED,
                    d + right if right >= 0 else UNBOUNDED)
    return additive(keeps(bounds, i, j))


def _take(t: torch.Tensor, ranges: tuple[Range, ...]) -> torch.Tensor:
    """Rows `ranges` of t [s, ...] concatenated: a view where there is one range."""
    if len(ranges) == 1:
        c, e = ranges[0]
        return t[c:e]
    return torch.cat([t[c:e] for c, e in ranges])


def _add_into(acc: torch.Tensor, part: torch.Tensor, ranges: tuple[Range, ...]) -> None:
    """acc[ranges] += the rows of `part` [sum of lengths, ...], in order."""
    at = 0
    for c, e in ranges:
        acc[c:e] += part[at:at + e - c]
        at += e - c


def _whole(calls: list[Call], sq: int, sk: int) -> bool:
    """Whether `calls` is one call over all sq rows and all sk keys in order."""
    return len(calls) == 1 and (calls[0].q0, calls[0].q1, calls[0].ranges) == (0, sq, ((0, sk),))


def _disjoint(calls: list[Call]) -> bool:
    """Whether no query row is in two calls."""
    ordered = sorted((c.q0, c.q1) for c in calls)
    return all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:]))


@dataclass(frozen=True)
class CallPlan:
    """A call's dense calls on one op, made once and read by its forward and backward:
    `calls` (in order), the same as `batches` (`call_batches`, for tensors of batch 1),
    `direct`: no query row is in two calls (rows are written, not merged), `whole`: one call
    over all rows and keys, `one_block`: the call is one call with its own bias
    (`one_block`)."""

    calls: tuple[Call, ...]
    batches: tuple[Batch, ...]
    direct: bool
    whole: bool
    one_block: bool = False


def plan_of(runs: tuple[Run, ...], shape: tuple[int, int], op: DenseOp) -> CallPlan:
    """The dense calls of a call of `shape` (sq, sk) with `runs` on `op`."""
    calls = [c for run in runs for c in calls_of(run, op)]
    return CallPlan(tuple(calls), batches_of(calls), _disjoint(calls), _whole(calls, *shape))


def call_plan(slices: TileSlices, op: DenseOp, device: torch.device) -> CallPlan:
    """`plan_of` a call's slices, kept with the call (`TileSlices.made_on`): every layer of a
    micro-batch and the backward read the one made by the first forward."""
    def make(_device: torch.device) -> CallPlan:
        if one_block(slices, op):
            return CallPlan((), (), True, True, one_block=True)
        return plan_of(slices.runs, slices.shape, op)
    return slices.made_on(f"dense calls {int(op.bottom_right)}{int(op.window)}", device, make)


def _units(plan: CallPlan, batch: int) -> tuple[Batch, ...]:
    """What runs as one op call: the plan's batches on tensors of batch 1, else each call."""
    return plan.batches if batch == 1 else tuple(Batch((c,)) for c in plan.calls)


def _rows(t: torch.Tensor, unit: Batch) -> torch.Tensor:
    """A unit's query rows of t [s, b, ...]: [rows, b, ...], or [rows, calls, ...] (b = 1)."""
    c = unit.first
    if len(unit.calls) == 1:
        return t[c.q0:c.q1]
    return strided_rows(t, c.q0, unit.q_step, len(unit.calls), unit.rows)


def _lse_rows(lse: torch.Tensor, unit: Batch) -> torch.Tensor:
    c = unit.first
    if len(unit.calls) == 1:
        return lse[..., c.q0:c.q1]
    return strided_lse(lse, c.q0, unit.q_step, len(unit.calls), unit.rows)


def _keys(t: torch.Tensor, unit: Batch) -> torch.Tensor:
    """A unit's key rows of t, concatenated where a call has several ranges."""
    if len(unit.calls) == 1:
        return _take(t, unit.first.ranges)
    return strided_rows(t, unit.first.ranges[0][0], unit.k_step, len(unit.calls), unit.keys)


def _bias_of(unit: Batch, device: torch.device) -> torch.Tensor | None:
    call = unit.first
    return None if call.band is None else _band_bias(call, device)


def plan_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 plan: CallPlan, op: DenseOp) -> tuple[torch.Tensor, torch.Tensor]:
    """out [sq, b, hq, dv] in q's dtype, lse [b, hq, sq] fp32 of the plan's calls on `op`;
    rows no call reaches: 0 and -inf."""
    sq, b, hq, _ = q.shape
    if plan.whole:  # one call over all rows and keys: its own outputs
        unit = plan.batches[0]
        return op.forward(q, k, v, unit.first.causal, scale, _bias_of(unit, q.device),
                          unit.first.window)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
    out = torch.zeros(sq, b, hq, v.shape[-1], device=q.device,
                      dtype=q.dtype if plan.direct else torch.float32)
    for unit in _units(plan, b):
        o, o_lse = op.forward(_rows(q, unit), _keys(k, unit), _keys(v, unit),
                              unit.first.causal, scale, _bias_of(unit, q.device),
                              unit.first.window)
        if plan.direct:
            _rows(out, unit).copy_(o)
            _lse_rows(lse, unit).copy_(o_lse)
        else:
            merge_into(_rows(out, unit), _lse_rows(lse, unit), o, o_lse)
    return out.to(q.dtype), lse


def plan_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, scale: float, plan: CallPlan,
                  op: DenseOp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (the inputs' shapes and dtype) of `plan_forward`'s call; out and lse are
    the whole row's. Gradients add up in fp32 where the inputs are narrower."""
    if plan.whole:
        unit = plan.batches[0]
        return op.backward(dout, q, k, v, out, lse, unit.first.causal, scale,
                           _bias_of(unit, q.device), unit.first.window)
    acc = torch.float32 if q.element_size() < 4 else q.dtype
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
    for unit in _units(plan, q.shape[1]):
        gq, gk, gv = op.backward(_rows(dout, unit), _rows(q, unit), _keys(k, unit),
                                 _keys(v, unit), _rows(out, unit), _lse_rows(lse, unit),
                                 unit.first.causal, scale, _bias_of(unit, q.device),
                                 unit.first.window)
        _rows(dq, unit).add_(gq)
        if len(unit.calls) == 1:
            _add_into(dk, gk, unit.first.ranges)
            _add_into(dv, gv, unit.first.ranges)
        else:
            _keys(dk, unit).add_(gk)
            _keys(dv, unit).add_(gv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def runs_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 runs: tuple[Run, ...], op: DenseOp) -> tuple[torch.Tensor, torch.Tensor]:
    """`plan_forward` of the runs (their calls made here)."""
    return plan_forward(q, k, v, scale, plan_of(runs, (q.shape[0], k.shape[0]), op), op)


def runs_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, scale: float, runs: tuple[Run, ...],
                  op: DenseOp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`plan_backward` of the runs (their calls made here)."""
    return plan_backward(dout, q, k, v, out, lse, scale,
                         plan_of(runs, (q.shape[0], k.shape[0]), op), op)


def one_block(slices: TileSlices, op: DenseOp) -> bool:
    """Whether a call of `slices` is one window block on `op`: a window run on an op without
    windows, and the call's bias ([rows, keys] fp32) at most `SMALL_BIAS_BYTES`; then it is
    one call with that bias (kept with the call), as a block of a longer run would be: a
    short call's outputs are not copied and its gradients not summed in fp32 buffers."""
    sq, sk = slices.shape
    return (not op.window and sq * sk * 4 <= SMALL_BIAS_BYTES
            and any(run.rule == WINDOW for run in slices.runs) and _covers(slices.runs, sq))


def _covers(runs: tuple[Run, ...], sq: int) -> bool:
    """Whether every row of [0, sq) is in a run (a biased call's rows must each see a key:
    the op gives a row that sees none lse 0, not -inf)."""
    reached = 0
    for run in sorted(runs, key=lambda r: r.q0):
        if run.q0 > reached:
            return False
        reached = max(reached, run.q1)
    return reached >= sq


def slices_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   slices: TileSlices, op: DenseOp) -> tuple[torch.Tensor, torch.Tensor]:
    """A call of `slices` on `op`: one block (`one_block`), else its calls (`call_plan`)."""
    plan = call_plan(slices, op, q.device)
    if plan.one_block:
        return op.forward(q, k, v, False, scale, slices.additive_mask(q.device), None)
    return plan_forward(q, k, v, scale, plan, op)


def slices_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, scale: float, slices: TileSlices,
                    op: DenseOp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `slices_forward`'s call (the plan its forward made); out and lse are the
    whole row's."""
    plan = call_plan(slices, op, q.device)
    if plan.one_block:
        return op.backward(dout, q, k, v, out, lse, False, scale,
                           slices.additive_mask(q.device), None)
    return plan_backward(dout, q, k, v, out, lse, scale, plan, op)
