"""What the ranks' agreement adds to a decode step (`megatron_mesh/inference/decode_agreement.py`).

    python scripts/bench_decode_agreement.py [--cp-sizes 2,4] [--layers 8] [--steps 200]

Spawns P gloo ranks on this machine per CP size, prefills an `InferenceSession` of --layers
layers, then decodes --steps steps two ways, alternated step by step so that both see the
same load: through the session (the agreement included: once per layer at the first step,
once per step after it) and through `decode_attention` on the same shards (no agreement).
Prints per step, microseconds (median / p90 over the steps after the first), and the
agreements per step.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import megatron_mesh as mm
from megatron_mesh.calls.layout import zigzag_split
from megatron_mesh.inference import CacheLayout, decode_attention
from megatron_mesh.inference.session import DECODE, InferenceSession
from megatron_mesh.runtime import agreement
from megatron_mesh.runtime.spawn import run_gloo

BATCH, HEADS, HEAD_DIM, PROMPT = 4, 8, 64, 64


def _rank(rank: int, world: int, layers: int, steps: int) -> dict[str, object]:
    grid = mm.MeshGrid.build(rows=world // 2 if world > 2 else world, cols=2 if world > 2 else 1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(PROMPT + steps + 1, BATCH, HEADS, HEAD_DIM, generator=g)
    session = InferenceSession(CacheLayout(world, rank, PROMPT, steps + 1),
                               torch.full((BATCH,), PROMPT))
    share = zigzag_split(x[:PROMPT], world)[rank]
    for layer in range(layers):
        session.attend(layer, share, share, share, grid, HEAD_DIM ** -0.5)
    session.phase = DECODE
    calls = [0]
    counted = agreement.max_over_cp

    def counting(*args):
        calls[0] += 1
        return counted(*args)

    agreement.max_over_cp = counting
    with_agreement, without, agreements = [], [], []
    for step in range(steps):
        session.step = step
        new = x[PROMPT + step][None]
        calls[0] = 0
        start = time.perf_counter()
        for layer in range(layers):
            session.attend(layer, new, new, new, grid, HEAD_DIM ** -0.5)
        middle = time.perf_counter()
        pos = session.decode_positions()
        for layer in range(layers):
            decode_attention(new[0], session.shards[layer], pos, HEAD_DIM ** -0.5, None, world)
        with_agreement.append((middle - start) * 1e6)
        without.append((time.perf_counter() - middle) * 1e6)
        agreements.append(calls[0])
    out: dict[str, object] = {"agreements": (agreements[0], max(agreements[1:]))}
    for name, times in (("session", with_agreement[1:]), ("decode only", without[1:])):
        times.sort()
        out[name] = statistics.median(times), times[int(0.9 * (len(times) - 1))]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp-sizes", default="2,4")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    print(f"per decode step of {args.layers} layers, microseconds (median / p90), gloo on this "
          "machine's CPUs")
    for world in map(int, args.cp_sizes.split(",")):
        results = run_gloo(_rank, world, args.layers, args.steps)
        for name in ("session", "decode only"):
            per_rank = ", ".join(f"{r[name][0]:.0f} / {r[name][1]:.0f}" for r in results)
            print(f"P={world} {name:11s} {per_rank}")
        first, later = results[0]["agreements"]
        print(f"P={world} agreements: {first} at the first step, {later} per step after it")


if __name__ == "__main__":
    main()
