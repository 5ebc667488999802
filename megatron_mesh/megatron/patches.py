"""Every replacement of a third-party name this package makes, in one registry.

A `Patch` names a module attribute (torch's or megatron-core's), what stands in for it and
why. `patched(*names)` applies them for the duration of a `with` block and restores the
originals on exit, in reverse order, also when the block raises. Each patch is behind a
guard: its module must import and hold the name (else RuntimeError naming the patch, never
a silent no-op), and the package's version must lie in the range the patch was checked
against (outside it: one warning, and the patch still applies). `tests/unit/test_patches.py`
fails when a patched name disappears from the installed packages.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from megatron_mesh.megatron.compat import SUPPORTED

__all__ = ["PATCHES", "Patch", "patched"]


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


@dataclass(frozen=True)
class Patch:
    """`module.attribute` replaced by `replacement()` (a factory: called when applied)."""

    module: str
    attribute: str
    replacement: Callable[[], Any]
    package: str  # the distribution whose version guards the patch
    checked: tuple[str, str]  # [lowest, highest) versions the patch was checked against
    why: str

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"

    def target(self) -> Any:
        """The module holding the name; RuntimeError when it or the name is gone."""
        try:
            module = importlib.import_module(self.module)
        except ImportError as e:
            raise RuntimeError(f"patch {self.name}: cannot import {self.module} ({e})") from None
        if not hasattr(module, self.attribute):
            raise RuntimeError(
                f"patch {self.name}: {self.package} {self.version()} has no {self.attribute} "
                f"in {self.module} (checked against {self.checked[0]} to {self.checked[1]}); "
                f"the patch needs revisiting ({self.why})")
        return module

    def version(self) -> str:
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return "(not installed)"

    def in_checked_range(self) -> bool:
        have = _version_tuple(self.version())
        low, high = (_version_tuple(v) for v in self.checked)
        return bool(have) and low <= have < high


def _cpu_current_device() -> str:
    """'cpu', where torch answers a CUDA index: megatron-core passes the answer on as a
    device, also inside calls that `cpu.megatron_on_cpu`'s function mode already handles
    (autograd's backward runs its layers' `torch.empty(device=current_device())`), where
    the mode sees nothing and an index would ask for a CUDA device."""
    return "cpu"


def _no_cuda_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _placed_rope() -> Callable[..., Any]:
    from megatron_mesh.megatron.rope import placed_apply_rotary_pos_emb

    return placed_apply_rotary_pos_emb


_TORCH = ("2.4", "3")
_MCORE = tuple(str(v) for v in SUPPORTED)  # the megatron-core releases tested

PATCHES: dict[str, Patch] = {p.name: p for p in (
    Patch("torch.cuda", "current_device", lambda: _cpu_current_device, "torch", _TORCH,
          "megatron-core asks it where to put RoPE frequencies and buffers"),
    Patch("torch.cuda", "current_stream", lambda: torch.cpu.current_stream, "torch", _TORCH,
          "megatron-core's DDP (0.19) waits on its events before a gradient reduction"),
    Patch("torch.cuda", "synchronize", lambda: _nothing, "torch", _TORCH,
          "the dist-checkpoint writer synchronizes after staging tensors in host memory"),
    Patch("megatron.core.tensor_parallel.random", "_get_cuda_rng_state",
          lambda: _no_cuda_rng_state, "megatron-core", _MCORE,
          "activation recomputation saves the CUDA generator's state"),
    Patch("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", lambda: _nothing,
          "megatron-core", _MCORE, "activation recomputation restores that state"),
    *(Patch(module, "apply_rotary_pos_emb", _placed_rope, "megatron-core", _MCORE,
            "RoPE of documents placed over the CP ranks (PlacedSeqParams) at each row's "
            "position in its document (megatron_mesh.megatron.placed_documents, rope)")
      for module in ("megatron.core.transformer.attention",
                     "megatron.core.transformer.multi_latent_attention")),
    Patch("megatron.core.dist_checkpointing.strategies.filesystem_async", "_results_queue",
          lambda: None, "megatron-core", _MCORE,
          "the checkpoint writer's results queue: one served by a manager process that exits "
          "with the rank (the caller passes it in `values`)"),
)}

_warned: set[str] = set()


@contextlib.contextmanager
def patched(*names: str, values: dict[str, Any] | None = None) -> Iterator[None]:
    """Within the block, the registered patches `names` are in force; the originals come
    back on exit. `values` gives a replacement per name in place of the registry's."""
    values = values or {}
    undo: list[tuple[Any, str, Any]] = []
    try:
        for name in names:
            patch = PATCHES[name]
            module = patch.target()
            if not patch.in_checked_range() and name not in _warned:
                _warned.add(name)
                warnings.warn(f"patch {name}: {patch.package} {patch.version()} is outside the "
                              f"versions it was checked against ({patch.checked[0]} to "
                              f"{patch.checked[1]}); applying it anyway", stacklevel=3)
            undo.append((module, patch.attribute, getattr(module, patch.attribute)))
            setattr(module, patch.attribute,
                    values[name] if name in values else patch.replacement())
        yield
    finally:
        for module, attribute, original in reversed(undo):
            setattr(module, attribute, original)
