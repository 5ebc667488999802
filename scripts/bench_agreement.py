"""Cost of the per-call agreement of mesh attention (`megatron_mesh/runtime/agreement.py`) on gloo.

    python scripts/bench_agreement.py [--cp-sizes 2,4] [--calls 2000]

Spawns P gloo ranks on this machine per CP size and prints, per call: the signature's
digest alone (local), `agreement.agree` (the digest and one all_reduce of three int64 over
the CP group's gloo group), a bare all_reduce of the same three int64 on that group (what
the agreement adds beyond it is Python), and a whole mesh_attention forward + backward on a
small shape for scale. Microseconds: median and 90th percentile over --calls calls. With
megatron-core installed, also a mask builder's micro-batch: `build_mask` of a one-slice
builder on [2, 4096] tokens alone (build) and agreed over all P ranks' gloo group
(`mask_builder.agreed_mask`, what the driver does per micro-batch with --mesh-mask-builder).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import megatron_mesh as mm
from megatron_mesh.attention import MeshAttention
from megatron_mesh.runtime import agreement
from megatron_mesh.runtime.spawn import run_gloo


def _timed(fn, calls: int) -> tuple[float, float]:
    """(median, 90th percentile) microseconds of fn() over `calls` calls."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def _causal_builder(tokens: torch.Tensor, position_ids: torch.Tensor) -> list[tuple]:
    n = tokens.shape[-1]
    return [(0, n, 0, n, "causal")]


def _mask_rows(calls: int) -> dict[str, tuple[float, float]]:
    """build and agreed (module docstring); none without megatron-core."""
    try:
        from megatron_mesh.megatron.mask_builder import agreed_mask, build_mask
    except ModuleNotFoundError:
        return {}
    tokens = torch.zeros(2, 4096, dtype=torch.int64)
    group = dist.new_group(backend="gloo")
    return {"build": _timed(lambda: build_mask(_causal_builder, "bench", tokens, tokens),
                            calls),
            "agreed": _timed(lambda: agreed_mask(_causal_builder, "bench", tokens, tokens,
                                                 group), calls)}


def _rank(rank: int, world: int, calls: int) -> dict[str, tuple[float, float]]:
    grid = mm.MeshGrid.build(rows=world // 2 if world > 2 else world, cols=2 if world > 2 else 1)
    q = torch.randn(8, 1, 4, 16, requires_grad=True)
    layer = MeshAttention.build(q, q, q, grid)
    signature = layer.call_signature(q, q, q)
    out = {"digest": _timed(signature.digest, calls)}
    for _ in range(50):  # warm-up
        agreement.agree(grid, signature)
    three = torch.zeros(3, dtype=torch.int64)
    bare, agreed = [], []  # alternated, so that both see the same load
    for _ in range(calls):
        start = time.perf_counter()
        dist.all_reduce(three, op=dist.ReduceOp.MAX, group=grid.agreement_group)
        middle = time.perf_counter()
        agreement.agree(grid, signature)
        bare.append((middle - start) * 1e6)
        agreed.append((time.perf_counter() - middle) * 1e6)
    for name, times in (("all_reduce", bare), ("agree", agreed)):
        times.sort()
        out[name] = statistics.median(times), times[int(0.9 * (len(times) - 1))]

    def attention():
        layer(q, q, q).sum().backward()

    out["attention"] = _timed(attention, max(20, calls // 20))
    return {**out, **_mask_rows(calls)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp-sizes", default="2,4")
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    print("per call, microseconds (median / p90), gloo on this machine's CPUs")
    for world in map(int, args.cp_sizes.split(",")):
        results = run_gloo(_rank, world, args.calls)
        for name in ("digest", "all_reduce", "agree", "attention", "build", "agreed"):
            if name not in results[0]:
                continue
            per_rank = ", ".join(f"{r[name][0]:.1f} / {r[name][1]:.1f}" for r in results)
            print(f"P={world} {name:9s} {per_rank}")


if __name__ == "__main__":
    main()
