"""Megatron's zigzag sequence layout, a layer's mask as one value, and its rank-blocks.

The sequence is cut into 2P equal sub-chunks; CP rank r holds sub-chunks r and 2P-1-r,
concatenated (token order kept). Packed documents (`documents.py`) take the same layout
inside every document; placed documents (`document_placement.py`) their own runs. Every
mask kind is slices over the whole sequence's positions (`mask_slices`), and block (x, y),
rank x's queries against rank y's keys, is those slices cut to the two ranks' runs of
positions (`block_for`, `slice_blocks.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..common.caches import per_documents
from ..masks.document_placement import DocumentPlacement
from ..masks.documents import Documents
from ..masks.mask import Mask
from ..masks.placed_documents import positions
from ..masks.slices import CAUSAL, FULL, SliceMask
from ..masks.window import Window, token_positions
from ..masks.zigzag import check_zigzag_divisible, zigzag_chunks
from .block import Block
from .document_blocks import document_block, document_blocks
from .part_arrays import (
    PartArrays,
    RunArrays,
    SliceArrays,
    document_arrays,
    slice_arrays,
    tile_parts,
)
from .slice_blocks import (
    MIN_SLAB_ROWS,
    Run,
    bounds_calls,
    document_run_arrays,
    documents_run_arrays,
    position_run_arrays,
    position_runs,
)


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


@dataclass(frozen=True)
class AttentionMask:
    """What a layer's queries see, decided once per call and passed to every block: the
    call's `mask.Mask` (the pairs causal, the packed documents, THD or placed, the sliding
    window and a user's slices all keep; None: that part limits nothing) on local tensors
    that are `ranks` zigzag shares (P, or P / A after the heads all-to-all)."""

    causal: bool
    documents: Documents | None = None
    ranks: int = 1
    window: Window | None = None  # sliding window on global positions (`window.py`)
    placement: DocumentPlacement | None = None  # documents placed over the `ranks` shares
    slices: SliceMask | None = None  # a user's slices (`slices.py`), over the same positions
    def __hash__(self) -> int:
        """Hashed once (every block and call cache lookup of a micro-batch hashes it)."""
        value = self.__dict__.get("_hash")
        if value is None:
            value = hash((self.causal, self.documents, self.ranks, self.window, self.placement,
                          self.slices))
            object.__setattr__(self, "_hash", value)
        return value

    @property
    def packing(self) -> Documents | DocumentPlacement | SliceMask | tuple | None:
        """The packed documents, THD or placed, and the user's slices (None: one dense
        sequence): what block data depends on beyond shapes (`caches.per_documents` keys
        on it)."""
        documents = self.documents if self.documents is not None else self.placement
        if documents is None or self.slices is None:
            return self.slices if documents is None else documents
        return documents, self.slices

    @property
    def value(self) -> Mask:
        """The call's `Mask` (without `ranks`)."""
        return Mask(self.causal, self.documents, self.placement, self.window, self.slices)

    @property
    def packed(self) -> bool:
        """Whether the shares are packed documents (THD layout or placed)."""
        return self.documents is not None or self.placement is not None


def block_for(q_rank: int, kv_rank: int, local_len: int, mask: AttentionMask,
              device: torch.device | str = "cpu") -> Block:
    """Block (q_rank, kv_rank) on shares of `local_len` rows with its kernel calls: the
    mask's slices cut to the two ranks' runs of positions (`slice_blocks.py`), the same for
    every mask kind."""
    return _block(mask, q_rank, kv_rank, local_len, torch.device(device))


def blocks_for(pairs: list[tuple[int, int]], local_len: int, mask: AttentionMask,
               device: torch.device | str = "cpu") -> list[Block]:
    """`block_for` of each (q_rank, kv_rank) in `pairs`: those not made yet in one pass over
    their parts (`part_arrays.tile_parts`, `document_blocks.document_blocks`)."""
    device = torch.device(device)
    kept = [_block.kept(mask, x, y, local_len, device) for x, y in pairs]
    missing = list(dict.fromkeys(pair for pair, block in zip(pairs, kept) if block is None))
    made: dict[tuple[int, int], Block] = {}
    if len(missing) > 1 and mask.window is None:
        for (x, y), block in zip(missing, _pair_blocks(mask, missing, local_len, device)):
            made[x, y] = _block.put(block, mask, x, y, local_len, device)
    return [block if block is not None else made.get((x, y)) or _block(mask, x, y, local_len,
                                                                        device)
            for (x, y), block in zip(pairs, kept)]


def _pair_blocks(mask: AttentionMask, pairs: list[tuple[int, int]], local_len: int,
                 device: torch.device) -> list[Block]:
    """Blocks (x, y) of `pairs`, their parts cut and their documents found in one pass."""
    ranks = list(dict.fromkeys(r for pair in pairs for r in pair))
    _plan_runs(mask, ranks, local_len)
    runs = {r: run_arrays(mask, r, local_len) for r in ranks}
    q_runs = [runs[x] for x, _ in pairs]
    k_runs = [runs[y] for _, y in pairs]
    tile = tile_parts(mask_arrays(mask, local_len), q_runs, k_runs)
    count = len(pairs)
    first = np.searchsorted(tile.block, np.arange(count), side="left")
    end = np.searchsorted(tile.block, np.arange(count), side="right")
    full = np.flatnonzero(end > first)
    renumber = np.zeros(count, dtype=np.int64)
    renumber[full] = np.arange(len(full))
    if len(full) < count:  # blocks without parts: the others numbered on
        tile = tile._replace(block=renumber[tile.block])
    fast = document_blocks(tile, len(full), local_len, device, _squares(mask)
                           ) if len(full) else []
    out = [Block(slice(0, 0), slice(0, 0), tiles=())] * count
    for n, b in enumerate(full.tolist()):
        x, y = pairs[b]
        out[b] = fast[n] if fast[n] is not None else _general(
            mask, x, y, local_len, device, tile.parts.take(slice(first[b], end[b])))
    return out


