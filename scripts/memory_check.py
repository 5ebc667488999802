"""Measured peak extra memory per rank of every method against `megatron_mesh.cost_models.memory`.

    python scripts/memory_check.py --cp-size 8 --seq-length 8192 --heads 8 --kv-heads 2 \
        --head-dim 64 --dtype fp32

Runs P gloo ranks on this machine; every method (ring = P x 1 streamed_kv, all_gather = P x 1
gathered, every R x C shape with each schedule, every heads x rows x cols grid with A > 1 and
each schedule) does one forward and one backward, and the peak extra bytes of each pass
(`peak_memory.CpuPeakMemory`: tracked CPU tensors, beyond what is alive at the end of the pass)
of the rank holding most are printed next to the model. Compute is the emulated tile kernel
(zeros of the right shapes, no sleep) unless --kernel torch; the emulated kernel's outputs
are the only kernel allocations the tracking sees, as with the real one.
"""
from __future__ import annotations

import argparse

import torch

import megatron_mesh as mm
from megatron_mesh.cost_models.memory import extra_memory
from megatron_mesh.cost_models.plan import resolve_plan
from megatron_mesh.dtypes import TORCH_DTYPES
from megatron_mesh.emulation.compute import EmulatedKernel
from megatron_mesh.layer_plan import Schedule
from megatron_mesh.runtime.peak_memory import pass_peaks
from megatron_mesh.runtime.spawn import run_gloo

MIB = 2 ** 20
SCHEDULES = tuple(str(s) for s in Schedule)


def methods(world: int, q_heads: int) -> list[tuple[str, int, int, int, str, str]]:
    """(label, heads, rows, cols, schedule, grad dtype) of every method at P = world."""
    out = [("ring", 1, world, 1, "streamed_kv", "input"),
           ("all_gather", 1, world, 1, "gathered", "input")]
    for a in (a for a in range(1, world + 1) if world % a == 0 and q_heads % a == 0):
        for r, c in mm.mesh_shapes(world // a):
            for schedule in SCHEDULES:
                if (schedule == "streamed_kv" and r == 1) or (schedule == "streamed_q" and c == 1):
                    continue  # no such ring: the gathered code runs
                name = "a2a" if a == world else f"{a}x{r}x{c}" if a > 1 else f"{r}x{c}"
                out.append((f"{name} {schedule}", a, r, c, schedule,
                            "input" if a == world else "mixed"))
    return out


def worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(rank)
    dtype, s = TORCH_DTYPES[args.dtype], args.seq_length // world
    kernel = EmulatedKernel(float("inf")) if args.kernel == "emulated" else "torch"
    grids, results = {}, {}
    for label, a, r, c, schedule, grads in methods(world, args.heads):
        if args.only and not any(o in label for o in args.only):
            continue
        if (a, r, c) not in grids:
            grids[a, r, c] = mm.MeshGrid.build(rows=r, cols=c, heads=a)
        q, k, v = (torch.randn(s, 1, h, args.head_dim, dtype=dtype).requires_grad_()
                   for h in (args.heads, args.kv_heads, args.kv_heads))
        dout = torch.randn(s, 1, args.heads, args.head_dim, dtype=dtype)
        grid = grids[a, r, c]
        results[label] = pass_peaks(
            lambda: mm.mesh_attention(q, k, v, grid, True, None, kernel, schedule, grads), dout)
    return results


def measure(args: argparse.Namespace) -> list[dict]:
    """worker() on args.cp_size gloo ranks on this machine; each rank's results."""
    return run_gloo(worker, args.cp_size, args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp-size", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--kernel", choices=("emulated", "torch"), default="emulated")
    p.add_argument("--only", nargs="*", help="labels containing any of these")
    p.add_argument("--save", help="write the measurements to this file (torch.save)")
    p.add_argument("--load", help="compare measurements saved by --save with the model")
    args = p.parse_args()
    if args.load:
        saved = torch.load(args.load, weights_only=False)
        per_rank, args = saved["per_rank"], saved["args"]
    else:
        per_rank = measure(args)
    if args.save:
        torch.save({"per_rank": per_rank, "args": args}, args.save)
    world = args.cp_size
    shape = mm.AttentionShape(args.seq_length, 1, args.heads, args.kv_heads, args.head_dim,
                              TORCH_DTYPES[args.dtype].itemsize)
    print(f"P={world} S={args.seq_length} heads {args.heads}/{args.kv_heads} x {args.head_dim} "
          f"{args.dtype} causal, kernel {args.kernel}; MiB, rank holding most (tracked CPU tensors)")
    print(f"{'method':<26} {'fwd meas':>8} {'model':>7} {'ratio':>6}   {'bwd meas':>8} "
          f"{'model':>7} {'ratio':>6}")
    worst = 0.0
    for label, a, r, c, schedule, grads in methods(world, args.heads):
        if label not in per_rank[0]:
            continue
        plan = resolve_plan(shape, r, c, schedule, grads, heads=a)
        model = extra_memory(shape, plan)
        cells = []
        for phase in ("forward", "backward"):
            measured = max(res[label][phase] for res in per_rank)
            ratio = measured / model[phase]
            worst = max(worst, abs(ratio - 1))
            cells.append(f"{measured / MIB:8.2f} {model[phase] / MIB:7.2f} {ratio:6.2f}"
                         + ("*" if abs(ratio - 1) > 0.1 else " "))
        if label == "ring":
            label = f"ring (TE {max(extra_memory(shape, world, 1, 'ring').values()) / MIB:.2f})"
        print(f"{label:<26} " + "  ".join(cells))
    print(f"worst |measured / model - 1| = {worst:.1%}; * = beyond 10%")


if __name__ == "__main__":
    main()
