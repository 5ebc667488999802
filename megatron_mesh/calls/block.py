"""One kernel call's worth of a rank-block: the `Block` value every mask kind produces
(`slice_blocks.py`) and every schedule consumes.

A leaf beside the masks: it knows rows and the call's slices, not which mask made them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .tile_slices import TileSlices

Runs = tuple[tuple[int, int], ...]  # [start, end) runs of local rows


@dataclass(frozen=True, eq=False)
class SideRuns:
    """One side's runs of local rows of a call's documents: document n's runs are
    [start[i], end[i]) for i in at[n] .. at[n+1] - 1, in the order of the call's rows;
    int64 arrays, start / end [runs], at [documents + 1]."""

    start: np.ndarray
    end: np.ndarray
    at: np.ndarray

    @classmethod
    def of(cls, docs: list[list[tuple[int, int]]]) -> SideRuns:
        """From each document's list of (start, end) runs."""
        table = np.array([r for doc in docs for r in doc], dtype=np.int64).reshape(-1, 2)
        at = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum([len(doc) for doc in docs], out=at[1:])
        return cls(table[:, 0].copy(), table[:, 1].copy(), at)

    def __len__(self) -> int:
        return len(self.at) - 1

    @functools.cached_property
    def first(self) -> np.ndarray:
        """int64 [documents]: each document's first row (the start of its first run)."""
        return self.start[self.at[:-1]]

    @functools.cached_property
    def one_run(self) -> bool:
        """Every document is one run."""
        return len(self.start) == len(self.at) - 1

    @functools.cached_property
    def low(self) -> np.ndarray:
        """int64 [documents]: each document's least row."""
        return self.start if self.one_run else np.minimum.reduceat(self.start, self.at[:-1])

    @functools.cached_property
    def high(self) -> np.ndarray:
        """int64 [documents]: each document's last row + 1."""
        return self.end if self.one_run else np.maximum.reduceat(self.end, self.at[:-1])

    @functools.cached_property
    def counts(self) -> np.ndarray:
        """int64 [documents]: each document's rows."""
        size = self.end - self.start
        return size if self.one_run else np.add.reduceat(size, self.at[:-1])

    def tuples(self) -> tuple[Runs, ...]:
        """Each document's runs as a tuple of (start, end)."""
        pairs = list(zip(self.start.tolist(), self.end.tolist()))
        at = self.at.tolist()
        return tuple(tuple(pairs[a:b]) for a, b in zip(at, at[1:]))

    @functools.cached_property
    def key(self) -> tuple[bytes, bytes, bytes]:
        """The runs' bytes (int64 start, end, at): equal runs, equal keys (a dict key)."""
        return tuple(np.ascontiguousarray(a, dtype=np.int64).tobytes()
                     for a in (self.start, self.end, self.at))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SideRuns) and (self is other or self.key == other.key)

    __hash__ = object.__hash__


@dataclass(frozen=True, eq=False)
class DocRuns:
    """Which local rows each document of a call over documents holds: its query runs `q`
    and key runs `kv` (`SideRuns`), documents in the order of the call."""

    q: SideRuns
    kv: SideRuns

    def __len__(self) -> int:
        return len(self.q.at) - 1

    def side(self, side: str) -> SideRuns:
        """The runs of 'q' or 'kv'."""
        return self.q if side == "q" else self.kv

    def tuples(self) -> tuple[tuple[Runs, Runs], ...]:
        """Per document, (its query runs, its key runs) as tuples."""
        return tuple(zip(self.q.tuples(), self.kv.tuples()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DocRuns) and self.q == other.q and self.kv == other.kv

    __hash__ = object.__hash__


@dataclass(frozen=True)
class Block:
    """One kernel call: the query rows and key rows of the local shares it uses (slices, or
    int64 index tensors where it gathers runs), and its mask: `causal` (the plain causal
    mask of a square call), the call's `slices` (`TileSlices`: documents, a band, or any
    slices; they hold the causal rule themselves), or neither (all pairs).

    A call over documents (`slices` of form documents) says which local rows each of its
    documents holds (`doc_runs`: per document, its query row runs and key row runs, in the
    order of the call's rows, as arrays), so the tile can join calls document by document
    (`document_groups.py`). A block of several calls is the union of the rows its `tiles` use, and
    the tiles are its kernel calls (each a `Block`)."""

    q_rows: slice | torch.Tensor
    kv_rows: slice | torch.Tensor
    causal: bool = False
    slices: TileSlices | None = None
    tiles: tuple[Block, ...] | None = None
    doc_runs: DocRuns | None = None

    @property
    def empty(self) -> bool:
        """No query row of the block sees any key."""
        if isinstance(self.q_rows, slice):
            return self.q_rows.stop <= self.q_rows.start
        return self.q_rows.numel() == 0

    @property
    def calls(self) -> tuple[Block, ...]:
        """The kernel calls computing the block: its tiles, or the block itself."""
        if self.empty:
            return ()
        return (self,) if self.tiles is None else self.tiles

    def seen(self) -> torch.Tensor:
        """bool [sq, sk] on the CPU: the pairs one call keeps (made on each call; checks)."""
        count = lambda rows: (rows.stop - rows.start if isinstance(rows, slice)  # noqa: E731
                              else rows.numel())
        if self.slices is not None:
            return self.slices.seen()
        sq, sk = count(self.q_rows), count(self.kv_rows)
        return TileSlices.band(sq, sk, -1, 0 if self.causal else -1).seen()
