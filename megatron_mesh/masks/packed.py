"""A mask written for one sample's positions, laid on the documents of a packed sequence.

A micro-batch of samples of `sample_len` tokens, packed as documents (THD, each document
padded; or placed back to back), puts document d at packed positions starts[d] ..
starts[d] + lengths[d]. The sample's mask, cut to the document's own rows and columns and
shifted there, is what the document's tokens see: the mask intersected with the documents'
(slices keep their rule under a shift, `slices.py`). Torch-free.
"""
from __future__ import annotations

from typing import Sequence

from .slices import SliceMask

_UNIT = 128  # the index grid `SliceMask.cut` looks slices up by (any size is exact)


def packed_slices(mask: SliceMask, sample_len: int, lengths: Sequence[int],
                  starts: Sequence[int], total: int) -> SliceMask:
    """`mask` (over one sample's `sample_len` positions) on each document of a packed
    sequence of `total` positions: document d holds the next lengths[d] tokens of the flat
    micro-batch (samples back to back; no document crosses a sample's end) at starts[d].
    Positions of no document (padding) see nothing."""
    mask.check_length(sample_len)
    if len(starts) < len(lengths):
        raise ValueError(f"{len(lengths)} documents but {len(starts)} starts")
    parts: list[tuple] = []
    flat = 0
    for n, start in zip(lengths, starts):
        first = flat % sample_len
        if first + n > sample_len:
            raise ValueError(f"a document of {n} tokens at position {first} crosses the end "
                             f"of its sample of {sample_len} tokens")
        shift = start - first
        for s in mask.cut(first, first + n, first, first + n, min(_UNIT, sample_len)):
            parts.append((s.q_start + shift, s.q_end + shift, s.k_start + shift,
                          s.k_end + shift, s.kind) + (() if s.window is None else (s.window,)))
        flat += n
    return SliceMask(parts, total)
