"""Fit a `GpuProfile` to `scripts/bench_tiles.py --json` rows (numpy; deterministic).

Each row times, for one backend, pass and chunk s (P blocks per tile, heads, head dim):

    single  one call: s query rows against P s / 2 keys (P s when not causal), no mask
    tile    the rank-blocks of the middle rank x = P // 2 (`bench_calls`): causal, the
            diagonal block (s x s, causal), x blocks below it (s rows against s / 2 keys)
            and P - 1 - x above it (s / 2 rows against s keys); full, P s x s blocks; each
            call's partial merged (forward) or added in fp32 (backward). Rows of
            `--calls blocks` (and those written before the bench grouped its calls, which
            have no `grouped` field) ran one call per block; grouped rows, and a kernel
            taking whole tiles (flex), ran the calls their `pass_calls` count, the tile's
            FLOPs shared evenly by them over s query rows each, as the planner prices a
            tile (`GpuProfile.tile_seconds`)

Per backend and pass (`gpu_profile` for the model):
1. latency, rate, fill from the single calls: for each fill on a log grid, least squares
   of the relative error is linear in (latency, 1 / rate); the fill of least error wins.
2. host, merge from the tiles with those fixed: the least squared relative error over a
   grid of 1 us steps (0 to `MAX_FIXED_S`).
Rows of pass "fwd+bwd" are not fitted; `residuals` checks them as forward + backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from megatron_mesh.planner.gpu_profile import PASSES, PassFit, call_flops

FILL_GRID = np.geomspace(2.0**7, 2.0**17, 161)  # parallel units (b x heads x rows)
STEP_S = 1e-6
MAX_FIXED_S = 500e-6
BOTH = "fwd+bwd"
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

Calls = list[tuple[float, float]]  # (flops, units) per kernel call


def bench_calls(row: dict, phase: str) -> tuple[Calls, Calls]:
    """(single, tile) kernel calls of one `bench_tiles.py` row in `phase` (module
    docstring), as (flops, units)."""
    s, p, causal = int(row["chunk"]), int(row["cp_size"]), bool(row["causal"])
    heads, d = int(row["heads"]), int(row["head_dim"])
    b = int(row.get("batch", 1))

    def call(rows: int, cols: int, masked: bool = False) -> tuple[float, float]:
        return call_flops(phase, rows, cols, heads, d, masked, b), float(b * heads * rows)

    single = [call(s, p * s // 2 if causal else p * s)]
    if not causal:
        blocks = [call(s, s)] * p
    else:
        x = p // 2
        blocks = [call(s, s, True)] + [call(s, s // 2)] * x + [call(s // 2, s)] * (p - 1 - x)
    if "pass_calls" not in row:
        if row.get("grouped", False):
            raise ValueError(f"a grouped row (chunk {s}, {row['pass']}) without 'pass_calls': "
                             "rerun scripts/bench_tiles.py, whose rows count each pass's calls")
        return single, blocks
    n = int(row["pass_calls"][phase])
    if n == len(blocks) and not row.get("grouped", False):
        return single, blocks
    return single, [(sum(f for f, _ in blocks) / n, float(b * heads * s))] * n


def _single_fit(singles: Sequence[tuple[Calls, float]]) -> tuple[float, float, float]:
    """(latency, tflops, fill) of least squared relative error over the single calls."""
    y = np.array([t for _, t in singles])
    best = None
    for fill in FILL_GRID:
        a = np.array([[1.0, sum(f / min(1.0, u / fill) for f, u in calls)]
                      for calls, _ in singles]) / y[:, None]
        theta, *_ = np.linalg.lstsq(a, np.ones(len(y)), rcond=None)
        if theta[0] < 0:  # no negative latency: the rate alone
            theta = np.array([0.0, a[:, 1] @ np.ones(len(y)) / (a[:, 1] @ a[:, 1])])
        loss = float(((a @ theta - 1) ** 2).sum())
        if best is None or loss < best[0]:
            best = (loss, float(theta[0]), 1 / float(theta[1]) / 1e12, float(fill))
    assert best is not None
    return best[1], best[2], best[3]


def _tile_fit(tiles: Sequence[tuple[Calls, float]], latency: float, tflops: float,
              fill: float) -> tuple[float, float]:
    """(host, merge) of least squared relative error over the tiles."""
    grid = np.arange(0.0, MAX_FIXED_S + STEP_S / 2, STEP_S)
    probe = PassFit(latency, tflops, fill, 0.0, 0.0)
    y = np.array([t for _, t in tiles])
    best = None
    for host in grid:
        pred = np.zeros((len(grid), len(tiles)))
        for k, (calls, _) in enumerate(tiles):
            gpu = np.array([probe.gpu_seconds(f, u) for f, u in calls])
            pred[:, k] = latency + np.maximum(host, gpu[None, :] + grid[:, None]).sum(1)
        loss = ((pred / y - 1) ** 2).sum(1)
        j = int(loss.argmin())
        if best is None or loss[j] < best[0]:
            best = (float(loss[j]), float(host), float(grid[j]))
    assert best is not None
    return best[1], best[2]


def fit_pass(rows: Sequence[dict], phase: str) -> PassFit:
    """The `PassFit` of one backend's rows of `phase` (single and tile times)."""
    singles, tiles = [], []
    for row in rows:
        single, tile = bench_calls(row, phase)
        singles.append((single, row["single_ms"] * 1e-3))
        tiles.append((tile, row["tile_ms"] * 1e-3))
    latency, tflops, fill = _single_fit(singles)
    host, merge = _tile_fit(tiles, latency, tflops, fill)
    return PassFit(latency, tflops, fill, host, merge)


