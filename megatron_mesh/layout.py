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
from .kernels.base import Segments


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
    causal or not, and the packed documents (None: one dense sequence per batch entry).
    `ranks` is the number of zigzag shares the local tensors are (P, or P / A after the
    heads all-to-all)."""

    causal: bool
    documents: Documents | None = None
    ranks: int = 1


@dataclass(frozen=True)
class Block:
    """One kernel call: the query rows and key rows of the local shares it uses (slices,
    or int64 index tensors for packed documents), and the tile's documents."""

    kind: BlockKind
    q_rows: slice | torch.Tensor
    kv_rows: slice | torch.Tensor
    segments: Segments | None = None

    @property
    def causal(self) -> bool:
        return self.kind is BlockKind.DIAGONAL

    @property
    def empty(self) -> bool:
        """No query row of the block sees any key (packed documents only)."""
        return isinstance(self.q_rows, torch.Tensor) and self.q_rows.numel() == 0


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
