"""Document-aware placement of packed documents over the CP ranks (issue 34, DESIGN.md §9).

Transformer Engine's THD layout (`documents.py`) cuts every document into 2P pieces over
every rank, so packed documents cost the bytes of one long sequence. Loss, MLP and norms are
per token, so any permutation of the packed tokens over the ranks is valid if attention knows
where each token is. `DocumentPlacement` says it: per rank, its local rows as runs
(document, first position, tokens) of contiguous positions inside one document.

`place_documents` keeps a document whole on one rank when it fits, and splits a document
too long or too heavy for one rank zigzag over a group of consecutive ranks (2g nearly equal
pieces, member k gets pieces k and 2g-1-k), the fewest ranks that balance allows. Every rank
holds exactly T / P tokens; the causal work (query, key pairs within documents) is balanced.

Algorithm (python ints only, deterministic, from the lengths alone):

1. Plan: each document's group size g: the fewest ranks whose share (L/g tokens, W/g work,
   W = L(L+1)/2) plus a light filler for the rest of the rank (C - L/g tokens at the density
   of a median document) fits the mean work per rank; g is rounded up to whole nodes when
   it exceeds one node (`gpus_per_node`), and is P for a document longer than P-1 ranks hold.
2. Groups: split documents, heaviest first, take the window of g consecutive ranks (inside
   one node when g fits one) whose busiest member is the least loaded and has room.
3. Whole documents, longest first, go to the rank that still needs the most work per free
   token (needed work / free tokens: dense documents where much work is missing).
4. A document that fits no rank's free room is cut over the ranks with the most room left,
   folded ("zigzag with unequal pieces": member k takes a front and a back piece, half its
   share each), so each member's work is its token share times the document's mean density.
   A plain cut would give the member holding the end of the document most of its work.
5. If the busiest rank exceeds the mean by more than `BALANCE_TOLERANCE`, the document with
   the most work on it gets the next group size and steps 2-4 rerun (a few times at most);
   the best placement seen is kept.
"""
from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass, field

import torch

from .zigzag import zigzag_chunks

Run = tuple[int, int, int]  # (document index, first position within the document, tokens)

BALANCE_TOLERANCE = 0.05  # rerun with a larger group when the busiest rank is above 1.05 x mean
MAX_REFINEMENTS = 12


def run_work(first: int, tokens: int) -> int:
    """Causal pairs of a run's queries within their document: position p sees p + 1 keys."""
    return tokens * first + tokens * (tokens + 1) // 2


def document_work(length: int) -> int:
    """Causal pairs of a whole document of `length` tokens."""
    return length * (length + 1) // 2


