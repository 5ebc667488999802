"""The heads dimension: an all-to-all over the A ranks of a heads group (Ulysses).

CP rank r = m * A + a holds Megatron's zigzag sub-chunks r and 2P-1-r of 2P, all heads.
After the all-to-all it holds 1/A of the heads (slice a) for the tokens of the A ranks of
mesh rank m: their first sub-chunks mA .. mA+A-1 are super-chunk m of 2P/A, in order,
and their second sub-chunks 2P-1-mA .. 2P-A-mA are super-chunk 2P/A-1-m, in reverse
order. Laid out as [super-chunk m, super-chunk 2P/A-1-m], that is the zigzag of P/A
super-ranks, so the R x C mesh runs unchanged on the rank's mesh (`MeshGrid.mesh_ranks`).
The output goes back by the inverse all-to-all; in backward the gradients take the
mirror path. Bytes per rank: an all-to-all of an M-byte input sends M (A-1)/A.

One message per direction: Q, K and V go out in one all-to-all (their gradients come back
in one), the piece for each rank holding its slices of the three back to back (`flat.py`:
K and V may have different head dims). Each tensor is laid out on its own before the send
(`_to_pieces`) and after the receive (`_to_sequence`), in the buffer that was sent.

GQA / MQA: head slice a of hq query heads needs the K/V heads of its queries. When A
divides hkv each slice takes hkv/A of them; otherwise the K/V heads are repeated
A / gcd(A, hkv) times (to lcm(A, hkv) heads) just before the all-to-all, which is the
first collective that needs them, and the repeated bytes travel (`layer_plan.kv_repeats`).
"""
from __future__ import annotations

import functools
from typing import Protocol, Sequence

import torch

from ..layer_plan import HEADS, kv_repeats
from . import comm
from .flat import flat_size, views
from .grid import MeshGrid


class Documents(Protocol):
    """Packed documents as the heads all-to-all lays them out (`masks/`: `Documents`, the
    THD layout; `DocumentPlacement`, placed rows)."""

    def heads_order(self, cp_size: int, heads: int) -> tuple[int, ...] | None:
        """The order (indices into the A t received rows) the mesh takes them in; None:
        as received."""


