"""The kernel calls of the blocks a rank has on hand together, grouped into few calls.

A rank-block's calls (`Block.calls`) each take rows of one query chunk and one key chunk.
Blocks on hand together (a query chunk against the column's K/V, or the row's query chunks
against one arriving K/V chunk) go to the kernel as few calls:

1. Plain calls (no slices) over the same query rows of one chunk take the
   keys of all of them, concatenated, in one call; a causal one (the diagonal, sq == sk)
   puts its keys last and the call is causal aligned at the bottom right (query i sees key
   j <= i + sk - sq), which is exactly the union, where the kernel takes that without a
   mask (`kernels.base.folds_diagonal`, given here as `bottom_right`); else the diagonal
   stays a call of its own.
2. Full calls (after 1) over the same key rows take the query rows of all of them,
   concatenated.

So under the causal zigzag a query chunk x against the column's chunks Y is at most two
calls (three with the diagonal apart): Q(x) against the first halves of K/V(y < x) and
K/V(x) (causal, last), and the second half of Q(x) against K/V(y > x); the row's chunks
against one K/V chunk are at most three (those above it, those below it, the diagonal).
Without a causal mask everything on hand is one call. Calls with slices (packed
documents, sliding windows, masks given as slices) are kept as they are.

A call concatenates at most `limit` rows on its grouped side (keys in 1, query rows in 2):
more go in several calls, cut greedily from the last piece back (the diagonal's run first,
as many keys before it as fit), each at least one piece; the copies and outputs of one call
stay bounded however many chunks are on hand.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .block import Block
from .document_groups import Member, covers, groups_of, join, with_member
from .tile_slices import TileSlices


@dataclass(frozen=True)
class Piece:
    """Rows of one chunk on hand: `chunk` indexes the query (or key) chunks of the group,
    `rows` its rows (a slice, or an int64 index tensor)."""

    chunk: int
    rows: slice | torch.Tensor

    @property
    def size(self) -> int:
        rows = self.rows
        return rows.stop - rows.start if isinstance(rows, slice) else int(rows.numel())


@dataclass(frozen=True)
class Call:
    """One kernel call: its query rows (pieces concatenated in order) against its key rows
    (likewise); `causal` is aligned at the bottom right of the concatenation."""

    q: tuple[Piece, ...]
    kv: tuple[Piece, ...]
    causal: bool = False
    slices: TileSlices | None = None
    # documents joined (`document_groups.py`): where each row of the pieces concatenated
    # sits in the call (None: in that order)
    q_place: torch.Tensor | None = field(default=None, compare=False)
    kv_place: torch.Tensor | None = field(default=None, compare=False)


def _key(piece: Piece) -> tuple | None:
    """A hashable key of a piece's rows (None for index tensors: never grouped)."""
    if not isinstance(piece.rows, slice):
        return None
    return piece.chunk, piece.rows.start, piece.rows.stop


def _runs(pieces: list[Piece], limit: int | None) -> list[list[Piece]]:
    """Consecutive runs of `pieces` of at most `limit` rows each (at least one piece),
    filled from the last back; limit None: one run."""
    if limit is None:
        return [pieces] if pieces else []
    out: list[list[Piece]] = []
    run: list[Piece] = []
    total = 0
    for p in reversed(pieces):
        if run and total + p.size > limit:
            out.append(run[::-1])
            run, total = [], 0
        run.append(p)
        total += p.size
    if run:
        out.append(run[::-1])
    return out[::-1]


def group_calls(blocks: list[tuple[int, int, Block]], bottom_right: bool,
                grouped: bool = True, limit: int | None = None) -> list[Call]:
    """The calls computing `blocks` [(query chunk index, key chunk index, Block)], grouped
    (module docstring); `bottom_right`: the kernel takes causal calls of sq < sk;
    grouped=False: each block's own calls, as they are (an A/B baseline); `limit`: the most
    rows a call concatenates (None: no cap)."""
    plain: dict[tuple, list[Call]] = {}
    out: list[Call] = []
    documents: list[tuple[int, int, Block]] = []
    for qi, ki, blk in blocks:
        for c in blk.calls:
            if grouped and c.doc_runs is not None:
                documents.append((qi, ki, c))
                continue
            call = Call((Piece(qi, c.q_rows),), (Piece(ki, c.kv_rows),), c.causal, c.slices)
            key = _key(call.q[0])
            if not grouped or c.slices is not None or key is None or _key(call.kv[0]) is None:
                out.append(call)
            else:
                plain.setdefault(key, []).append(call)
    by_keys: dict[tuple, list[Call]] = {}
    for calls in plain.values():  # 1. the same query rows: keys concatenated
        full = sorted((c for c in calls if not c.causal), key=lambda c: c.kv[0].chunk)
        causal = [c for c in calls if c.causal]
        keys = [p for c in full for p in c.kv]
        if (causal and bottom_right and full
                and causal[0].q[0].size == causal[0].kv[0].size):
            diagonal, *rest = causal
            *runs, last = _runs(keys + list(diagonal.kv), limit)
            out.append(Call(full[0].q, tuple(last), causal=True))  # the diagonal's run
            out.extend(rest)
        else:
            out.extend(causal)
            runs = _runs(keys, limit)
        for run in runs:
            merged = Call(full[0].q, tuple(run))
            by_keys.setdefault(tuple(_key(p) for p in merged.kv), []).append(merged)
    for calls in by_keys.values():  # 2. the same key rows: queries concatenated
        calls.sort(key=lambda c: c.q[0].chunk)
        for run in _runs([c.q[0] for c in calls], limit):
            out.append(Call(tuple(run), calls[0].kv))
    return out + document_calls(documents, bottom_right, limit)


