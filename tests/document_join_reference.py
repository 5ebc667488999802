"""The per-document planner of joined document calls (`calls.groups.document_calls`): the
calls' documents as tuples of runs, matched one by one in dictionaries, for the tests to
compare the array planner with."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_mesh.calls.groups import Call, Piece, _member_runs, _on, _own
from megatron_mesh.calls.tile_slices import TileSlices


@dataclass(frozen=True)
class Member:
    shared: int
    other: int
    call: object

    def runs(self, side: str) -> tuple:
        """Each document's runs on `side` as tuples."""
        return self.call.doc_runs.side(side).tuples()


def _span(runs) -> tuple[int, int]:
    return min(a for a, _ in runs), max(b for _, b in runs)


@dataclass
class Group:
    shared: int
    members: list = field(default_factory=list)
    docs: dict = field(default_factory=dict)  # runs -> order joined
    starts: list = field(default_factory=list)
    ends: list = field(default_factory=list)

    def takes(self, runs) -> bool:
        for doc in runs:
            if doc in self.docs:
                continue
            first, last = _span(doc)
            n = bisect.bisect_right(self.starts, last - 1) - 1
            if n >= 0 and self.ends[n] > first:
                return False
        return True

    def add(self, member, runs) -> None:
        self.members.append(member)
        for doc in runs:
            if doc not in self.docs:
                self.docs[doc] = len(self.docs)
                first, last = _span(doc)
                n = bisect.bisect_left(self.starts, first)
                self.starts.insert(n, first)
                self.ends.insert(n, last)


def groups_of(members, side: str) -> list[Group]:
    out: list[Group] = []
    for m in members:
        runs = m.runs(side)
        for g in out:
            if g.shared == m.shared and g.takes(runs):
                g.add(m, runs)
                break
        else:
            g = Group(m.shared)
            g.add(m, runs)
            out.append(g)
    return out


def join(group: Group, side: str, causal_last: bool, device: torch.device):
    """(shared rows, pieces, place, slices): the members as one call, document by document."""
    shared = 0 if side == "q" else 1
    joined = 1 - shared
    other_side = "kv" if side == "q" else "q"
    count = lambda runs: sum(b - a for a, b in runs)  # noqa: E731
    docs = sorted(group.docs, key=lambda runs: runs[0][0])
    where, offset = [], 0
    for m in group.members:
        inside = {}
        for doc, rows in zip(m.runs(side), m.runs(other_side)):
            inside[doc] = (offset, offset + count(rows))
            offset += count(rows)
        where.append(inside)
    order, cu_joined, cu_shared = [], [0], [0]
    for doc in docs:
        for inside in where:
            if doc in inside:
                order.append(torch.arange(*inside[doc]))
        cu_joined.append(cu_joined[-1] + sum(inside[doc][1] - inside[doc][0]
                                             for inside in where if doc in inside))
        cu_shared.append(cu_shared[-1] + count(doc))
    cu_q, cu_kv = (cu_shared, cu_joined) if side == "q" else (cu_joined, cu_shared)
    runs = [r for doc in docs for r in doc]
    shared_rows = (slice(runs[0][0], runs[-1][1])
                   if all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
                   else torch.cat([torch.arange(a, b) for a, b in runs]))
    pieces = tuple((m.other, m.call.kv_rows if joined == 1 else m.call.q_rows)
                   for m in group.members)
    order_of_call = torch.cat(order)
    place = torch.empty_like(order_of_call)
    place[order_of_call] = torch.arange(order_of_call.numel())
    slices = TileSlices.documents(np.array(cu_q), np.array(cu_kv), causal_last, device)
    return _on(shared_rows, device), pieces, place.to(device), slices


def document_calls(calls, bottom_right: bool, limit: int | None) -> list[Call]:
    """`groups.document_calls`, document by document."""
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
    for group in groups_of(full, "q"):
        members = sorted(group.members, key=lambda m: m.other)
        diagonal = diagonals.get(group.shared, [])
        fold = False
        if bottom_right and len(diagonal) == 1:
            own = set(diagonal[0].runs("q"))
            fold = all(doc in own for doc in group.docs) and group.takes(tuple(own))
        if fold:
            members.append(diagonal.pop())
        runs = _member_runs(members, "kv", limit)
        for n, run in enumerate(runs):
            last = fold and n == len(runs) - 1
            if len(run) == 1 and not last:
                alone.append(run[0])
                continue
            (sub,) = groups_of(run, "q")
            rows, pieces, place, slices = join(sub, "q", last, device)
            out.append(Call((Piece(group.shared, rows),),
                            tuple(Piece(c, r) for c, r in pieces), last, slices,
                            kv_place=place))
    for rest in diagonals.values():
        out += [_own(m.shared, m.other, m.call) for m in rest]
    swapped = [Member(m.other, m.shared, m.call) for m in alone]
    for group in groups_of(swapped, "kv"):
        members = sorted(group.members, key=lambda m: m.other)
        for run in _member_runs(members, "q", limit):
            if len(run) == 1:
                m = run[0]
                out.append(_own(m.other, m.shared, m.call))
                continue
            (sub,) = groups_of(run, "kv")
            rows, pieces, place, slices = join(sub, "kv", False, device)
            out.append(Call(tuple(Piece(c, r) for c, r in pieces), (Piece(group.shared, rows),),
                            False, slices, q_place=place))
    return out
