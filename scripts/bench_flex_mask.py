"""Time and peak memory of building a whole tile's FlexAttention mask
(`schedules.whole_tile.tile_mask` -> `kernels.flex.TileMask`) on the CPU, the blocks' calls
already made (they are made once per micro-batch for every backend):

    python scripts/bench_flex_mask.py [--iters 5] [--threads 1]

Cases: a sliding window's sparse exchange (a rank of a 2 x 2 mesh holding a peer's chunk
packed, `KeptRows`: 4096-row chunks and a window of 7000 to the left, about 8K x 7K;
8192-row chunks and a window of 4096, 16K x 12K), a causal tile of 4000-row chunks (not
whole 128-row blocks: 2 query chunks x 4 key chunks), and the same of 8192-row chunks.
Prints, per case, the tile's rows x keys, the bytes a bool mask of that size would take,
the median seconds of --iters builds, the peak of tracked CPU tensors while building
(`runtime.peak_memory`) and the mask's own bytes (kinds and partial blocks). One torch
thread by default: on a loaded machine more threads wait on each other and the numbers
scatter tenfold.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_mesh.calls.layout import AttentionMask
from megatron_mesh.calls.needed_rows import needed_rows
from megatron_mesh.masks.window import Window
from megatron_mesh.runtime.peak_memory import CpuPeakMemory
from megatron_mesh.schedules import whole_tile
from megatron_mesh.schedules.kept_rows import KeptRows

MIB = 2 ** 20
CPU = torch.device("cpu")


def window_case(local: int, left: int, me: int) -> tuple:
    """Rank `me` of a 2 x 2 mesh under a causal window: its row's and column's peers' rows
    packed, as the sparse exchange holds them."""
    mask = AttentionMask(True, ranks=4, window=Window(left, 0))
    rows, cols = 2, 2
    row = [me // cols * cols + c for c in range(cols)]
    col = [r * cols + me % cols for r in range(rows)]
    q_kept = [None if x == me else KeptRows(needed_rows(mask, rows, cols, local, me, x, "q"),
                                            local) for x in row]
    kv_kept = [None if y == me else KeptRows(needed_rows(mask, rows, cols, local, me, y, "kv"),
                                             local) for y in col]
    return mask, row, col, local, q_kept, kv_kept


def causal_case(local: int) -> tuple:
    return AttentionMask(True, ranks=4), [2, 3], [0, 1, 2, 3], local, None, None


def clear() -> None:
    for name in ("_tile_mask", "_packed_mask"):
        cache = getattr(whole_tile, name, None)
        if cache is not None:
            cache.cache_clear()


def build(case: tuple):
    mask, xs, ys, local, q_kept, kv_kept = case
    clear()
    return whole_tile.tile_mask(mask, xs, ys, local, CPU, (), q_kept, kv_kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = {"window 7000, 2x2 rank 0, packed (4096-row chunks)": window_case(4096, 7000, 0),
             "window 4096, 2x2 rank 3, packed (8192-row chunks)": window_case(8192, 4096, 3),
             "causal 4000-row chunks, 2 x 4": causal_case(4000),
             "causal 8192-row chunks, 2 x 4": causal_case(8192)}
    for name, case in cases.items():
        made = build(case)  # the blocks' calls made and kept
        seconds = []
        for _ in range(args.iters):
            start = time.perf_counter()
            build(case)
            seconds.append(time.perf_counter() - start)
        with CpuPeakMemory() as mem:
            made = build(case)
            own = made.kinds.untyped_storage().nbytes() + made.partial.untyped_storage().nbytes()
        sq, sk = made.shape
        print(f"{name}: {sq} x {sk} (a bool mask: {sq * sk / MIB:.1f} MiB), "
              f"{statistics.median(seconds) * 1e3:.1f} ms, peak while building "
              f"{mem.peak_bytes / MIB:.2f} MiB, mask {own / MIB:.2f} MiB "
              f"({int((made.kinds >= 2).sum())} partial blocks)")


if __name__ == "__main__":
    main()
