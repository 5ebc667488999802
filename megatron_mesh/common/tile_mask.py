"""The mask of one tile call, as the masks make it and the kernels take it.

`Segments`: the documents of a tile (packed sequences, as varlen bounds); `TileMask`: a
sliding window's band or an explicit bool [sq, sk]. Rows are the tile's query rows, columns
its key / value rows.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .caches import BytesLRU


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
        return additive(seen).to(device)


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
        return cls(tuple(seen.shape), None, seen, additive(seen).to(device))

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
    return additive(_band_seen(shape, window, device))


def additive(seen: torch.Tensor) -> torch.Tensor:
    """The additive form of a bool mask, the one way every tile's bias is made: fp32 of
    `seen`'s shape and device, 0 where it is True, -inf elsewhere."""
    return torch.zeros(seen.shape, dtype=torch.float32, device=seen.device).masked_fill_(
        ~seen, float("-inf"))
