"""Megatron's zigzag sequence layout and the three kinds of causal rank-blocks.

The sequence is cut into 2P equal sub-chunks; CP rank r holds sub-chunks r and 2P-1-r,
concatenated (token order kept). Block (x, y) is rank x's queries against rank y's keys.
Packed documents (`documents.py`) take the same layout inside every document, so the same
rule picks each document's rows of a block.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..common.caches import per_documents
from ..common.tile_mask import Segments, TileMask
from .block import Block, BlockKind, as_rows, band_tile, block_kind
from .document_placement import DocumentPlacement
from .documents import Documents
from .placed import placed_block, placed_slices, positions
from .seen import sees
from .slice_blocks import slice_block
from .slices import CAUSAL, FULL, SliceMask
from .window import Window, token_positions, windowed
from .zigzag import check_zigzag_divisible, held_pieces, zigzag_chunks


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
    """What a layer's queries see, decided once per call and passed to every block:
    causal or not, the packed documents (None: one dense sequence per batch entry) and the
    sliding window (None: none); or a mask given as slices (`slices`, then causal is False
    and the others None). `ranks` is the number of zigzag shares the local tensors are (P,
    or P / A after the heads all-to-all)."""

    causal: bool
    documents: Documents | None = None
    ranks: int = 1
    window: Window | None = None  # sliding window on global positions (`window.py`)
    placement: DocumentPlacement | None = None  # documents placed over the `ranks` shares
    slices: SliceMask | None = None  # a mask given as slices (`slices.py`): it alone rules

    @property
    def packing(self) -> Documents | DocumentPlacement | SliceMask | None:
        """The packed documents, THD or placed, or the slices of a mask given as such (None:
        one dense sequence): what block data depends on beyond shapes
        (`caches.per_documents` keys on it)."""
        if self.documents is not None:
            return self.documents
        return self.placement if self.placement is not None else self.slices

    @property
    def packed(self) -> bool:
        """Whether the shares are packed documents (THD layout or placed)."""
        return self.documents is not None or self.placement is not None


def block_for(q_rank: int, kv_rank: int, local_len: int, mask: AttentionMask | bool,
              device: torch.device | str = "cpu") -> Block:
    """The single kernel call computing block (q_rank, kv_rank) on shares of `local_len`
    rows (`mask` True / False: a dense causal / full sequence)."""
    if isinstance(mask, bool):
        mask = AttentionMask(mask)
    if mask.slices is not None:
        return slice_block(mask.slices, mask.ranks, q_rank, kv_rank, local_len,
                           torch.device(device))
    kind = block_kind(q_rank, kv_rank, mask.causal)
    if mask.placement is not None and mask.window is None:
        return placed_block(mask.placement, mask.causal, q_rank, kv_rank, torch.device(device))
    if mask.window is not None and not _window_spares(mask, q_rank, kv_rank, local_len):
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


# a micro-batch's blocks (at most R x C per rank), for its documents only (`caches.py`)
@per_documents(lambda documents, *_: documents)
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
    kv_rank under `mask`: its slices (`mask_slices`) read on the rows' positions."""
    return sees(mask_slices(mask, local_len), global_positions(mask, q_rank, local_len),
                global_positions(mask, kv_rank, local_len))


def sequence_slices(seq_len: int, causal: bool) -> SliceMask:
    """The mask of one dense sequence of `seq_len` tokens as slices: one, causal or full."""
    return SliceMask([(0, seq_len, 0, seq_len, CAUSAL if causal else FULL)], seq_len)


# the last few micro-batches' masks with documents, per shape without (`caches.py`)
@per_documents(lambda mask, *_: mask.packing)
def mask_slices(mask: AttentionMask, local_len: int) -> SliceMask:
    """`mask` on shares of `local_len` rows as slices over the whole sequence's positions
    (`global_positions`), whatever its kind: its builder's slices (a dense sequence, THD
    documents, placed documents, or the slices given), with the window laid on them."""
    if mask.slices is not None:
        return mask.slices
    if mask.placement is not None:
        base = placed_slices(mask.placement, mask.causal)
    elif mask.documents is not None:
        base = mask.documents.slices(mask.causal)
    else:
        base = sequence_slices(local_len * mask.ranks, mask.causal)
    return windowed(base, mask.window)


