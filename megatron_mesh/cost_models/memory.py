"""Extra memory per rank of each schedule: the most bytes it holds at once, beyond the
inputs and the pass's result (out in forward; dq, dk, dv in backward). What autograd keeps
for backward beyond the inputs and out (the lse; with a heads dimension the relaid Q, K, V
and the mesh's output) counts as extra.

Bytes of one rank's chunk (element counts as in `traffic.py`: q, kv, l), e = input bytes,
g = bytes of the gradient exchange (dQ: g_q, dK/dV: g_kv, `layer_plan.GradDtype`):

    Q = q e, KV = kv e, L = 4 l (lse, D: fp32), FQ = 4 q, FKV = 4 kv (fp32 partials);
    O = o e, FO = 4 o for outputs and dO (O = Q, FO = FQ unless V has its own head dim;
    the terms below say Q for both where they are equal)
    acc = FO + L: one fp32 accumulator pair (output, lse)
    block forward = O + 3 L: one block's output and lse, and the merge's new lse and one
        weight (the merge works in place: nothing of the output's size)
    block backward = Q + KV (dq, dk, dv of the diagonal block); off the diagonal, where
        every streamed step is, a block has half its query rows or half its keys:
        max(Q/2 + KV, Q + KV/2)
    grouped calls (the default, `tile_calls.grouping`): a "block" above is the largest
        kernel call of the schedule on any rank (`grouped_calls`, the blocks on hand
        grouped as `tile_calls.call_shapes` gives them): forward, out and lse of its
        query rows with its concatenated Q and K/V pieces (one piece is a view, not a
        copy), or with the merge's new lse and one weight of a piece; backward, dq, dk, dv
        of its rows with its concatenated dO, Q, out, lse and K/V pieces; "off the
        diagonal" the largest but the diagonal on its own. bottom_right: the diagonal is
        folded into the call with the keys before it (one K/V chunk more there). A call
        concatenates at most `tile_calls.group_tokens()` keys or query rows (16K), so its
        copies are a few chunks' worth on any grid
    merge of C > 1 partials = 2 C (Q + L) (sent and received) + acc + max(2 L, Q if e < 4)

    gathered forward : C Q (row's Q; none when C = 1) + R KV (column's K/V; none when R = 1)
                       + C (Q + L) (the partials; none when C = 1, where the fp32
                       accumulator is the row's result) + acc + block; or the merge
    streamed_kv fwd  : C Q + C acc + min(2, R-1) KV (K/V in hand and arriving) + block;
                       C acc + C (Q + L) (accumulators copied into the partials); the merge
    streamed_q fwd   : R KV + min(2, C-1) Q + 4 acc (own, the one being built, the one in
                       flight, the one arriving) + block; C = 2: max(2 acc + block, 3 acc)
    stand-in = max(Q + block off the diagonal, FQ + [e < 4] Q + 3 L) (a stand-in output
        with its block, or while it is made: u, its rows' max, norm and scale)
    gathered backward: 2 C Q + 2 C L (Q, dO, lse, D of the row) + R KV + R FKV (dK, dV
                       partials) + 2 FQ (own dQ, the one being built) + 2 q g_q (the one in
                       flight and the one arriving on the row ring) + stand-in; C = 2: the
                       one partial is sent after its blocks (max(stand-in, (1 + [g_q < 4])
                       q g_q + O)); C = 1: R KV + FQ + R FKV + block
    streamed_kv bwd  : rows + 2 FKV (own and the one being built) + 2 kv g_kv (in flight
                       and arriving) + the larger of a step before the last (C FQ + 2 KV +
                       block off the diagonal) and the last step (KV + max(C FQ, (C-1) FQ
                       + 2 q g_q) + block off the diagonal: the dQ partials leave on the row
                       ring one by one, one in flight, one arriving; while one is converted,
                       g_q < 4: C FQ + 2 q g_q); rows = 2 C Q + 2 C L + (C-1) Q (the row's
                       inputs and stand-in outputs), none when C = 1; R = 2: 2 FKV + KV +
                       max(last step, FQ + 2 q g_q + (1 + [g_kv < 4]) kv g_kv) (the dK/dV
                       partial sent after the blocks)
    streamed_q bwd   : R KV + R FKV + 2 (2 Q + 2 L) ((Q, dO), (lse, D) in hand and arriving)
                       + 2 FQ + 2 q g_q + stand-in; C = 2: the own
                       block with the ring's input and first arrival (2 (2 Q + 2 L) + FQ
                       + diagonal block), or one step with one Q in hand and the dQ
                       partial sent after it
    each minus the result: Q forward, Q + KV backward
    ring (p2p)       : 2 kv e forward; 2 kv e + 2 * 4 kv backward (Transformer Engine's
                       ring, K/V and dK, dV in flight; a model for comparison)

    windowed (sliding windows, `schedules/sparse.py`; every schedule runs it): with qi, qo the
                       Q rows a rank receives from and sends to its row, ki, ko the K/V
                       rows from and to its column (in chunks, `masks.needed_rows`;
                       C - 1 and R - 1 each when no window is given), the most of
                       forward : both exchanges start together and this rank's own
                                 block (Q, K/V of its own chunk: the diagonal) runs while
                                 they are in flight: flight = C Q + R KV + (qi + qo) Q
                                 + (ki + ko) KV (the row's Q and the column's K/V laid
                                 into whole chunks, the rows sent and arriving);
                                 flight + acc + block; then, on the landed rows, C Q
                                 + R KV + C acc + the largest other block (its query rows'
                                 share of O + 3 L: its own queries over another column
                                 member's K/V, or another row's queries); C acc (+ C O if
                                 e < 4: the outputs in the input dtype); held + (qi + qo)
                                 O (the rows sent back: held = C acc, or acc + (C-1) L
                                 + C O if e < 4, the other rows' fp32 accumulators freed);
                                 held + qo O + (qi + qo) L (their lse); acc + qo (O + L)
                                 + FO + 3 L (the received rows merged one by one)
                       backward: rows = C (Q + O + 2 L) + 3 L (the row's Q, dO, (lse, D),
                                 the stacked (lse, D), and D as the attention's backward
                                 formed it): rows + 2 L + (qi + qo) (Q + O + 2 L) ((lse, D)
                                 copied to be sent); both exchanges in flight with this
                                 rank's own block on its own inputs meanwhile: rows
                                 + (qi + qo) (Q + O + 2 L) + R KV + (ki + ko) KV + C FQ
                                 + R FKV + the diagonal block (Q + KV: its lse is this
                                 rank's own, not a copy of the gathered rows'); then rows
                                 + R KV + C FQ + R FKV + the largest of another row's
                                 block (its rows' share of Q + L and KV) with its stand-in
                                 output O, the stand-in being made (FO (+ O if e < 4)
                                 + 3 L), or a block of its own queries over another column
                                 member's K/V (its shares of Q + L and KV, no stand-in);
                                 grads = 3 L + C FQ
                                 + R FKV, then + (qi + qo) q g_q (+ one peer's rows of FQ
                                 each way: converted to g_q, or received as g_q and
                                 converted back) for the dQ rows sent back, then dK and
                                 dV one at a time likewise (K's share of (ki + ko) kv g_kv)
                       minus the result, the most over the ranks. In fp32 the returned dq,
                       dk, dv are views of the partials' buffers and keep them (result C FQ
                       + R FKV). The tile masks a layer makes once per shape and keeps
                       (cached) are not counted.

A heads x R x C grid (`heads_extra_memory`): forward, the R x C mesh's peak on its 1/A of
the heads (`layer_plan.heads_shape`) plus the relaid Q, K, V that autograd keeps (Q + KV', KV'
with the repeated K/V heads), or the relayout of Q, K, V in one message (2 (Q + KV'):
sent and received, laid out in the sent buffer; the repeated K/V heads held meanwhile), or
the output's all-to-all (the mesh's output and lse, sent and received: 3 Q + L); backward,
the mesh's peak plus the relaid dO (Q), or the gradients relaid back in one message (the
mesh's dq, dk, dv, Q + KV', and 2 (Q + KV'); with repeated K/V heads dq is then copied out
of the shared buffer, which holds no more than the received one let go).

streamed_kv bounds the K/V side by two chunks whatever R is, streamed_q the Q side by two
chunks whatever C is; "streamed" takes whichever of the two holds less. Neither bounds both
sides: when every chunk is sent once, every (Q, K/V) pair of the tile must be in memory
together at some moment, which two buffers per side cannot give for C, R > 2.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Sequence

from ..layer_plan import FP32_BYTES as FP32
from ..layer_plan import AttentionShape, GradDtype, MeshPlan, Schedule, heads_shape, kv_repeats
from .tile_calls import CallShape, call_shapes, grouping, piece_limit


@dataclass(frozen=True)
class _Chunk:
    """Bytes of one rank's chunk and of the buffers built from it (see the module docstring)."""

    q: int  # Q
    kv: int  # KV
    o: int  # O (= Q unless V has its own head dim)
    fo: int  # FO
    lse: int  # L
    fq: int  # FQ
    fkv: int  # FKV
    e: int
    dq_exchange: int  # q g_q
    dkv_exchange: int  # kv g_kv
    # the largest grouped call of a schedule (`grouped_calls`); None: one call per block
    call_forward: int | None = None
    call_backward: int | None = None
    call_backward_off_diagonal: int | None = None

    @classmethod
    def of(cls, shape: AttentionShape, cp_size: int, grads: GradDtype) -> "_Chunk":
        q, kv, lse = shape.local_elements(cp_size)
        o = shape.out_elements(cp_size)
        e = shape.dtype_bytes
        return cls(q * e, kv * e, o * e, FP32 * o, FP32 * lse, FP32 * q, FP32 * kv, e,
                   q * grads.dq_bytes(e), kv * grads.dkv_bytes(e))

    @property
    def acc(self) -> int:
        return self.fo + self.lse

    @property
    def block_forward(self) -> int:
        if self.call_forward is not None:
            return self.call_forward
        return self.o + 3 * self.lse

    @property
    def block_backward(self) -> int:
        if self.call_backward is not None:
            return self.call_backward
        return self.q + self.kv

    @property
    def block_backward_off_diagonal(self) -> int:
        if self.call_backward_off_diagonal is not None:
            return self.call_backward_off_diagonal
        return max(self.q // 2 + self.kv, self.q + self.kv // 2)

    def forward_call(self, call: CallShape) -> int:
        """One grouped forward call (`CallShape`, half chunks): its output and lse, with
        the concatenated Q and K/V while the kernel runs (a call of one piece takes a
        view), or a piece's merge (new lse and one weight) after them."""
        rows = sum(call.q)
        result = rows * (self.o + self.lse) // 2
        copies = ((rows * self.q if len(call.q) > 1 else 0)
                  + (sum(call.kv) * self.kv if len(call.kv) > 1 else 0)) // 2
        return result + max(copies, max(call.q) * self.lse)

    def backward_call(self, call: CallShape) -> int:
        """One grouped backward call: dq, dk, dv of its rows, with the concatenated
        (dO, Q, out, lse) and K/V the kernel reads."""
        rows, keys = sum(call.q), sum(call.kv)
        copies = ((rows * (2 * self.o + self.q + self.lse) if len(call.q) > 1 else 0)
                  + (keys * self.kv if len(call.kv) > 1 else 0))
        return (copies + rows * self.q + keys * self.kv) // 2

    @property
    def stand_in(self) -> int:
        """A stand-in output with its block off the diagonal, or while it is made (u, its
        rows' max, norm and scale)."""
        return max(self.o + self.block_backward_off_diagonal,
                   self.fo + (self.o if self.e < FP32 else 0) + 3 * self.lse)

    @property
    def result(self) -> dict[str, int]:
        return {"forward": self.o, "backward": self.q + self.kv}

    @property
    def merge_rows(self) -> int:
        """A merge of received rows: their accumulator rows taken out, new lse, weight."""
        return self.fo + 3 * self.lse

    def merge(self, c: int) -> int:
        """The row's partials merged at their owner (none when C = 1)."""
        if c == 1:
            return 0
        return 2 * c * (self.o + self.lse) + self.acc + max(2 * self.lse,
                                                             self.o if self.e < FP32 else 0)


DIAGONAL = CallShape((2,), (2,))  # a causal diagonal block on its own


def grouped_calls(m: _Chunk, r: int, c: int, schedule: str, bottom_right: bool,
                  limit: int | None = None) -> _Chunk:
    """m with the largest grouped call of `schedule` on an R x C mesh (any rank, causal
    zigzag; `tile_calls.call_shapes`) in place of one block's: forward, backward,
    and backward but the diagonal on its own; `bottom_right`: the kernel folds the
    diagonal into a call (`kernels.base.folds_diagonal`)."""
    shapes = {phase: call_shapes(r, c, True, schedule, phase, bottom_right, limit)
              for phase in ("forward", "backward")}
    off = [m.backward_call(call) for call in shapes["backward"] if call != DIAGONAL]
    return replace(m, call_forward=max(map(m.forward_call, shapes["forward"])),
                   call_backward=max(map(m.backward_call, shapes["backward"])),
                   call_backward_off_diagonal=max(off, default=m.backward_call(DIAGONAL)))


def _gathered_backward(m: _Chunk, r: int, c: int) -> int:
    """The gathered backward's peak (module docstring): the row's (Q, dO), (lse, D), the
    column's K/V and the dK/dV partials held while the dQ partials go around the row."""
    col_kv = r * m.kv if r > 1 else 0
    if c == 1:  # no row: this rank's dQ and one block
        return col_kv + m.fq + r * m.fkv + m.block_backward
    held = c * (m.q + m.o + 2 * m.lse) + col_kv + r * m.fkv + 2 * m.fq  # own dQ, one built
    if c > 2:  # one dQ partial in flight, one arriving
        return held + 2 * m.dq_exchange + m.stand_in
    sent = (1 + (m.dq_exchange < m.fq)) * m.dq_exchange + m.o  # the one partial, sent last
    return held + max(m.stand_in, sent)


def _streamed_kv_backward(m: _Chunk, r: int, c: int) -> int:
    """The streamed_kv backward's peak (module docstring): a step before the last (C dQ
    partials, two K/V chunks) or the last (the dQ partials leaving, one K/V chunk)."""
    rows = c * (m.q + m.o + 2 * m.lse) + (c - 1) * m.o if c > 1 else 0
    if c == 1:  # no row ring: this rank's dQ only
        dq_blocks, dq_sending, dq_after = m.fq, 0, m.fq
    else:  # the last step: the partials left, one in flight and one arriving
        dq_blocks = max(c * m.fq, (c - 1) * m.fq + 2 * m.dq_exchange)
        dq_sending = c * m.fq + 2 * m.dq_exchange if m.dq_exchange < m.fq else 0
        dq_after = m.fq + 2 * m.dq_exchange
    last = m.kv + max(dq_blocks + m.block_backward_off_diagonal, dq_sending)
    if r > 2:
        before = c * m.fq + 2 * m.kv + m.block_backward_off_diagonal
        return rows + 2 * m.fkv + 2 * m.dkv_exchange + max(before, last)
    sent = (1 + (m.dkv_exchange < m.fkv)) * m.dkv_exchange  # the one partial, sent last
    return rows + 2 * m.fkv + max(last, m.kv + dq_after + sent)


def _bound(r: int, c: int) -> tuple:
    """Rows exchanged when every peer's whole chunk is used (no window given): (Q rows
    received, sent, K/V rows received, sent, in chunks; the (Q, K/V) rows, in chunks, of
    the blocks of the other rows' queries; the same of this rank's own queries' blocks
    over the other column members' K/V)."""
    return (c - 1, c - 1, r - 1, r - 1, [(1, 1)] * (c > 1), [(1, 1)] * (r > 1))


def _windowed_peaks(m: _Chunk, r: int, c: int, k_share: Fraction,
                    exchanged: list[tuple]) -> dict[str, int]:
    """The sparse exchange's peaks (module docstring), the most over the ranks whose rows
    are `exchanged` (`_bound`); k_share: K's part of a K/V row."""
    worst = {"forward": 0, "backward": 0}
    fp32 = m.e >= FP32
    for q_in, q_out, kv_in, kv_out, others, own_row in exchanged:
        f = lambda rows, size: int(rows * size)  # noqa: E731
        row_q, col_kv = c * m.q, r * m.kv
        held = c * m.acc if fp32 else m.acc + (c - 1) * m.lse + c * m.o
        # both exchanges in flight: the buffers, the rows sent and the rows arriving
        in_flight = row_q + col_kv + f(q_in + q_out, m.q) + f(kv_in + kv_out, m.kv)
        # the other blocks (own queries over the column's K/V, other rows' queries)
        block = max((f(qr, m.o + 3 * m.lse) for qr, _ in [*own_row, *others]), default=0)
        forward = max(
            in_flight + m.acc + m.block_forward,  # this rank's own block meanwhile
            row_q + col_kv + c * m.acc + block,  # then the others, on the landed rows
            c * m.acc + (0 if fp32 else c * m.o),  # the outputs in the input dtype
            held + f(q_in + q_out, m.o),  # outputs sent and received
            held + f(q_out, m.o) + f(q_in + q_out, m.lse),  # then the lse rows
            m.acc + f(q_out, m.o + m.lse) + m.merge_rows)  # merged at their owner
        chunk = m.q + m.o + 2 * m.lse  # Q, dO, (lse, D)
        # the row gathered, the stacked (lse, D) kept, and D itself (formed once by the
        # attention's backward, held through the runner's)
        rows = c * chunk + 3 * m.lse
        # another row's block with its stand-in output, or the stand-in being made; or a
        # block of this rank's queries over another column member's K/V (no stand-in)
        stand_in = max((m.o + f(qr, m.q + m.lse) + f(kvr, m.kv) for qr, kvr in others),
                       default=0)
        if others:
            stand_in = max(stand_in, m.fo + (0 if fp32 else m.o) + 3 * m.lse)
        stand_in = max([stand_in] + [f(qr, m.q + m.lse) + f(kvr, m.kv) for qr, kvr in own_row])
        grads = 3 * m.lse + c * m.fq + r * m.fkv
        dkv_out = f(kv_in, m.dkv_exchange) + (0 if m.dkv_exchange >= m.fkv
                                              else f(min(kv_in, 1), m.fkv))
        backward = max(
            rows + 2 * m.lse + f(q_in + q_out, chunk),  # (lse, D) copied to be sent
            # both exchanges in flight, the partials, this rank's own block meanwhile (on
            # its own lse: no copy of the stacked rows' lse, as the other blocks take)
            rows + f(q_in + q_out, chunk) + col_kv + f(kv_in + kv_out, m.kv)
            + c * m.fq + r * m.fkv + m.block_backward,
            rows + col_kv + c * m.fq + r * m.fkv + stand_in,  # then the others
            grads + f(q_in, m.dq_exchange) + f(q_out, m.dq_exchange)  # dQ rows sent back
            + (0 if m.dq_exchange >= m.fq else f(min(q_in, 1), m.fq)) + f(min(q_out, 1), m.fq),
            grads + f(k_share, dkv_out + f(kv_out, m.dkv_exchange)  # dK, then dV rows
                      + f(min(kv_out, 1), m.fkv)))
        worst = {"forward": max(worst["forward"], forward),
                 "backward": max(worst["backward"], backward)}
    return worst


def _peaks(m: _Chunk, r: int, c: int, schedule: str, bottom_right: bool = False,
           grouped: bool | None = None, limit: int | None = None) -> dict[str, int]:
    """The most bytes held at once in each pass, the result included; the blocks' calls
    grouped where `tile_calls.grouping(grouped)` (`grouped_calls`), each at most `limit`
    half chunks (`tile_calls.piece_limit`)."""
    row_q = c * m.q if c > 1 else 0
    col_kv = r * m.kv if r > 1 else 0
    if schedule not in tuple(Schedule):  # ('ring' and 'windowed' go elsewhere: extra_memory)
        raise ValueError(f"schedule={schedule!r} is not one of gathered, streamed_kv, "
                         "streamed_q, ring or windowed")
    if grouping(grouped):
        m = grouped_calls(m, r, c, schedule, bottom_right, limit)
    # the schedule has no ring to run here: the gathered code runs
    if Schedule(schedule).runs_gathered(r, c):
        partials = c * (m.o + m.lse) if c > 1 else 0  # one column: the accumulator is the row's
        return {"forward": max(row_q + col_kv + partials + m.acc + m.block_forward,
                               m.merge(c)),
                "backward": _gathered_backward(m, r, c)}
    if schedule == "streamed_kv":
        ring_kv = min(2, r - 1) * m.kv
        return {"forward": max(row_q + c * m.acc + ring_kv + m.block_forward,
                               c * (m.acc + m.o + m.lse), m.merge(c)),
                "backward": _streamed_kv_backward(m, r, c)}
    if schedule == "streamed_q":
        ring_q = min(2, c - 1) * m.q
        if c > 2:
            accs = 4 * m.acc + m.block_forward
        else:  # the one partial is sent after its blocks
            accs = max(2 * m.acc + m.block_forward, 3 * m.acc)
        chunk = m.q + m.o + 2 * m.lse  # (Q, dO) and (lse, D)
        stand_in = m.stand_in
        if c > 2:
            steps = 2 * chunk + 2 * m.fq + 2 * m.dq_exchange + stand_in
        else:
            sent = (1 + (m.dq_exchange < m.fq)) * m.dq_exchange + m.q
            steps = max(2 * chunk + m.fq + m.block_backward,
                        chunk + 2 * m.fq + max(stand_in, sent))
        return {"forward": col_kv + ring_q + accs,
                "backward": col_kv + r * m.fkv + steps}
    raise AssertionError(schedule)


Exchanged = Sequence[tuple]
"""Per rank of the mesh, `_bound`'s tuple of the rows it exchanges under a given window
(counted by `sparse.exchanged_rows`)."""


def _windowed_memory(shape: AttentionShape, m: _Chunk, r: int, c: int,
                     windowed: bool | Exchanged) -> dict[str, int]:
    """The sparse exchange's peaks on an R x C mesh of `shape`: with the rows each rank
    exchanges under a window, or every peer's whole chunk exchanged (windowed=True)."""
    exchanged = [_bound(r, c)] if windowed is True else list(windowed)
    return _windowed_peaks(m, r, c, Fraction(shape.head_dim, shape.head_dim + shape.dv),
                           exchanged)


def extra_memory(shape: AttentionShape, rows: int | MeshPlan, cols: int | None = None,
                 schedule: str | None = None,
                 grad_reduce_dtype: GradDtype | str = GradDtype.MIXED,
                 windowed: bool | Exchanged = False, *, bottom_right: bool = False,
                 grouped: bool | None = None) -> dict[str, int]:
    """{'forward': bytes, 'backward': bytes} of extra buffers for one rank.

    extra_memory(shape, plan): the plan's grid, schedule and gradient dtype;
    extra_memory(shape, rows, cols, schedule[, grad_reduce_dtype]): a schedule by name ('ring' for
    Transformer Engine's p2p ring for comparison, rows * cols = P).
    The blocks' kernel calls are grouped as the tiles run them (`tile_calls.grouping(grouped)`),
    the causal diagonal folded in where `bottom_right` (the kernel's `folds_diagonal`: torch's
    on CUDA's flash op; False: cuDNN, Transformer Engine, the memory-efficient op, the CPU).
    """
    if isinstance(rows, MeshPlan):
        if rows.heads > 1:
            return heads_extra_memory(shape, rows, windowed, bottom_right=bottom_right,
                                      grouped=grouped)
        rows, cols, schedule, grad_reduce_dtype = (rows.rows, rows.cols, rows.schedule.value,
                                            rows.grad_reduce_dtype)
    if windowed:  # under a sliding window every schedule runs the sparse exchange
        schedule = "windowed"
    if cols is None or schedule is None:
        raise TypeError("extra_memory takes (shape, plan) or (shape, rows, cols, schedule)")
    if schedule == "ring":
        _, kv, _ = shape.local_elements(rows * cols)
        e = shape.dtype_bytes
        return {"forward": 2 * kv * e, "backward": 2 * kv * e + 2 * FP32 * kv}
    m = _Chunk.of(shape, rows * cols, GradDtype(grad_reduce_dtype))
    if schedule != "windowed":
        peaks = _peaks(m, rows, cols, schedule, bottom_right, grouped,
                       piece_limit(shape.seq_len // (rows * cols)))
        return {phase: peaks[phase] - m.result[phase] for phase in peaks}
    peaks = _windowed_memory(shape, m, rows, cols, windowed or True)
    result = dict(m.result)
    if m.e >= FP32:  # fp32 dq, dk, dv are views of the partials' buffers, which they keep
        result["backward"] = cols * m.fq + rows * m.fkv
    return {phase: peaks[phase] - result[phase] for phase in peaks}


def heads_extra_memory(shape: AttentionShape, plan: MeshPlan,
                       windowed: bool | Exchanged = False, *, bottom_right: bool = False,
                       grouped: bool | None = None) -> dict[str, int]:
    """Extra memory of a heads x rows x cols plan: the R x C mesh's on its 1/A of the heads
    (`layer_plan.heads_shape`), held while the relaid Q, K, V (Q + KV') are kept for backward,
    or the relayouts (module docstring); backward: the mesh's, held while dO is relaid
    (Q), or the gradients relaid back in one message (Q + KV' and 2 (Q + KV'))."""
    inner = heads_shape(shape, plan.heads)
    m = _Chunk.of(inner, plan.rows * plan.cols, plan.grad_reduce_dtype)
    mesh = (_windowed_memory(inner, m, plan.rows, plan.cols, windowed) if windowed
            else _peaks(m, plan.rows, plan.cols, plan.schedule.value, bottom_right, grouped,
                        piece_limit(inner.seq_len // (plan.rows * plan.cols))))
    relaid = m.q + m.kv
    outer = _Chunk.of(shape, plan.cp_size, plan.grad_reduce_dtype)
    repeated = m.kv if kv_repeats(plan.heads, shape.kv_heads) > 1 else 0
    # relaying Q, K, V out (one message: sent, then laid out in the sent buffer, and
    # received; the repeated K/V heads held meanwhile), the mesh, or the output's
    # all-to-all (the mesh's output and lse, sent and received)
    forward = max(repeated + 2 * relaid, relaid + mesh["forward"], relaid + 3 * m.o + m.lse)
    grads = m.q + m.kv  # the mesh's dq, dk, dv, relaid back in one message
    backward = max(mesh["backward"] + m.o, grads + 2 * relaid)
    return {"forward": forward - outer.result["forward"],
            "backward": backward - outer.result["backward"]}


def streamed_schedule(shape: AttentionShape, rows: int, cols: int) -> Schedule:
    """The ring the "streamed" schedule runs on this shape: the only ring when the grid has
    one (streamed_kv on a single column, streamed_q on a single row: the other would run the
    gathered code and overlap nothing), else "streamed_kv" or "streamed_q", whichever holds
    less extra memory at its peak (forward or backward); K/V on a tie."""
    kv, q = Schedule.STREAMED_KV, Schedule.STREAMED_Q
    if kv.runs_gathered(rows, cols) != q.runs_gathered(rows, cols):
        return q if kv.runs_gathered(rows, cols) else kv

    def peak(schedule: Schedule) -> int:
        return max(extra_memory(shape, rows, cols, schedule.value).values())
    return q if peak(q) < peak(kv) else kv
