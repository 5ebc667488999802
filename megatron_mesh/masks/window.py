"""Sliding windows: `window_size=(left, right)` as Transformer Engine and flash-attention
define it. Query i sees key j when i - left <= j <= i + right, -1 meaning unbounded on that
side; with a causal mask right is 0 (given as 0 or -1). Positions are global: the token's
index in the whole sequence (dense zigzag layout) or within its document (packed documents).

`Window` is the checked value (decided once per call); `windowed` lays it on a mask given
as slices (a band on every slice: `Slice.banded`); `token_positions` gives the global
positions of a rank's local rows, from which `layout.block_for` cuts each block's rows and
tile mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .documents import Documents
from .seen import band, keeps
from .slices import SliceMask
from .zigzag import held_pieces, zigzag_chunks


@dataclass(frozen=True)
class Window:
    """A sliding window that limits something: left, right >= 0, or -1 for unbounded."""

    left: int
    right: int

    def sees(self, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
        """[sq, sk] bool: key position kv_pos[j] inside query position q_pos[i]'s window."""
        return keeps(band(self.left, self.right), q_pos[:, None], kv_pos[None, :])

    @property
    def bounds(self) -> tuple[int | None, int | None]:
        """(lo, hi): the window keeps key j of query i iff lo <= j - i <= hi (None: unbounded)."""
        return (-self.left if self.left >= 0 else None,
                self.right if self.right >= 0 else None)


def windowed(mask: SliceMask, window: Window | None) -> SliceMask:
    """`mask` with the window laid on every slice (positions are the slices'); `mask`
    itself when there is no window."""
    if window is None:
        return mask
    return SliceMask([part.as_tuple for s in mask.slices for part in s.banded(*window.bounds)],
                     mask.seq_len)


def window_of(window_size: tuple[int, int] | list[int] | None, causal: bool) -> Window | None:
    """The checked `Window` of `window_size` (None when it limits nothing). ValueError
    naming the bad value: not a pair of ints, below -1, or right > 0 with causal."""
    if window_size is None:
        return None
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise ValueError(f"window_size={window_size!r} must be None or a pair (left, right) "
                         "of ints, -1 meaning unbounded")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"window_size={tuple(window_size)}: left and right must be >= -1 "
                         "(-1: unbounded)")
    if causal:
        if right > 0:
            raise ValueError(f"window_size={tuple(window_size)} with causal=True: right "
                             "must be 0 or -1 (a causal query sees no later key)")
        right = 0
    if left == -1 and (right == -1 or causal):
        return None  # the plain (causal) mask
    return Window(left, right)


def token_positions(ranks: int, rank: int, local_len: int,
                    documents: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(position, document) int64 [local_len] of `rank`'s local rows in the zigzag layout of
    `ranks` shares: the global position (within its document when packed) and the document
    index (0 when dense; -1 on padding tokens, which see and are seen by nothing)."""
    if documents is None:
        half = local_len // 2
        rows = torch.arange(local_len)
        second = zigzag_chunks(ranks, rank)[1] * half + rows - half
        pos = torch.where(rows < half, rank * half + rows, second)
        return pos, torch.zeros(local_len, dtype=torch.int64)
    padded = np.diff(np.array(documents.cu_padded, dtype=np.int64))
    piece = padded // (2 * ranks) if ranks > 1 else padded
    share = padded // ranks
    offset = np.cumsum(share) - share
    held = held_pieces(ranks, rank)
    count = len(held) * piece  # rows of each document on the rank
    doc = np.repeat(np.arange(len(padded)), count)
    row = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    half = row // np.maximum(piece, 1)[doc]  # which held piece
    index = np.array(held, dtype=np.int64)[np.minimum(half, len(held) - 1)]
    at = index * piece[doc] + row - half * piece[doc]
    pos = np.zeros(local_len, dtype=np.int64)
    which = np.full(local_len, -1, dtype=np.int64)
    rows = offset[doc] + row
    pos[rows] = at
    which[rows] = np.where(at < np.array(documents.lengths, dtype=np.int64)[doc], doc, -1)
    return torch.from_numpy(pos), torch.from_numpy(which)
