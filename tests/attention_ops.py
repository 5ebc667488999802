"""Which attention ops a piece of code dispatches (on any device, 'meta' included)."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class AttentionOps(TorchDispatchMode):
    """Records the names of the aten attention ops dispatched inside it (`names`)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "attention" in func.overloadpacket.__name__:
            self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
