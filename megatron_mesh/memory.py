"""Extra memory per rank of each schedule: the buffers it holds at its peak, in bytes,
beyond the inputs, the output and what autograd saves (q, k, v, out, lse).

Element counts as in `traffic.py` (q, kv, l for one rank's share), e = input bytes:

    (a group of one rank gathers nothing: its terms vanish; A = 4 (q + l), one fp32
    accumulator pair; M = 3 * 4 q, one block's merge temporaries; O = q e + 4 l, one partial
    output with its lse; X = 2 C O, the partials sent and received, O when C = 1)
    gathered forward : max(C q e (row Q) + R kv e (column K/V) + C O (the partials) + A + M,
                       X): the gathered chunks are dropped before the partials travel
    streamed_kv forward: max(C q e + 2 kv e (K/V in hand and arriving) + C A (accumulators)
                       + M, C (A + O) (accumulators copied into the partials), X)
    gathered backward: 2 C q e + 8 C l (row Q, dO, lse, D) + (C-1) q e (output stand-ins)
                       + R kv e + 4 C q (dQ partials) + 4 R kv (dK, dV partials)
    streamed_kv backward: the gathered one with 2 kv e instead of R kv e and 4 * 3 kv
                       (own dK, dV, the partial being built and the one arriving) instead
                       of 4 R kv
    streamed_q forward : R kv e + 2 q e (Q in hand and arriving; q e when C = 2) + 4 A + M
                       (own and working accumulators, fp32 partial sent / arriving; C = 2:
                       max(2 A + M, 3 A), the one partial leaves after the last block)
    streamed_q backward: R kv e + 2 (2 q e + 8 l) (Q, dO, lse, D in hand and arriving; one
                       set when C = 2) + q e (output stand-in) + 4 * 4 q (own, working,
                       sent and arriving dQ; nothing sent ahead when C = 2) + 4 R kv (dK, dV)
    ring (p2p)       : 2 kv e forward; 2 kv e + 2 * 4 kv backward (K/V and dK, dV in flight)

streamed_kv bounds the K/V side by two chunks whatever R is, streamed_q the Q side by two
chunks whatever C is; "streamed" takes whichever of the two holds less. Neither bounds both
sides: when every chunk is sent once, every (Q, K/V) pair of the tile must be in memory
together at some moment, which two buffers per side cannot give for C, R > 2.
"""
from __future__ import annotations

from .dtypes import FP32_BYTES as FP32
from .plan import MeshPlan
from .traffic import AttentionShape


def extra_memory(shape: AttentionShape, rows: int | MeshPlan, cols: int | None = None,
                 schedule: str | None = None) -> dict[str, int]:
    """{'forward': bytes, 'backward': bytes} of extra buffers for one rank.

    extra_memory(shape, plan): the plan's grid and schedule; extra_memory(shape, rows, cols,
    schedule): a schedule by name ('ring' for Transformer Engine's p2p ring for comparison,
    rows * cols = P).
    """
    if isinstance(rows, MeshPlan):
        if rows.heads > 1:
            return heads_extra_memory(shape, rows)
        rows, cols, schedule = rows.rows, rows.cols, rows.schedule.value
    if cols is None or schedule is None:
        raise TypeError("extra_memory takes (shape, plan) or (shape, rows, cols, schedule)")
    q, kv, lse = shape.local_elements(rows * cols)
    e, c, r = shape.dtype_bytes, cols, rows
    if schedule == "ring":
        return {"forward": 2 * kv * e, "backward": 2 * kv * e + 2 * FP32 * kv}
    # a group of one gathers nothing: its "gathered" buffer is the input itself
    row_q = c * q * e if c > 1 else 0
    col_kv = r * kv * e if r > 1 else 0
    partial = q * e + FP32 * lse  # one partial output and its lse
    exchange = 2 * c * partial if c > 1 else partial  # partials sent and received
    row_bwd = (2 * c * q * e + 2 * FP32 * c * lse if c > 1 else 0) + (c - 1) * q * e + FP32 * c * q
    ring_kv = 2 * kv * e if r > 1 else 0
    acc = FP32 * (q + lse)  # one fp32 accumulator pair
    merge = 3 * FP32 * q  # one block's merge temporaries
    if schedule == "gathered":
        return {"forward": max(row_q + col_kv + c * partial + acc + merge, exchange),
                "backward": row_bwd + col_kv + FP32 * r * kv}
    if schedule == "streamed_kv" and r == 1:  # no column ring: the gathered code runs
        return extra_memory(shape, rows, cols, "gathered")
    if schedule == "streamed_kv":
        return {"forward": max(row_q + ring_kv + c * acc + merge, c * (acc + partial), exchange),
                "backward": row_bwd + ring_kv + 3 * FP32 * kv}
    if schedule == "streamed_q" and c == 1:  # no row ring: the gathered code runs
        return extra_memory(shape, rows, cols, "gathered")
    if schedule == "streamed_q":
        ring_q = min(2, c - 1)  # the input is the first Q in hand
        # own and working accumulators, the partial sent and the one arriving (C = 2: the
        # one partial goes out after the last block)
        accs = 4 * acc + merge if c > 2 else max(2 * acc + merge, 3 * acc)
        return {"forward": col_kv + ring_q * q * e + accs,
                "backward": col_kv + ring_q * (2 * q * e + 2 * FP32 * lse) + q * e
                + (2 + ring_q) * FP32 * q + FP32 * r * kv}
    raise ValueError(
        f"schedule={schedule!r} is not one of gathered, streamed_kv, streamed_q, ring")


def heads_extra_memory(shape: AttentionShape, plan: MeshPlan) -> dict[str, int]:
    """Extra memory of a heads x rows x cols plan: the R x C mesh's on its 1/A of the heads,
    plus one set of all-to-all buffers for Q, K, V (q + f kv elements, f = repeated K/V
    heads)."""
    from .traffic import heads_shape

    inner = heads_shape(shape, plan.heads)
    mesh = extra_memory(inner, plan.rows, plan.cols, plan.schedule.value)
    q, kv, _ = inner.local_elements(plan.rows * plan.cols)
    layout = (q + kv) * shape.dtype_bytes
    return {phase: n + layout for phase, n in mesh.items()}


def streamed_schedule(shape: AttentionShape, rows: int, cols: int) -> str:
    """The ring the "streamed" schedule runs on this shape: the only ring when the grid has
    one (streamed_kv on a single column, streamed_q on a single row: the other would run the
    gathered code and overlap nothing), else "streamed_kv" or "streamed_q", whichever holds
    less extra memory at its peak (forward or backward); K/V on a tie."""
    if cols == 1 or rows == 1:
        return "streamed_kv" if cols == 1 else "streamed_q"

    def peak(schedule: str) -> int:
        return max(extra_memory(shape, rows, cols, schedule).values())
    return "streamed_q" if peak("streamed_q") < peak("streamed_kv") else "streamed_kv"