def heads_to_sequence(xs: Sequence[torch.Tensor], grid: MeshGrid, phase: comm.Phase,
                      documents: Documents | None = None) -> tuple[torch.Tensor, ...]:
    """Each x [s, b, h, d] (zigzag of P, all heads) -> [A s, b, h/A, d] (zigzag of P/A,
    head slice `grid.head_index`; `_to_sequence`), all in one all-to-all. Two buffers of
    the xs' size together: the one sent takes the results (views of it)."""
    a = grid.heads
    pieces = [(s, b, h // a, d) for s, b, h, d in (x.shape for x in xs)]
    send = xs[0].new_empty(a * flat_size(pieces))
    for x, slot in zip(xs, _piece_views(send, a, pieces)):  # slot a': head slice a'
        s, b, h, d = x.shape
        slot.copy_(x.reshape(s, b, a, h // a, d).permute(2, 0, 1, 3, 4))
    recv = comm.all_to_all(send, grid.heads_group, phase, HEADS, order=grid.heads_order)
    outs = views(send, [(a * s, *rest) for s, *rest in pieces])
    for got, out in zip(_piece_views(recv, a, pieces), outs):  # piece a': rank a''s tokens
        _to_sequence(got, out, grid, documents)
    return outs


def sequence_to_heads(ys: Sequence[torch.Tensor], grid: MeshGrid, phase: comm.Phase,
                      documents: Documents | None = None) -> tuple[torch.Tensor, ...]:
    """Inverse of `heads_to_sequence`: each y [A s, b, h/A, d] -> [s, b, h, d], all in one
    all-to-all. Two buffers of the ys' size together: the one sent takes the results."""
    a = grid.heads
    pieces = [(y.shape[0] // a, *y.shape[1:]) for y in ys]
    send = ys[0].new_empty(a * flat_size(pieces))
    for y, slot in zip(ys, _piece_views(send, a, pieces)):  # slot a': rank a''s tokens
        _to_pieces(y, slot, grid, documents)
    recv = comm.all_to_all(send, grid.heads_group, phase, HEADS, order=grid.heads_order)
    outs = views(send, [(s, b, a * hs, d) for s, b, hs, d in pieces])
    for got, out in zip(_piece_views(recv, a, pieces), outs):  # piece a': head slice a'
        s, b, hs, d = got.shape[1:]
        out.view(s, b, a, hs, d).copy_(got.permute(1, 2, 0, 3, 4))
    return outs


def _piece_views(buffer: torch.Tensor, a: int, shapes: Sequence[tuple[int, ...]]
                 ) -> list[torch.Tensor]:
    """`buffer` (1-D: A pieces, each the shapes' tensors back to back) as one [A, *shape]
    view per shape: row a' of each is that tensor's part of piece a'."""
    rows = buffer.view(a, -1).split([flat_size([s]) for s in shapes], dim=1)
    return [r.view(a, *s) for r, s in zip(rows, shapes)]


def _to_sequence(got: torch.Tensor, out: torch.Tensor, grid: MeshGrid,
                 documents: Documents | None) -> None:
    """After the receive: got [A, s, b, hs, d] (piece a': rank a''s tokens) laid out into
    out [A s, b, hs, d] as the mesh takes them: plain, the zigzag of P/A (first halves in
    rank order, second halves reversed); packed documents (b = 1), the THD layout of P/A
    (`Documents.heads_order`); placed (`DocumentPlacement`), the members' rows one after
    another (`placed.mesh_placement`: no order, as received)."""
    a, s = got.shape[:2]
    where = None if documents is None else _heads_positions(documents, grid, out.device)
    if documents is not None and where is None:
        out.view(got.shape).copy_(got)
    elif where is not None:
        where = where.view(a, s)
        for i in range(a):
            out.index_copy_(0, where[i], got[i])
    else:
        halves = got.view(a, 2, s // 2, *got.shape[2:])
        first, second = out.view(2, a, s // 2, *got.shape[2:])
        first.copy_(halves[:, 0])
        for i in range(a):
            second[i].copy_(halves[a - 1 - i, 1])


def _to_pieces(y: torch.Tensor, pieces: torch.Tensor, grid: MeshGrid,
               documents: Documents | None) -> None:
    """Before the send, the inverse of `_to_sequence`: y [A s, b, hs, d] -> pieces
    [A, s, b, hs, d] (piece a': rank a''s tokens)."""
    a, s = pieces.shape[:2]
    where = None if documents is None else _heads_positions(documents, grid, y.device)
    if documents is not None and where is None:
        pieces.copy_(y.reshape(pieces.shape))
    elif where is not None:
        where = where.view(a, s)
        for i in range(a):
            torch.index_select(y, 0, where[i], out=pieces[i])
    else:
        halves = pieces.view(a, 2, s // 2, *pieces.shape[2:])
        first, second = y.reshape(2, a, s // 2, *pieces.shape[2:])
        halves[:, 0].copy_(first)
        for i in range(a):
            halves[i, 1].copy_(second[a - 1 - i])


class _Relayout(torch.autograd.Function):
    """`there(xs)` in forward (one message); its inverse `back` on the gradients in
    backward (one message)."""

    @staticmethod
    def forward(ctx, grid, there, back, *xs):
        ctx.grid, ctx.back = grid, back
        return there(xs, grid, "forward")

    @staticmethod
    def backward(ctx, *grads):
        # an output without a gradient gets zeros (autograd materializes them by default)
        return None, None, None, *ctx.back(grads, ctx.grid, "backward")


def scatter_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: MeshGrid,
                  documents: Documents | None = None):
    """q [s, b, hq, d], k [s, b, hkv, d], v [s, b, hkv, dv] -> this rank's head slice over
    its mesh rank's tokens: [A s, b, hq/A, d], [A s, b, lcm(A, hkv)/A, d] and [.., dv],
    in one all-to-all (their gradients in one); differentiable."""
    repeats = kv_repeats(grid.heads, k.shape[2])
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
    there = functools.partial(heads_to_sequence, documents=documents)
    back = functools.partial(_gradients_back, documents=documents, repeated=repeats > 1)
    return _Relayout.apply(grid, there, back, q, k, v)


def _gradients_back(grads: Sequence[torch.Tensor], grid: MeshGrid, phase: comm.Phase,
                    documents: Documents | None, repeated: bool) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv back to this rank's tokens in one message (`sequence_to_heads`: views of
    one buffer). Repeated K/V heads: dk, dv are summed over the repeats next, so dq takes
    its own buffer (once the received one is let go: no more at the peak) rather than keep
    the repeated heads' bytes alive with it."""
    dq, dk, dv = sequence_to_heads(grads, grid, phase, documents)
    return (dq.clone() if repeated else dq), dk, dv


def gather_heads(out: torch.Tensor, grid: MeshGrid, documents: Documents | None = None
                 ) -> torch.Tensor:
    """The mesh's output [A s, b, hq/A, d] back to this rank's tokens [s, b, hq, d]."""
    there = functools.partial(sequence_to_heads, documents=documents)
    back = functools.partial(heads_to_sequence, documents=documents)
    return _Relayout.apply(grid, there, back, out)[0]


@functools.lru_cache(maxsize=8)  # one per micro-batch's documents and grid
def _heads_positions_on(documents: Documents, cp_size: int, heads: int,
                        device: torch.device) -> torch.Tensor | None:
    order = documents.heads_order(cp_size, heads)
    if order is None:
        return None
    positions = [0] * len(order)
    for position, row in enumerate(order):
        positions[row] = position
    return torch.tensor(positions, dtype=torch.int64, device=device)


def _heads_positions(documents: Documents, grid: MeshGrid, device: torch.device
                     ) -> torch.Tensor | None:
    """Where each of the A t received rows goes in the THD layout of P/A (the inverse of
    `Documents.heads_order` for this grid), an index tensor on `device`, made once; None
    where the rows stay as received."""
    return _heads_positions_on(documents, grid.cp_size, grid.heads, device)
