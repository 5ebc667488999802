"""Which of a call's runs Transformer Engine's "thd" fused attention takes, and with which
mask: a decision made once per call and kept with it (`RunsPlan`).

A call's runs (`calls/tile_runs.py`) packed into variable-length calls (`varlen_runs.packs_of`:
sequence n = query rows against concatenated key ranges, one rule per pack) are, to TE,
packed sequences with their own query and key lengths (cu_seqlens_q, cu_seqlens_kv), each
aligned at its own bottom right:

    full     attn_mask_type "padding", window (-1, -1)
    causal   "padding_causal_bottom_right", window (-1, 0), bottom_right_diagonal
    window   "padding", flash-attention's window (left, right), bottom_right_diagonal

TE's `fused_attn_fwd` / `_bwd` take "padding_causal_bottom_right" in every release read
(2.1 to 2.20). A window's right bound and the band's alignment are set only where the
functions take `bottom_right_diagonal` (TE 2.12 on; before, TE's cuDNN graph set the band's
left bound alone, aligned by the mask): windows need it. A sequence of more queries than
keys under a causal mask or a window is left to the fallback (TE's fused attention turns
sliding windows with s_q > s_kv down; bottom-right causal needs s_q <= s_kv), unless it can
be cut: a window run of more queries than keys goes to TE as parts of its rows, each against
the keys its rows see, no longer than them, with the band re-aligned to each part
(`fit_runs`; a window as wide as a chunk leaves such runs at the chunks' edges). Whatever TE's
own backend query then turns down (cuDNN and GPU rules: thd windows need cuDNN 9.6,
bottom-right causal thd cuDNN 9.6) is asked per pack shape by the kernel (`te_fused`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

import torch

from ..calls.tile_runs import WINDOW, Run
from .varlen_runs import Pack

PADDING, PADDING_CAUSAL, PADDING_CAUSAL_BOTTOM_RIGHT = (
    "padding", "padding_causal", "padding_causal_bottom_right")
WINDOW_PARAMETER = "bottom_right_diagonal"  # fused_attn_fwd / _bwd take it from TE 2.12


@dataclass(frozen=True)
class RunMask:
    """TE's mask for one thd call: attn_mask_type, window_size and the band's alignment
    (`bottom_right_diagonal`, passed where the function takes it)."""

    attn_mask_type: str
    window_size: tuple[int, int]
    bottom_right_diagonal: bool

    @property
    def windowed(self) -> bool:
        """A band beyond plain causal / full (TE's sliding window)."""
        return self.window_size not in ((-1, -1), (-1, 0))


FULL_MASK = RunMask(PADDING, (-1, -1), False)
CAUSAL_MASK = RunMask(PADDING_CAUSAL, (-1, 0), False)  # top-left: square sequences only
BOTTOM_RIGHT_MASK = RunMask(PADDING_CAUSAL_BOTTOM_RIGHT, (-1, 0), True)


def run_mask(causal: bool, window: tuple[int, int] | None) -> RunMask:
    """TE's mask of a pack of `causal` (bottom-right) or flash `window` (left, right;
    -1 unbounded) runs, else full."""
    if causal or window == (-1, 0):
        return BOTTOM_RIGHT_MASK
    if window is None or window == (-1, -1):
        return FULL_MASK
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"a window ({left}, {right}) must be >= -1 on each side")
    return RunMask(PADDING, (left, right), True)


def documents_mask(causal: bool, bottom_right: bool) -> RunMask:
    """TE's mask of packed documents: full, causal (top-left where every causal document is
    square, as before), bottom-right causal where one has more keys than queries."""
    if not causal:
        return FULL_MASK
    return BOTTOM_RIGHT_MASK if bottom_right else CAUSAL_MASK


def fit_runs(runs: tuple[Run, ...]) -> tuple[Run, ...]:
    """`runs` with each window run of more queries than keys (one key range) cut, from its
    last row up, into parts of at most that many rows, each against the keys its rows see
    and its band re-aligned at its own bottom right; a run whose parts a flash window cannot
    say (a bounded side that would become -1, or a part still taller than its keys) is kept
    whole (TE then refuses it: `pack_refusal`)."""
    out: list[Run] = []
    for run in runs:
        parts = _window_parts(run) if run.rule == WINDOW and run.sq > run.sk else None
        out.extend(parts or (run,))
    return tuple(sorted(out, key=lambda r: (r.q0, r.q1)))


