"""Time and balance of `place_documents` (document-aware placement, docs/placement.md).

    PYTHONPATH=$PWD python3 scripts/bench_placement.py                 # the table and the timing
    PYTHONPATH=$PWD python3 scripts/bench_placement.py --repeats 50

Prints, per mix and CP size: documents, busiest / mean causal work, crossing tokens (tokens of
documents held by more than one rank, % of all), ranks per split document (size: count), and
the time of one call (the fastest of --repeats; python ints, one process). Then the time for
1000 documents at P = 8, 16, 64. The mixes are those of tests/unit/test_document_placement.py.
"""
from __future__ import annotations

import argparse
import math
import random
import time

from megatron_mesh.masks.document_placer import place_documents

S = 65536


def cumulative(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def lognormal_mix(seed: int, total: int = S, count: int | None = None) -> list[int]:
    """Log-normal lengths, median 1024, sigma 1, clipped to 128..8192, filling `total`
    tokens (or `count` documents, the last one padded to the next multiple of 128)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while (sum(lengths) < total) if count is None else (len(lengths) < count):
        n = min(8192, max(128, round(1024 * math.exp(rng.gauss(0.0, 1.0)))))
        lengths.append(n if count is not None else min(n, total - sum(lengths)))
    if count is not None:
        lengths[-1] += -sum(lengths) % 128
    return lengths


def long_beside_short(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    short: list[int] = []
    while 32768 + sum(short) < S:
        short.append(min(rng.randint(128, 1024), S - 32768 - sum(short)))
    lengths = short + [32768]
    rng.shuffle(lengths)
    return lengths


def all_short(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < S:
        lengths.append(min(rng.randint(16, 512), S - sum(lengths)))
    return lengths


MIXES = {
    "log-normal (5 seeds, worst)": [lognormal_mix(seed) for seed in range(5)],
    "log-normal 512K (5 seeds, worst)": [lognormal_mix(seed, total=8 * S) for seed in range(5)],
    "one 32K + short": [long_beside_short()],
    "all short (16..512)": [all_short()],
    "64 x 1024": [[1024] * 64],
    "10 x 6400": [[6400] * 10],
    "4096 x 1 token": [[1] * 4096],
}


def fastest(cu: list[int], cp_size: int, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        place_documents(cu, cp_size)
        best = min(best, time.perf_counter() - start)
    return best


def histogram(placement) -> str:
    counts: dict[int, int] = {}
    for group in placement.groups:
        if len(group) > 1:
            counts[len(group)] = counts.get(len(group), 0) + 1
    return " ".join(f"{g}:{c}" for g, c in sorted(counts.items(), reverse=True)) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"{'mix':33} {'P':>3} {'docs':>5} {'busiest/mean':>12} {'crossing':>16} {'ms':>7}  "
          "ranks per split doc")
    for name, mixes in MIXES.items():
        for cp_size in (8, 16, 64):
            rows = []
            for lengths in mixes:
                cu = cumulative(lengths)
                placement = place_documents(cu, cp_size)
                works = [placement.work(r) for r in range(cp_size)]
                ratio = max(works) * cp_size / sum(works)
                rows.append((ratio, placement, fastest(cu, cp_size, args.repeats)))
            ratio, placement, seconds = max(rows, key=lambda row: row[0])
            crossing = placement.crossing_tokens()
            print(f"{name:33} {cp_size:3} {len(placement.lengths):5} {ratio:12.3f} "
                  f"{crossing:7} ({100 * crossing / placement.total:4.1f}%) {1e3 * seconds:7.2f}  "
                  f"{histogram(placement)}")
    print()
    for cp_size in (8, 16, 64):
        lengths = lognormal_mix(0, count=1000)
        lengths[-1] += -sum(lengths) % (2 * cp_size)
        cu = cumulative(lengths)
        placement = place_documents(cu, cp_size)
        seconds = fastest(cu, cp_size, args.repeats)
        print(f"1000 documents ({sum(lengths)} tokens), P = {cp_size}: {1e3 * seconds:.2f} ms; "
              f"{placement.summary()}")


if __name__ == "__main__":
    main()
