"""Every rank's tile over packed documents (THD), as the kernels get it, against the
definition: the grouped calls (`schedules.blocks._tile_calls`: the blocks of one array pass,
documents joined call by call, a causal diagonal folded or not, rows per call capped) and the
whole-tile mask (`schedules.whole_tile.tile_mask`, with the sparse exchange's kept rows), laid
back on positions from the THD layout written here, keep each pair of the dense mask built here
from cu_seqlens (with a window and a user's slices) exactly once, and nothing else.

Documents of the kinds the layout's edges meet, on R x C grids of P = 4, 8, 16: one token,
lengths at piece and half boundaries, one document over the whole sequence, padding at the end
only, a document of no token, many tiny ones; caches kept from case to case, so micro-batches
of the same lengths (or the same cumulative lengths, padded otherwise) in turn are planned
each for its own documents."""
from __future__ import annotations

import random

import torch

from megatron_mesh.calls.layout import AttentionMask
from megatron_mesh.calls.needed_rows import needed_rows
from megatron_mesh.masks.documents import Documents
from megatron_mesh.masks.slices import SliceMask
from megatron_mesh.masks.window import Window
from megatron_mesh.schedules.blocks import _tile_calls
from megatron_mesh.schedules.kept_rows import KeptRows
from megatron_mesh.schedules.whole_tile import tile_mask

CPU = torch.device("cpu")


def thd_positions(cu_padded: list[int], lengths: list[int], ranks: int, rank: int
                  ) -> torch.Tensor:
    """int64 [T / P]: the packed position of each local row of `rank` (pieces r and
    2P-1-r of every document cut in 2P, in document order), -1 on padding."""
    out = []
    for start, end, n in zip(cu_padded, cu_padded[1:], lengths):
        piece = (end - start) // (2 * ranks)
        for index in (rank, 2 * ranks - 1 - rank):
            out += [start + p if p < n else -1
                    for p in range(index * piece, (index + 1) * piece)]
    return torch.tensor(out, dtype=torch.int64)


def definition(cu_padded: list[int], lengths: list[int], causal: bool,
               window: tuple[int, int] | None, slices: list[tuple] | None) -> torch.Tensor:
    """bool [T, T]: query i sees key j iff both are tokens of one document, j <= i where
    causal, i - left <= j <= i + right under the window (-1: unbounded), and some user
    slice (q0, q1, k0, k1, kind) holds (i, j) (causal: j - i <= k1 - q1)."""
    total = cu_padded[-1]
    doc = torch.full((total,), -1)
    for d, (start, n) in enumerate(zip(cu_padded, lengths)):
        doc[start:start + n] = d
    i, j = torch.arange(total)[:, None], torch.arange(total)[None, :]
    seen = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
    if causal:
        seen &= j <= i
    if window is not None:
        left, right = window
        seen &= ((j >= i - left) | (left < 0)) & ((j <= i + right) | (right < 0))
    if slices is not None:
        user = torch.zeros_like(seen)
        for q0, q1, k0, k1, kind in slices:
            box = (i >= q0) & (i < q1) & (j >= k0) & (j < k1)
            user |= box & ((j - i <= k1 - q1) if kind == "causal" else True)
        seen &= user
    return seen


def call_pairs(call) -> tuple[torch.Tensor, torch.Tensor]:
    """(i, j): the pairs of a call's rows it keeps, in the order of its pieces concatenated
    (a joined call's rows put back from their places)."""
    sq = sum(p.size for p in call.q)
    sk = sum(p.size for p in call.kv)
    if call.slices is not None:
        seen = call.slices.seen()
    else:
        seen = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq) if call.causal else \
            torch.ones(sq, sk, dtype=torch.bool)
    if call.q_place is not None:
        seen = seen[call.q_place]
    if call.kv_place is not None:
        seen = seen[:, call.kv_place]
    return seen.nonzero(as_tuple=True)


def rows_of(rows: slice | torch.Tensor, local: int) -> torch.Tensor:
    return torch.arange(local)[rows] if isinstance(rows, slice) else rows


