"""The prefix-LM mask: the first `prefix_len` tokens see each other both ways, the rest see
the whole prefix and, causally, each other. Three slices; nothing else in the package knows
this mask (`slices.py` says what slices mean, the mesh runs any list of them).
"""
from __future__ import annotations

from .slices import CAUSAL, FULL, SliceMask


def prefix_lm_mask(seq_len: int, prefix_len: int) -> SliceMask:
    """The prefix-LM `SliceMask` of a sequence of `seq_len` tokens whose first `prefix_len`
    (0 < prefix_len <= seq_len) are the prefix; prefix_len == seq_len: full attention."""
    for name, n in (("seq_len", seq_len), ("prefix_len", prefix_len)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name}={n!r} must be a positive int")
    if prefix_len > seq_len:
        raise ValueError(f"prefix_len={prefix_len} must be at most seq_len={seq_len}")
    slices = [(0, prefix_len, 0, prefix_len, FULL)]
    if prefix_len < seq_len:
        slices += [(prefix_len, seq_len, 0, prefix_len, FULL),
                   (prefix_len, seq_len, prefix_len, seq_len, CAUSAL)]
    return SliceMask(slices, seq_len)
