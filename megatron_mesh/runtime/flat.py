"""Several tensors of one dtype laid out back to back in one flat buffer.

Lets one collective or one ring message carry tensors of different shapes (K [s, b, h, d]
beside V [s, b, h, dv] with multi-latent attention's own V head dim; Q beside dO) without
padding: the buffer holds exactly the elements of its parts.
"""
from __future__ import annotations

from typing import Sequence

import torch


def flat_size(shapes: Sequence[torch.Size | tuple[int, ...]]) -> int:
    """Elements of a buffer holding tensors of `shapes`."""
    return sum(int(torch.Size(s).numel()) for s in shapes)


def views(flat: torch.Tensor, shapes: Sequence[torch.Size | tuple[int, ...]]
          ) -> tuple[torch.Tensor, ...]:
    """The parts of `flat` (1-D, `flat_size(shapes)` elements) as views of `shapes`."""
    out, offset = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        out.append(flat[offset:offset + n].view(shape))
        offset += n
    return tuple(out)


def pack(parts: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """`parts` copied back to back into `out` (1-D; a new buffer when None)."""
    if out is None:
        out = parts[0].new_empty(flat_size([p.shape for p in parts]))
    for slot, part in zip(views(out, [p.shape for p in parts]), parts):
        slot.copy_(part)
    return out