def global_positions(mask: AttentionMask, rank: int, local_len: int) -> torch.Tensor:
    """int64 [local_len]: the position in the whole sequence of each of `rank`'s rows under
    `mask` (the packed sequence's for documents, padded for THD), -1 on padding."""
    if mask.placement is not None:
        pos, doc = positions(mask.placement, rank)
        starts = torch.tensor((0, *mask.placement.lengths[:-1])).cumsum(0)
        return starts[doc] + pos
    if mask.slices is not None:
        pos, _ = token_positions(mask.ranks, rank, local_len)
        return pos
    pos, doc = token_positions(mask.ranks, rank, local_len, mask.documents)
    if mask.documents is None:
        return pos
    starts = torch.tensor(mask.documents.cu_padded)
    return torch.where(doc >= 0, starts[doc.clamp(min=0)] + pos, -1)


# A block under a window whose shares hold at most this many rows is one kernel call over
# the rows it uses, with its mask made once; on taller shares each contiguous run of
# positions (a zigzag sub-chunk, or a document's piece) is cut into band tiles, each query
# slab at most MIN_SLAB_ROWS rows or twice the window's width where that is more, so a
# tile's work and mask stay within a band of the window, not the whole block. Documents of
# fewer than SMALL_DOCUMENT_ROWS rows on the query side are grouped, consecutive ones, into
# one call of at least MIN_SLAB_ROWS query rows with an explicit mask of the group.
ONE_CALL_ROWS = 1024
MIN_SLAB_ROWS = 1024
SMALL_DOCUMENT_ROWS = 256


def _window_spares(mask: AttentionMask, q_rank: int, kv_rank: int, local_len: int) -> bool:
    """Whether the window leaves every pair of a dense block that the causal (or full)
    mask keeps: then the block is the plain one. Positions: each rank's zigzag sub-chunks."""
    if mask.packed:
        return False
    half = local_len // 2
    q_first, q_second = (c * half for c in zigzag_chunks(mask.ranks, q_rank))
    kv_first, kv_second = (c * half for c in zigzag_chunks(mask.ranks, kv_rank))
    left, right = mask.window.left, mask.window.right
    return ((left < 0 or q_second + half - 1 - kv_first <= left)
            and (mask.causal or right < 0 or kv_second + half - 1 - q_first <= right))


# per shape without documents; with them, for the last few micro-batches only (`caches.py`)
@per_documents(lambda mask, *_: mask.packing)
def _window_block(mask: AttentionMask, q_rank: int, kv_rank: int, local_len: int,
                  device: torch.device) -> Block:
    """A block under a sliding window: the query rows that see some key and the key rows
    some query sees, with its kernel calls as `tiles`."""
    kind = block_kind(q_rank, kv_rank, mask.causal)
    if local_len <= ONE_CALL_ROWS:
        tile = _one_call(mask, q_rank, kv_rank, local_len, device)
        if tile is None:
            return Block(kind, slice(0, 0), slice(0, 0), tiles=())
        return Block(kind, tile.q_rows, tile.kv_rows, tiles=(tile,))
    tiles = tuple(_band_tiles(mask, q_rank, kv_rank, local_len, device))  # rows on the CPU
    q_used = torch.zeros(local_len, dtype=torch.bool)
    kv_used = torch.zeros(local_len, dtype=torch.bool)
    for tile in tiles:
        q_used[tile.q_rows] = True
        kv_used[tile.kv_rows] = True
    on_device = lambda rows: rows if isinstance(rows, slice) else rows.to(device)  # noqa: E731
    tiles = tuple(replace(t, q_rows=on_device(t.q_rows), kv_rows=on_device(t.kv_rows))
                  for t in tiles)
    return Block(kind, as_rows(q_used, device), as_rows(kv_used, device), tiles=tiles)


Run = tuple[int, int, int]  # (first local row, its position, rows) of contiguous positions


def _runs(mask: AttentionMask, rank: int, local_len: int) -> list[list[Run]]:
    """Per document (one for a dense sequence), `rank`'s runs of real rows: its zigzag
    sub-chunks, or its pieces of each document, positions counted within the document and
    padding rows left out (as `window.token_positions` gives them row by row)."""
    if mask.placement is not None:
        return mask.placement.local_runs_by_document(rank)
    if mask.documents is None:
        half = local_len // 2
        return [[(row * half, chunk * half, half)
                 for row, chunk in enumerate(zigzag_chunks(mask.ranks, rank))]]
    out = []
    ranks = mask.ranks
    for (offset, piece), length in zip(mask.documents.pieces(ranks), mask.documents.lengths):
        indices = held_pieces(ranks, rank)
        runs = []
        for k, index in enumerate(indices):
            rows = max(0, min(piece, length - index * piece))
            if rows:
                runs.append((offset + k * piece, index * piece, rows))
        out.append(runs)
    return out


