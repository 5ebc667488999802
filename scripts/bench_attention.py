"""Benchmark mesh attention: forward + backward time and bytes sent per rank, per mesh shape.

On GPUs, one process per GPU over NCCL:
    torchrun --nproc-per-node 8 scripts/bench_attention.py --seq-length 65536 --dtype bf16
On a CPU, P gloo processes are spawned:
    python scripts/bench_attention.py --cp-size 4 --seq-length 4096

Prints one row per shape, R x C or A x R x C with an all-to-all over A ranks first (P x 1,
Megatron's all_gather CP, A x P/A x 1, its a2a+p2p, and P x 1 x 1, its a2a, included;
--shapes picks some, e.g. 2x4,2x2x2) and schedule:
median forward and backward milliseconds over --iters, bytes sent per rank as counted on
the real collectives, the traffic formula's bytes, traffic relative to P x 1, and peak
extra memory per rank (measured: the CUDA allocator's peak, or on a CPU the tracked tensors
of one more step; next to the model of `megatron_mesh.cost_models.memory`), with Transformer Engine's
ring (two K/V buffers) as the memory reference.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import megatron_mesh as mm
from megatron_mesh.cost_models.memory import extra_memory
from megatron_mesh.cost_models.plan import resolve_plan
from megatron_mesh.dtypes import DTYPE_NAMES, TORCH_DTYPES
from megatron_mesh.layer_plan import DEFAULT_GRAD_DTYPE, GRAD_DTYPE_NAMES, STREAMED, grid_shapes
from megatron_mesh.layer_plan import SCHEDULE_NAMES as SCHEDULES
from megatron_mesh.planner import Cluster, Workload
from megatron_mesh.planner.methods.ring import ring_transfers
from megatron_mesh.runtime.peak_memory import pass_peaks
from megatron_mesh.runtime.spawn import run_gloo


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp-size", type=int, default=None,
                   help="ranks to spawn on a CPU (default 4); under torchrun the world size")
    p.add_argument("--shapes", default=None, help="comma-separated RxC list (default: every factorization)")
    p.add_argument("--seq-length", type=int, default=4096, help="whole sequence S")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default=None,
                   help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "te"])
    p.add_argument("--schedules", default="streamed_kv,streamed_q,gathered",
                   help="comma-separated schedules to time (streamed_kv, streamed_q, gathered; "
                   "streamed runs the one of the two rings it picks for the shape)")
    p.add_argument("--grad-reduce-dtype", default=DEFAULT_GRAD_DTYPE, choices=GRAD_DTYPE_NAMES,
                   help="dtypes of the dQ and dK, dV exchanges (default %(default)s: dQ fp32, dK, dV "
                   "in the input dtype)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    for schedule in args.schedules.split(","):
        if schedule not in SCHEDULES:
            p.error(f"--schedules entry {schedule!r} is not one of {', '.join(SCHEDULES)}")
    return args


def shapes_of(args: argparse.Namespace, cp_size: int) -> list[tuple[int, int, int]]:
    """(heads, rows, cols) of --shapes ('RxC' or 'AxRxC'), default every factorization whose
    heads divide the query heads."""
    if args.shapes is None:
        return [s for s in grid_shapes(cp_size) if args.heads % s[0] == 0]
    shapes = []
    for text in args.shapes.split(","):
        try:
            sizes = [int(n) for n in text.lower().split("x")]
        except ValueError:
            sizes = []
        if len(sizes) not in (2, 3):
            raise SystemExit(f"--shapes entry {text!r} is not RxC or AxRxC (e.g. 2x4, 2x2x2)")
        heads, rows, cols = ([1] + sizes)[-3:]
        if heads * rows * cols != cp_size:
            raise SystemExit(f"--shapes entry {text} does not multiply to the CP size {cp_size}")
        if args.heads % heads:
            raise SystemExit(f"--shapes entry {text}: heads {heads} must divide --heads "
                             f"{args.heads}")
        shapes.append((heads, rows, cols))
    return shapes


def bench_shape(args, grid: mm.MeshGrid, schedule: str, device: torch.device,
                dtype: torch.dtype) -> dict:
    rows, cols = grid.rows, grid.cols
    s = args.seq_length // grid.cp_size
    gen = torch.Generator(device=device).manual_seed(grid.cp_rank)
    make = lambda h: torch.randn(s, args.batch, h, args.head_dim, generator=gen,  # noqa: E731
                                 device=device, dtype=dtype)
    q, k, v = make(args.heads), make(args.kv_heads), make(args.kv_heads)
    dout = make(args.heads)
    for t in (q, k, v):
        t.requires_grad_()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    fwd, bwd, sent = [], [], 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base_mem = torch.cuda.memory_allocated(device)
    for it in range(args.warmup + args.iters):
        for t in (q, k, v):  # fresh gradients: no accumulation into last step's
            t.grad = None
        sync()
        with mm.TrafficCounter() as counter:
            t0 = time.perf_counter()
            out = mm.mesh_attention(q, k, v, grid, causal=args.causal, backend=args.backend,
                                    schedule=schedule, grad_reduce_dtype=args.grad_reduce_dtype)
            sync()
            t1 = time.perf_counter()
            out.backward(dout)
            sync()
            t2 = time.perf_counter()
        if it >= args.warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        sent = counter.total_bytes
        del out
    shape = mm.AttentionShape(args.seq_length, args.batch, args.heads, args.kv_heads,
                              args.head_dim, torch.finfo(dtype).bits // 8)
    plan = resolve_plan(shape, rows, cols, schedule, args.grad_reduce_dtype, heads=grid.heads)
    ran = plan.schedule.value
    if device.type == "cuda":  # less what autograd keeps (q, k, v, out, lse) and dout
        kept = 2 * q.nbytes + k.nbytes + v.nbytes + 4 * q.numel() // args.head_dim
        memory = torch.cuda.max_memory_allocated(device) - base_mem - kept
    else:  # one more untimed step, its tensors tracked
        for t in (q, k, v):
            t.grad = None
        memory = max(pass_peaks(lambda: mm.mesh_attention(
            q, k, v, grid, causal=args.causal, backend=args.backend, schedule=schedule,
            grad_reduce_dtype=args.grad_reduce_dtype), dout).values())
    label = f"{ran}*" if schedule == STREAMED else ran
    return {"shape": grid.shape_text, "cols": cols, "schedule": label, "fwd_ms": 1e3 * statistics.median(fwd),
            "bwd_ms": 1e3 * statistics.median(bwd), "sent": sent,
            "formula": mm.mesh_traffic(shape, plan).total, "memory": memory,
            "model_memory": max(extra_memory(shape, plan).values()),
            "ring_memory": max(extra_memory(shape, grid.cp_size, 1, "ring").values())}


def run(args: argparse.Namespace, device: torch.device) -> None:
    default = "bf16" if device.type == "cuda" else "fp32"
    dtype = TORCH_DTYPES[args.dtype or default]
    world = dist.get_world_size()
    schedules = args.schedules.split(",")
    rows_out = []
    for a, r, c in shapes_of(args, world):
        grid = mm.MeshGrid.build(rows=r, cols=c, heads=a)
        rows_out += [bench_shape(args, grid, schedule, device, dtype) for schedule in schedules]
    worst = [torch.tensor([row["sent"]], dtype=torch.float64) for row in rows_out]
    for t in worst:  # report the most any rank sent (ranks send the same; this checks it)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if dist.get_rank() != 0:
        return
    base = next((row["sent"] for row in rows_out if row["shape"] == f"{world}x1"), None)
    print(f"mesh attention, P={world}, S={args.seq_length}, b={args.batch}, heads={args.heads}/"
          f"{args.kv_heads}, d={args.head_dim}, {str(dtype).removeprefix('torch.')}, "
          f"causal={args.causal}, {device.type}, backend={args.backend}, "
          f"gradients exchanged in {args.grad_reduce_dtype}")
    mem_kind = "CUDA allocator" if device.type == "cuda" else "CPU tensors tracked"
    ring = ring_bytes(args, world, dtype)
    print(f"ring (p2p, Transformer Engine's KV-P2P) for comparison: {ring / 2**20:.3f} MiB "
          "sent per rank (planner formula 3 (P-1) kv, input dtype)")
    print(f"{'shape':>8} {'schedule':>12} {'fwd ms':>9} {'bwd ms':>9} {'total ms':>9} "
          f"{'MiB sent/rank':>14} {'formula MiB':>12} {'vs Px1':>7} {'extra MiB':>10} "
          f"{'model MiB':>10} {'ring MiB':>9}")
    for row, most in zip(rows_out, worst):
        rel = f"{row['sent'] / base:7.2f}" if base else "      -"
        print(f"{row['shape']:>8} {row['schedule']:>12} {row['fwd_ms']:9.2f} "
              f"{row['bwd_ms']:9.2f} {row['fwd_ms'] + row['bwd_ms']:9.2f} "
              f"{most.item() / 2**20:14.3f} {row['formula'] / 2**20:12.3f} {rel} "
              f"{row['memory'] / 2**20:10.2f} {row['model_memory'] / 2**20:10.2f} "
              f"{row['ring_memory'] / 2**20:9.2f}")
    print(f"extra MiB: peak extra memory per rank, measured ({mem_kind}); model MiB: "
          "megatron_mesh.cost_models.memory; ring MiB: Transformer Engine's p2p ring (two K/V "
          "buffers, model); "
          "* = the ring schedule 'streamed' runs for this shape")


def ring_bytes(args: argparse.Namespace, world: int, dtype: torch.dtype) -> int:
    """Bytes per rank of ring attention on the same problem, from the planner's model."""
    workload = Workload(args.seq_length, args.heads, args.kv_heads, args.head_dim, args.batch,
                        DTYPE_NAMES[dtype], args.causal)
    return sum(t.nbytes for t in ring_transfers(workload, Cluster(gpus=world)))


def _spawned(rank: int, world: int, args: argparse.Namespace) -> None:
    run(args, torch.device("cpu"))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # launched by torchrun
        cuda = torch.cuda.is_available()
        dist.init_process_group("nccl" if cuda else "gloo")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        try:
            run(args, device)
        finally:
            dist.destroy_process_group()
        return
    world = args.cp_size or 4
    run_gloo(_spawned, world, args, threads=max(1, (os.cpu_count() or 1) // world))


if __name__ == "__main__":
    main()
