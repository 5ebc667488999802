"""Packed documents (THD) in Transformer Engine's context-parallel layout.

A packed sequence holds n documents back to back; `cu_seqlens` [n + 1] are their cumulative
lengths. Each document is padded to a multiple of 2P (P = CP size) and cut into 2P equal
pieces; CP rank r holds pieces r and 2P-1-r of EVERY document, in document order:

    local tokens of rank r = [doc 0: piece r, piece 2P-1-r | doc 1: piece r, piece 2P-1-r | ...]

So every rank holds a share of every document, and Megatron's zigzag block rule holds inside
each document (`layout.block_for`): the rank-blocks carry the same work and bytes as the dense
layout. Attention never crosses a document. In the padded form the actual lengths are shorter
than the padded ones: padding tokens attend to nothing, are attended by nothing, get output 0
and zero gradients.

`Documents` is the value the attention call takes (python ints, the same on every rank); its
mask is slices over the padded packed sequence's positions (`slices`: one per document),
from which every rank-block is cut like any mask's (`slice_blocks.py`).
"""
from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass, field

import torch

from .slices import CAUSAL, FULL, SliceMask
from .zigzag import zigzag_chunks


@dataclass(frozen=True)
class Documents:
    """The documents of one packed sequence: padded cumulative lengths (each document's
    padded length a multiple of 2P) and each document's actual length (<= padded)."""

    cu_padded: tuple[int, ...]
    lengths: tuple[int, ...]
    # hashed once: every block, mask and cache lookup of a micro-batch hashes the documents
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.cu_padded, self.lengths)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor | list[int],
                        cu_seqlens_padded: torch.Tensor | list[int] | None = None
                        ) -> Documents:
        """Validate Megatron's cumulative lengths (int32 tensors [n + 1], or lists) ->
        Documents; ValueError naming the bad value. Without `cu_seqlens_padded` the
        documents are unpadded (their lengths must then be multiples of 2P)."""
        actual = cumulative_lengths("cu_seqlens", cu_seqlens, strict=False)
        padded = actual if cu_seqlens_padded is None else cumulative_lengths(
            "cu_seqlens_padded", cu_seqlens_padded, strict=True)
        if cu_seqlens_padded is None and any(b <= a for a, b in zip(actual, actual[1:])):
            raise ValueError(f"cu_seqlens={list(actual)} must be strictly increasing "
                             "(every document holds at least one token)")
        if len(actual) != len(padded):
            raise ValueError(f"cu_seqlens has {len(actual) - 1} documents but "
                             f"cu_seqlens_padded has {len(padded) - 1}; they must match")
        lengths = tuple(b - a for a, b in zip(actual, actual[1:]))
        for i, (n, a, b) in enumerate(zip(lengths, padded, padded[1:])):
            if n > b - a:
                raise ValueError(f"document {i} has {n} tokens (cu_seqlens) but a padded "
                                 f"length of {b - a} (cu_seqlens_padded); it must not exceed it")
        return cls(padded, lengths)

    @property
    def count(self) -> int:
        return len(self.lengths)

    @property
    def total(self) -> int:
        """Padded tokens of the whole packed sequence."""
        return self.cu_padded[-1]

    @property
    def padded_lengths(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.cu_padded, self.cu_padded[1:]))

    def check_cp(self, cp_size: int, local_tokens: int) -> None:
        """ValueError unless every padded length is a multiple of 2P and the whole sequence
        is P times this rank's `local_tokens`."""
        for i, n in enumerate(self.padded_lengths):
            if cp_size > 1 and n % (2 * cp_size):
                raise ValueError(
                    f"document {i} has padded length {n}, not a multiple of 2 * CP = "
                    f"{2 * cp_size} (each document is cut into 2P equal pieces); pad it "
                    "(cu_seqlens_padded) to a multiple of 2P")
        if self.total != cp_size * local_tokens:
            raise ValueError(
                f"cu_seqlens cover {self.total} tokens, but {cp_size} ranks of {local_tokens} "
                f"local tokens hold {cp_size * local_tokens}; the packed sequence's padded "
                "total must be CP size x local tokens")

    def pieces(self, cp_size: int) -> list[tuple[int, int]]:
        """(local offset, piece length) of each document on every rank of `cp_size`: rows
        [offset, offset + piece) hold its first piece, the next `piece` rows its second.
        One rank holds each document whole, as one piece (its lengths need not be even)."""
        out, offset = [], 0
        for n in self.padded_lengths:
            piece = n // (2 * cp_size) if cp_size > 1 else n
            out.append((offset, piece))
            offset += n // cp_size
        return out

    def heads_order(self, cp_size: int, heads: int) -> tuple[int, ...]:
        """After the heads all-to-all a rank holds its A group members' local tokens one
        after another ([A, t]); this is the order (indices into the A t rows) that lays them
        out as the THD layout of P / A super-ranks: in each document, super-piece m (pieces
        mA .. mA+A-1: the members' first pieces in order), then super-piece 2P/A-1-m (their
        second pieces in reverse order)."""
        local = self.total // cp_size
        order = []
        for offset, piece in self.pieces(cp_size):
            for a in range(heads):
                order += range(a * local + offset, a * local + offset + piece)
            for a in reversed(range(heads)):
                order += range(a * local + offset + piece, a * local + offset + 2 * piece)
        return tuple(order)

    def slices(self, causal: bool) -> SliceMask:
        """The mask as slices over the padded packed sequence (`total` positions): each
        document's real tokens see each other (causally where `causal`), padding nothing."""
        kind = CAUSAL if causal else FULL
        return SliceMask([(start, start + n, start, start + n, kind)
                          for start, n in zip(self.cu_padded, self.lengths) if n],
                         self.total)

    def agreement_key(self) -> int:
        """A number every rank of a group must share when they pass the same documents."""
        return self._hash & 0x7FFF_FFFF_FFFF_FFFF  # ints only: the same in every process


