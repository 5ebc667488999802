"""Where packed documents sit on the CP ranks: the value (docs/placement.md).

Transformer Engine's THD layout (`documents.py`) cuts every document into 2P pieces over
every rank, so packed documents cost the bytes of one long sequence. Loss, MLP and norms are
per token, so any permutation of the packed tokens over the ranks is valid if attention knows
where each token is. `DocumentPlacement` says it: per rank, its local rows as runs
(document, first position, tokens) of contiguous positions inside one document.

A placement is made by `masks.document_placer.place_documents` (balanced, from the lengths
alone), `zigzag_placement` (one document, Megatron's zigzag) or `DocumentPlacement.from_runs`
(any placement, checked).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from .documents import cumulative_lengths
from .zigzag import zigzag_chunks

Run = tuple[int, int, int]  # (document index, first position within the document, tokens)


def run_work(first: int, tokens: int) -> int:
    """Causal pairs of a run's queries within their document: position p sees p + 1 keys."""
    return tokens * first + tokens * (tokens + 1) // 2


def run_pairs(q_first: int, q_len: int, k_first: int, k_len: int, causal: bool) -> int:
    """(query, key) pairs of one document between a query run at positions q_first ..
    q_first + q_len - 1 and a key run at k_first .. (causal: a key at or before the query)."""
    if not causal:
        return q_len * k_len

    def below(t: int) -> int:  # pairs of the queries at positions < t
        a = min(max(t - k_first, 0), k_len)
        return a * (a + 1) // 2 + max(t - k_first - k_len, 0) * k_len

    return below(q_first + q_len) - below(q_first)


def document_work(length: int) -> int:
    """Causal pairs of a whole document of `length` tokens."""
    return length * (length + 1) // 2


@dataclass(frozen=True)
class DocumentPlacement:
    """Which tokens of which documents each CP rank holds (python ints, the same on every rank).

    `runs[r]` are rank r's local rows in local order, as runs of contiguous positions inside one
    document (`place_documents` sorts them by (document, position); a zigzag member's two pieces
    stay two runs even where they touch). Placements are equal iff their runs are.
    `groups[d]` are the sorted CP ranks holding document d.
    """

    cp_size: int
    lengths: tuple[int, ...]
    runs: tuple[tuple[Run, ...], ...]
    groups: tuple[tuple[int, ...], ...] | None = field(default=None, compare=False, repr=False)
    # hashed once: every block, mask and cache lookup of a micro-batch hashes the placement
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.groups is None:  # built from runs directly (unvalidated: use from_runs)
            object.__setattr__(self, "groups", _groups(self.runs, len(self.lengths)))
        object.__setattr__(self, "_hash", hash((self.cp_size, self.lengths, self.runs)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def from_runs(cls, cp_size: int, lengths, runs) -> DocumentPlacement:
        """A validated placement: every token of every document held exactly once, every rank
        holding the same number of tokens; ValueError naming the problem."""
        cp_size = positive_int("cp_size", cp_size)
        lengths = tuple(positive_int(f"lengths[{i}]", n) for i, n in enumerate(lengths))
        if len(runs) != cp_size:
            raise ValueError(f"runs has {len(runs)} ranks' runs, cp_size={cp_size}; "
                             "give one tuple of runs per CP rank")
        canonical = tuple(_checked_runs(rank, rank_runs, lengths)
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

    def heads_order(self, cp_size: int, heads: int) -> None:
        """After the heads all-to-all a rank holds its A group members' rows one after
        another, which is the order the mesh takes a placement's rows in
        (`placed.mesh_placement`): None, nothing to reorder (`Documents.heads_order`)."""
        return None

    def agreement_key(self) -> int:
        """A number every rank of a group shares when they pass the same placement."""
        return self._hash & 0x7FFF_FFFF_FFFF_FFFF  # ints only: the same in every process

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
    rank r holds sub-chunks r and 2P-1-r, two runs (also where they touch, on rank P-1).
    With one rank there is no split: the document is one run, as `place_documents` gives."""
    cp_size = positive_int("cp_size", cp_size)
    total = positive_int("total", total)
    check_total(total, cp_size)
    if cp_size == 1:
        return DocumentPlacement.from_runs(1, (total,), (((0, 0, total),),))
    h = total // (2 * cp_size)
    runs = [tuple((0, c * h, h) for c in zigzag_chunks(cp_size, r)) for r in range(cp_size)]
    return DocumentPlacement.from_runs(cp_size, (total,), runs)


def _checked_runs(rank: int, runs, lengths: tuple[int, ...]) -> tuple[Run, ...]:
    """Rank's runs checked (inside a document, at least one token), in the order given."""
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
    return tuple(checked)


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
    """Per document the sorted ranks holding it (no list per document: thousands of small
    lists cost more in garbage-collector passes than the loop itself)."""
    singles = tuple((rank,) for rank in range(len(runs)))
    owner = [0] * count
    seen = [False] * count
    shared: dict[int, list[int]] = {}
    for rank, rank_runs in enumerate(runs):
        for doc, _, _ in rank_runs:
            if not seen[doc]:
                seen[doc], owner[doc] = True, rank
            elif owner[doc] != rank:
                ranks = shared.setdefault(doc, [owner[doc]])
                if ranks[-1] != rank:
                    ranks.append(rank)
    groups = [singles[rank] for rank in owner]
    for doc, ranks in shared.items():
        groups[doc] = tuple(sorted(ranks))
    return tuple(groups)


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


def positive_int(name: str, value) -> int:
    """`value` as an int >= 1; ValueError naming `name` otherwise."""
    value = _int(name, value)
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    return value


def check_total(total: int, cp_size: int) -> None:
    """ValueError unless a packed sequence of `total` tokens splits over `cp_size` ranks."""
    if total % (2 * cp_size):
        raise ValueError(f"the packed sequence holds {total} tokens, not a multiple of "
                         f"2 x cp_size = {2 * cp_size}; pad it to a multiple of {2 * cp_size}")


def lengths_from_cu_seqlens(cu_seqlens) -> tuple[int, ...]:
    """Document lengths from cumulative lengths (`documents.cumulative_lengths` checks
    them); ValueError naming the bad value."""
    if not isinstance(cu_seqlens, (torch.Tensor, list, tuple)):
        raise ValueError(f"cu_seqlens must be an int32 tensor or a list / tuple of ints, "
                         f"got {type(cu_seqlens).__name__}")
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type == "meta":
        raise ValueError("cu_seqlens is on the meta device (shapes without values); the "
                         "placement reads the lengths: give a CPU or accelerator tensor or a list")
    values = cumulative_lengths("cu_seqlens", cu_seqlens, strict=True)
    return tuple(map(operator.sub, values[1:], values[:-1]))
