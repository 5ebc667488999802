"""Host time to plan one micro-batch, per rank, beside the attention it plans.

A rank's plan of a micro-batch is what it builds for its own tile: the blocks of its row's
query chunks against its column's K/V chunks (their parts, kernel calls and `TileSlices`),
made ahead of the first layer (`schedules.blocks.plan_blocks`, as the driver calls it), then
grouped into the tile's calls (`schedules.blocks.tile_calls`: one query chunk against the
column, as the gathered schedule asks for it). Each measurement starts from empty caches
and new mask values, as a new micro-batch does (no table kept by a value's identity serves
it). The micro-batch: `--tokens` tokens in N documents of random lengths, given as packed
documents (THD, `cu_seqlens`) and as the same mask given as slices (`SliceMask`, dense
zigzag layout). Beside it, MODEL (H200 profile): the planner's GPU
profile (`planner/profiles/h200.json`, its backend) pricing the plan's calls, forward and
backward, bf16, `--heads` x `--head-dim` (the heads a rank computes: hq / A).

    python scripts/bench_host_plan.py                          # P = 8 and 64, 100 / 1000 docs
    python scripts/bench_host_plan.py --grids 2x4 --documents 1000 --profile
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch

from megatron_mesh.calls.layout import AttentionMask
from megatron_mesh.common.caches import _CACHES
from megatron_mesh.cost_models.tile_calls import group_tokens
from megatron_mesh.masks.documents import Documents
from megatron_mesh.planner.gpu_profile import load_profile
from megatron_mesh.runtime.grid import MeshGrid
from megatron_mesh.schedules.blocks import _tile_calls, plan_blocks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128 * 1024)
    p.add_argument("--documents", default="100,1000", help="comma-separated counts")
    p.add_argument("--grids", default="2x4,2x2x2,8x8,4x4x4",
                   help="R x C or A x R x C (A: heads groups), comma-separated")
    p.add_argument("--masks", default="thd,slices", help="thd, slices (comma-separated)")
    p.add_argument("--repeat", type=int, default=3, help="runs per case (min reported)")
    p.add_argument("--rank", type=int, default=0, help="the mesh rank planned")
    p.add_argument("--heads", type=int, default=32, help="query heads before the split")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--no-fold", dest="fold", action="store_false",
                   help="the kernel takes no bottom-right causal diagonal")
    p.add_argument("--profile", action="store_true", help="cProfile one run per case")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def grid_of(text: str) -> tuple[int, int, int]:
    """'RxC' or 'AxRxC' -> (A, R, C)."""
    dims = tuple(int(n) for n in text.split("x"))
    return dims if len(dims) == 3 else (1, *dims)  # type: ignore[return-value]


def documents(tokens: int, count: int, cp_size: int, seed: int) -> Documents:
    """`count` documents of random lengths filling `tokens`: padded lengths multiples of
    2P, actual lengths up to 2P - 1 shorter."""
    unit = 2 * cp_size
    units = tokens // unit
    if units < count:
        raise ValueError(f"{count} documents do not fit {tokens} tokens at 2P = {unit}")
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, units), count - 1))
    sizes = [(b - a) * unit for a, b in zip([0, *cuts], [*cuts, units])]
    cu = [0]
    for n in sizes:
        cu.append(cu[-1] + n)
    lengths = [n - rng.randrange(min(unit, n)) for n in sizes]
    return Documents(tuple(cu), tuple(lengths))


def masks(docs: Documents, ranks: int, kinds: list[str]) -> dict[str, AttentionMask]:
    out = {}
    if "thd" in kinds:
        out["thd"] = AttentionMask(True, docs, ranks)
    if "slices" in kinds:
        out["slices"] = AttentionMask(False, ranks=ranks, slices=docs.slices(True))
    return out


def clear_caches() -> None:
    for cache in _CACHES:
        cache.cache_clear()


def new_micro_batch(docs: Documents, ranks: int, kind: str) -> AttentionMask:
    """The mask of `kind` as a new micro-batch brings it, with the caches emptied: new values
    (documents, slices) equal to the last run's, so that nothing kept by a value's identity
    (`part_arrays.slice_arrays`' table of a mask's slices) serves the next run either."""
    clear_caches()
    return masks(Documents(docs.cu_padded, docs.lengths), ranks, [kind])[kind]


def plan(mask: AttentionMask, grid: MeshGrid, local_len: int, fold: bool):
    """The calls of the grid's rank's tile as the driver makes them: its blocks ahead of
    the first layer (`plan_blocks`), then each of its row's query chunks against its
    column's K/V chunks (what the layer asks for)."""
    plan_blocks(mask, grid, local_len)
    ys = tuple(grid.col_mesh_ranks)
    return [c for x in grid.row_mesh_ranks
            for c in _tile_calls(mask, (x,), ys, local_len, torch.device("cpu"), frozenset(),
                                 fold, True, group_tokens())]


def _size(rows) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else int(rows.numel())


def pairs(call) -> int:
    if call.slices is not None:
        return call.slices.pairs
    sq, sk = sum(_size(p.rows) for p in call.q), sum(_size(p.rows) for p in call.kv)
    return sq * sk - (sq * (sq - 1) // 2 if call.causal else 0)


def model_ms(calls, heads: int, head_dim: int) -> tuple[float, float]:
    """(forward, backward) milliseconds of `calls` on the H200 profile's backend."""
    profile = load_profile("h200")
    out = []
    for phase, ratio in (("forward", 1.0), ("backward", 2.5)):
        fit = profile.fit(phase)
        shapes = [(ratio * 4.0 * heads * head_dim * pairs(c),
                   heads * sum(_size(p.rows) for p in c.q)) for c in calls]
        out.append(1e3 * fit.calls_seconds(shapes) if shapes else 0.0)
    return out[0], out[1]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    kinds = args.masks.split(",")
    print(f"host planning of one micro-batch, mesh rank {args.rank}'s tile, {args.tokens} "
          f"tokens, min of {args.repeat} runs, caches empty; torch {torch.__version__}")
    print(f"{'grid':>8} {'P':>3} {'docs':>5} {'mask':>6} {'calls':>6} {'host ms':>9} | "
          f"MODEL (H200 profile) fwd ms  bwd ms")
    for grid_text in args.grids.split(","):
        a, rows, cols = grid_of(grid_text)
        p = a * rows * cols
        local_len = a * args.tokens // p
        grid = MeshGrid(rows, cols, args.rank * a, tuple(range(p)), None, None, heads=a)
        for count in (int(n) for n in args.documents.split(",")):
            docs = documents(args.tokens, count, p, args.seed)
            for kind in kinds:
                times, calls = [], []
                for _ in range(args.repeat):
                    mask = new_micro_batch(docs, rows * cols, kind)
                    start = time.perf_counter()
                    calls = plan(mask, grid, local_len, args.fold)
                    times.append(time.perf_counter() - start)
                fwd, bwd = model_ms(calls, args.heads // a, args.head_dim)
                print(f"{grid_text:>8} {p:>3} {count:>5} {kind:>6} {len(calls):>6} "
                      f"{1e3 * min(times):>9.2f} | {fwd:>26.2f} {bwd:>7.2f}", flush=True)
                if args.profile:
                    mask = new_micro_batch(docs, rows * cols, kind)
                    profiler = cProfile.Profile()
                    profiler.runcall(plan, mask, grid, local_len, args.fold)
                    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
