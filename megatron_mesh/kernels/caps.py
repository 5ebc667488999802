"""What a tile kernel takes besides plain tiles, declared as a value (`KernelCaps`).

Every kernel declares `caps` (a class attribute, or set per object where it depends on the
kernel's parts: TE's runs documents, windows and masks on its own thd calls where its
release and backend query take them and the rest on its fallbacks, so it declares what its
fallbacks take); `get_kernel` chooses from the declarations and a
kernel refuses a call carrying an input its caps do not declare (`base.check_call`). A new
capability is a new field (default False: kernels that do not declare it do not take it)
with its words in `WHAT`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class KernelCaps:
    """What a kernel takes (or what a layer needs of one).

    documents:  `TileSlices` of form documents: packed documents (varlen tiles, b = 1);
    tile_mask:  any `TileSlices` of form band or slices (sliding windows; windows inside
                packed documents, masks given as slices: their additive bias);
    window:     `TileSlices` of form band only (`flash_window`, flash-attention's window);
                implied by `tile_mask`;
    v_head_dim: v [sk, b, hkv, dv] with dv != d (multi-latent attention);
    bottom_right: `causal` with sq < sk, aligned at the bottom right (query i sees key j
                where j <= i + sk - sq): the blocks of a tile grouped into one call with
                the diagonal's keys last (`calls.groups`). Without it a kernel's causal is
                top-left aligned (cuDNN through torch, Transformer Engine's "causal") and
                takes sq == sk only.
    whole_tile: the blocks a rank has on hand together as ONE call with the tile's mask
                (`tile_forward` / `tile_backward` taking a `flex.TileMask`;
                `schedules/whole_tile.py`) in place of grouped calls.
    """

    documents: bool = False
    tile_mask: bool = False
    window: bool = False
    v_head_dim: bool = False
    bottom_right: bool = False
    whole_tile: bool = False

    @classmethod
    def of(cls, needs: KernelCaps | Iterable[str] | str | None) -> KernelCaps:
        """`needs` as caps: caps as they are, None as none, names (one or several) as the
        caps with those fields set; ValueError for a name that is no field."""
        if needs is None:
            return cls()
        if isinstance(needs, KernelCaps):
            return needs
        names = {needs} if isinstance(needs, str) else set(needs)
        unknown = names - set(NAMES)
        if unknown:
            raise ValueError(f"unknown kernel capabilities {sorted(unknown)}; known: "
                             f"{', '.join(NAMES)}")
        return cls(**{n: True for n in names})

    @property
    def names(self) -> tuple[str, ...]:
        """The fields set, in declaration order."""
        return tuple(n for n in NAMES if getattr(self, n))

    def __or__(self, other: KernelCaps) -> KernelCaps:
        return KernelCaps(**{n: getattr(self, n) or getattr(other, n) for n in NAMES})

    def missing(self, needs: KernelCaps) -> tuple[str, ...]:
        """The names `needs` sets that these caps do not cover (`tile_mask` covers
        `window`)."""
        return tuple(n for n in needs.names
                     if not (getattr(self, n) or (n == "window" and self.tile_mask)))

    def covers(self, needs: KernelCaps) -> bool:
        return not self.missing(needs)

    def __str__(self) -> str:
        return ", ".join(self.names) or "plain tiles only"


NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(KernelCaps))

# What each capability is, in the words of the layer's options (for error messages).
WHAT = {
    "documents": "packed documents (cu_seqlens)",
    "tile_mask": "sliding windows (window_size) or masks given as slices (mask=)",
    "window": "sliding-window bands (flash-attention windows)",
    "v_head_dim": "a V head dim of its own (multi-latent attention)",
    "bottom_right": "causal tiles of more keys than queries (bottom-right aligned)",
    "whole_tile": "a rank's whole tile as one call with a block mask",
}

NONE = KernelCaps()
WINDOWS = KernelCaps(tile_mask=True)  # what a layer under a sliding window needs


def what(names: Iterable[str]) -> str:
    """The words of `names`, joined ('packed documents (cu_seqlens) and ...')."""
    return " and ".join(WHAT[n] for n in names)


def caps_of(kernel: object) -> KernelCaps:
    """The caps `kernel` declares; one that declares none takes plain tiles only."""
    caps = getattr(kernel, "caps", NONE)
    if not isinstance(caps, KernelCaps):
        raise TypeError(f"tile kernel {kernel_name(kernel)!r}: caps must be a KernelCaps, "
                        f"got {type(caps).__name__}")
    return caps


def kernel_name(kernel: object) -> str:
    return getattr(kernel, "name", type(kernel).__name__)


__all__ = ["KernelCaps", "NAMES", "NONE", "WHAT", "WINDOWS", "caps_of", "kernel_name", "what"]
