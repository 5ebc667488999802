"""The tile-kernel interface every backend implements.

A tile is one (query chunk x key/value chunk) attention call. Tensors use Megatron's
sbhd layout: q [sq, b, hq, d], k / v [sk, b, hkv, d] with hq % hkv == 0 (GQA / MQA are
handled by the kernel; K/V are never expanded by the caller).
"""
from __future__ import annotations

import functools
import logging
from typing import Protocol

import torch

from ..calls.tile_slices import BAND, DOCUMENTS, TileSlices
from .caps import KernelCaps, caps_of, kernel_name, what

logger = logging.getLogger("megatron_mesh.kernels")


@functools.lru_cache(maxsize=None)
def log_once(message: str) -> None:
    """Logs `message` (INFO, logger 'megatron_mesh.kernels') the first time it is given."""
    logger.info(message)


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
        slices: TileSlices | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns out [sq, b, hq, dv] in q's dtype and lse [b, hq, sq] in fp32.

        `causal` with sq == sk is the plain causal mask; with sq < sk it is aligned at the
        bottom right (query i sees key j <= i + sk - sq), taken by kernels whose caps
        declare `bottom_right` (ValueError otherwise). With `slices` (`TileSlices`) query
        row i sees key row j where a slice of the call keeps the pair, and `causal` is the
        slices' own (documents: each causal; else False): documents (b = 1) need
        `caps.documents`, a band `caps.window` (or `tile_mask`), other slices
        `caps.tile_mask`, dv != d `caps.v_head_dim`: ValueError otherwise.
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
        slices: TileSlices | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns dq [sq, b, hq, d], dk [sk, b, hkv, d], dv [sk, b, hkv, dv] in the inputs'
        dtype; `slices` as in `forward`.

        `out` [sq, b, hq, d] and `lse` [b, hq, sq] (fp32) are those of the WHOLE attention
        row, not of this tile: then the tile's gradients are exact partial sums. The
        kernel uses `out` only through D = rowsum(dout * out) (see `delta.py`).
        """
        ...


def call_needs(q: torch.Tensor, v: torch.Tensor, slices: TileSlices | None,
               causal: bool = False) -> KernelCaps:
    """What one call needs: q [sq, b, hq, d], v [sk, b, hkv, dv], its slices, and whether
    it is causal (with sq != sk and no slices: bottom-right aligned). Documents of more keys
    than queries need `bottom_right` only of a kernel that takes no tile masks: one that
    does runs them as runs (`run_calls`), splitting them where its causal is top-left."""
    form = None if slices is None else slices.form
    return KernelCaps(documents=form == DOCUMENTS, tile_mask=form not in (None, DOCUMENTS, BAND),
                      window=form == BAND, v_head_dim=q.shape[-1] != v.shape[-1],
                      bottom_right=(causal and slices is None and q.shape[0] != v.shape[0]))


def documents_need_bottom_right(kernel: object, slices: TileSlices | None) -> bool:
    """Whether a documents call of more keys than queries needs `kernel` to declare
    `bottom_right`: where its caps take no tile masks (it has no runs to split them)."""
    return (slices is not None and slices.form == DOCUMENTS and slices.bottom_right
            and not caps_of(kernel).tile_mask)


def check_call(kernel: object, q: torch.Tensor, v: torch.Tensor,
               slices: TileSlices | None = None, causal: bool = False) -> None:
    """ValueError, naming the kernel and the capability, when the call carries an input
    `kernel`'s caps do not declare."""
    if (slices is None and q.shape[-1] == v.shape[-1]
            and not (causal and q.shape[0] != v.shape[0])):
        return  # a plain tile: every kernel takes it
    needs = call_needs(q, v, slices, causal)
    if documents_need_bottom_right(kernel, slices):
        needs = needs | KernelCaps(bottom_right=True)
    missing = caps_of(kernel).missing(needs)
    if missing:
        raise ValueError(f"tile kernel {kernel_name(kernel)!r} does not take {what(missing)} "
                         f"(its caps: {caps_of(kernel)}; it declares what it takes in "
                         "`caps`, a KernelCaps)")


def folds_diagonal(kernel: object, q: torch.Tensor) -> bool:
    """Whether a grouped tile on tensors like q [sq, b, hq, d] gives `kernel` a causal
    diagonal with the keys of the full blocks before it, as one call aligned at the bottom
    right (`calls.groups`): where its caps declare `bottom_right` and, if it says
    (`bottom_right_mask_free(q)`), it takes that call without building a mask of sq x sk.
    Elsewhere the diagonal stays a call of its own."""
    if not caps_of(kernel).bottom_right:
        return False
    mask_free = getattr(kernel, "bottom_right_mask_free", None)
    return True if mask_free is None else bool(mask_free(q))


def dense_last_dim(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is dense (stride 1), else a contiguous copy.

    torch's fused attention ops read the head dim as dense without checking it: a view
    such as x[..., ::2] (stride 2) or an expanded gradient (stride 0) would be read wrong.
    Other strides (transposed [s, b] views, broadcast batches) they handle as they are.
    """
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()
