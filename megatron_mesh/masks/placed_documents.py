"""Documents placed by `document_placement.place_documents`, as a mask.

A placement gives each rank its local rows as runs of contiguous positions inside one
document; the runs of one document over all ranks partition it. Its mask is one slice per
document over the packed sequence (`placed_slices`), and each row's position in that
sequence comes from its run (`positions`); the blocks are cut from those like every mask's
(`slice_blocks.py`): the runs a rank holds of one document on both sides make one causal
document of a variable-length call, key runs wholly before a query run one full document,
runs that overlap otherwise a band. Documents held whole by one rank meet only on the
diagonal block, so no other block uses their rows and the sparse exchange
(`schedules/sparse.py`) moves none of them.
"""
from __future__ import annotations

import torch

from ..common.caches import per_documents
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