def _band_tiles(mask: AttentionMask, q_rank: int, kv_rank: int, local_len: int,
                device: torch.device):
    """The calls of a block under a window on tall shares, in closed form: each run of
    query positions, cut into slabs, against each run of key positions of its document,
    trimmed to the rows the window keeps. Every such tile is exactly flash-attention's
    bottom-right window over its rows (`TileMask.band`), so no mask of the block is ever
    made. Short documents go in groups (`_group_call`)."""
    lo = -mask.window.left if mask.window.left >= 0 else None  # key pos - query pos >= lo
    hi = mask.window.right if mask.window.right >= 0 else None  # ... <= hi
    if mask.causal:
        hi = 0 if hi is None else min(hi, 0)
    slab = MIN_SLAB_ROWS if lo is None or hi is None else max(MIN_SLAB_ROWS, 2 * (hi - lo + 1))
    group: list[tuple[list[Run], list[Run]]] = []
    for q_runs, kv_runs in zip(_runs(mask, q_rank, local_len), _runs(mask, kv_rank, local_len)):
        if not q_runs or not kv_runs:
            continue
        if mask.packed and sum(n for *_, n in q_runs) < SMALL_DOCUMENT_ROWS:
            group.append((q_runs, kv_runs))
            if sum(n for runs, _ in group for *_, n in runs) >= MIN_SLAB_ROWS:
                yield from _group_call(group, lo, hi, device)
                group = []
            continue
        for q_row, q_pos, q_len in q_runs:
            for start in range(0, q_len, slab):
                for kv_row, kv_pos, kv_len in kv_runs:
                    tile = band_tile(q_pos, start, min(start + slab, q_len), kv_pos, kv_len,
                                      lo, hi)
                    if tile is not None:
                        (i0, i1), (j0, j1), kind, band = tile
                        yield Block(kind, slice(q_row + i0, q_row + i1),
                                    slice(kv_row + j0, kv_row + j1), mask=band)
    if group:
        yield from _group_call(group, lo, hi, device)


def _group_call(group: list[tuple[list[Run], list[Run]]], lo: int | None, hi: int | None,
                device: torch.device):
    """One call over a group of short documents' runs (query and key runs of each): the
    rows that see or are seen (index tensors on the CPU), with the explicit mask of the
    group (block-diagonal over its documents, each under the window; its additive form on
    `device`), or nothing when no row sees a key."""
    def rows_of(side: int):
        row, pos, doc = [], [], []
        for d, runs in enumerate(member[side] for member in group):
            for first, start, n in runs:
                row.append(torch.arange(first, first + n))
                pos.append(torch.arange(start, start + n))
                doc.append(torch.full((n,), d))
        return torch.cat(row), torch.cat(pos), torch.cat(doc)

    q_row, q_pos, q_doc = rows_of(0)
    kv_row, kv_pos, kv_doc = rows_of(1)
    delta = kv_pos[None, :] - q_pos[:, None]
    seen = q_doc[:, None] == kv_doc[None, :]
    if lo is not None:
        seen &= delta >= lo
    if hi is not None:
        seen &= delta <= hi
    q_any, kv_any = seen.any(1), seen.any(0)
    if not bool(q_any.any()):
        return
    seen = seen[q_any][:, kv_any]
    tile_mask = None if bool(seen.all()) else TileMask.explicit(seen, device)
    yield Block(BlockKind.FULL, q_row[q_any], kv_row[kv_any], mask=tile_mask)


def _one_call(mask: AttentionMask, q_rank: int, kv_rank: int, local_len: int,
              device: torch.device) -> Block | None:
    """A block under a window (inside packed documents, or on short shares) as one kernel
    call over the rows it uses, with its mask: flash-attention's window where that alone
    gives it, else explicit (None when no row sees any key)."""
    seen = block_pairs(mask, q_rank, kv_rank, local_len)
    q_any, kv_any = seen.any(1), seen.any(0)
    if not bool(q_any.any()):
        return None
    kind = block_kind(q_rank, kv_rank, mask.causal)
    q_rows, kv_rows = as_rows(q_any, device), as_rows(kv_any, device)
    tile = seen[q_any][:, kv_any]
    if bool(tile.all()):
        return Block(BlockKind.FULL, q_rows, kv_rows)
    if tile.shape[0] == tile.shape[1] and torch.equal(tile, torch.ones_like(tile).tril()):
        return Block(BlockKind.DIAGONAL, q_rows, kv_rows)
    if not mask.packed:
        pos_q, _ = token_positions(mask.ranks, q_rank, local_len)
        pos_k, _ = token_positions(mask.ranks, kv_rank, local_len)
        flash = _flash_window(pos_q[q_any], pos_k[kv_any], tile, mask.window)
        if flash is not None:
            return Block(kind, q_rows, kv_rows, mask=TileMask.band(*tile.shape, *flash))
    return Block(kind, q_rows, kv_rows, mask=TileMask.explicit(tile, device))


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
