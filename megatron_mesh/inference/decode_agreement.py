"""Every CP rank agrees on its decode steps: the same step, shapes, options and exchange.

A decode step runs one exchange per layer (`decode.py`). Ranks that decode different steps,
or a layer with a window, sinks or another exchange on some ranks only, would run different
collectives (a hang until the timeout) or merge partials of different attentions (silently
wrong outputs). So the session takes part in mesh attention's agreement
(`runtime/agreement.agree`: one all_reduce of a digest over the CP group; a second
collective naming the values that differ only when they differ) at calls chosen from the
layer numbers alone, the same calls on every rank:

  - each layer's first decode call of the session (L agreements at the first step);
  - after that, the last layer's call of each step (one agreement per generated token), on
    the step, that layer's options and the changes in the step's other layers: every
    other call compares its options with its layer's agreed ones locally (a tuple compare,
    no collective) and runs the agreed exchange, so a change on some ranks cannot hang the
    exchange and is named at the step's last layer, before the step's output leaves it.

A step past the cache's room is refused by the session on every rank before any collective
(every rank holds the same step and layout). The agreed options are kept per layer: bounded
by the model's layers, dropped with the session. `scripts/bench_decode_agreement.py`
measures what the agreement adds to a decode step (one all_reduce per step; about 5 us per
layer of local comparison).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from ..runtime import agreement
from ..runtime.grid import MeshGrid

_DIGEST_MASK = 0x7FFF_FFFF_FFFF_FFFF


@dataclass(frozen=True)
class DecodeOptions:
    """One layer's decode call as every rank must pass it (the step aside)."""

    layer: int
    q: tuple[int, ...]  # [1, b, hq, d]: the step's new queries
    kv: tuple[tuple[int, ...], tuple[int, ...]]  # k [1, b, hkv, d], v [1, b, hkv, dv]
    dtype: str
    softmax_scale: str  # its exact repr
    window_left: int | None
    sink: bool  # a softmax_offset is passed
    exchange: str  # `decode.EXCHANGES`
    cache: tuple[int, int, int, str]  # (P, padded prompt length, max_new, dense | packed)

    @classmethod
    def of(cls, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           window_left: int | None, sink: torch.Tensor | None, exchange: str,
           cache: tuple[int, int, int, str]) -> DecodeOptions:
        return cls(layer, tuple(q.shape), (tuple(k.shape), tuple(v.shape)),
                   str(q.dtype).removeprefix("torch."), repr(scale), window_left,
                   sink is not None, exchange, cache)

    def texts(self) -> dict[str, str]:
        """Each field as it reads in a message."""
        (k, v), (p, prompt, room, kind) = self.kv, self.cache
        return {
            "layer": str(self.layer),
            "shapes": f"q {list(self.q)} k {list(k)} v {list(v)} {self.dtype}",
            "softmax_scale": self.softmax_scale,
            "window_size": "none" if self.window_left is None else f"left {self.window_left}",
            "softmax_offset": "given" if self.sink else "none",
            "exchange": repr(self.exchange),
            "cache": f"{kind} prompts of {prompt} tokens over {p} ranks, room for {room} steps",
        }

    def change(self, agreed: DecodeOptions) -> str:
        """How this call differs from its layer's `agreed` options, as text."""
        mine, old = self.texts(), agreed.texts()
        return "; ".join(f"{name} {mine[name]} after {old[name]}" for name in mine
                         if mine[name] != old[name])


@dataclass(frozen=True)
class DecodeSignature:
    """A decode step as `agreement.agree` compares it."""

    step: int
    options: DecodeOptions
    changed: str  # the changes since the last agreement ("none": none)
    SUBJECT: ClassVar[str] = "a decode step"
    SAME: ClassVar[str] = ("the same step with the same shapes, softmax_scale, window_size, "
                           "softmax_offset, exchange and cache, and change none of them later")

    def digest(self) -> int:
        values = (self.step, tuple(getattr(self.options, f.name) for f in fields(self.options)),
                  self.changed)
        return int.from_bytes(hashlib.blake2b(repr(values).encode(), digest_size=8).digest(),
                              "little") & _DIGEST_MASK

    def texts(self) -> dict[str, str]:
        return {"step": str(self.step), **self.options.texts(),
                "changed since the last agreement": self.changed}


class DecodeAgreement:
    """Which decode calls of a session agree (module docstring), and the options agreed."""

    def __init__(self) -> None:
        self.agreed: dict[int, DecodeOptions] = {}  # layer -> its agreed options
        self.last: int | None = None  # the last layer of a step, known from the second step
        self._order: list[int] = []  # the layers of the first step, in call order
        self._changed: list[str] = []  # each call's change since the last agreement

    def agrees(self, layer: int) -> bool:
        """Whether this layer's call now takes part in the agreement (every rank alike)."""
        if layer not in self.agreed:
            return True
        if self.last is None:  # the first step is over: its last layer ends every step
            self.last = self._order[-1]
        return layer == self.last

    def before_exchange(self, grid: MeshGrid, step: int, options: DecodeOptions) -> str:
        """Collective at the calls `agrees` chose (ValueError on every rank naming what
        differs); local elsewhere. Returns the exchange to run: the agreed one."""
        if self.agrees(options.layer):
            changed = " | ".join(self._changed) or "none"
            agreement.agree(grid, DecodeSignature(step, options, changed))
            if options.layer not in self.agreed:
                self._order.append(options.layer)
            self.agreed[options.layer] = options
            self._changed.clear()
            return options.exchange
        agreed = self.agreed[options.layer]
        if options != agreed:  # at most one entry per layer of a step
            self._changed.append(f"layer {options.layer} at step {step}: "
                                 f"{options.change(agreed)}")
        return agreed.exchange
