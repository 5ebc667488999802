"""Megatron's zigzag sequence layout and the three kinds of causal rank-blocks.

The sequence is cut into 2P equal sub-chunks; CP rank r holds sub-chunks r and 2P-1-r,
concatenated (token order kept). Block (x, y) is rank x's queries against rank y's keys.
Packed documents (`documents.py`) take the same layout inside every document, so the same
rule picks each document's rows of a block.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

from .checks import check_zigzag_divisible
from .documents import Documents
from .kernels.base import Segments, TileMask
from .window import Window, token_positions


def zigzag_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two sub-chunk indices (of 2 * cp_size) held by `cp_rank`."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def zigzag_split(full: torch.Tensor, cp_size: int, dim: int = 0) -> list[torch.Tensor]:
    """Split a whole sequence (along `dim`) into the cp_size per-rank zigzag shares."""
    check_zigzag_divisible(full.shape[dim], cp_size, ranks="cp_size",
                           single_rank=True)
    sub = full.chunk(2 * cp_size, dim=dim)
    pairs = (zigzag_chunks(cp_size, rank) for rank in range(cp_size))
    return [torch.cat([sub[a], sub[b]], dim=dim) for a, b in pairs]


def zigzag_merge(chunks: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Inverse of `zigzag_split`: rebuild the whole sequence from the per-rank shares."""
    cp_size = len(chunks)
    sub: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, share in enumerate(chunks):
        first, second = share.chunk(2, dim=dim)
        a, b = zigzag_chunks(cp_size, rank)
        sub[a], sub[b] = first, second
    return torch.cat(sub, dim=dim)  # type: ignore[arg-type]


class BlockKind(enum.Enum):
    """What part of block (x, y) survives the causal mask under the zigzag layout."""

    FULL = "full"  # non-causal: all of Q(x) x all of K/V(y)
    DIAGONAL = "diagonal"  # x == y: local Q x local K/V, causal mask
    LOWER = "lower"  # x > y: all of Q(x) x first half of K/V(y), no mask
    UPPER = "upper"  # x < y: second half of Q(x) x all of K/V(y), no mask


@dataclass(frozen=True)
class AttentionMask:
    """What a layer's queries see, decided once per call and passed to every block:
    causal or not, the packed documents (None: one dense sequence per batch entry) and the
    sliding window (None: none).
    `ranks` is the number of zigzag shares the local tensors are (P, or P / A after the
    heads all-to-all)."""

    causal: bool
    documents: Documents | None = None
    ranks: int = 1
    window: Window | None = None  # sliding window on global positions (`window.py`)


@dataclass(frozen=True)
class Block:
    """One kernel call: the query rows and key rows of the local shares it uses (slices,
    or int64 index tensors for packed documents), and the tile's documents."""

    kind: BlockKind
    q_rows: slice | torch.Tensor
    kv_rows: slice | torch.Tensor
    segments: Segments | None = None
    mask: TileMask | None = None  # sliding windows: the tile's explicit mask

    @property
    def causal(self) -> bool:
        return self.kind is BlockKind.DIAGONAL and self.mask is None

    @property
    def empty(self) -> bool:
        """No query row of the block sees any key (packed documents, sliding windows)."""
        if isinstance(self.q_rows, slice):
            return self.q_rows.stop <= self.q_rows.start
        return self.q_rows.numel() == 0


def block_kind(q_rank: int, kv_rank: int, causal: bool) -> BlockKind:
    """The zigzag rule: which part of block (q_rank, kv_rank) survives the mask."""
    if not causal:
        return BlockKind.FULL
    if q_rank == kv_rank:
        return BlockKind.DIAGONAL
    return BlockKind.LOWER if q_rank > kv_rank else BlockKind.UPPER


def block_for(q_rank: int, kv_rank: int, local_len: int, mask: AttentionMask | bool,
              device: torch.device | str = "cpu") -> Block:
    """The single kernel call computing block (q_rank, kv_rank) on shares of `local_len`
    rows (`mask` True / False: a dense causal / full sequence)."""
    if isinstance(mask, bool):
        mask = AttentionMask(mask)
    kind = block_kind(q_rank, kv_rank, mask.causal)
    if mask.window is not None:
        return _window_block(mask, q_rank, kv_rank, local_len, torch.device(device))
    if mask.documents is not None:
        return _documents_block(mask.documents, mask.ranks, q_rank, kv_rank, kind,
                                torch.device(device))
    whole, half = slice(0, local_len), local_len // 2
    if kind is BlockKind.LOWER:
        return Block(kind, whole, slice(0, half))
    if kind is BlockKind.UPPER:
        return Block(kind, slice(half, local_len), whole)
    return Block(kind, whole, whole)


