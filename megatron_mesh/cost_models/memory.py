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
    whole tiles (`whole_tile=True`: a kernel taking the blocks on hand as one call,
        FlexAttention's, `schedules/whole_tile.py`): a "block" above is the largest such
        call (`tile_calls.call_shapes(..., whole_tile=True)`: whole chunks, uncapped):
        forward, FlexAttention's out and lse of its rows, its mask, and its concatenated
        K/V (one copy; its query chunks are a view in streamed_kv's forward, where they lie
        in the gathered row's buffer, else one copy too) or a chunk's merge (new lse, one
        weight); backward, its dq, dk, dv, its mask, and its concatenated pieces as a
        grouped call's. The mask (`kernels.flex.TileMask` and the BlockMask made of it,
        at 128 x 128 blocks, nq x nk of the call): kinds int32 [nq, nk], the partial
        blocks bool [a power of two >= 2 + n, 128, 128] (n: the causal diagonal's
        s / 128 where a half chunk is whole blocks; else a bound: the blocks holding a
        half chunk's edge, nk a query half and nq a key half, and s / 128 + 4 on the
        diagonal), and the BlockMask's indices (16 nq nk + 8 (nq + nk)); while it is made,
        before the call's other buffers, its partial blocks, about 64 bytes a block of
        marks and index arithmetic and a bool of up to 32 blocks (the pieces made a
        batch at a time: nothing of the call's rows x keys). It is counted with its call: a layer keeps a
        micro-batch's masks for its later layers and the backward, which then hold them
        all (made once, counted nowhere here). What runs
        inside the kernel is not counted (the compiled kernel's work buffers; on the CPU,
        the eager op's dense [sq, sk] scores, which the CUDA kernel never makes)
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

    windowed (the sparse exchange, `schedules/sparse.py`: sliding windows, placed documents,
                       slice masks): with qi, qo the Q rows a rank receives from and
                       sends to its row, ki, ko the K/V rows from and to its column (in
                       chunks, `calls.needed_rows`; C - 1 and R - 1 each when every row
                       is used). A peer's rows are held packed (qi Q, not C Q), their
                       partials too; this rank's own chunk is used in place. A call
                       (`calls.groups`, its Q and K/V rows): forward, its output and lse
                       with its concatenated pieces (one piece is a view) or a merge's new
                       lse and weight; backward, its dq, dk, dv, its rows' lse and its
                       concatenated pieces. The most of
                       forward : both exchanges in flight (the rows sent and arriving) with
                                 this rank's own block: (qi + qo) Q + (ki + ko) KV + acc
                                 + block; then on the rows received qi (Q + acc) + ki KV
                                 + acc + the largest other call; the peers' outputs in the
                                 input dtype (e < 4: acc + qi acc + one peer's O); sent
                                 back with their lse while this rank's arrive: acc + (qi
                                 + qo) (O + L); merged one peer at a time: acc + qo (O + L)
                                 + one peer's rows of FO + 3 L
                       backward: D (L, the attention's) held throughout; both exchanges in
                                 flight with the own block: L + (qi + qo) (Q + O + 2 L)
                                 + (ki + ko) KV + FQ + FKV + block; then grads = L + FQ
                                 + FKV, + ki (KV + FKV), + the row in order: at each row
                                 member, the rows of those not yet done, the dQ partials
                                 of those done and its own, and its rows (Q + O + 2 L) with
                                 its stand-in output (made: its rows of FO (+ O if e < 4)
                                 + 3 L; held: O) and a call, or this rank's own queries'
                                 calls; the dQ rows back (fp32: (qi + qo) FQ; else the
                                 copies in g_q next to the partials, in flight, and one
                                 peer's rows back in fp32) with ki FKV still held; then
                                 the dK, dV rows alike (dK or dV of one peer in fp32)
                       minus the result (the fp32 dq, dk, dv are this rank's own
                       buffers), the most over the ranks. The tile masks a layer makes
                       once per shape and keeps (cached) are not counted.

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
    tokens: int = 0  # a rank's chunk (s): a whole-tile call's mask has its blocks
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
                   q * grads.dq_bytes(e), kv * grads.dkv_bytes(e),
                   shape.seq_len // cp_size)

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

    def _mask_blocks(self, call: CallShape) -> tuple[int, int, int]:
        """(nq, nk, partial blocks) of a whole-tile call's mask (module docstring)."""
        half = self.tokens // 2
        nq, nk = (-(-sum(pieces) * half // FLEX_BLOCK) for pieces in (call.q, call.kv))
        if half % FLEX_BLOCK == 0:
            partial = self.tokens // FLEX_BLOCK if call.diagonal else 0
        else:  # blocks holding a half chunk's edge (its last block row or column), and the
            # diagonal's (s / 128 + 4 at most): a bound
            edges = sum(call.q) * nk + sum(call.kv) * nq
            partial = min(nq * nk, edges + (self.tokens // FLEX_BLOCK + 4 if call.diagonal
                                            else 0))
        return nq, nk, partial

    def tile_mask(self, call: CallShape) -> int:
        """The mask of a whole-tile call: `TileMask`'s kinds and partial blocks and its
        BlockMask's indices (module docstring)."""
        nq, nk, partial = self._mask_blocks(call)
        kept = 1 << (1 + partial).bit_length()  # the least power of two >= 2 + partial
        return 4 * nq * nk + kept * FLEX_BLOCK ** 2 + 16 * nq * nk + 8 * (nq + nk)

    def tile_mask_build(self, call: CallShape) -> int:
        """While a whole-tile call's mask is made (`calls/band_blocks.py`, before the
        call's other buffers): its partial blocks, about 64 bytes a block of marks and
        index arithmetic, and, where some block is partial, a bool of a batch of pieces
        being made (`FLEX_BUILD_BATCH` blocks at most; they are made in the mask's own
        buffer) and their key - row table (int16)."""
        nq, nk, partial = self._mask_blocks(call)
        kept = 1 << (1 + partial).bit_length()
        made = min(FLEX_BUILD_BATCH, partial) + 2 if partial else 0
        return 64 * nq * nk + (kept + made) * FLEX_BLOCK ** 2

    def whole_forward_call(self, call: CallShape, q_view: bool) -> int:
        """One whole-tile forward call: its out and lse with its mask, and its
        concatenated K/V and Q (`q_view`: the query chunks lie in one buffer) while the
        kernel runs, or a chunk's merge after it."""
        rows = sum(call.q)
        copies = ((rows * self.q if len(call.q) > 1 and not q_view else 0)
                  + (sum(call.kv) * self.kv if len(call.kv) > 1 else 0)) // 2
        return max(self.tile_mask_build(call),
                   rows * (self.o + self.lse) // 2 + self.tile_mask(call)
                   + max(copies, max(call.q) * self.lse))

    def whole_backward_call(self, call: CallShape) -> int:
        """One whole-tile backward call: a grouped call's buffers and its mask, or the
        mask while it is made."""
        return max(self.tile_mask_build(call), self.backward_call(call) + self.tile_mask(call))

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
FLEX_BLOCK = 128  # FlexAttention's block of rows and keys (`kernels.flex.BLOCK`)
FLEX_BUILD_BATCH = 32  # pieces a whole-tile mask makes at once (`calls.band_blocks.BATCH`)


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


def whole_tile_calls(m: _Chunk, r: int, c: int, schedule: str) -> _Chunk:
    """m with the largest whole-tile call of `schedule` on an R x C mesh (any rank,
    causal zigzag; `tile_calls.call_shapes(..., whole_tile=True)`) in place of one
    block's: forward, backward, and backward but the diagonal on its own."""
    shapes = {phase: call_shapes(r, c, True, schedule, phase, whole_tile=True)
              for phase in ("forward", "backward")}
    # the query chunks lie in the gathered row's buffer: streamed_kv's steps, the gathered
    # whole tile
    q_view = schedule == "streamed_kv" or Schedule(schedule).runs_gathered(r, c)
    diagonal = replace(DIAGONAL, diagonal=True)
    off = [m.whole_backward_call(call) for call in shapes["backward"] if call != diagonal]
    return replace(m, call_forward=max(m.whole_forward_call(call, q_view)
                                       for call in shapes["forward"]),
                   call_backward=max(map(m.whole_backward_call, shapes["backward"])),
                   call_backward_off_diagonal=max(off, default=m.whole_backward_call(diagonal)))


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


def _whole_gathered_backward(m: _Chunk, r: int, c: int) -> int:
    """The gathered backward's peak on a kernel taking whole tiles, C > 1 (module
    docstring): the diagonal while the row and the column are gathered, then the tile but
    the diagonal in one call with the C - 1 stand-in outputs and dQ partials, then the
    partials leaving on the row ring one after another."""
    base = r * m.kv + r * m.fkv + m.fq if r > 1 else m.fkv + m.fq  # column K/V, dK/dV, own dQ
    rows = c * (m.q + m.o + 2 * m.lse)  # the row's (Q, dO), (lse, D)
    held = base + rows + (c - 1) * (m.o + m.fq)  # with the stand-ins and the dQ partials
    making = m.fo + (m.o if m.e < FP32 else 0) + 3 * m.lse  # a stand-in while it is made
    ring = base + (c - 1) * m.fq + 2 * m.dq_exchange
    return max(held + max(making, m.block_backward_off_diagonal), ring)


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
    """Rows exchanged when every peer's whole chunk is used (no window given), as
    `sparse.exchanged_rows` gives them: (Q rows received, sent, K/V rows received, sent, in
    chunks; per other row member, its Q rows and its calls (Q, K/V rows) against the
    column; the calls of this rank's own queries over the other column members' K/V; how
    many row members come before this rank)."""
    return (c - 1, c - 1, r - 1, r - 1, [(1, [(1, 1)])] * (c - 1), [(1, 1)] * (r > 1), 0)


def _windowed_peaks(m: _Chunk, r: int, c: int, k_share: Fraction,
                    exchanged: list[tuple]) -> dict[str, int]:
    """The sparse exchange's peaks (module docstring), the most over the ranks whose rows
    are `exchanged` (`_bound`); k_share: K's part of a K/V row. A peer's rows are held
    packed; this rank's own chunk is used in place."""
    worst = {"forward": 0, "backward": 0}
    fp32 = m.e >= FP32
    f = lambda rows, size: int(rows * size)  # noqa: E731

    def forward_call(q: Fraction, kv: Fraction, q_pieces: int = 1, kv_pieces: int = 1) -> int:
        """A call's output and lse, with its concatenated Q and K/V while it runs (one piece
        is a view) or a piece's merge (new lse, one weight) after it."""
        copies = (f(q, m.q) if q_pieces > 1 else 0) + (f(kv, m.kv) if kv_pieces > 1 else 0)
        return f(q, m.o + m.lse) + max(copies, f(q, 2 * m.lse))

    def backward_call(q: Fraction, kv: Fraction, q_pieces: int = 1, kv_pieces: int = 1) -> int:
        """A call's dq, dk, dv with its rows' lse and the concatenated inputs it reads."""
        copies = ((f(q, 2 * m.o + m.q + m.lse) if q_pieces > 1 else 0)
                  + (f(kv, m.kv) if kv_pieces > 1 else 0))
        return f(q, m.q + m.lse) + f(kv, m.kv) + copies

    for q_in, q_out, kv_in, kv_out, others, own_row, own_at in exchanged:
        one_in, one_out = min(q_in, 1), min(q_out, 1)  # at most one peer's rows
        # the other calls (own queries over the column's K/V, other rows' queries)
        block = max((forward_call(*call) for call in
                     [*own_row, *(call for _, calls in others for call in calls)]), default=0)
        forward = max(
            # both exchanges in flight (rows sent and arriving), this rank's own block
            f(q_in + q_out, m.q) + f(kv_in + kv_out, m.kv) + m.acc + m.block_forward,
            # then the others on the rows received, the peers' rows accumulated packed
            f(q_in, m.q + m.acc) + f(kv_in, m.kv) + m.acc + block,
            # the peers' outputs in the input dtype, one at a time
            m.acc + f(q_in, m.acc) + (0 if fp32 else f(one_in, m.o)),
            # sent back with their lse, this rank's rows received
            m.acc + f(q_in + q_out, m.o + m.lse),
            # merged one peer at a time (its rows of the accumulators, new lse, weight)
            m.acc + f(q_out, m.o + m.lse) + f(one_out, m.merge_rows))
        chunk = m.q + m.o + 2 * m.lse  # Q, dO, lse, D
        grads = m.lse + m.fq + m.fkv  # D (the attention's), this rank's dQ and dK, dV
        # the row in order, this rank's own queries at own_at: the peers' rows not yet done
        # held, the dQ partials of those done (and the current one's) held; a peer's rows
        # with their stand-in output (or while it is made), or this rank's own queries over
        # the other column members' K/V (no stand-in)
        steps = [(share, calls) for share, calls in others]
        steps.insert(own_at, (None, own_row))
        loop, done = 0, Fraction(0)
        for n, (share, calls) in enumerate(steps):
            waiting = sum((s for s, _ in steps[n + 1:] if s is not None), Fraction(0))
            if share is None:
                work = max((backward_call(*call) for call in calls), default=0)
            else:
                done += share
                work = f(share, chunk) + max(
                    [f(share, m.fo + (0 if fp32 else m.o) + 3 * m.lse)]
                    + [f(share, m.o) + backward_call(*call) for call in calls])
            loop = max(loop, f(waiting, chunk) + f(done, m.fq) + work)
        grads = m.lse + m.fq + m.fkv  # D (the attention's), this rank's dQ and dK, dV
        # the partials sent back in the exchange dtype: while copied, while in flight with
        # this rank's rows arriving, then one peer's rows back in fp32 to be added
        dq_back = f(q_in + q_out, m.fq) if m.dq_exchange >= m.fq else max(
            f(q_in, m.fq + m.dq_exchange), f(q_in + q_out, m.dq_exchange),
            f(q_out, m.dq_exchange) + f(one_out, m.fq))
        kv_one = f(min(kv_out, 1) * max(k_share, 1 - k_share), m.fkv)  # dK or dV rows
        dkv_back = f(kv_in + kv_out, m.fkv) if m.dkv_exchange >= m.fkv else max(
            f(kv_in, m.fkv + m.dkv_exchange), f(kv_in + kv_out, m.dkv_exchange),
            f(kv_out, m.dkv_exchange) + kv_one)
        backward = max(
            # both exchanges in flight, this rank's own block on its own inputs meanwhile
            m.lse + f(q_in + q_out, chunk) + f(kv_in + kv_out, m.kv) + m.fq + m.fkv
            + m.block_backward,
            # then the others on the rows received, their partials packed
            grads + f(kv_in, m.kv + m.fkv) + loop,
            grads + f(kv_in, m.fkv) + dq_back,  # the dQ rows sent back and added
            grads + dkv_back,  # then the dK, dV rows
            # the results in the input dtype next to the fp32 partials
            grads + (0 if fp32 else m.q + m.kv))
        worst = {"forward": max(worst["forward"], forward),
                 "backward": max(worst["backward"], backward)}
    return worst


def _peaks(m: _Chunk, r: int, c: int, schedule: str, bottom_right: bool = False,
           grouped: bool | None = None, limit: int | None = None,
           whole_tile: bool = False) -> dict[str, int]:
    """The most bytes held at once in each pass, the result included; the blocks' calls
    grouped where `tile_calls.grouping(grouped)` (`grouped_calls`), each at most `limit`
    half chunks (`tile_calls.piece_limit`), or one call a group (`whole_tile`,
    `whole_tile_calls`)."""
    row_q = c * m.q if c > 1 else 0
    col_kv = r * m.kv if r > 1 else 0
    if schedule not in tuple(Schedule):  # ('ring' and 'windowed' go elsewhere: extra_memory)
        raise ValueError(f"schedule={schedule!r} is not one of gathered, streamed_kv, "
                         "streamed_q, ring or windowed")
    if whole_tile:
        m = whole_tile_calls(m, r, c, schedule)
    elif grouping(grouped):
        m = grouped_calls(m, r, c, schedule, bottom_right, limit)
    # the schedule has no ring to run here: the gathered code runs
    if Schedule(schedule).runs_gathered(r, c) and whole_tile and c > 1:  # the whole tile
        return {"forward": max(row_q + col_kv + c * m.acc + m.block_forward,
                               c * (m.acc + m.o + m.lse), m.merge(c)),
                "backward": _whole_gathered_backward(m, r, c)}
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
                 grouped: bool | None = None, whole_tile: bool = False) -> dict[str, int]:
    """{'forward': bytes, 'backward': bytes} of extra buffers for one rank.

    extra_memory(shape, plan): the plan's grid, schedule and gradient dtype;
    extra_memory(shape, rows, cols, schedule[, grad_reduce_dtype]): a schedule by name ('ring' for
    Transformer Engine's p2p ring for comparison, rows * cols = P).
    The blocks' kernel calls are grouped as the tiles run them (`tile_calls.grouping(grouped)`),
    the causal diagonal folded in where `bottom_right` (the kernel's `folds_diagonal`: torch's
    on CUDA's flash op; False: cuDNN, Transformer Engine, the memory-efficient op, the CPU);
    `whole_tile`: the kernel takes each group on hand as one call (`KernelCaps.whole_tile`,
    backend 'flex'; `whole_tile_calls`; the sparse exchange's calls stay modelled grouped).
    """
    if isinstance(rows, MeshPlan):
        if rows.heads > 1:
            return heads_extra_memory(shape, rows, windowed, bottom_right=bottom_right,
                                      grouped=grouped, whole_tile=whole_tile)
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
                       piece_limit(shape.seq_len // (rows * cols)), whole_tile)
        return {phase: peaks[phase] - m.result[phase] for phase in peaks}
    peaks = _windowed_memory(shape, m, rows, cols, windowed or True)
    return {phase: peaks[phase] - m.result[phase] for phase in peaks}


def heads_extra_memory(shape: AttentionShape, plan: MeshPlan,
                       windowed: bool | Exchanged = False, *, bottom_right: bool = False,
                       grouped: bool | None = None, whole_tile: bool = False
                       ) -> dict[str, int]:
    """Extra memory of a heads x rows x cols plan: the R x C mesh's on its 1/A of the heads
    (`layer_plan.heads_shape`), held while the relaid Q, K, V (Q + KV') are kept for backward,
    or the relayouts (module docstring); backward: the mesh's, held while dO is relaid
    (Q), or the gradients relaid back in one message (Q + KV' and 2 (Q + KV'))."""
    inner = heads_shape(shape, plan.heads)
    m = _Chunk.of(inner, plan.rows * plan.cols, plan.grad_reduce_dtype)
    mesh = (_windowed_memory(inner, m, plan.rows, plan.cols, windowed) if windowed
            else _peaks(m, plan.rows, plan.cols, plan.schedule.value, bottom_right, grouped,
                        piece_limit(inner.seq_len // (plan.rows * plan.cols)), whole_tile))
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
