"""Which attention ops a piece of code dispatches (on any device, 'meta' included)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class AttentionOps(TorchDispatchMode):
    """Records the names of the aten attention ops dispatched inside it (`names`), how many
    ran (`calls`), and the element count of every additive mask (attn_mask / attn_bias) given
    to one (`masks`), with its shape and strides (`mask_layouts`)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()
        self.masks: list[int] = []
        self.mask_layouts: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "attention" in func.overloadpacket.__name__:
            self.names.add(func.overloadpacket.__name__)
            self.calls += 1
            given = dict(zip((a.name for a in func._schema.arguments), args), **(kwargs or {}))
            for name in ("attn_mask", "attn_bias", "bias"):
                if isinstance(given.get(name), torch.Tensor):
                    self.masks.append(given[name].numel())
                    self.mask_layouts.append((tuple(given[name].shape), given[name].stride()))
        return func(*args, **(kwargs or {}))
