"""One kernel call's worth of a rank-block: the `Block` value every mask kind produces and
every schedule consumes, with the zigzag block rule and the closed-form band tile.

A leaf beside the masks (`layout`, `placed`): it knows rows, kinds and tile masks, not
which mask made them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..common.tile_mask import Segments, TileMask


class BlockKind(enum.Enum):
    """What part of block (x, y) survives the causal mask under the zigzag layout."""

    FULL = "full"  # non-causal: all of Q(x) x all of K/V(y)
    DIAGONAL = "diagonal"  # x == y: local Q x local K/V, causal mask
    LOWER = "lower"  # x > y: all of Q(x) x first half of K/V(y), no mask
    UPPER = "upper"  # x < y: second half of Q(x) x all of K/V(y), no mask


@dataclass(frozen=True)
class Block:
    """One kernel call: the query rows and key rows of the local shares it uses (slices,
    or int64 index tensors for packed documents), and the tile's documents.

    Under a sliding window a block is the union of the rows its `tiles` use, and the tiles
    are its kernel calls (each a `Block` of contiguous rows with its window as a `TileMask`)."""

    kind: BlockKind
    q_rows: slice | torch.Tensor
    kv_rows: slice | torch.Tensor
    segments: Segments | None = None
    mask: TileMask | None = None  # sliding windows: the tile's mask
    tiles: tuple[Block, ...] | None = None  # sliding windows: the kernel calls

    @property
    def causal(self) -> bool:
        return self.kind is BlockKind.DIAGONAL and self.mask is None

    @property
    def empty(self) -> bool:
        """No query row of the block sees any key (packed documents, sliding windows)."""
        if isinstance(self.q_rows, slice):
            return self.q_rows.stop <= self.q_rows.start
        return self.q_rows.numel() == 0

    @property
    def calls(self) -> tuple[Block, ...]:
        """The kernel calls computing the block: its tiles, or the block itself."""
        if self.empty:
            return ()
        return (self,) if self.tiles is None else self.tiles


def block_kind(q_rank: int, kv_rank: int, causal: bool) -> BlockKind:
    """The zigzag rule: which part of block (q_rank, kv_rank) survives the mask."""
    if not causal:
        return BlockKind.FULL
    if q_rank == kv_rank:
        return BlockKind.DIAGONAL
    return BlockKind.LOWER if q_rank > kv_rank else BlockKind.UPPER


def as_rows(selected: torch.Tensor, device: torch.device) -> slice | torch.Tensor:
    """The True rows of a bool vector: a slice when they are contiguous, else an index."""
    index = selected.nonzero().flatten()
    if index.numel() == 0:
        return slice(0, 0)
    first, last = int(index[0]), int(index[-1])
    if last - first + 1 == index.numel():
        return slice(first, last + 1)
    return index.to(device)


def band_tile(q_pos: int, i_start: int, i_stop: int, kv_pos: int, kv_len: int,
               lo: int | None, hi: int | None):
    """Query rows [i_start, i_stop) of a run at position q_pos against a run of kv_len keys
    at kv_pos, where query i sees key j when lo <= (kv_pos + j) - (q_pos + i) <= hi (None:
    unbounded): ((i0, i1), (j0, j1), kind, TileMask or None) of the rows that see or are
    seen, or None when none does."""
    off = kv_pos - q_pos
    i0 = i_start if hi is None else max(i_start, off - hi)
    i1 = i_stop if lo is None else min(i_stop, kv_len + off - lo)
    if i1 <= i0:
        return None
    j0 = 0 if lo is None else max(0, i0 - off + lo)
    j1 = kv_len if hi is None else min(kv_len, i1 - off + hi)
    if j1 <= j0:
        return None
    sq, sk, shift = i1 - i0, j1 - j0, off + j0 - i0  # key pos - query pos at (0, 0)
    full = ((lo is None or shift - (sq - 1) >= lo) and (hi is None or shift + sk - 1 <= hi))
    if full:
        return (i0, i1), (j0, j1), BlockKind.FULL, None
    if sq == sk and shift == 0 and hi == 0 and (lo is None or lo <= -(sq - 1)):
        return (i0, i1), (j0, j1), BlockKind.DIAGONAL, None
    left = -1 if lo is None else sk - sq + shift - lo
    right = -1 if hi is None else hi - (sk - sq) - shift
    return (i0, i1), (j0, j1), BlockKind.FULL, TileMask.band(sq, sk, left, right)