def check_rows(rows: Sequence[dict]) -> None:
    """Rows of one device and one half-precision dtype, each with the fields a fit reads."""
    need = ("backend", "chunk", "pass", "tile_ms", "single_ms", "device", "dtype", "cp_size",
            "heads", "kv_heads", "head_dim", "causal")
    if not rows:
        raise ValueError("no rows to fit")
    for i, row in enumerate(rows):
        missing = [k for k in need if k not in row]
        if missing:
            raise ValueError(f"row {i + 1} lacks {', '.join(missing)} (bench_tiles.py --json "
                             "rows have them)")
        if row.get("documents"):
            raise ValueError(f"row {i + 1} times {row['documents']} packed documents: the "
                             "profile is fitted to dense tiles (bench_tiles.py without "
                             "--documents)")
        if row["pass"] not in (*PASSES, BOTH):
            raise ValueError(f"row {i + 1}: pass {row['pass']!r} is not one of "
                             f"{', '.join((*PASSES, BOTH))}")
    merges = sorted({r["merge"] for r in rows if "merge" in r})
    if len(merges) > 1:
        raise ValueError(f"rows of several merges ({', '.join(merges)}): the profile prices "
                         "one merge; fit the rows of one")
    devices = sorted({r["device"] for r in rows})
    if len(devices) > 1:
        raise ValueError(f"rows of several devices ({', '.join(devices)}): fit one at a time")
    dtypes = sorted({r["dtype"] for r in rows})
    if dtypes not in (["bfloat16"], ["float16"]):
        raise ValueError(f"rows of dtype {', '.join(dtypes)}: the profile is fitted to one "
                         "half-precision dtype (bfloat16 or float16)")


def fit_rows(rows: Sequence[dict]) -> tuple[tuple[str, str, PassFit], ...]:
    """((backend, pass, PassFit), ...) for every backend of `rows`, in their order."""
    check_rows(rows)
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    out = []
    for backend in backends:
        for phase in PASSES:
            mine = [r for r in rows if r["backend"] == backend and r["pass"] == phase]
            if len(mine) < 3:
                raise ValueError(f"backend {backend} has {len(mine)} {phase} rows: a fit needs "
                                 "at least 3 chunk sizes")
            out.append((backend, phase, fit_pass(mine, phase)))
    return tuple(out)


@dataclass(frozen=True)
class Residual:
    """Fitted against measured time of one row: relative errors (fit / measured - 1)."""

    backend: str
    phase: str
    chunk: int
    heads: int
    kv_heads: int
    single: float
    tile: float

    @property
    def worst(self) -> float:
        return max(abs(self.single), abs(self.tile))


def predict(fits: dict[str, PassFit], row: dict) -> tuple[float, float]:
    """(single, tile) seconds of `row` from one backend's fits by pass (fwd+bwd: the sum,
    less the forward's latency: the bench waits once for both)."""
    phases = PASSES if row["pass"] == BOTH else (row["pass"],)
    single = tile = 0.0
    for phase in phases:
        one, calls = bench_calls(row, phase)
        single += fits[phase].calls_seconds(one)
        tile += fits[phase].calls_seconds(calls)
    if row["pass"] == BOTH:
        single -= fits["forward"].latency_s
        tile -= fits["forward"].latency_s
    return single, tile


def residuals(fits: Iterable[tuple[str, str, PassFit]], rows: Sequence[dict]) -> list[Residual]:
    """The relative error of the fitted time of every row (single and tile)."""
    by_backend: dict[str, dict[str, PassFit]] = {}
    for backend, phase, fit in fits:
        by_backend.setdefault(backend, {})[phase] = fit
    out = []
    for row in rows:
        single, tile = predict(by_backend[row["backend"]], row)
        out.append(Residual(row["backend"], row["pass"], int(row["chunk"]), int(row["heads"]),
                            int(row["kv_heads"]), single / (row["single_ms"] * 1e-3) - 1,
                            tile / (row["tile_ms"] * 1e-3) - 1))
    return out
