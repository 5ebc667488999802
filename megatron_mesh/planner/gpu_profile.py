"""A GPU's attention kernel time, fitted to measured tiles (`profiles/*.json`).

One kernel call of F FLOPs (forward 4 b hq d rows cols, half when causal; backward 2.5 x
that) spreads over u = b hq rows parallel units (batch x query heads x query rows):

    gpu(call) = F / (rate x min(1, u / fill))     the GPU's time: below `fill` units the
                                                   call leaves part of the GPU idle
    one call  = latency + gpu(call)                alone, waited for
    a tile    = latency + sum_i max(host, gpu(call_i) + merge)
                                                   n calls in a row: the host issues each in
                                                   `host` seconds while the GPU runs the one
                                                   before; each call's partial is merged
                                                   (forward) or accumulated (backward) in
                                                   `merge` seconds of GPU time

`latency`, `rate` (TFLOP/s), `fill` (units), `host` and `merge` are fitted per kernel backend
(torch, cudnn) and pass (forward, backward) to `scripts/bench_tiles.py` rows
(`scripts/fit_gpu_profile.py`, `planner.profile_fit`). Measured in bf16 at head dim 128:
other head dims scale by their FLOPs at the same rate, fp16 runs at bf16's rate, fp32 at
`dtype_rate` (a data-sheet ratio, not measured); the K/V heads do not enter (GQA rows fit
the same parameters). A profile may be another's scaled (`scaled_from`, `rate_scale`): its
rates are the base's times the scale, and it says so (`measured` False). Torch-free.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from megatron_mesh.layer_plan import BACKEND_NAMES, BACKWARD_FLOPS_RATIO, attention_flops

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
GPU_PROFILES = ("h100", "h200")  # --gpu names: profiles/<name>.json
PASSES = ("forward", "backward")
TFLOP = 1e12


@dataclass(frozen=True)
class PassFit:
    """One backend's fitted kernel time in one pass (module docstring)."""

    latency_s: float
    tflops: float
    fill_units: float
    host_s: float
    merge_s: float

    def gpu_seconds(self, flops: float, units: float) -> float:
        """GPU time of one call of `flops` over `units` parallel units."""
        return flops / (self.tflops * TFLOP * min(1.0, units / self.fill_units))

    def in_tile_seconds(self, flops: float, units: float) -> float:
        """One call's share of a tile: max(host, gpu + merge)."""
        return max(self.host_s, self.gpu_seconds(flops, units) + self.merge_s)

    def calls_seconds(self, calls: Sequence[tuple[float, float]]) -> float:
        """Seconds of `calls` ((flops, units) each): one alone, or a tile of several."""
        if len(calls) == 1:
            return self.latency_s + self.gpu_seconds(*calls[0])
        return self.latency_s + sum(self.in_tile_seconds(f, u) for f, u in calls)

    def scaled(self, rate: float = 1.0, time: float = 1.0) -> PassFit:
        """Rates times `rate`, fixed times (latency, host, merge) times `time`."""
        return PassFit(self.latency_s * time, self.tflops * rate, self.fill_units,
                       self.host_s * time, self.merge_s * time)


def call_flops(phase: str, rows: int, cols: int, heads: int, head_dim: int, causal: bool,
               batch: int = 1) -> float:
    """FLOPs of one call: `rows` queries of `heads` heads x `head_dim` against `cols` keys."""
    check_phase(phase)
    flops = attention_flops(rows, cols, batch, heads, head_dim, causal)
    return flops if phase == "forward" else BACKWARD_FLOPS_RATIO * flops


def check_phase(phase: str) -> None:
    if phase not in PASSES:
        raise ValueError(f"pass {phase!r} is not one of {', '.join(PASSES)}")