def _window_parts(run: Run) -> list[Run] | None:
    """`fit_runs`'s parts of one window run, or None."""
    if len(run.keys) != 1:
        return None
    k0, (left, right) = run.keys[0][0], run.window
    sq, sk = run.sq, run.sk
    shift = sk - sq  # row i sees key j iff shift - left <= j - i <= shift + right
    parts, b = [], sq
    while b > 0:
        a = max(0, b - sk)
        lo = 0 if left < 0 else max(0, a + shift - left)  # the keys rows [a, b) see
        hi = sk if right < 0 else min(sk, b - 1 + shift + right + 1)
        m, n = b - a, hi - lo
        # in the part's own rows i' = i - a and keys j' = j - lo: shift' - left' <= j' - i'
        # <= shift' + right', shift' = n - m
        moved = (n - m) - (shift + a - lo)
        part_left = -1 if left < 0 else left + moved
        part_right = -1 if right < 0 else right - moved
        if m > n or (left >= 0 and part_left < 0) or (right >= 0 and part_right < 0):
            return None
        parts.append(Run(run.q0 + a, run.q0 + b, ((k0 + lo, k0 + hi),), WINDOW,
                         (part_left, part_right)))
        b = a
    return parts


RELEASE, SHAPE = "release", "shape"  # the kinds of refusal (each logged once per kind)


def pack_refusal(pack: Pack, params: Collection[str]) -> tuple[str, str] | None:
    """Why TE's thd call (whose function has parameters `params`) cannot take `pack`, as
    (kind, words), or None: a window where the function has no `bottom_right_diagonal`
    (RELEASE), a sequence of more queries than keys under a causal mask or a window
    (SHAPE)."""
    mask = run_mask(pack.causal, pack.window)
    if mask.windowed and WINDOW_PARAMETER not in params:
        return RELEASE, (f"window {mask.window_size}: this Transformer Engine's fused_attn_fwd "
                         f"has no {WINDOW_PARAMETER} (from 2.12) to align the band at the "
                         "bottom right")
    if mask.attn_mask_type != PADDING or mask.windowed:
        cu_q, cu_k = pack.cu_q, pack.cu_k
        for n in range(len(cu_q) - 1):
            sq, sk = cu_q[n + 1] - cu_q[n], cu_k[n + 1] - cu_k[n]
            if sq > sk:
                rule = "causal" if pack.causal else f"window {mask.window_size}"
                return SHAPE, f"a {rule} sequence of {sq} queries against {sk} keys"
    return None


@dataclass(frozen=True, eq=False)
class RunsPlan:
    """A call's runs as TE thd calls: the packs, each pack's index and length tensors
    (`Pack.tensors`) and mask, and why TE cannot take them all (None: it can)."""

    packs: tuple[Pack, ...]
    tensors: tuple[dict[str, torch.Tensor], ...]
    masks: tuple[RunMask, ...]
    refusal: tuple[str, str] | None  # (kind, words) of the first pack TE cannot take

    @classmethod
    def of(cls, packs: tuple[Pack, ...], params: Collection[str], device: torch.device
           ) -> RunsPlan:
        """The plan of `packs` for a function with parameters `params`; tensors on `device`
        only where TE takes every pack."""
        refusal = next(filter(None, (pack_refusal(p, params) for p in packs)), None)
        tensors = () if refusal else tuple(p.tensors(device) for p in packs)
        return cls(packs, tensors, tuple(run_mask(p.causal, p.window) for p in packs),
                   refusal)

    def shapes(self) -> tuple[tuple, ...]:
        """What TE's backend query reads of each pack: mask, sequences, longest query and
        key sequence, query and key tokens."""
        return tuple((m, len(p.rows), max(b - a for a, b in p.rows),
                      max(e - c for c, e in zip(p.cu_k, p.cu_k[1:])), p.cu_q[-1], p.cu_k[-1])
                     for p, m in zip(self.packs, self.masks))


__all__ = ["BOTTOM_RIGHT_MASK", "CAUSAL_MASK", "FULL_MASK", "RunMask", "RunsPlan",
           "documents_mask", "fit_runs", "pack_refusal", "run_mask"]
