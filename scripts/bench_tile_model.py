"""MODEL: a rank's tile against one fused call, as a GPU profile prices them, on every grid.

For each heads x rows x cols grid of P ranks and each chunk size (the query rows of one
block, S A / P), the rank's tile is the calls its schedule makes (`planner.pricing.tiles
.mesh_calls`: grouped as the tiles run them, the diagonal folded where the backend folds
it); the same pass FLOPs in one call of the tile's query rows is the floor. The ratio
one call / tile (forward + backward) is the tile's efficiency; beside it the memory model's
extra bytes per rank of that plan (`cost_models.memory.extra_memory`, for the backend's
calls: the diagonal folded where it folds it, one call a group for 'flex'). Every number is
MODEL (the profile's fit, not a measurement); the goal column is 90 / 85 / 75% at
8K / 4K / 2K tokens a chunk. --backend names the tile kernel (`GpuProfile.for_kernel`): one
the profile fits by its fit; 'flex' and 'te', which it does not fit, by their own calls at
the profile kernel's time a call (what such a kernel would give at that speed).

    python scripts/bench_tile_model.py                             # P = 8..64, MHA and GQA
    python scripts/bench_tile_model.py --cp-sizes 8 --chunks 2048 --backend torch
    python scripts/bench_tile_model.py --backend flex --schedule gathered
"""
from __future__ import annotations

import argparse
import sys

from megatron_mesh.cost_models.memory import extra_memory
from megatron_mesh.layer_plan import grid_shapes, heads_sizes
from megatron_mesh.planner.gpu_profile import load_profile
from megatron_mesh.planner.pricing.tiles import KernelCalls, mesh_calls
from megatron_mesh.planner.pricing.workload import Workload

GOALS = {8192: 0.90, 4096: 0.85, 2048: 0.75}
MiB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="h200", help="planner/profiles/<name>.json")
    p.add_argument("--backend", default="auto",
                   help="the tile kernel to price: auto (the profile's), torch, cudnn, te, flex")
    p.add_argument("--cp-sizes", default="8,16,32,64", help="P, comma-separated")
    p.add_argument("--chunks", default="2048,4096,8192", help="tokens a chunk, comma-separated")
    p.add_argument("--heads", default="16/16,32/8", help="query/kv heads, comma-separated")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--schedule", default=None,
                   help="the mesh schedule (default: the driver's, resolved per grid)")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    return p.parse_args(argv)


def tile_row(profile, workload: Workload, cp_size: int, grid: tuple[int, int, int]) -> dict:
    """The tile's and one call's seconds (forward, backward) and the plan's extra bytes, for
    the calls of `profile.calls_backend` at `profile.backend`'s time a call."""
    a, r, c = grid
    backend = profile.calls_backend
    calls = mesh_calls(workload, cp_size, r, c, a, backend=backend)
    chunk = workload.seq_length * a // cp_size
    flops = {"forward": workload.forward_flops() / cp_size,
             "backward": workload.backward_flops() / cp_size}
    tile = one = 0.0
    for phase in ("forward", "backward"):
        tile += profile.tile_seconds(phase, flops[phase], calls.count(phase), calls.rows,
                                     calls.heads, calls.batch, calls.dtype)
        one += profile.tile_seconds(phase, flops[phase], 1, c * chunk, calls.heads,
                                    calls.batch, calls.dtype)
    kernel = KernelCalls.of(backend, workload.dtype)
    extra = extra_memory(workload.attention_shape(), workload.mesh_plan(r, c, a),
                         bottom_right=kernel.bottom_right, whole_tile=kernel.whole_tile)
    return {"schedule": workload.mesh_plan(r, c, a).schedule.value,
            "calls": (calls.forward, calls.backward), "tile_ms": 1e3 * tile,
            "one_ms": 1e3 * one, "ratio": one / tile,
            "peak_mib": max(extra.values()) / MiB}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        profile = load_profile(args.profile).for_kernel(args.backend)
    except ValueError as exc:  # a profile or backend it does not have: one line, exit 2
        print(f"bench_tile_model: {exc}", file=sys.stderr)
        return 2
    print(f"MODEL, not measured: {profile.describe()}")
    print(f"backend {profile.calls_backend}, bf16, {'causal' if args.causal else 'full'}, head dim "
          f"{args.head_dim}; ratio = one fused call / the tile (fwd + bwd)")
    print(f"{'heads':>6} {'chunk':>6} {'P':>3} {'grid':>8} {'schedule':>11} {'calls f/b':>9} {'tile ms':>8} "
          f"{'1 call ms':>9} {'ratio':>6} {'goal':>5} {'extra MiB':>9}")
    short = []
    schedule = {} if args.schedule is None else {"mesh_schedule": args.schedule}
    for spec in args.heads.split(","):
        hq, hkv = (int(x) for x in spec.split("/"))
        for chunk in (int(x) for x in args.chunks.split(",")):
            goal = GOALS.get(chunk)
            for cp_size in (int(x) for x in args.cp_sizes.split(",")):
                sizes = set(heads_sizes(cp_size, hq))
                for grid in grid_shapes(cp_size):
                    a, r, c = grid
                    if a not in sizes:
                        continue
                    workload = Workload(seq_length=chunk * cp_size // a, num_heads=hq,
                                        num_kv_heads=hkv, head_dim=args.head_dim,
                                        causal=args.causal, **schedule)
                    row = tile_row(profile, workload, cp_size, grid)
                    name = f"{r}x{c}" if a == 1 else f"{a}x{r}x{c}"
                    meets = "" if goal is None else ("ok" if row["ratio"] >= goal else "SHORT")
                    if meets == "SHORT":
                        short.append((spec, chunk, name, row["ratio"]))
                    print(f"{spec:>6} {chunk:>6} {cp_size:>3} {name:>8} {row['schedule']:>11} "
                          f"{row['calls'][0]:>4}/{row['calls'][1]:<4} {row['tile_ms']:>8.2f} "
                          f"{row['one_ms']:>9.2f} {row['ratio']:>6.0%} {meets:>5} "
                          f"{row['peak_mib']:>9.1f}")
    print(f"MODEL: {len(short)} grid(s) below the goal"
          + (": worst " + " ".join(f"{h} {c} {g} {x:.0%}" for h, c, g, x in
                                   sorted(short, key=lambda s: s[3])[:5]) if short else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