@dataclass(frozen=True)
class GpuProfile:
    """A GPU's fitted kernel time: `fits` ((backend, pass, PassFit), ...), the backend the
    planner prices (`backend`: what backend 'auto' runs there without Transformer Engine),
    dtype rate factors ((dtype, factor), ...), and where the numbers come from; `kernel`:
    the tile kernel whose calls the planner counts where it is not `backend` (one without a
    fit here, priced at `backend`'s fitted time: `for_kernel`)."""

    name: str
    machine: str
    versions: tuple[tuple[str, str], ...]
    date: str
    source: str
    measured: bool
    note: str
    backend: str
    dtype_rate: tuple[tuple[str, float], ...]
    fits: tuple[tuple[str, str, PassFit], ...]
    max_rel_error: float
    kernel: str | None = None

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(b for b, _, _ in self.fits))

    @property
    def calls_backend(self) -> str:
        """The tile kernel whose calls are counted (`kernel`, else `backend`)."""
        return self.kernel or self.backend

    def for_kernel(self, kernel: str) -> GpuProfile:
        """This profile pricing the tile kernel `kernel` (`layer_plan.BACKEND_NAMES`, e.g.
        --mesh-kernel): 'auto' as it is; a kernel with a fit here by that fit; any other by its
        own calls (`pricing.tiles.KernelCalls`: flex takes a group on hand in one call) at
        `backend`'s fitted time a call (MODEL: it is not measured; `describe` says so)."""
        if kernel not in BACKEND_NAMES:
            raise ValueError(f"tile kernel {kernel!r} is not one of {', '.join(BACKEND_NAMES)}")
        if kernel == "auto":
            return self
        if kernel in self.backends:
            return replace(self, backend=kernel, kernel=None)
        return replace(self, kernel=kernel)

    def fit(self, phase: str, backend: str | None = None) -> PassFit:
        """The fit of `backend` (default: the profile's) in `phase`."""
        check_phase(phase)
        backend = backend or self.backend
        for b, p, fit in self.fits:
            if b == backend and p == phase:
                return fit
        raise ValueError(f"GPU profile {self.name} has no backend {backend!r}; it has "
                         + ", ".join(self.backends))

    def rate_factor(self, dtype: str) -> float:
        for name, factor in self.dtype_rate:
            if name == dtype:
                return factor
        raise ValueError(f"GPU profile {self.name} prices no dtype {dtype!r}; it prices "
                         + ", ".join(n for n, _ in self.dtype_rate))

    def _fit(self, phase: str, dtype: str, backend: str | None) -> PassFit:
        return self.fit(phase, backend).scaled(rate=self.rate_factor(dtype))

    def call_seconds(self, phase: str, rows: int, cols: int, heads: int, kv_heads: int,
                     head_dim: int, dtype: str = "bf16", causal: bool = False, batch: int = 1,
                     calls: int = 1, backend: str | None = None) -> float:
        """Seconds of `calls` kernel calls of one shape (rows x cols, `heads` query and
        `kv_heads` K/V heads of `head_dim`, causal or full): one alone (calls = 1), or a tile
        of several in a row (each merged: module docstring)."""
        if heads % kv_heads:
            raise ValueError(f"heads {heads} must be a multiple of kv_heads {kv_heads}")
        flops = call_flops(phase, rows, cols, heads, head_dim, causal, batch)
        return self.tile_seconds(phase, calls * flops, calls, rows, heads, batch, dtype, backend)

    def tile_seconds(self, phase: str, flops: float, calls: int, rows: int, heads: int,
                     batch: int = 1, dtype: str = "bf16", backend: str | None = None) -> float:
        """Seconds of a pass's `flops` split evenly over `calls` calls of `rows` query rows of
        `heads` heads each: latency + gpu for one call, latency + calls x max(host, gpu +
        merge) for several."""
        if calls < 1:
            raise ValueError(f"calls must be a positive integer, got {calls!r}")
        fit = self._fit(phase, dtype, backend)
        units = batch * heads * rows
        if calls == 1:
            return fit.calls_seconds([(flops, units)])
        return fit.latency_s + calls * fit.in_tile_seconds(flops / calls, units)

    def share_seconds(self, phase: str, flops: float, rows: int, heads: int, batch: int = 1,
                      dtype: str = "bf16", backend: str | None = None) -> float:
        """One call's share of a tile (max(host, gpu + merge)): what an emulated kernel
        sleeps per call, the pass's latency left out."""
        return self._fit(phase, dtype, backend).in_tile_seconds(flops, batch * heads * rows)

    def scaled(self, rate: float = 1.0, time: float = 1.0, **changes) -> GpuProfile:
        """Every fit's rates times `rate`, fixed times times `time` (e.g. a GPU played
        `time` times slower: rate = 1 / time), other fields as `changes`."""
        fits = tuple((b, p, f.scaled(rate, time)) for b, p, f in self.fits)
        return replace(self, fits=fits, **changes)

    def describe(self) -> str:
        """One line for people: the profile, its kernels and where its numbers come from."""
        versions = ", ".join(f"{k} {v}" for k, v in self.versions)
        how = "measured" if self.measured else "SCALED, not measured"
        kernels = (f"{self.backend} kernels" if self.calls_backend == self.backend else
                   f"{self.kernel} calls at {self.backend}'s fitted time a call (no "
                   f"{self.kernel} fit: MODEL)")
        return (f"GPU profile {self.name} ({how}): {kernels}, {self.machine}, "
                f"{versions}, {self.date}" + (f"; {self.note}" if self.note else ""))


