"""Calls over documents on hand together, joined document by document into few calls.

A block over packed documents is one variable-length call (`slice_blocks.py`): document n
of the call is its query rows against its key rows, and the block says which local rows
those are (`Block.doc_runs`). Blocks on hand together share a side: the query chunk of a
row against the column's K/V chunks, or the row's query chunks against one K/V chunk. Their
calls join into one variable-length call per group, as the dense blocks do (`groups.py`):

    the same query chunk    each document's query rows against its keys of every call,
                            concatenated (the calls in chunk order); a causal call (the
                            diagonal block) last, its documents then causal aligned at the
                            bottom right, where the kernel takes that (`bottom_right`) and
                            every document of the group has keys in it; else apart
    the same K/V chunk      each document's key rows against its queries of every full call,
                            concatenated

A call joins a group where each of its documents either is one of the group's (the same
rows on the shared side) or meets none of its rows: so the lower blocks (all of a chunk's
rows) and the upper ones (its second pieces) make two groups, as in the dense case. The
joined call gathers each call's rows as one piece (`Piece`), each placed document by
document (`Call.q_place` / `kv_place`, an index on the device), so a group of any number of
documents is one copy of its rows, not one per document. At most `limit` rows are concatenated on
the joined side per call (the last calls first, as `groups.py` cuts them).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .block import Block, SideRuns
from .part_arrays import spans
from .tile_slices import TileSlices


@dataclass(frozen=True)
class Member:
    """One call of a group: its chunks on both sides (`side` first: the joined side's chunk
    is `other`), its block call."""

    shared: int  # the chunk of the side the group shares
    other: int  # the chunk of the joined side
    call: Block


class _Docs:
    """A group's documents on its shared side, numbered in the order they joined: their
    runs (`SideRuns` in that order), least rows `low` and last rows + 1 `high`, and
    `by_low`: their numbers in order of `low` (no two documents of a group start at one
    row: a call meeting a document's first row is refused or is that document)."""

    def __init__(self, runs: SideRuns) -> None:
        self.runs = runs
        low = runs.low
        if len(low) < 2 or (low[1:] > low[:-1]).all():  # in order already (a call's are)
            self.by_low = np.arange(len(low))
            self.low_sorted, self.high_sorted = low, runs.high
        else:
            self.by_low = np.argsort(low, kind="stable")
            self.low_sorted = low[self.by_low]
            self.high_sorted = runs.high[self.by_low]

    def __len__(self) -> int:
        return len(self.runs)

    def match(self, other: SideRuns) -> np.ndarray:
        """int64 [documents of other]: the number of the group's document with the same
        runs as each of `other`'s, -1 where none."""
        if len(self) == 0:
            return np.full(len(other), -1, dtype=np.int64)
        j = np.minimum(np.searchsorted(self.low_sorted, other.low), len(self) - 1)
        found = self.by_low[j]
        mine = self.runs
        same = self.low_sorted[j] == other.low
        if mine.one_run and other.one_run:
            same &= (mine.start[found] == other.start) & (mine.end[found] == other.end)
        else:
            count = np.diff(other.at)
            same &= (np.diff(mine.at)[found] == count) & (mine.high[found] == other.high)
            check = np.flatnonzero(same)
            if len(check):
                mine_at = spans(mine.at[found[check]], count[check])
                other_at = spans(other.at[check], count[check])
                equal = (mine.start[mine_at] == other.start[other_at]) & (
                    mine.end[mine_at] == other.end[other_at])
                firsts = np.cumsum(count[check]) - count[check]
                same[check] = np.logical_and.reduceat(equal, firsts)
        return np.where(same, found, -1)

    def meets(self, other: SideRuns, ids: np.ndarray) -> bool:
        """Whether some document of `other` not in the group (ids -1) meets the group's
        document of the greatest least row before its last row (the group's rule)."""
        new = ids < 0
        if len(self) == 0 or not new.any():
            return False
        low, high = other.low[new], other.high[new]
        n = np.searchsorted(self.low_sorted, high - 1, side="right") - 1
        return bool(((n >= 0) & (self.high_sorted[np.maximum(n, 0)] > low)).any())

    def joined(self, other: SideRuns, ids: np.ndarray) -> tuple[_Docs, np.ndarray]:
        """The group's documents with `other`'s new ones (ids -1) after them, and the
        numbers of `other`'s documents there."""
        new = np.flatnonzero(ids < 0)
        if len(new) == 0:
            return self, ids
        ids = ids.copy()
        ids[new] = len(self) + np.arange(len(new))
        if len(self) == 0 and len(new) == len(other):
            return _Docs(other), ids
        count = np.diff(other.at)[new]
        pieces = spans(other.at[new], count)
        mine = self.runs
        at = np.concatenate([mine.at, mine.at[-1] + np.cumsum(count)])
        runs = SideRuns(np.concatenate([mine.start, other.start[pieces]]),
                        np.concatenate([mine.end, other.end[pieces]]), at)
        return _Docs(runs), ids


class _Group:
    """Calls sharing one chunk on the shared side whose documents there agree: the
    documents (`_Docs`) and, per member, the numbers of its documents among them."""

    def __init__(self, shared: int, side: str) -> None:
        self.shared, self.side = shared, side
        self.members: list[Member] = []
        self.ids: list[np.ndarray] = []
        self.docs = _NO_DOCS
        self._last: tuple[SideRuns, np.ndarray] | None = None
        # runs matched against the documents as they are, by their bytes (`SideRuns.key`):
        # a call with the same runs as one of them has its match (no document-by-document
        # search); forgotten when documents join
        self._known: dict[tuple[bytes, ...], np.ndarray] = {}
        self._verdicts: dict[int, bool] = {}  # `takes` of the known matches, by their ids

    def _match(self, runs: SideRuns) -> np.ndarray:
        if self._last is None or self._last[0] is not runs:
            found = self._known.get(runs.key)
            if found is None:
                found = self._known[runs.key] = self.docs.match(runs)
            self._last = runs, found
        return self._last[1]

    def takes(self, runs: SideRuns) -> bool:
        """Whether a call whose documents have these shared runs fits the group: each of
        its documents is one of the group's or meets none of the group's rows."""
        ids = self._match(runs)
        verdict = self._verdicts.get(id(ids))
        if verdict is None:
            verdict = self._verdicts[id(ids)] = not self.docs.meets(runs, ids)
        return verdict

    def add(self, member: Member, runs: SideRuns) -> None:
        if len(self.docs) == 0:  # the first member: its documents are the group's
            docs, ids = _Docs(runs), np.arange(len(runs))
        else:
            docs, ids = self.docs.joined(runs, self._match(runs))
        if docs is not self.docs:  # new documents: a match made before may differ now
            self.docs, self._known, self._verdicts = docs, {runs.key: ids}, {}
        self._last = None
        self.members.append(member)
        self.ids.append(ids)


_NO_DOCS = _Docs(SideRuns(*(np.zeros(0, dtype=np.int64),) * 2, np.zeros(1, dtype=np.int64)))


def groups_of(members: list[Member], side: str) -> list[_Group]:
    """`members` (calls over documents) in groups that share their chunk on `side` and
    agree there, first fit in the order given."""
    out: list[_Group] = []
    for m in members:
        runs = m.call.doc_runs.side(side)
        for g in out:
            if g.shared == m.shared and g.takes(runs):
                g.add(m, runs)
                break
        else:
            g = _Group(m.shared, side)
            g.add(m, runs)
            out.append(g)
    return out


def covers(group: _Group, diagonal: Member) -> bool:
    """Whether the causal diagonal's documents hold every document of `group` (the same
    query rows) and meet none of its other rows: then each document ends with its keys."""
    runs = diagonal.call.doc_runs.q
    own = _Docs(runs).match(group.docs.runs)
    return bool((own >= 0).all()) and group.takes(runs)


def with_member(group: _Group, member: Member) -> _Group:
    """`group` with `member` added last (its documents matched, new ones numbered after)."""
    out = _Group(group.shared, group.side)
    out.members, out.ids, out.docs = list(group.members), list(group.ids), group.docs
    out._known = dict(group._known)
    out.add(member, member.call.doc_runs.side(group.side))
    return out


@dataclass(frozen=True)
class Joined:
    """One call joining a group's members on the side not shared: the rows of each member's
    call on that side (one piece each, concatenated in member order), the shared side's rows,
    where each row of the concatenation sits in the call, and its slices."""

    shared_rows: slice | torch.Tensor
    pieces: tuple[tuple[int, slice | torch.Tensor], ...]  # (chunk, rows) per member
    place: torch.Tensor
    slices: TileSlices
    causal: bool


def join(group: _Group, members: list[int], causal_last: bool, device: torch.device
         ) -> Joined:
    """Members `members` (indices, in order) of `group` as one call, documents concatenated
    on the side other than the shared one; `causal_last`: the last member is the causal
    diagonal, its documents' keys last and every document causal at the bottom right. The
    documents in order of their first rows (of those first, the one met first)."""
    side = group.side
    joined_side = "kv" if side == "q" else "q"
    ids = np.concatenate([group.ids[n] for n in members])
    used, seen_at = np.unique(ids, return_index=True)
    docs = group.docs.runs
    order = used[np.lexsort((seen_at, docs.first[used]))]  # the documents in call order
    rank = np.empty(len(docs), dtype=np.int64)
    rank[order] = np.arange(len(order))
    # per (member, document): the document, the member, its rows on the joined side (in
    # the member's order: its rows start where the member's earlier documents end)
    doc_of = rank[ids]
    size = np.concatenate([group.members[n].call.doc_runs.side(joined_side).counts
                           for n in members])
    member_of = np.repeat(np.arange(len(members)), [len(group.ids[n]) for n in members])
    start = np.cumsum(size) - size  # where each pair's rows sit in the concatenation
    by_doc = np.lexsort((member_of, doc_of))  # by document, then member
    cu_joined = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(np.bincount(doc_of, size, len(order)).astype(np.int64), out=cu_joined[1:])
    cu_shared = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(docs.counts[order], out=cu_shared[1:])
    cu_q, cu_kv = (cu_shared, cu_joined) if side == "q" else (cu_joined, cu_shared)
    slices = TileSlices.documents(cu_q, cu_kv, causal_last, device)
    if len(order) == len(docs) and (order[1:] > order[:-1]).all():  # every one, in order
        shared_rows = rows_of(docs.start, docs.end)
    else:
        pieces = spans(docs.at[order], np.diff(docs.at)[order])
        shared_rows = rows_of(docs.start[pieces], docs.end[pieces])
    chunks = tuple((group.members[n].other, group.members[n].call.kv_rows if side == "q"
                    else group.members[n].call.q_rows) for n in members)
    rows = spans(start[by_doc], size[by_doc])  # the concatenation's row at each place
    place = np.empty_like(rows)
    place[rows] = np.arange(len(rows))
    return Joined(shared_rows, chunks, torch.from_numpy(place).to(device), slices, causal_last)


def rows_of(start: np.ndarray, end: np.ndarray) -> slice | torch.Tensor:
    """Runs [start, end) of local rows in order: a slice where they follow one another,
    else an int64 index (on the CPU; the caller moves it)."""
    if (start[1:] == end[:-1]).all():
        return slice(int(start[0]), int(end[-1]))
    return torch.from_numpy(spans(start, end - start))
