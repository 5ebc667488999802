"""Chunked attention (Llama 4's local layers): the sequence is cut into chunks of `chunk`
tokens and query i sees key j iff j <= i and both lie in the same chunk (i // chunk ==
j // chunk). One causal slice per chunk; nothing else in the package knows this mask
(`slices.py` says what slices mean, the mesh runs any list of them). With documents
(`cu_seqlens` over the dense sequence) chunks restart at each document's first token and
never cross a document's end.
"""
from __future__ import annotations

import functools
from typing import Sequence

from .slices import CAUSAL, SliceMask


def _check_int(name: str, n: object) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{name}={n!r} must be a positive int")


def chunked_mask(seq_len: int, chunk: int, cu_seqlens: Sequence[int] | None = None
                 ) -> SliceMask:
    """The chunked-attention `SliceMask` of a sequence of `seq_len` tokens: causal within
    each chunk of `chunk` tokens (the last may be shorter); with `cu_seqlens` (cumulative
    document lengths, 0 .. seq_len) the chunks of each document, counted from its start.
    chunk >= seq_len is the plain causal mask."""
    _check_int("seq_len", seq_len)
    _check_int("chunk", chunk)
    bounds = (0, seq_len) if cu_seqlens is None else tuple(int(c) for c in cu_seqlens)
    return _chunked(seq_len, chunk, bounds)


@functools.lru_cache(maxsize=16)  # the layers of a model and its micro-batches share one
def _chunked(seq_len: int, chunk: int, bounds: tuple[int, ...]) -> SliceMask:
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq_len or any(
            b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens={list(bounds)[:8]} must rise from 0 to seq_len="
                         f"{seq_len}")
    slices = [(s, min(s + chunk, end), s, min(s + chunk, end), CAUSAL)
              for start, end in zip(bounds, bounds[1:]) for s in range(start, end, chunk)]
    return SliceMask(slices, seq_len)

