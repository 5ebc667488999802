"""One kernel call's worth of a rank-block: the `Block` value every mask kind produces
(`slice_blocks.py`) and every schedule consumes.

A leaf beside the masks: it knows rows and the call's slices, not which mask made them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .tile_slices import TileSlices

Runs = tuple[tuple[int, int], ...]  # [start, end) runs of local rows


@dataclass(frozen=True)
class Block:
    """One kernel call: the query rows and key rows of the local shares it uses (slices, or
    int64 index tensors where it gathers runs), and its mask: `causal` (the plain causal
    mask of a square call), the call's `slices` (`TileSlices`: documents, a band, or any
    slices; they hold the causal rule themselves), or neither (all pairs).

    A call over documents (`slices` of form documents) says which local rows each of its
    documents holds (`doc_runs`: per document, its query row runs and key row runs, in the
    order of the call's rows), so the tile can join calls document by document
    (`groups.py`). A block of several calls is the union of the rows its `tiles` use, and
    the tiles are its kernel calls (each a `Block`)."""

    q_rows: slice | torch.Tensor
    kv_rows: slice | torch.Tensor
    causal: bool = False
    slices: TileSlices | None = None
    tiles: tuple[Block, ...] | None = None
    doc_runs: tuple[tuple[Runs, Runs], ...] | None = None

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
