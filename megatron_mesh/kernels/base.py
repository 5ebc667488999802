"""The tile-kernel interface every backend implements.

A tile is one (query chunk x key/value chunk) attention call. Tensors use Megatron's
sbhd layout: q [sq, b, hq, d], k / v [sk, b, hkv, d] with hq % hkv == 0 (GQA / MQA are
handled by the kernel; K/V are never expanded by the caller).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..runtime.caches import BytesLRU
from .caps import KernelCaps, caps_of, kernel_name, what

logger = logging.getLogger("megatron_mesh.kernels")


@functools.lru_cache(maxsize=None)
def log_once(message: str) -> None:
    """Logs `message` (INFO, logger 'megatron_mesh.kernels') the first time it is given."""
    logger.info(message)


@dataclass(frozen=True)
class Segments:
    """The documents of one tile (packed sequences): query rows cu_q[i] .. cu_q[i+1] attend
    only key rows cu_kv[i] .. cu_kv[i+1] (causally, top-left aligned, where the tile is
    causal; then the two counts of a document are equal). No document is empty on either
    side, so every query row sees at least one key.

    `cu_q_tensor` / `cu_kv_tensor` are the same bounds as int32 tensors on the tiles' device,
    made once (the varlen kernels take them)."""

    cu_q: tuple[int, ...]
    cu_kv: tuple[int, ...]
    cu_q_tensor: torch.Tensor = field(compare=False, repr=False)
    cu_kv_tensor: torch.Tensor = field(compare=False, repr=False)

    @classmethod
    def build(cls, cu_q: tuple[int, ...], cu_kv: tuple[int, ...], device: torch.device
              ) -> Segments:
        as_tensor = lambda cu: torch.tensor(cu, dtype=torch.int32, device=device)  # noqa: E731
        return cls(tuple(cu_q), tuple(cu_kv), as_tensor(cu_q), as_tensor(cu_kv))

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in zip(self.cu_q, self.cu_q[1:]))

    @property
    def max_kv(self) -> int:
        return max(b - a for a, b in zip(self.cu_kv, self.cu_kv[1:]))

    def additive_mask(self, causal: bool, device: torch.device) -> torch.Tensor:
        """[sq, sk] fp32: 0 where a query row may see a key row, -inf elsewhere."""
        counts = lambda cu: torch.tensor(cu).diff()  # noqa: E731
        docs_q = torch.repeat_interleave(counts(self.cu_q))
        docs_kv = torch.repeat_interleave(counts(self.cu_kv))
        seen = docs_q[:, None] == docs_kv[None, :]
        if causal:
            start_q, start_kv = torch.tensor(self.cu_q[:-1]), torch.tensor(self.cu_kv[:-1])
            pos_q = torch.arange(self.cu_q[-1]) - start_q[docs_q]
            pos_kv = torch.arange(self.cu_kv[-1]) - start_kv[docs_kv]
            seen &= pos_kv[None, :] <= pos_q[:, None]
        mask = torch.zeros(seen.shape, dtype=torch.float32)
        return mask.masked_fill_(~seen, float("-inf")).to(device)


@dataclass(frozen=True, eq=False)
class TileMask:
    """The mask of a tile under a sliding window: query row i of sq sees key row j of sk
    where `seen` says so; every query row sees at least one key.

    Either a band, `flash_window` = (left, right) as flash-attention's window_size_left /
    right (bottom-right aligned: j - i - (sk - sq) in [-left, right], -1 unbounded), which
    every dense window tile is (`TileMask.band`; nothing of size sq x sk is kept), or an
    explicit bool [sq, sk] (windows inside packed documents, `TileMask.explicit`, its
    additive form made once on the tiles' device)."""

    shape: tuple[int, int]
    flash_window: tuple[int, int] | None = None
    explicit_seen: torch.Tensor | None = field(default=None, compare=False, repr=False)
    explicit_bias: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @classmethod
    def band(cls, sq: int, sk: int, left: int, right: int) -> TileMask:
        if left < -1 or right < -1:
            raise ValueError(f"a band's window ({left}, {right}) must be >= -1 on each side")
        return cls((sq, sk), (left, right))

    @classmethod
    def explicit(cls, seen: torch.Tensor, device: torch.device) -> TileMask:
        bias = torch.zeros(seen.shape, dtype=torch.float32).masked_fill_(~seen, float("-inf"))
        return cls(tuple(seen.shape), None, seen, bias.to(device))

    @property
    def seen(self) -> torch.Tensor:
        """bool [sq, sk] on the CPU (made on each call for a band)."""
        if self.flash_window is None:
            return self.explicit_seen
        return _band_seen(self.shape, self.flash_window, torch.device("cpu"))

    @functools.cached_property
    def pairs(self) -> int:
        """How many (query, key) pairs the mask keeps (a band's counted in closed form)."""
        if self.flash_window is None:
            return int(self.explicit_seen.sum())
        sq, sk = self.shape
        left, right = self.flash_window
        i = torch.arange(sq) + (sk - sq)
        first = (i - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
        last = (i + right).clamp(max=sk - 1) if right >= 0 else torch.full_like(i, sk - 1)
        return int((last - first + 1).clamp(min=0).sum())

    def additive_mask(self, causal: bool, device: torch.device) -> torch.Tensor:
        """[sq, sk] fp32: 0 where a query row may see a key row, -inf elsewhere (`causal`
        is folded into the mask already and ignored)."""
        if self.flash_window is not None:
            return _band_bias(self.shape, self.flash_window, torch.device(device))
        bias = self.explicit_bias
        return bias if bias.device == torch.device(device) else bias.to(device)


def _band_seen(shape: tuple[int, int], window: tuple[int, int], device: torch.device
               ) -> torch.Tensor:
    """bool [sq, sk]: key j - query i - (sk - sq) within [-left, right] (-1 unbounded)."""
    sq, sk = shape
    left, right = window
    seen = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        seen = seen.tril(right + sk - sq)
    if left >= 0:
        seen = seen.triu(sk - sq - left)
    return seen


# at most this many bytes of band masks are kept (a larger one is made per call)
BAND_MASK_BYTES = 64 << 20


@functools.partial(BytesLRU, max_bytes=BAND_MASK_BYTES)
def _band_bias(shape: tuple[int, int], window: tuple[int, int], device: torch.device
               ) -> torch.Tensor:
    """The additive form of a band (0 seen, -inf not), made once per shape, window and
    device while the kept ones fit in `BAND_MASK_BYTES`: a layer's dense window tiles take
    a few shapes; packed documents bring new ones with their lengths."""
    bias = torch.zeros(shape, dtype=torch.float32, device=device)
    return bias.masked_fill_(~_band_seen(shape, window, device), float("-inf"))


class TileKernel(Protocol):
    """Forward and backward of one attention tile, one signature for every kernel.

    `caps` declares what the kernel takes besides plain tiles (`caps.KernelCaps`:
    documents, tile masks, V's own head dim); a call carrying an input it does not declare
    raises ValueError naming the kernel and the capability (`check_call`)."""

    name: str
    caps: KernelCaps

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        softmax_scale: float,
        *,
        segments: Segments | None = None,
        mask: TileMask | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns out [sq, b, hq, dv] in q's dtype and lse [b, hq, sq] in fp32.

        `causal` with sq == sk is the plain causal mask; with sq < sk it is aligned at the
        bottom right (query i sees key j <= i + sk - sq), taken by kernels whose caps
        declare `bottom_right` (ValueError otherwise). With `segments` (packed
        documents; b = 1) attention stays inside each document's rows (`Segments`). With
        `mask` (sliding windows; then causal is False and segments None) query row i sees
        key row j where mask.seen[i, j]. Segments need `caps.documents`, a band mask
        `caps.window` (or `tile_mask`), an explicit one `caps.tile_mask`, dv != d
        `caps.v_head_dim`: ValueError otherwise.
        """
        ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        softmax_scale: float,
        *,
        segments: Segments | None = None,
        mask: TileMask | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns dq [sq, b, hq, d], dk [sk, b, hkv, d], dv [sk, b, hkv, dv] in the inputs'
        dtype; `segments` and `mask` as in `forward`.

        `out` [sq, b, hq, d] and `lse` [b, hq, sq] (fp32) are those of the WHOLE attention
        row, not of this tile: then the tile's gradients are exact partial sums. The
        kernel uses `out` only through D = rowsum(dout * out) (see `delta.py`).
        """
        ...


def call_needs(q: torch.Tensor, v: torch.Tensor, segments: Segments | None,
               mask: TileMask | None, causal: bool = False) -> KernelCaps:
    """What one call needs: q [sq, b, hq, d], v [sk, b, hkv, dv], its segments and mask,
    and whether it is causal (with sq != sk and no segments: bottom-right aligned)."""
    return KernelCaps(documents=segments is not None,
                      tile_mask=mask is not None and mask.flash_window is None,
                      window=mask is not None and mask.flash_window is not None,
                      v_head_dim=q.shape[-1] != v.shape[-1],
                      bottom_right=causal and segments is None and q.shape[0] != v.shape[0])


def check_call(kernel: object, q: torch.Tensor, v: torch.Tensor,
               segments: Segments | None = None, mask: TileMask | None = None,
               causal: bool = False) -> None:
    """ValueError, naming the kernel and the capability, when the call carries an input
    `kernel`'s caps do not declare."""
    if (segments is None and mask is None and q.shape[-1] == v.shape[-1]
            and not (causal and q.shape[0] != v.shape[0])):
        return  # a plain tile: every kernel takes it
    missing = caps_of(kernel).missing(call_needs(q, v, segments, mask, causal))
    if missing:
        raise ValueError(f"tile kernel {kernel_name(kernel)!r} does not take {what(missing)} "
                         f"(its caps: {caps_of(kernel)}; it declares what it takes in "
                         "`caps`, a KernelCaps)")


def dense_last_dim(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is dense (stride 1), else a contiguous copy.

    torch's fused attention ops read the head dim as dense without checking it: a view
    such as x[..., ::2] (stride 2) or an expanded gradient (stride 0) would be read wrong.
    Other strides (transposed [s, b] views, broadcast batches) they handle as they are.
    """
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()