@functools.lru_cache(maxsize=128)  # a micro-batch's blocks: at most R x C per rank and layer
def _documents_block(documents: Documents, ranks: int, q_rank: int, kv_rank: int,
                     kind: BlockKind, device: torch.device) -> Block:
    """A block over packed documents, its index tensors made once per block and device."""
    q_rows, kv_rows, cu_q, cu_kv = documents.rows_of_block(
        ranks, q_rank, kv_rank, kind is not BlockKind.FULL)
    index = lambda rows: torch.tensor(rows, dtype=torch.int64, device=device)  # noqa: E731
    segments = Segments.build(cu_q, cu_kv, device) if len(cu_q) > 1 else None
    return Block(kind, index(q_rows), index(kv_rows), segments)


def block_pairs(mask: AttentionMask, q_rank: int, kv_rank: int, local_len: int) -> torch.Tensor:
    """[local_len, local_len] bool: local query row i of q_rank sees local key row j of
    kv_rank under `mask` (causal, documents and window on global positions)."""
    pos_q, doc_q = token_positions(mask.ranks, q_rank, local_len, mask.documents)
    pos_k, doc_k = token_positions(mask.ranks, kv_rank, local_len, mask.documents)
    seen = (doc_q[:, None] == doc_k[None, :]) & (doc_q[:, None] >= 0)
    if mask.causal:
        seen &= pos_k[None, :] <= pos_q[:, None]
    if mask.window is not None:
        seen &= mask.window.sees(pos_q, pos_k)
    return seen


def _as_rows(selected: torch.Tensor, device: torch.device) -> slice | torch.Tensor:
    """The True rows of a bool vector: a slice when they are contiguous, else an index."""
    index = selected.nonzero().flatten()
    if index.numel() == 0:
        return slice(0, 0)
    first, last = int(index[0]), int(index[-1])
    if last - first + 1 == index.numel():
        return slice(first, last + 1)
    return index.to(device)


@functools.lru_cache(maxsize=4096)
def _window_block(mask: AttentionMask, q_rank: int, kv_rank: int, local_len: int,
                  device: torch.device) -> Block:
    """A block under a sliding window: the query rows that see some key and the key rows
    some query sees, with the tile's mask (none where the tile is full or plainly causal)."""
    kind = block_kind(q_rank, kv_rank, mask.causal)
    seen = block_pairs(mask, q_rank, kv_rank, local_len)
    q_any, kv_any = seen.any(1), seen.any(0)
    q_rows, kv_rows = _as_rows(q_any, device), _as_rows(kv_any, device)
    if not bool(q_any.any()):
        return Block(kind, q_rows, kv_rows)
    tile = seen[q_any][:, kv_any]
    if bool(tile.all()):
        return Block(BlockKind.FULL, q_rows, kv_rows)
    if tile.shape[0] == tile.shape[1] and torch.equal(tile, torch.ones_like(tile).tril()):
        return Block(BlockKind.DIAGONAL, q_rows, kv_rows)
    flash = None
    if mask.documents is None:
        pos_q, _ = token_positions(mask.ranks, q_rank, local_len)
        pos_k, _ = token_positions(mask.ranks, kv_rank, local_len)
        flash = _flash_window(pos_q[q_any], pos_k[kv_any], tile, mask.window)
    return Block(kind, q_rows, kv_rows, mask=TileMask.build(tile, device, flash))


def _flash_window(pos_q: torch.Tensor, pos_k: torch.Tensor, tile: torch.Tensor,
                  window: Window) -> tuple[int, int] | None:
    """flash-attention's (window_size_left, window_size_right), bottom-right aligned,
    that gives exactly `tile` for these contiguous query / key positions, or None."""
    sq, sk = tile.shape
    if not (torch.equal(pos_q, pos_q[0] + torch.arange(sq))
            and torch.equal(pos_k, pos_k[0] + torch.arange(sk))):
        return None
    shift = int(pos_q[0] - pos_k[0]) - (sk - sq)  # key j - query i of the same position
    left = -1 if window.left < 0 else window.left - shift
    right = -1 if window.right < 0 else window.right + shift
    if (window.left >= 0 and left < 0) or (window.right >= 0 and right < 0):
        return None
    flash = Window(left, right).sees(torch.arange(sq) + (sk - sq), torch.arange(sk))
    return (left, right) if torch.equal(flash, tile) else None