def profile_from_dict(data: dict, base: GpuProfile | None = None) -> GpuProfile:
    """A profile from its JSON form (`profile_to_dict`); a scaled one from its `base`."""
    if "scaled_from" in data:
        if base is None:
            raise ValueError(f"profile {data['name']} is scaled from {data['scaled_from']}: "
                             "give its base")
        return base.scaled(
            rate=float(data["rate_scale"]), name=data["name"], machine=data["machine"],
            date=data["date"], source=f"{base.source}; {data['source']}", measured=False,
            note=data["note"])
    fits = tuple((backend, phase, PassFit(**fit)) for backend, passes in data["fits"].items()
                 for phase, fit in passes.items())
    return GpuProfile(
        name=data["name"], machine=data["machine"],
        versions=tuple((str(k), str(v)) for k, v in data["versions"].items()),
        date=data["date"], source=data["source"], measured=bool(data.get("measured", True)),
        note=data.get("note", ""), backend=data["backend"],
        dtype_rate=tuple((k, float(v)) for k, v in data["dtype_rate"].items()),
        fits=fits, max_rel_error=float(data["max_rel_error"]))


def profile_to_dict(profile: GpuProfile) -> dict:
    """The JSON form of a measured profile (`profile_from_dict` reads it back)."""
    fits: dict[str, dict[str, dict[str, float]]] = {}
    for backend, phase, fit in profile.fits:
        fits.setdefault(backend, {})[phase] = vars(fit).copy()
    return {"name": profile.name, "machine": profile.machine,
            "versions": dict(profile.versions), "date": profile.date,
            "source": profile.source, "measured": profile.measured, "note": profile.note,
            "backend": profile.backend, "dtype_rate": dict(profile.dtype_rate),
            "max_rel_error": profile.max_rel_error, "fits": fits}


@functools.lru_cache(maxsize=len(GPU_PROFILES))
def load_profile(name: str) -> GpuProfile:
    """The profile called `name` (one of `GPU_PROFILES`) from the package's data."""
    if name not in GPU_PROFILES:
        raise ValueError(f"GPU profile {name!r} is not one of {', '.join(GPU_PROFILES)}")
    data = json.loads((PROFILE_DIR / f"{name}.json").read_text())
    base = load_profile(data["scaled_from"]) if "scaled_from" in data else None
    return profile_from_dict(data, base)


def profile_for_device(device_name: str | None) -> str | None:
    """The profile (one of `GPU_PROFILES`) a CUDA device name names as a model number:
    'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100'; None for any other device
    ('NVIDIA A100-SXM4-80GB', 'NVIDIA GH200 480GB') or none (None, '')."""
    if not device_name:
        return None
    text = device_name.lower()
    for name in GPU_PROFILES:
        if re.search(rf"(?<![a-z0-9]){re.escape(name)}(?![0-9])", text):
            return name
    return None
