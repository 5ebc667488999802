"""The mask of one kernel call, as the masks make it and the kernels take it: slices of the
call's own rows.

A slice of a call is query rows [q0, q1) x key rows [k0, k1) where query row i sees key
row j iff lo <= j - i <= hi (None: unbounded), rows counted in the call (the pieces it
gathers, concatenated), read by the one rule of every mask (`masks/seen.keeps`). A
`TileSlices` holds a call's slices and the form a kernel takes them in:

    documents   document-diagonal: document n is query rows cu_q[n] .. cu_q[n+1] against
                key rows cu_kv[n] .. cu_kv[n+1], all full or all causal (aligned at the
                bottom right, as flash-attention's variable-length causal; square ones
                are the plain causal mask): the variable-length form (held as arrays;
                `cu_q` / `cu_kv`, `cu_q_tensor` / `cu_kv_tensor` and the slices made
                once, when first asked for; `bottom_right` where one is not square)
    band        one slice over the whole call: flash-attention's window `flash_window`
                (left, right), aligned at the bottom right (-1: unbounded)
    slices      anything else

Every form is also the call's runs (`runs`, `tile_runs.py`): query rows against
concatenated key ranges, full, causal or a window at the bottom right, which kernels take
without a mask of the call's size. `seen` / `additive_mask` give the dense mask, for
references and emulation; a kernel takes `additive_mask` only for one window block of rows
on an op without a window of its own (`kernels/run_calls.py`).

Every query row of a call is in some slice and sees a key there, so the merge and the
backward never meet a row without one.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from ..common.caches import BytesLRU
from ..masks.seen import UNBOUNDED, Bounds, keeps
from ..masks.slices import slice_pairs
from .tile_runs import Run, runs_of

DOCUMENTS, BAND, SLICES = "documents", "band", "slices"
Bound = tuple[int, int, int, int, "int | None", "int | None"]  # (q0, q1, k0, k1, lo, hi)


@dataclass(frozen=True, eq=False)
class TileSlices:
    """The slices of one kernel call of `shape` (sq, sk) rows and their form (module
    docstring). Build with `documents`, `band` or `of`."""

    shape: tuple[int, int]
    held_slices: tuple[Bound, ...] | None  # None for documents: made from the arrays
    form: str
    causal: bool = False  # documents: each causal (bottom-right aligned)
    # documents: the offsets of each one's query rows and key rows, int64 [docs + 1] each
    cu_q_array: np.ndarray | None = field(default=None, repr=False)
    cu_kv_array: np.ndarray | None = field(default=None, repr=False)
    flash_window: tuple[int, int] | None = None  # band: (left, right)
    device: torch.device | None = field(default=None, repr=False)  # documents' cu tensors
    _bias: dict = field(default_factory=dict, repr=False)  # slices: device -> bias
    _on_device: dict = field(default_factory=dict, repr=False)  # (what, device) -> tensors

    @classmethod
    def documents(cls, cu_q, cu_kv, causal: bool, device: torch.device) -> TileSlices:
        """Documents n = 0 .. len(cu_q) - 2: query rows cu_q[n] .. cu_q[n+1] against key rows
        cu_kv[n] .. cu_kv[n+1], causal (aligned at the bottom right: query i sees key j iff
        j - i <= k_end - q_end; no more queries than keys) or full; none empty. cu_q, cu_kv:
        tuples of ints or int64 arrays [docs + 1]."""
        cu_q = np.asarray(cu_q, dtype=np.int64)
        cu_kv = np.asarray(cu_kv, dtype=np.int64)
        return cls((int(cu_q[-1]), int(cu_kv[-1])), None, DOCUMENTS, causal, cu_q, cu_kv,
                   device=torch.device(device))

    @functools.cached_property
    def slices(self) -> tuple[Bound, ...]:
        """The call's slices (q0, q1, k0, k1, lo, hi) in its own rows."""
        if self.held_slices is not None:
            return self.held_slices
        cu_q, cu_kv = self.cu_q, self.cu_kv
        causal = self.causal
        return tuple((q0, q1, k0, k1, None, k1 - q1 if causal else None)
                     for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_kv, cu_kv[1:]))

    @functools.cached_property
    def cu_q(self) -> tuple[int, ...]:
        """Documents: the offsets of each one's query rows (() for other forms)."""
        return () if self.cu_q_array is None else tuple(self.cu_q_array.tolist())

    @functools.cached_property
    def cu_kv(self) -> tuple[int, ...]:
        """Documents: the offsets of each one's key rows (() for other forms)."""
        return () if self.cu_kv_array is None else tuple(self.cu_kv_array.tolist())

    @functools.cached_property
    def cu_q_tensor(self) -> torch.Tensor | None:
        """Documents: `cu_q` as int32 on the call's device (None for other forms)."""
        return _int32(self.cu_q_array, self.device)

    @functools.cached_property
    def cu_kv_tensor(self) -> torch.Tensor | None:
        """Documents: `cu_kv` as int32 on the call's device (None for other forms)."""
        return _int32(self.cu_kv_array, self.device)

    @classmethod
    def band(cls, sq: int, sk: int, left: int, right: int) -> TileSlices:
        """One slice over sq x sk: query i sees key j iff -left <= j - i - (sk - sq) <= right
        (flash-attention's window, bottom-right aligned; -1 unbounded)."""
        if left < -1 or right < -1:
            raise ValueError(f"a band's window ({left}, {right}) must be >= -1 on each side")
        d = sk - sq
        bound = (0, sq, 0, sk, d - left if left >= 0 else None, d + right if right >= 0 else None)
        return cls((sq, sk), (bound,), BAND, flash_window=(left, right))

    @classmethod
    def of(cls, slices: list[Bound], shape: tuple[int, int], device: torch.device
           ) -> TileSlices:
        """A call's slices in its own rows, in the form a kernel takes them best: one slice
        over the whole call as a band, document-diagonal ones as documents, else slices."""
        slices = sorted(slices)
        sq, sk = shape
        if len(slices) == 1 and slices[0][:4] == (0, sq, 0, sk):
            lo, hi = slices[0][4:]
            d = sk - sq
            left, right = (-1 if lo is None else d - lo), (-1 if hi is None else hi - d)
            if left >= -1 and right >= -1 and (lo is None) == (left == -1) and (
                    hi is None) == (right == -1):
                return cls.band(sq, sk, left, right)
        cu = _diagonal(slices, shape)
        if cu is not None:
            return cls.documents(*cu, device)
        return cls(shape, tuple(slices), SLICES)

    @functools.cached_property
    def bottom_right(self) -> bool:
        """Documents: some causal one has more keys than queries (its causal is aligned at
        the bottom right, which not every kernel takes)."""
        return self.causal and self.cu_q_array is not None and bool(
            (np.diff(self.cu_q_array) != np.diff(self.cu_kv_array)).any())

    @functools.cached_property
    def max_q(self) -> int:
        """Documents: the most query rows of one."""
        return int(np.diff(self.cu_q_array).max())

    @functools.cached_property
    def max_kv(self) -> int:
        """Documents: the most key rows of one."""
        return int(np.diff(self.cu_kv_array).max())

    @functools.cached_property
    def runs(self) -> tuple[Run, ...]:
        """The call as runs (`tile_runs`): query rows against concatenated key ranges, each
        full, causal or a window at the bottom right; what kernels without a mask argument
        take (made once per call)."""
        return runs_of(self.slices, self.shape)

    def made_on(self, what: str, device: torch.device, make):
        """make(device), kept with the call per (what, device): a kernel's index tensors."""
        key = (what, torch.device(device))
        found = self._on_device.get(key)
        if found is None:
            found = self._on_device[key] = make(key[1])
        return found

    @functools.cached_property
    def pairs(self) -> int:
        """How many (query, key) pairs the call keeps (closed form)."""
        return sum(slice_pairs(*s) for s in self.slices)

    def seen(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """bool [sq, sk]: query row i sees key row j (made on each call)."""
        sq, sk = self.shape
        i = torch.arange(sq, device=device)[:, None]
        j = torch.arange(sk, device=device)[None, :]
        out = torch.zeros(sq, sk, dtype=torch.bool, device=device)
        for q0, q1, k0, k1, lo, hi in self.slices:
            out |= keeps(Bounds(q0, q1, k0, k1, -UNBOUNDED if lo is None else lo,
                                UNBOUNDED if hi is None else hi), i, j)
        return out

    def additive_mask(self, device: torch.device | str) -> torch.Tensor:
        """[sq, sk] fp32 on `device`: 0 where a query row sees a key row, -inf elsewhere. A
        band's is kept per shape and window (`BAND_MASK_BYTES`), other slices' with the
        call (made once per device); documents' is made per call (their kernels mostly
        take them as documents)."""
        device = torch.device(device)
        if self.form == BAND:
            return _band_bias(self.shape, self.flash_window, device)
        if self.form == DOCUMENTS:
            return additive(self.seen(device))
        bias = self._bias.get(device)
        if bias is None:
            bias = self._bias[device] = additive(self.seen(device))
        return bias


def _diagonal(slices: list[Bound], shape: tuple[int, int]
              ) -> tuple[tuple[int, ...], tuple[int, ...], bool] | None:
    """(cu_q, cu_kv, causal) where sorted `slices` are documents down the diagonal covering
    the call's rows (each full, or each causal aligned at the bottom right), else None."""
    cu_q, cu_kv, kinds = [0], [0], set()
    for q0, q1, k0, k1, lo, hi in slices:
        if (q0, k0) != (cu_q[-1], cu_kv[-1]) or lo is not None:
            return None
        if q1 - q0 == 1 and k1 - k0 == 1:
            pass  # one query and one key: full and causal alike
        elif hi is None:
            kinds.add(False)
        elif hi == k1 - q1 and q1 - q0 <= k1 - k0:
            kinds.add(True)
        else:
            return None
        cu_q.append(q1)
        cu_kv.append(k1)
    if len(kinds) > 1 or (cu_q[-1], cu_kv[-1]) != tuple(shape):
        return None
    return tuple(cu_q), tuple(cu_kv), bool(kinds) and kinds.pop()


def _int32(cu: np.ndarray | None, device: torch.device | None) -> torch.Tensor | None:
    if cu is None:
        return None
    return torch.from_numpy(cu.astype(np.int32)).to(device)


# at most this many bytes of band masks are kept (a larger one is made per call)
BAND_MASK_BYTES = 64 << 20


@functools.partial(BytesLRU, max_bytes=BAND_MASK_BYTES)
def _band_bias(shape: tuple[int, int], window: tuple[int, int], device: torch.device
               ) -> torch.Tensor:
    """The additive form of a band (0 seen, -inf not), made once per shape, window and
    device while the kept ones fit in `BAND_MASK_BYTES`: a layer's dense window tiles take
    a few shapes; packed documents bring new ones with their lengths."""
    sq, sk = shape
    left, right = window
    seen = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        seen = seen.tril(right + sk - sq)
    if left >= 0:
        seen = seen.triu(sk - sq - left)
    return additive(seen)


def additive(seen: torch.Tensor) -> torch.Tensor:
    """The additive form of a bool mask, the one way every tile's bias is made: fp32 of
    `seen`'s shape and device, 0 where it is True, -inf elsewhere."""
    return torch.zeros(seen.shape, dtype=torch.float32, device=seen.device).masked_fill_(
        ~seen, float("-inf"))
