"""Megatron's zigzag sequence layout and the three kinds of causal rank-blocks.

The sequence is cut into 2P equal sub-chunks; CP rank r holds sub-chunks r and 2P-1-r,
concatenated (token order kept). Block (x, y) is rank x's queries against rank y's keys.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .checks import check_zigzag_divisible


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
class Block:
    """One kernel call: the query rows and key rows of the local shares it uses."""

    kind: BlockKind
    q_rows: slice
    kv_rows: slice

    @property
    def causal(self) -> bool:
        return self.kind is BlockKind.DIAGONAL


def block_for(q_rank: int, kv_rank: int, local_len: int, causal: bool) -> Block:
    """The single kernel call computing block (q_rank, kv_rank) on shares of `local_len` rows."""
    whole, half = slice(0, local_len), local_len // 2
    if not causal:
        return Block(BlockKind.FULL, whole, whole)
    if q_rank == kv_rank:
        return Block(BlockKind.DIAGONAL, whole, whole)
    if q_rank > kv_rank:
        return Block(BlockKind.LOWER, whole, slice(0, half))
    return Block(BlockKind.UPPER, slice(half, local_len), whole)