# per shape without documents; with them, for the last few micro-batches only (`caches.py`)
@per_documents(lambda mask, *_: mask.packing)
def _block(mask: AttentionMask, q_rank: int, kv_rank: int, local_len: int,
           device: torch.device) -> Block:
    tile = tile_parts(mask_arrays(mask, local_len), [run_arrays(mask, q_rank, local_len)],
                      [run_arrays(mask, kv_rank, local_len)])
    if len(tile.parts) == 0:
        return Block(slice(0, 0), slice(0, 0), tiles=())
    if mask.window is None:
        block = document_block(tile, local_len, device, _squares(mask))
        if block is not None:
            return block
    return _general(mask, q_rank, kv_rank, local_len, device, tile.parts)


def _general(mask: AttentionMask, q_rank: int, kv_rank: int, local_len: int,
             device: torch.device, parts: PartArrays) -> Block:
    """The block of `parts` (non-empty) on the general path (`slice_blocks.bounds_calls`)."""
    return bounds_calls(parts.bounds(), local_len, mask.window is not None,
                        slab_rows(mask.window, mask.causal), device,
                        rank_runs(mask, q_rank, local_len), rank_runs(mask, kv_rank, local_len))


@per_documents(lambda mask, *_: mask.packing)
def rank_runs(mask: AttentionMask, rank: int, local_len: int) -> tuple[Run, ...]:
    """`rank`'s local rows as runs of contiguous positions (`global_positions`), sorted by
    position: its zigzag sub-chunks, its pieces of each document, or its placed runs."""
    return position_runs(global_positions(mask, rank, local_len))


@per_documents(lambda mask, *_: mask.packing)
def run_arrays(mask: AttentionMask, rank: int, local_len: int) -> RunArrays:
    """`rank_runs` as arrays (`part_arrays.RunArrays`); packed documents from their pieces."""
    if mask.documents is not None and mask.placement is None:
        docs = mask.documents
        return document_run_arrays(docs.cu_padded, docs.lengths, mask.ranks, rank)
    return position_run_arrays(global_positions(mask, rank, local_len))


def _plan_runs(mask: AttentionMask, ranks: list[int], local_len: int) -> None:
    """Make the `run_arrays` of THD documents of `ranks` not kept yet in one pass."""
    if mask.documents is None or mask.placement is not None:
        return
    missing = [r for r in dict.fromkeys(ranks) if not run_arrays.holds(mask, r, local_len)]
    if len(missing) > 1:
        docs = mask.documents
        for r, runs in zip(missing, documents_run_arrays(docs.cu_padded, docs.lengths,
                                                         mask.ranks, missing)):
            run_arrays.put(runs, mask, r, local_len)


def slab_rows(window: Window | None, causal: bool) -> int:
    """The query rows of a band's slab under `window` on tall shares: `MIN_SLAB_ROWS`, or
    twice the window's width where that is more (a tile's work stays within a band of the
    window, not the whole block)."""
    if window is None or window.left < 0 or (window.right < 0 and not causal):
        return MIN_SLAB_ROWS
    right = 0 if causal else window.right
    return max(MIN_SLAB_ROWS, 2 * (window.left + right + 1))


def sequence_slices(seq_len: int, causal: bool) -> SliceMask:
    """The mask of one dense sequence of `seq_len` tokens as slices: one, causal or full."""
    return SliceMask([(0, seq_len, 0, seq_len, CAUSAL if causal else FULL)], seq_len)


# the last few micro-batches' masks with documents, per shape without (`caches.py`)
@per_documents(lambda mask, *_: mask.packing)
def mask_slices(mask: AttentionMask, local_len: int) -> SliceMask:
    """`mask` on shares of `local_len` rows as slices over the whole sequence's positions
    (`global_positions`), whatever its kind (`Mask.sequence_slices`): its documents' or the
    dense sequence's slices, the user's intersected with them, the window laid on them."""
    return mask.value.sequence_slices(local_len * mask.ranks)


def _squares(mask: AttentionMask) -> bool:
    """Whether `mask_arrays` are THD documents' squares (`part_arrays.document_arrays`)."""
    return mask.documents is not None and mask.window is None and mask.slices is None


@per_documents(lambda mask, *_: mask.packing)
def mask_arrays(mask: AttentionMask, local_len: int) -> SliceArrays:
    """`mask_slices` as arrays (`part_arrays.slice_arrays`); packed documents without a
    window straight from their lengths."""
    if _squares(mask):
        return document_arrays(mask.documents.cu_padded, mask.documents.lengths, mask.causal)
    return slice_arrays(mask_slices(mask, local_len))


def global_positions(mask: AttentionMask, rank: int, local_len: int) -> torch.Tensor:
    """int64 [local_len]: the position in the whole sequence of each of `rank`'s rows under
    `mask` (the packed sequence's for documents, padded for THD), -1 on padding."""
    if mask.placement is not None:
        pos, doc = positions(mask.placement, rank)
        starts = torch.tensor((0, *mask.placement.lengths[:-1])).cumsum(0)
        return starts[doc] + pos
    pos, doc = token_positions(mask.ranks, rank, local_len, mask.documents)
    if mask.documents is None:
        return pos
    starts = torch.tensor(mask.documents.cu_padded)
    return torch.where(doc >= 0, starts[doc.clamp(min=0)] + pos, -1)