def cover(total: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """int [T + 1, T + 1]: how often each (query, key) position is kept (row / column T:
    a padding row)."""
    count = torch.zeros(total + 1, total + 1, dtype=torch.int64)
    for qp, kp in pairs:
        qp, kp = torch.where(qp < 0, total, qp), torch.where(kp < 0, total, kp)
        count.index_put_((qp, kp), torch.ones_like(qp), accumulate=True)
    return count


def tile_pairs(mask: AttentionMask, pos: list[torch.Tensor], rows: int, cols: int,
               fold: bool, limit: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's grouped calls (its row's query chunks against its column's K/V chunks)
    as pairs of positions."""
    local = len(pos[0])
    out = []
    for me in range(rows * cols):
        xs = tuple(me // cols * cols + c for c in range(cols))
        ys = tuple(r * cols + me % cols for r in range(rows))
        for call in _tile_calls(mask, xs, ys, local, CPU, frozenset(), fold, True, limit):
            qp = torch.cat([pos[xs[p.chunk]][rows_of(p.rows, local)] for p in call.q])
            kp = torch.cat([pos[ys[p.chunk]][rows_of(p.rows, local)] for p in call.kv])
            i, j = call_pairs(call)
            out.append((qp[i], kp[j]))
    return out


def whole_tile_pairs(mask: AttentionMask, pos: list[torch.Tensor], rows: int, cols: int
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's whole-tile mask, peers' chunks held as the rows its blocks use
    (`needed_rows`, packed), as pairs of positions."""
    local = len(pos[0])
    out = []
    for me in range(rows * cols):
        xs = [me // cols * cols + c for c in range(cols)]
        ys = [r * cols + me % cols for r in range(rows)]
        q_kept = [None if x == me else KeptRows(needed_rows(mask, rows, cols, local, me, x,
                                                            "q"), local) for x in xs]
        kv_kept = [None if y == me else KeptRows(needed_rows(mask, rows, cols, local, me, y,
                                                             "kv"), local) for y in ys]
        held = lambda r, kept: pos[r] if kept is None else pos[r][list(kept.kept)]  # noqa: E731
        qp = torch.cat([held(x, k) for x, k in zip(xs, q_kept)])
        kp = torch.cat([held(y, k) for y, k in zip(ys, kv_kept)])
        i, j = tile_mask(mask, xs, ys, local, CPU, (), q_kept, kv_kept).seen().nonzero(
            as_tuple=True)
        out.append((qp[i], kp[j]))
    return out


def edge_documents(ranks: int, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """(padded lengths, lengths) of documents at the layout's edges, on `ranks` ranks."""
    unit = 2 * ranks  # the least padded length: pieces of one token
    big = 4 * unit
    piece = big // unit  # a piece of a big document
    return [
        ([unit, big, unit], [1, big, 1]),  # one token
        ([big, big], [3 * piece, big // 2]),  # ending at a piece, at the half
        ([big, big], [big // 2 + 1, big - piece]),
        ([big, big], [piece, big // 2 - 1]),
        ([2 * big], [2 * big]),  # one document over the whole sequence
        ([2 * big], [2 * big - 1]),
        ([unit, big, unit], [unit, big, unit - 3]),  # padding at the end only
        ([unit, big, unit], [unit, 0, 3]),  # a document of no token
        ([unit] * 24, [rng.choice([1, 2, ranks, unit - 1, unit]) for _ in range(24)]),  # tiny
    ]


def random_slices(cu_padded: list[int], rng: random.Random) -> list[tuple]:
    """A slice (full or causal) inside most documents' spans, of random rows and keys: a
    block then holds several of them, cut anywhere in a document."""
    out = []
    for start, end in zip(cu_padded, cu_padded[1:]):
        if rng.random() < 0.8:
            q0, k0 = rng.randrange(start, end), rng.randrange(start, end)
            out.append((q0, rng.randint(q0 + 1, end), k0, rng.randint(k0 + 1, end),
                        rng.choice(("full", "causal"))))
    return out or [(0, cu_padded[-1], 0, cu_padded[-1], "full")]


def test_every_ranks_tile_keeps_each_pair_of_the_documents_once():
    """The union of every rank's grouped calls, and of its whole-tile masks, is the
    definition's mask, each pair once (module docstring)."""
    rng = random.Random(0)
    for rows, cols, picked in ((2, 2, None), (1, 4, None), (2, 4, None), (4, 2, (0, 2, 8, 10)),
                               (4, 4, (0, 1, 4, 6, 10))):
        ranks = rows * cols
        cases = edge_documents(ranks, rng)
        # right after the padding at the end: the same cu_seqlens padded otherwise, and the
        # same padding with tokens moved between documents
        padded, lengths = cases[6]
        cases[7:7] = [([2 * padded[0], *padded[1:]], lengths),
                      (padded, [lengths[0] - 1, lengths[1], lengths[2] + 1])]
        for n, (padded, lengths) in enumerate(cases):
            if picked is not None and n not in picked:  # a few on the larger grids
                continue
            cu = [0]
            for size in padded:
                cu.append(cu[-1] + size)
            docs = Documents(tuple(cu), tuple(lengths))
            total = cu[-1]
            pos = [thd_positions(cu, lengths, ranks, r) for r in range(ranks)]
            causal = n % 3 != 2
            window = ((rng.randint(0, total // 3), 0) if causal else
                      (rng.randint(-1, total // 3), rng.randint(0, total // 4)))
            slices = random_slices(cu, rng)
            for kind, mask in (
                    ("documents", AttentionMask(causal, docs, ranks)),
                    ("window", AttentionMask(causal, docs, ranks, Window(*window))),
                    ("slices", AttentionMask(causal, docs, ranks,
                                             slices=SliceMask(slices, total)))):
                want = torch.zeros(total + 1, total + 1, dtype=torch.int64)
                want[:total, :total] = definition(
                    cu, lengths, causal, window if kind == "window" else None,
                    slices if kind == "slices" else None).long()
                where = (rows, cols, padded, lengths, causal, kind)
                # the diagonal folded, or apart and rows per call capped, in turn
                fold, limit = (True, None) if n % 2 else (False, 3 * total // ranks // 4)
                got = cover(total, tile_pairs(mask, pos, rows, cols, fold, limit))
                assert torch.equal(got, want), (*where, fold, limit)
                if (kind, n % 3) in (("documents", 0), ("window", 1), ("slices", 2)):
                    got = cover(total, whole_tile_pairs(mask, pos, rows, cols))
                    assert torch.equal(got, want), (*where, "whole tile")
