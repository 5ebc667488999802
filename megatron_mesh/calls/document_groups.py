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

import bisect
from dataclasses import dataclass, field
from operator import itemgetter

import numpy as np
import torch

from .block import Block, Runs
from .tile_slices import TileSlices


@dataclass(frozen=True)
class Member:
    """One call of a group: its chunks on both sides (`side` first: the joined side's chunk
    is `other`), its block call."""

    shared: int  # the chunk of the side the group shares
    other: int  # the chunk of the joined side
    call: Block


def _side_runs(call: Block, side: str) -> tuple[Runs, ...]:
    """Each document's runs of local rows on `side` ('q' or 'kv')."""
    return tuple(map(itemgetter(0 if side == "q" else 1), call.doc_runs))


def _count(runs: Runs) -> int:
    return sum(b - a for a, b in runs)


def _span(runs: Runs) -> tuple[int, int]:
    """The first row and the last row + 1 of a document's runs (in any order)."""
    if len(runs) == 1:
        return runs[0]
    return min(runs)[0], max(map(itemgetter(1), runs))


@dataclass
class _Group:
    """Calls sharing one chunk on the shared side whose documents there agree: the
    documents by their shared runs (in order of rows), and the row ranges they hold."""

    shared: int
    members: list[Member]
    docs: dict[Runs, int]  # shared runs -> document index in the group
    starts: list[int]  # sorted first rows of the documents' runs
    ends: list[int]  # the last row + 1 of the document starting at starts[n]
    # the shared runs of members' calls as a whole: a call with the same has every
    # document in the group (found by one hash, not document by document)
    calls: set[tuple[Runs, ...]] = field(default_factory=set)

    def takes(self, runs: tuple[Runs, ...]) -> bool:
        """Whether a call whose documents have these shared runs fits the group."""
        if runs in self.calls:
            return True
        docs = self.docs
        for doc in [doc for doc in runs if doc not in docs]:
            first, last = _span(doc)
            n = bisect.bisect_right(self.starts, last - 1) - 1
            if n >= 0 and self.ends[n] > first:
                return False
        return True

    def add(self, member: Member, runs: tuple[Runs, ...]) -> None:
        self.members.append(member)
        if runs in self.calls:
            return
        self.calls.add(runs)
        docs = self.docs
        if not docs:  # the group's first call: its documents at once
            new = list(dict.fromkeys(runs))
            docs.update(zip(new, range(len(new))))
            spans = sorted(((*_span(doc), -n) for n, doc in enumerate(new)),
                           key=lambda s: (s[0], s[2]))  # equal starts: the last first
            self.starts, self.ends = [s[0] for s in spans], [s[1] for s in spans]
            return
        for doc in [doc for doc in runs if doc not in docs]:
            if doc not in docs:  # twice in one call: once
                docs[doc] = len(docs)
                first, last = _span(doc)
                n = bisect.bisect_left(self.starts, first)
                self.starts.insert(n, first)
                self.ends.insert(n, last)


def groups_of(members: list[Member], side: str) -> list[_Group]:
    """`members` (calls over documents) in groups that share their chunk on `side` and
    agree there, first fit in the order given."""
    out: list[_Group] = []
    for m in members:
        runs = _side_runs(m.call, side)
        for g in out:
            if g.shared == m.shared and g.takes(runs):
                g.add(m, runs)
                break
        else:
            g = _Group(m.shared, [], {}, [], [])
            g.add(m, runs)
            out.append(g)
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


def join(group: _Group, side: str, causal_last: bool, device: torch.device) -> Joined:
    """The members of `group` as one call, documents concatenated on the side other than
    `side` (the shared one); `causal_last`: the last member is the causal diagonal, its
    documents' keys last and every document causal at the bottom right."""
    shared = 0 if side == "q" else 1
    joined = 1 - shared
    docs = sorted(group.docs, key=lambda runs: runs[0][0])
    index = {doc: n for n, doc in enumerate(docs)}
    # per (member, document): the document, the member, its rows on the joined side (in
    # the member's order: its rows start where the member's earlier documents end)
    doc_of, member_of, size = [], [], []
    for n, m in enumerate(group.members):
        doc_of += map(index.__getitem__, map(itemgetter(shared), m.call.doc_runs))
        size += [_count(doc[joined]) for doc in m.call.doc_runs]
        member_of.append(np.full(len(m.call.doc_runs), n))
    doc_of, size = np.array(doc_of, dtype=np.int64), np.array(size, dtype=np.int64)
    start = np.cumsum(size) - size  # where each pair's rows sit in the concatenation
    order = np.lexsort((np.concatenate(member_of), doc_of))  # by document, then member
    cu_joined = np.concatenate([[0], np.cumsum(np.bincount(doc_of, size, len(docs)))])
    cu_shared = np.concatenate([[0], np.cumsum([_count(doc) for doc in docs])])
    cu_joined, cu_shared = tuple(cu_joined.astype(np.int64).tolist()), tuple(cu_shared.tolist())
    cu_q, cu_kv = (cu_shared, cu_joined) if side == "q" else (cu_joined, cu_shared)
    slices = TileSlices.documents(cu_q, cu_kv, causal_last, device)
    shared_rows = _rows([r for doc in docs for r in doc])
    pieces = tuple((m.other, m.call.kv_rows if joined == 1 else m.call.q_rows)
                   for m in group.members)
    rows = _aranges(start[order], size[order])  # the concatenation's row at each place
    place = np.empty_like(rows)
    place[rows] = np.arange(len(rows))
    return Joined(shared_rows, pieces, torch.from_numpy(place).to(device), slices, causal_last)


def _aranges(start: np.ndarray, size: np.ndarray) -> np.ndarray:
    """start[n] .. start[n] + size[n] - 1 for every n, concatenated (int64)."""
    return np.arange(int(size.sum()), dtype=np.int64) - np.repeat(np.cumsum(size) - size - start,
                                                                  size)


def _rows(runs: list[tuple[int, int]]) -> slice | torch.Tensor:
    """Runs of local rows in order: a slice where they follow one another, else an index
    (on the CPU; the caller moves it)."""
    table = np.array(runs, dtype=np.int64).reshape(-1, 2)
    if (table[1:, 0] == table[:-1, 1]).all():
        return slice(runs[0][0], runs[-1][1])
    return torch.from_numpy(_aranges(table[:, 0], table[:, 1] - table[:, 0]))