def document_calls(calls: list[tuple[int, int, Block]], bottom_right: bool,
                   limit: int | None) -> list[Call]:
    """Calls over documents [(query chunk, key chunk, call)] joined document by document
    (`document_groups.py`): 1. full calls of one query chunk, keys concatenated, the chunk's
    causal diagonal last where `bottom_right` takes it; 2. full calls left alone, of one key
    chunk, queries concatenated. At most `limit` rows concatenated per call."""
    if not calls:
        return []
    device = calls[0][2].slices.device
    full = [Member(qi, ki, c) for qi, ki, c in calls if not c.causal]
    diagonals: dict[int, list[Member]] = {}
    for qi, ki, c in calls:
        if c.causal:
            diagonals.setdefault(qi, []).append(Member(qi, ki, c))
    out: list[Call] = []
    alone: list[Member] = []
    for group in groups_of(full, "q"):  # 1. the same query chunk
        order = sorted(range(len(group.members)), key=lambda n: group.members[n].other)
        diagonal = diagonals.get(group.shared, [])
        fold = bottom_right and len(diagonal) == 1 and covers(group, diagonal[0])
        if fold:
            group = with_member(group, diagonal.pop())
            order.append(len(group.members) - 1)
        runs = _member_runs([group.members[n] for n in order], "kv", limit)
        at = 0
        for n, run in enumerate(runs):
            picked, at = order[at:at + len(run)], at + len(run)
            last = fold and n == len(runs) - 1
            if len(run) == 1 and not last:
                alone.append(run[0])
                continue
            joined = join(group, picked, last, device)
            out.append(Call((Piece(group.shared, _on(joined.shared_rows, device)),),
                            tuple(Piece(c, r) for c, r in joined.pieces), joined.causal,
                            joined.slices, kv_place=joined.place))
    for rest in diagonals.values():  # diagonals not folded: calls of their own
        out += [_own(m.shared, m.other, m.call) for m in rest]
    swapped = [Member(m.other, m.shared, m.call) for m in alone]
    for group in groups_of(swapped, "kv"):  # 2. the same key chunk
        order = sorted(range(len(group.members)), key=lambda n: group.members[n].other)
        at = 0
        for run in _member_runs([group.members[n] for n in order], "q", limit):
            picked, at = order[at:at + len(run)], at + len(run)
            if len(run) == 1:
                m = run[0]
                out.append(_own(m.other, m.shared, m.call))
                continue
            joined = join(group, picked, False, device)
            out.append(Call(tuple(Piece(c, r) for c, r in joined.pieces),
                            (Piece(group.shared, _on(joined.shared_rows, device)),), False,
                            joined.slices, q_place=joined.place))
    return out


def _own(qi: int, ki: int, c: Block) -> Call:
    return Call((Piece(qi, c.q_rows),), (Piece(ki, c.kv_rows),), c.causal, c.slices)


def _on(rows: slice | torch.Tensor, device: torch.device) -> slice | torch.Tensor:
    return rows if isinstance(rows, slice) else rows.to(device)


def _member_runs(members: list[Member], side: str, limit: int | None) -> list[list[Member]]:
    """Consecutive runs of members of at most `limit` rows on `side` ('q' or 'kv') each
    (at least one member), filled from the last back; limit None: one run."""
    rows = [Piece(n, m.call.kv_rows if side == "kv" else m.call.q_rows)
            for n, m in enumerate(members)]
    return [[members[p.chunk] for p in run] for run in _runs(rows, limit)]