@dataclass(frozen=True)
class DocumentPlacement:
    """Which tokens of which documents each CP rank holds (python ints, the same on every rank).

    `runs[r]` are rank r's local rows in local order, as runs of contiguous positions inside one
    document, sorted by (document, position) and with touching runs merged (a canonical form,
    so equal placements compare equal). `groups[d]` are the sorted CP ranks holding document d.
    """

    cp_size: int
    lengths: tuple[int, ...]
    runs: tuple[tuple[Run, ...], ...]
    groups: tuple[tuple[int, ...], ...] = field(compare=False, repr=False)

    @classmethod
    def from_runs(cls, cp_size: int, lengths, runs) -> DocumentPlacement:
        """A validated placement: every token of every document held exactly once, every rank
        holding the same number of tokens; ValueError naming the problem."""
        cp_size = _positive_int("cp_size", cp_size)
        lengths = tuple(_positive_int(f"lengths[{i}]", n) for i, n in enumerate(lengths))
        if len(runs) != cp_size:
            raise ValueError(f"runs has {len(runs)} ranks' runs, cp_size={cp_size}; "
                             "give one tuple of runs per CP rank")
        canonical = tuple(_canonical_runs(rank, rank_runs, lengths)
                          for rank, rank_runs in enumerate(runs))
        _check_cover(canonical, lengths)
        _check_equal_tokens(canonical, lengths)
        return cls(cp_size, lengths, canonical, _groups(canonical, len(lengths)))

    @property
    def total(self) -> int:
        """T: tokens of the whole packed sequence."""
        return sum(self.lengths)

    @property
    def local_tokens(self) -> int:
        """T / P: tokens every rank holds."""
        return self.total // self.cp_size

    @property
    def cu_seqlens(self) -> tuple[int, ...]:
        """Cumulative document lengths [n + 1], starting at 0."""
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return tuple(out)

    def token_indices(self, rank: int) -> torch.Tensor:
        """int64 [T / P]: positions in the packed sequence of `rank`'s local rows, in local order."""
        cu = self.cu_seqlens
        runs = self.runs[self._rank(rank)]
        starts = torch.tensor([cu[doc] + first for doc, first, _ in runs], dtype=torch.int64)
        counts = torch.tensor([n for _, _, n in runs], dtype=torch.int64)
        local_starts = torch.cumsum(counts, 0) - counts
        shift = torch.repeat_interleave(starts - local_starts, counts)
        return torch.arange(self.local_tokens, dtype=torch.int64) + shift

    def permute(self, x: torch.Tensor, rank: int, dim: int = 0) -> torch.Tensor:
        """`rank`'s share of a whole packed tensor (T along `dim`)."""
        return x.index_select(dim, self.token_indices(rank).to(x.device))

    def merge(self, shares: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """The whole packed tensor from all ranks' shares (inverse of `permute`)."""
        if len(shares) != self.cp_size:
            raise ValueError(f"merge takes one share per CP rank ({self.cp_size}), got {len(shares)}")
        order = torch.cat([self.token_indices(r) for r in range(self.cp_size)])
        inverse = torch.argsort(order)
        return torch.cat(shares, dim).index_select(dim, inverse.to(shares[0].device))

    def work(self, rank: int) -> int:
        """Causal (query, key) pairs of `rank`'s queries within their documents."""
        return sum(run_work(first, n) for _, first, n in self.runs[self._rank(rank)])

    def works(self) -> tuple[int, ...]:
        """`work` of every rank."""
        return tuple(self.work(r) for r in range(self.cp_size))

    def spans(self, doc: int) -> tuple[int, ...]:
        """Sorted CP ranks holding document `doc`."""
        return self.groups[doc]

    def key(self) -> tuple:
        """Hashable; equal iff the placements are equal (for the ranks' agreement check)."""
        return (self.cp_size, self.lengths, self.runs)

    def agreement_key(self) -> int:
        """A number every rank of a group shares when they pass the same placement."""
        return hash(self.key()) & 0x7FFF_FFFF_FFFF_FFFF

    def local_runs_by_document(self, rank: int) -> list[list[tuple[int, int, int]]]:
        """Per document (all, in document order; [] where `rank` holds none): the
        (first local row, first position, tokens) of `rank`'s runs of it."""
        out: list[list[tuple[int, int, int]]] = [[] for _ in self.lengths]
        row = 0
        for doc, first, n in self.runs[self._rank(rank)]:
            out[doc].append((row, first, n))
            row += n
        return out

    def crossing_tokens(self) -> int:
        """Tokens of documents held by more than one rank (the rows attention exchanges)."""
        return sum(n for n, group in zip(self.lengths, self.groups) if len(group) > 1)

    def summary(self) -> str:
        """One line for logs: ranks per split document, busiest / mean work, crossing tokens."""
        works = self.works()
        mean = sum(works) / self.cp_size
        split = sorted((len(g) for g in self.groups if len(g) > 1), reverse=True)
        ratio = max(works) / mean if mean else 1.0
        crossing = self.crossing_tokens()
        return (f"placement of {len(self.lengths)} documents ({self.total} tokens) over "
                f"{self.cp_size} CP ranks: {len(split)} split, ranks per split document "
                f"{_histogram(split)}; work busiest/mean {ratio:.3f}; crossing tokens "
                f"{crossing} ({100 * crossing / self.total:.1f}%)")

    def _rank(self, rank: int) -> int:
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank={rank} must be in 0..{self.cp_size - 1} (cp_size={self.cp_size})")
        return rank


def zigzag_placement(total: int, cp_size: int) -> DocumentPlacement:
    """One document of `total` tokens in Megatron's zigzag layout: 2P sub-chunks of h = T / 2P,
    rank r holds sub-chunks r and 2P-1-r."""
    cp_size = _positive_int("cp_size", cp_size)
    total = _positive_int("total", total)
    _check_total(total, cp_size)
    h = total // (2 * cp_size)
    runs = [tuple((0, c * h, h) for c in zigzag_chunks(cp_size, r)) for r in range(cp_size)]
    return DocumentPlacement.from_runs(cp_size, (total,), runs)


def place_documents(cu_seqlens, cp_size: int, gpus_per_node: int | None = None
                    ) -> DocumentPlacement:
    """Document-aware placement of a packed sequence (module docstring: the algorithm).

    `cu_seqlens`: int32 tensor or list / tuple of ints, [n + 1] cumulative lengths from 0,
    strictly increasing, total a multiple of 2 x cp_size. `gpus_per_node`: consecutive CP ranks
    per node (None: no node constraint); a split group stays inside one node when it fits.

    Guarantees: exactly T / P tokens per rank; a document that fits the room left on a rank is
    one run on it; split groups are consecutive ranks; one document of the whole length gives
    exactly `zigzag_placement(T, P)`; deterministic from the lengths alone.

    Balance: the busiest rank's work is within 10% of the mean when there are "enough"
    documents, meaning no document's unavoidable share dominates: every document of L tokens
    has L(L+1)/2 <= P/2 x (mean work per rank) (or is longer than C = T / P, which splits it
    over enough ranks), and the documents of at most C / 4 tokens hold at least a quarter of
    the tokens (the filler that evens out the ranks). Tested on log-normal mixes (median 1024,
    128..8192, S = 64K, P = 8 and 16), one 32K document beside many short ones, all short,
    many equal and 1-token documents.
    """
    lengths = _lengths_from_cu_seqlens(cu_seqlens)
    cp_size = _positive_int("cp_size", cp_size)
    if gpus_per_node is not None:
        gpus_per_node = _positive_int("gpus_per_node", gpus_per_node)
    _check_total(sum(lengths), cp_size)
    return _Placer(lengths, cp_size, gpus_per_node).place()


class _Placer:
    """One placement problem: plan group sizes, place, refine (module docstring)."""

    def __init__(self, lengths: tuple[int, ...], cp_size: int, gpus_per_node: int | None):
        self.lengths = lengths
        self.cp_size = cp_size
        self.node = gpus_per_node if gpus_per_node and gpus_per_node < cp_size else cp_size
        self.capacity = sum(lengths) // cp_size
        self.mean_work = sum(document_work(n) for n in lengths) / cp_size
        ordered = sorted(lengths)
        self.filler_density = (ordered[len(ordered) // 2] + 1) / 2
        self.order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)

    def place(self) -> DocumentPlacement:
        sizes = {d: g for d in self.order if (g := self.planned_size(self.lengths[d])) > 1}
        best = None
        for _ in range(MAX_REFINEMENTS):
            runs, works = self.assign(sizes)
            busiest = max(works)
            if best is None or busiest < best[0]:
                best = (busiest, runs)
            if busiest <= (1 + BALANCE_TOLERANCE) * self.mean_work:
                break
            doc = self.heaviest_document(runs[works.index(busiest)], sizes)
            if doc is None:
                break
            sizes[doc] = self.next_size(sizes.get(doc, 1))
        runs = tuple(tuple(_merge_touching(sorted(r))) for r in best[1])
        return DocumentPlacement(self.cp_size, self.lengths, runs, _groups(runs, len(self.lengths)))

    def allowed_size(self, g: int) -> int:
        """g rounded up to whole nodes when it exceeds one node; at most P."""
        if g > self.node:
            g = -(-g // self.node) * self.node
        return min(g, self.cp_size)

    def next_size(self, g: int) -> int:
        return self.allowed_size(g + 1)

    def planned_size(self, length: int) -> int:
        """The fewest ranks whose share of the document, plus a light filler for the rest of
        each member's tokens, stays within the mean work per rank."""
        work = document_work(length)
        g = max(1, -(-length // self.capacity))
        while g < self.cp_size:
            share_tokens = length / g
            if share_tokens <= self.capacity and (
                    work / g + (self.capacity - share_tokens) * self.filler_density
                    <= self.mean_work):
                break
            g += 1
        return self.allowed_size(g)

    def heaviest_document(self, runs: list[Run], sizes: dict[int, int]) -> int | None:
        """The document with the most work on a rank that can still take a larger group."""
        work_of: dict[int, int] = {}
        for doc, first, n in runs:
            work_of[doc] = work_of.get(doc, 0) + run_work(first, n)
        candidates = [d for d in work_of if sizes.get(d, 1) < self.cp_size]
        return max(candidates, key=lambda d: (work_of[d], -d)) if candidates else None

    def assign(self, sizes: dict[int, int]) -> tuple[list[list[Run]], list[int]]:
        """Steps 2-4: groups, whole documents, folded cuts. Returns runs and work per rank."""
        runs: list[list[Run]] = [[] for _ in range(self.cp_size)]
        room = [self.capacity] * self.cp_size
        works = [0] * self.cp_size
        leftover = []
        for doc in sorted(sizes, key=lambda d: (-sizes[d], -self.lengths[d], d)):
            if not self.place_group(doc, sizes[doc], runs, room, works):
                leftover.append(doc)
        whole = [d for d in self.order if d not in sizes]
        leftover += self.place_whole(whole, runs, room, works)
        for doc in leftover:
            self.place_cut(doc, runs, room, works)
        return runs, works

    def place_group(self, doc: int, g: int, runs, room, works) -> bool:
        """Zigzag over the least loaded window of g consecutive ranks with room; False if none."""
        length = self.lengths[doc]
        pieces = _nearly_equal(length, 2 * g)
        shares = [pieces[k] + pieces[2 * g - 1 - k] for k in range(g)]
        best = None
        for start in self.window_starts(g):
            if all(room[start + k] >= shares[k] for k in range(g)):
                load = (max(works[start:start + g]), sum(works[start:start + g]), start)
                if best is None or load < best:
                    best = load
        if best is None:
            return False
        members = range(best[2], best[2] + g)
        pairs = [(pieces[k], pieces[2 * g - 1 - k]) for k in range(g)]
        self.fold(doc, members, pairs, runs, room, works)
        return True

    def window_starts(self, g: int) -> list[int]:
        """First ranks of windows of g consecutive ranks: inside one node when g fits one,
        else aligned to node starts."""
        if g <= self.node:
            return [s for s in range(self.cp_size - g + 1) if s // self.node == (s + g - 1) // self.node]
        return list(range(0, self.cp_size - g + 1, self.node))

    def place_whole(self, docs: list[int], runs, room, works) -> list[int]:
        """Longest first, each to the rank needing the most work per free token that has room
        for it. Returns the documents no rank has room for."""
        mean = self.mean_work
        heap = [(-(mean - works[r]) / room[r], r) for r in range(self.cp_size) if room[r] > 0]
        heapq.heapify(heap)
        leftover = []
        for doc in docs:
            length = self.lengths[doc]
            skipped = []
            while heap and room[heap[0][1]] < length:
                skipped.append(heapq.heappop(heap))
            if heap:
                _, rank = heapq.heappop(heap)
                runs[rank].append((doc, 0, length))
                room[rank] -= length
                works[rank] += document_work(length)
                if room[rank]:
                    heapq.heappush(heap, (-(mean - works[rank]) / room[rank], rank))
            else:
                leftover.append(doc)
            for item in skipped:
                heapq.heappush(heap, item)
        return leftover

    def place_cut(self, doc: int, runs, room, works) -> None:
        """Fold a document over the ranks with the most room left (fewest ranks), each taking
        what room it has (or what is left of the document)."""
        left = self.lengths[doc]
        members, shares = [], []
        for rank in sorted(range(self.cp_size), key=lambda r: (-room[r], r)):
            if left == 0:
                break
            take = min(room[rank], left)
            if take:
                members.append(rank)
                shares.append(take)
                left -= take
        if left:
            raise AssertionError("placement: tokens left with every rank full")  # cannot happen
        order = sorted(range(len(members)), key=members.__getitem__)
        members = [members[i] for i in order]
        pairs = [(shares[i] - shares[i] // 2, shares[i] // 2) for i in order]
        self.fold(doc, members, pairs, runs, room, works)

    def fold(self, doc: int, members, pairs, runs, room, works) -> None:
        """Member k takes a front piece (positions laid from 0 up) and a back piece (laid
        from the end down): with equal pieces, Megatron's zigzag over the members."""
        length = self.lengths[doc]
        front, back = 0, length
        for rank, (head, tail) in zip(members, pairs):
            for first, n in ((front, head), (back - tail, tail)):
                if n:
                    runs[rank].append((doc, first, n))
                    works[rank] += run_work(first, n)
            room[rank] -= head + tail
            front += head
            back -= tail


def _nearly_equal(total: int, parts: int) -> list[int]:
    """`total` cut into `parts` contiguous sizes differing by at most one (larger first)."""
    base, extra = divmod(total, parts)
    return [base + (1 if j < extra else 0) for j in range(parts)]


def _merge_touching(runs: list[Run]) -> list[Run]:
    """Consecutive runs of one document whose positions continue become one run."""
    out: list[Run] = []
    for doc, first, n in runs:
        if out and out[-1][0] == doc and out[-1][1] + out[-1][2] == first:
            out[-1] = (doc, out[-1][1], out[-1][2] + n)
        else:
            out.append((doc, first, n))
    return out


def _canonical_runs(rank: int, runs, lengths: tuple[int, ...]) -> tuple[Run, ...]:
    """Rank's runs checked (inside a document, at least one token), sorted, touching merged."""
    checked = []
    for run in runs:
        if len(run) != 3:
            raise ValueError(f"rank {rank}: run {run!r} must be (document, first position, tokens)")
        doc, first, n = (_int(f"rank {rank} run {run!r}", v) for v in run)
        if not 0 <= doc < len(lengths):
            raise ValueError(f"rank {rank}: run {run!r} names document {doc}; "
                             f"documents are 0..{len(lengths) - 1}")
        if first < 0 or n < 1 or first + n > lengths[doc]:
            raise ValueError(f"rank {rank}: run {run!r} must hold >= 1 token inside document "
                             f"{doc} of {lengths[doc]} tokens (positions 0..{lengths[doc] - 1})")
        checked.append((doc, first, n))
    return tuple(_merge_touching(sorted(checked)))


def _check_cover(runs: tuple[tuple[Run, ...], ...], lengths: tuple[int, ...]) -> None:
    """ValueError unless every token of every document is held exactly once."""
    pieces = sorted((doc, first, n, rank) for rank, rank_runs in enumerate(runs)
                    for doc, first, n in rank_runs)
    expected = [0] * len(lengths)
    for doc, first, n, rank in pieces:
        if first != expected[doc]:
            what = "held twice" if first < expected[doc] else "held by no rank"
            position = min(first, expected[doc])
            raise ValueError(f"document {doc}: position {position} is {what} "
                             f"(rank {rank}'s run starts at {first})")
        expected[doc] = first + n
    for doc, (end, n) in enumerate(zip(expected, lengths)):
        if end != n:
            raise ValueError(f"document {doc}: positions {end}..{n - 1} of its {n} are held by no rank")


def _check_equal_tokens(runs: tuple[tuple[Run, ...], ...], lengths: tuple[int, ...]) -> None:
    counts = [sum(n for _, _, n in rank_runs) for rank_runs in runs]
    if len(set(counts)) > 1:
        raise ValueError(f"ranks hold {counts} tokens; every rank must hold the same "
                         f"(total {sum(lengths)} / {len(runs)} ranks)")


def _groups(runs: tuple[tuple[Run, ...], ...], count: int) -> tuple[tuple[int, ...], ...]:
    members: list[list[int]] = [[] for _ in range(count)]
    for rank, rank_runs in enumerate(runs):
        for doc, _, _ in rank_runs:
            if not members[doc] or members[doc][-1] != rank:
                members[doc].append(rank)
    return tuple(tuple(m) for m in members)


def _histogram(sizes: list[int]) -> str:
    counts: dict[int, int] = {}
    for g in sizes:
        counts[g] = counts.get(g, 0) + 1
    return "{" + ", ".join(f"{g}: {c}" for g, c in counts.items()) + "}" if counts else "none"


def _int(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name}: {value!r} is not an integer")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name}: {value!r} ({type(value).__name__}) is not an integer") from None


def _positive_int(name: str, value) -> int:
    value = _int(name, value)
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    return value


def _check_total(total: int, cp_size: int) -> None:
    if total % (2 * cp_size):
        raise ValueError(f"the packed sequence holds {total} tokens, not a multiple of "
                         f"2 x cp_size = {2 * cp_size}; pad it to a multiple of {2 * cp_size}")


def _lengths_from_cu_seqlens(cu_seqlens) -> tuple[int, ...]:
    """Document lengths from cumulative lengths; ValueError naming the bad value."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype != torch.int32:
            raise ValueError(f"cu_seqlens must be an int32 tensor, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D [n + 1], got shape {tuple(cu_seqlens.shape)}")
        values = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, (list, tuple)):
        values = [_int(f"cu_seqlens[{i}]", v) for i, v in enumerate(cu_seqlens)]
    else:
        raise ValueError(f"cu_seqlens must be an int32 tensor or a list / tuple of ints, "
                         f"got {type(cu_seqlens).__name__}")
    if len(values) < 2 or values[0] != 0:
        raise ValueError(f"cu_seqlens={_short(values)} must start at 0 and hold n + 1 >= 2 "
                         "cumulative lengths")
    lengths = tuple(b - a for a, b in zip(values, values[1:]))
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"cu_seqlens must be strictly increasing: cu_seqlens[{i + 1}]="
                             f"{values[i + 1]} <= cu_seqlens[{i}]={values[i]} (document {i} "
                             "would hold no token)")
    return lengths


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:8]))}, ...]"
