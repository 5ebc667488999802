"""The heads dimension: an all-to-all over the A ranks of a heads group (Ulysses).

CP rank r = m * A + a holds Megatron's zigzag sub-chunks r and 2P-1-r of 2P, all heads.
After the all-to-all it holds 1/A of the heads (slice a) for the tokens of the A ranks of
mesh rank m: their first sub-chunks mA .. mA+A-1 are super-chunk m of 2P/A, in order,
and their second sub-chunks 2P-1-mA .. 2P-A-mA are super-chunk 2P/A-1-m, in reverse
order. Laid out as [super-chunk m, super-chunk 2P/A-1-m], that is the zigzag of P/A
super-ranks, so the R x C mesh runs unchanged on the rank's mesh (`MeshGrid.mesh_ranks`).
The output goes back by the inverse all-to-all; in backward the gradients take the
mirror path. Bytes per rank: an all-to-all of an M-byte input sends M (A-1)/A.

GQA / MQA: head slice a of hq query heads needs the K/V heads of its queries. When A
divides hkv each slice takes hkv/A of them; otherwise the K/V heads are repeated
A / gcd(A, hkv) times (to lcm(A, hkv) heads) just before the all-to-all, which is the
first collective that needs them, and the repeated bytes travel (`values.kv_repeats`).
"""
from __future__ import annotations

import functools

import torch

from ..masks.document_placement import DocumentPlacement
from ..masks.documents import Documents
from ..values import HEADS, kv_repeats
from . import comm
from .grid import MeshGrid


def heads_to_sequence(x: torch.Tensor, grid: MeshGrid, phase: comm.Phase,
                      documents: Documents | None = None) -> torch.Tensor:
    """[s, b, h, d] (zigzag of P, all heads) -> [A s, b, h/A, d] (zigzag of P/A, head
    slice `grid.head_index`). Two buffers of x's size: the one sent takes the result.
    Packed documents (b = 1): the THD layout of P/A (`Documents.heads_order`); placed
    documents (`DocumentPlacement`): the members' rows one after another
    (`placed.mesh_placement`)."""
    s, b, h, d = x.shape
    a, hs = grid.heads, h // grid.heads
    send = x.new_empty(a, s, b, hs, d)  # piece a' goes to rank a'
    send.copy_(x.reshape(s, b, a, hs, d).permute(2, 0, 1, 3, 4))
    recv = comm.all_to_all(send, grid.heads_group, phase, HEADS,
                           order=grid.heads_order)  # piece a': rank a''s tokens
    if isinstance(documents, DocumentPlacement):  # placed: the members' rows one after another
        return recv.view(a * s, b, hs, d)
    if documents is not None:
        order = _heads_order(documents, grid, x.device)
        return torch.index_select(recv.view(a * s, b, hs, d), 0, order, out=send.view(-1, b, hs, d))
    halves = recv.view(a, 2, s // 2, b, hs, d)
    out = send.view(2, a, s // 2, b, hs, d)  # first halves in rank order, second reversed
    out[0].copy_(halves[:, 0])
    for i in range(a):
        out[1, i].copy_(halves[a - 1 - i, 1])
    return out.view(-1, b, hs, d)


def sequence_to_heads(y: torch.Tensor, grid: MeshGrid, phase: comm.Phase,
                      documents: Documents | None = None) -> torch.Tensor:
    """Inverse of `heads_to_sequence`: [A s, b, h/A, d] -> [s, b, h, d]. Two buffers of
    y's size: the one sent takes the result."""
    a = grid.heads
    s2, b, hs, d = y.shape
    send = y.new_empty(a, 2, s2 // (2 * a), b, hs, d)  # piece a': its tokens' two halves
    if isinstance(documents, DocumentPlacement):
        send.view(s2, b, hs, d).copy_(y)
    elif documents is not None:
        send.view(s2, b, hs, d).index_copy_(0, _heads_order(documents, grid, y.device), y)
    else:
        first, second = y.view(2, a, s2 // (2 * a), b, hs, d)
        send[:, 0].copy_(first)
        for i in range(a):
            send[i, 1].copy_(second[a - 1 - i])
    recv = comm.all_to_all(send.view(a, -1, b, hs, d), grid.heads_group, phase, HEADS,
                           order=grid.heads_order)
    out = send.view(-1, b, a, hs, d)  # piece a' of recv: head slice a'
    out.copy_(recv.permute(1, 2, 0, 3, 4))
    return out.view(-1, b, a * hs, d)


class _Relayout(torch.autograd.Function):
    """`there(x)` in forward; its inverse `back` on the gradient in backward."""

    @staticmethod
    def forward(ctx, x, grid, there, back):
        ctx.grid, ctx.back = grid, back
        return there(x, grid, "forward")

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad, ctx.grid, "backward"), None, None, None


def scatter_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: MeshGrid,
                  documents: Documents | None = None):
    """q [s, b, hq, d], k / v [s, b, hkv, d] -> this rank's head slice over its mesh rank's
    tokens: [A s, b, hq/A, d] and [A s, b, lcm(A, hkv)/A, d]; differentiable."""
    repeats = kv_repeats(grid.heads, k.shape[2])
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
    there = functools.partial(heads_to_sequence, documents=documents)
    back = functools.partial(sequence_to_heads, documents=documents)
    return tuple(_Relayout.apply(t, grid, there, back) for t in (q, k, v))


def gather_heads(out: torch.Tensor, grid: MeshGrid, documents: Documents | None = None
                 ) -> torch.Tensor:
    """The mesh's output [A s, b, hq/A, d] back to this rank's tokens [s, b, hq, d]."""
    there = functools.partial(sequence_to_heads, documents=documents)
    back = functools.partial(heads_to_sequence, documents=documents)
    return _Relayout.apply(out, grid, there, back)


@functools.lru_cache(maxsize=8)  # one per micro-batch's documents and grid
def _heads_order_on(documents: Documents, cp_size: int, heads: int, device: torch.device
                    ) -> torch.Tensor:
    order = documents.heads_order(cp_size, heads)
    return torch.tensor(order, dtype=torch.int64, device=device)


def _heads_order(documents: Documents, grid: MeshGrid, device: torch.device) -> torch.Tensor:
    """`Documents.heads_order` for this grid as an index tensor on `device`, made once."""
    return _heads_order_on(documents, grid.cp_size, grid.heads, device)
