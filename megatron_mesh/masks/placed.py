"""Rank-blocks of documents placed by `document_placement.place_documents`.

A placement gives each rank its local rows as runs of contiguous positions inside one
document; the runs of one document over all ranks partition it. Block (x, y) pairs x's
runs with y's runs of the same document (causal: a query at position p sees the keys at
positions <= p of its document):

    the same run on both sides (x == y)   a causal square: one call for all of them (varlen)
    a key run wholly before a query run   all pairs: one call for all of them, per query run
                                          one segment over the key runs it sees (varlen)
    a key run wholly after                nothing
    runs that overlap otherwise           a band tile (flash-attention's own window)

Documents held whole by one rank meet only on the diagonal block, so no other block uses
their rows and the sparse exchange (`schedules/sparse.py`) moves none of them. Under a sliding
window the blocks are cut by `layout`'s band tiles over the same runs.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..common.caches import per_documents
from ..common.tile_mask import Segments
from .block import Block, BlockKind, as_rows, band_tile, block_kind
from .document_placement import DocumentPlacement
from .documents import Documents
from .slices import CAUSAL, FULL, SliceMask


@per_documents(lambda placement, *_: placement)  # made once per micro-batch and grid
def mesh_placement(placement: DocumentPlacement, heads: int) -> DocumentPlacement:
    """The placement over the P / A mesh ranks after the heads all-to-all: mesh rank m holds
    the local rows of CP ranks mA .. mA+A-1 one after another (`heads.scatter_heads` keeps
    that order for a placement), so its runs are theirs in that order (not re-sorted)."""
    if heads == 1:
        return placement
    mesh = placement.cp_size // heads
    runs = tuple(tuple(run for member in placement.runs[m * heads:(m + 1) * heads]
                       for run in member) for m in range(mesh))
    groups = tuple(tuple(sorted({r // heads for r in group})) for group in placement.groups)
    return DocumentPlacement(mesh, placement.lengths, runs, groups)


def placed_slices(placement: DocumentPlacement, causal: bool) -> SliceMask:
    """The mask of placed documents as slices over the packed sequence's positions (the
    documents back to back, unpadded): one per document, causal where `causal`; where each
    token sits decides nothing here (`positions`)."""
    kind, start, slices = CAUSAL if causal else FULL, 0, []
    for n in placement.lengths:
        slices.append((start, start + n, start, start + n, kind))
        start += n
    return SliceMask(slices, start)


def positions(placement: DocumentPlacement, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position within its document, document) int64 [local rows] of `rank`'s rows."""
    pos, doc = [], []
    for d, first, n in placement.runs[rank]:
        pos.append(torch.arange(first, first + n))
        doc.append(torch.full((n,), d, dtype=torch.int64))
    return torch.cat(pos), torch.cat(doc)


@per_documents(lambda placement, *_: placement)  # the last few micro-batches' blocks
def placed_block(placement: DocumentPlacement, causal: bool, q_rank: int, kv_rank: int,
                 device: torch.device) -> Block:
    """Block (q_rank, kv_rank) of `placement` without a window: at most one causal varlen
    call (the runs both sides share), one full varlen call (each query run against the
    runs of its document it sees whole) and band tiles where runs overlap otherwise."""
    q_runs = placement.local_runs_by_document(q_rank)
    kv_runs = placement.local_runs_by_document(kv_rank)
    diagonal: list[tuple[int, int]] = []  # (first local row, rows) of each shared run
    full: list[tuple[tuple[int, int], list[tuple[int, int]]]] = []  # query run, key runs
    bands: list[Block] = []
    for q_doc, kv_doc in zip(q_runs, kv_runs):
        for q_row, q_pos, q_len in q_doc:
            seen = []
            for kv_row, kv_pos, kv_len in kv_doc:
                if not causal or kv_pos + kv_len <= q_pos:
                    seen.append((kv_row, kv_len))
                elif q_rank == kv_rank and kv_row == q_row:
                    diagonal.append((q_row, q_len))
                elif kv_pos < q_pos + q_len:  # runs that overlap otherwise: one band
                    (i0, i1), (j0, j1), kind, band = band_tile(q_pos, 0, q_len, kv_pos,
                                                               kv_len, None, 0)
                    bands.append(Block(kind, slice(q_row + i0, q_row + i1),
                                       slice(kv_row + j0, kv_row + j1), mask=band))
            if seen:
                full.append(((q_row, q_len), seen))
    tiles = []  # row indices on the CPU until the block's union is taken
    if diagonal:
        tiles.append(_varlen(BlockKind.DIAGONAL, [(d, [d]) for d in diagonal]))
    if full:
        tiles.append(_varlen(BlockKind.FULL, full))
    tiles += [(band, None) for band in bands]
    kind = block_kind(q_rank, kv_rank, causal)
    if not tiles:
        return Block(kind, slice(0, 0), slice(0, 0), tiles=())
    length = placement.local_tokens
    q_used = torch.zeros(length, dtype=torch.bool)
    kv_used = torch.zeros(length, dtype=torch.bool)
    for tile, _ in tiles:
        q_used[tile.q_rows] = True
        kv_used[tile.kv_rows] = True
    on_device = lambda rows: rows if isinstance(rows, slice) else rows.to(device)  # noqa: E731
    calls = tuple(replace(tile, q_rows=on_device(tile.q_rows), kv_rows=on_device(tile.kv_rows),
                          segments=None if cu is None else Segments.build(*cu, device))
                  for tile, cu in tiles)
    return Block(kind, as_rows(q_used, device), as_rows(kv_used, device), tiles=calls)


