"""A call's runs (`calls/tile_runs.py`) on a kernel's dense op: no mask of the call's size.

Each run becomes the dense calls its op takes: the run itself where the op aligns causal
at the bottom right and takes flash-attention's window; elsewhere a causal run of more
keys than queries is a full call on its first sk - sq keys and a causal square on the last
sq (top-left and bottom-right alike), and a window run is cut into blocks of `BAND_ROWS`
rows (or the window's width), each against the keys its rows reach with the additive bias
of that block only ([rows, keys of the block], 0 / -inf; a run of one block takes all its
keys; a call with a window whose bias is at most `SMALL_BIAS_BYTES` is one call with
it, `one_block`). Block biases are kept per shape while they fit in `BAND_MASK_BYTES`
(a larger one is made per call). Key ranges that are not adjacent
are concatenated (a copy of those keys only). Rows of one call are written as they come;
rows in several calls are merged by log-sum-exp (`common.merge`). The backward runs each
call with the whole row's out and lse and adds its gradients into the rows it read.

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

BAND_ROWS = 128  # rows of one block of a window run (at least the window's width)
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
    d = sk - sq
    rows = max(BAND_ROWS, left + right + 1)
    if sq <= rows:  # one block: all the run's keys (no copy of its outputs to trim)
        return [Call(run.q0, run.q1, run.keys, band=(d, left, right))]
    out = []
    for t0 in range(0, sq, rows):
        t1 = min(sq, t0 + rows)
        x0 = 0 if left < 0 else max(0, t0 + d - left)
        x1 = sk if right < 0 else min(sk, t1 - 1 + d + right + 1)
        out.append(Call(run.q0 + t0, run.q0 + t1, ((c + x0, c + x1),),
                        band=(d + t0 - x0, left, right)))
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
    """Whether no query row is in two calls (calls ordered by q0)."""
    ordered = sorted((c.q0, c.q1) for c in calls)
    return all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:]))


def runs_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 runs: tuple[Run, ...], op: DenseOp) -> tuple[torch.Tensor, torch.Tensor]:
    """out [sq, b, hq, dv] in q's dtype, lse [b, hq, sq] fp32 of the call's runs on `op`;
    rows no run reaches: 0 and -inf."""
    sq, b, hq, _ = q.shape
    calls = [c for run in runs for c in calls_of(run, op)]
    if _whole(calls, sq, k.shape[0]):  # one call over all rows and keys: its own outputs
        call = calls[0]
        bias = None if call.band is None else _band_bias(call, q.device)
        return op.forward(q, k, v, call.causal, scale, bias, call.window)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
    direct = _disjoint(calls)
    out = torch.zeros(sq, b, hq, v.shape[-1], device=q.device,
                      dtype=q.dtype if direct else torch.float32)
    for call in calls:
        bias = None if call.band is None else _band_bias(call, q.device)
        o, o_lse = op.forward(q[call.q0:call.q1], _take(k, call.ranges), _take(v, call.ranges),
                          call.causal, scale, bias, call.window)
        if direct:
            out[call.q0:call.q1] = o
            lse[..., call.q0:call.q1] = o_lse
        else:
            merge_into(out, lse, o, o_lse, slice(call.q0, call.q1))
    return out.to(q.dtype), lse


def runs_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, scale: float, runs: tuple[Run, ...],
                  op: DenseOp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (the inputs' shapes and dtype) of `runs_forward`'s call; out and lse are
    the whole row's. Gradients add up in fp32 where the inputs are narrower."""
    calls = [c for run in runs for c in calls_of(run, op)]
    if _whole(calls, q.shape[0], k.shape[0]):
        call = calls[0]
        bias = None if call.band is None else _band_bias(call, q.device)
        return op.backward(dout, q, k, v, out, lse, call.causal, scale, bias, call.window)
    acc = torch.float32 if q.element_size() < 4 else q.dtype
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
    for run in runs:
        for call in calls_of(run, op):
            rows = slice(call.q0, call.q1)
            bias = None if call.band is None else _band_bias(call, q.device)
            gq, gk, gv = op.backward(dout[rows], q[rows], _take(k, call.ranges),
                                     _take(v, call.ranges), out[rows], lse[..., rows],
                                     call.causal, scale, bias, call.window)
            dq[rows] += gq
            _add_into(dk, gk, call.ranges)
            _add_into(dv, gv, call.ranges)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


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
    """A call of `slices` on `op`: one block (`one_block`), else its runs."""
    if one_block(slices, op):
        return op.forward(q, k, v, False, scale, slices.additive_mask(q.device), None)
    return runs_forward(q, k, v, scale, slices.runs, op)


def slices_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, scale: float, slices: TileSlices,
                    op: DenseOp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `slices_forward`'s call; out and lse are the whole row's."""
    if one_block(slices, op):
        return op.backward(dout, q, k, v, out, lse, False, scale,
                           slices.additive_mask(q.device), None)
    return runs_backward(dout, q, k, v, out, lse, scale, slices.runs, op)