def cumulative_lengths(name: str, values: torch.Tensor | list[int] | tuple[int, ...], strict: bool
                ) -> tuple[int, ...]:
    """Cumulative lengths as python ints, checked: int32 if a tensor, 1-D, starting at 0,
    non-decreasing (strictly increasing when `strict`)."""
    if isinstance(values, torch.Tensor):
        if values.dtype != torch.int32:
            raise ValueError(f"{name} must be an int32 tensor, got {values.dtype}")
        if values.dim() != 1:
            raise ValueError(f"{name} must be 1-D [n + 1], got shape {tuple(values.shape)}")
        values = values.tolist()
    if not all(type(v) is int for v in values):  # plain ints (a tensor's) skip the ABC check
        for v in values:
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ValueError(f"{name}={list(values)} holds {v!r}: cumulative lengths must "
                                 "be integers (an int32 tensor or a list of ints)")
    values = tuple(map(int, values))
    if len(values) < 2 or values[0] != 0:
        raise ValueError(f"{name}={list(values)} must start at 0 and hold n + 1 >= 2 "
                         "cumulative lengths")
    rising = operator.lt if strict else operator.le
    if not all(map(rising, values, values[1:])):
        raise ValueError(f"{name}={list(values)} must be "
                         f"{'strictly increasing' if strict else 'non-decreasing'}")
    return values


def thd_split(full: torch.Tensor, documents: Documents, cp_size: int) -> list[torch.Tensor]:
    """Split a whole packed sequence [T, ...] (T = padded total) into the cp_size ranks'
    THD shares: pieces r and 2P-1-r of every document, in document order."""
    if cp_size == 1:
        return [full]
    shares = []
    for rank in range(cp_size):
        parts = []
        for start, n in zip(documents.cu_padded, documents.padded_lengths):
            piece = n // (2 * cp_size)
            for index in zigzag_chunks(cp_size, rank):
                parts.append(full[start + index * piece: start + (index + 1) * piece])
        shares.append(torch.cat(parts))
    return shares


def thd_merge(shares: list[torch.Tensor], documents: Documents) -> torch.Tensor:
    """Inverse of `thd_split`: the whole packed sequence from the ranks' shares."""
    cp_size = len(shares)
    if cp_size == 1:
        return shares[0]
    whole = shares[0].new_empty(documents.total, *shares[0].shape[1:])
    for rank, share in enumerate(shares):
        for (offset, piece), start in zip(documents.pieces(cp_size), documents.cu_padded):
            for half, index in enumerate(zigzag_chunks(cp_size, rank)):
                whole[start + index * piece: start + (index + 1) * piece] = \
                    share[offset + half * piece: offset + (half + 1) * piece]
    return whole


def thd_partition_indices(documents: Documents, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The indices into the whole packed sequence of `cp_rank`'s share (int64 [T / P]),
    the layout Transformer Engine's `thd_get_partitioned_indices` gives."""
    index = torch.arange(documents.total)
    return thd_split(index, documents, cp_size)[cp_rank]