def _varlen(kind: BlockKind, segments: list[tuple[tuple[int, int], list[tuple[int, int]]]]
            ) -> tuple[Block, tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """One varlen call: segment i = query run i against its key runs (concatenated); its
    rows on the CPU (slices where contiguous), and its (cu_q, cu_kv) where it has more than
    one segment (None: one plain call)."""
    q_rows, kv_rows, cu_q, cu_kv = [], [], [0], [0]
    for (q_row, q_len), kv in segments:
        q_rows.append(torch.arange(q_row, q_row + q_len))
        cu_q.append(cu_q[-1] + q_len)
        for kv_row, kv_len in kv:
            kv_rows.append(torch.arange(kv_row, kv_row + kv_len))
        cu_kv.append(cu_kv[-1] + sum(n for _, n in kv))
    contiguous = lambda i: slice(int(i[0]), int(i[-1]) + 1) if bool(  # noqa: E731
        (i.diff() == 1).all()) else i
    block = Block(kind, contiguous(torch.cat(q_rows)), contiguous(torch.cat(kv_rows)))
    return block, ((tuple(cu_q), tuple(cu_kv)) if len(cu_q) > 2 else None)


def check_placement(placement: object, cp_size: int, local_tokens: int, batch: int) -> None:
    """ValueError unless `placement` is a `DocumentPlacement` over `cp_size` ranks whose
    share is `local_tokens` rows of one packed sequence (b = 1)."""
    if not isinstance(placement, DocumentPlacement):
        raise ValueError(f"placement must be a DocumentPlacement (from place_documents), got "
                         f"{type(placement).__name__}")
    if placement.cp_size != cp_size:
        raise ValueError(f"placement was built for {placement.cp_size} CP ranks, but this "
                         f"grid has {cp_size}; build it with place_documents(cu_seqlens, "
                         f"{cp_size})")
    if local_tokens != placement.local_tokens or batch != 1:
        raise ValueError(f"placement gives each rank {placement.local_tokens} tokens of one "
                         f"packed sequence, but the local tensors hold {local_tokens} (batch "
                         f"{batch}); pass the packed tensors at placement.token_indices(rank)")


def check_placement_documents(placement: DocumentPlacement, cu_seqlens, cu_seqlens_padded
                              ) -> None:
    """ValueError unless cu_seqlens (when given beside a placement) are its documents;
    placed documents carry no padding, so cu_seqlens_padded is refused."""
    if cu_seqlens_padded is not None:
        raise ValueError("cu_seqlens_padded was given with a placement; placed documents "
                         "are not padded (pass cu_seqlens, or neither)")
    if cu_seqlens is None:
        return
    if not isinstance(placement, DocumentPlacement):
        check_placement(placement, 0, 0, 1)
    lengths = Documents.from_cu_seqlens(cu_seqlens).lengths
    if lengths != placement.lengths:
        raise ValueError(f"cu_seqlens hold {len(lengths)} documents of lengths "
                         f"{_short(lengths)}, but the placement was built for "
                         f"{len(placement.lengths)} of lengths {_short(placement.lengths)}; "
                         "build it from the same cu_seqlens")


def _short(values: tuple[int, ...], shown: int = 6) -> str:
    text = ", ".join(map(str, values[:shown]))
    return f"[{text}{', ...' if len(values) > shown else ''}]"
