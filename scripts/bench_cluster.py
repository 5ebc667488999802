"""Time every context-parallel method on an EMULATED cluster and compare with the planner.

P ranks run on this machine as N nodes x G GPUs. Links are shaped at the collectives
(`megatron_mesh.emulation.ShapedLinks`: NVLink inside a node, one NIC per GPU across nodes),
compute is emulated (`EmulatedKernel`: each tile sleeps for the planner's compute time), both
the modelled cluster's numbers played --slowdown times slower. The real schedules, real gloo
collectives and real bytes run around them. For each method: forward + backward time per
layer (median and spread of --repeats), the planner's prediction for the same emulated
cluster, their ratio, speedup over ring measured and predicted, and peak extra memory per
rank (measured on CPU tensors, and the model of `megatron_mesh.cost_models.memory`).

    python scripts/bench_cluster.py                       # P = 8 and 16, two nodes, 4 workloads
    python scripts/bench_cluster.py --cp-sizes 4 --seq-lengths 4096 --repeats 2 --json out.json
    python scripts/bench_cluster.py --cp-sizes 8 --seq-lengths 32768 --window-size 1024

With --window-size L (a causal sliding window of L tokens back): the windowed layer, run by
all_gather (P x 1, every rank gathers all K/V: what Transformer Engine's all_gather moves
under a window), a2a (Ulysses, P x 1 x 1) where the heads allow, every 2D mesh shape and the
planner's heads x rows x cols choice, all with the sparse exchange; ring (p2p) and a2a+p2p
do not take windows in Transformer Engine and are not run.

Methods: ring (P x 1, K/V streamed: Transformer Engine's p2p), all_gather (P x 1 gathered),
a2a (Ulysses, P x 1 x 1) where the heads allow it, a2a+p2p (A x P/A x 1) for every A the
heads allow, every 2D mesh shape with the schedule "streamed" picks, the best 2D shape with
each schedule, and the planner's heads x rows x cols choice. Gradients of Transformer
Engine's methods travel in the input dtype, as Transformer Engine's; the mesh's in the
default exchange.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from cluster_documents import documents_report, parse_lengths, run_documents_rank

import megatron_mesh as mm
from megatron_mesh.cost_models.memory import extra_memory, streamed_schedule
from megatron_mesh.cost_models.plan import resolve_plan
from megatron_mesh.dtypes import TORCH_DTYPES
from megatron_mesh.emulation import EmulatedKernel, Emulation, ShapedLinks
from megatron_mesh.layer_plan import DEFAULT_GRAD_DTYPE
from megatron_mesh.masks.window import window_of
from megatron_mesh.planner import Cluster, Workload, search
from megatron_mesh.planner.cost import Estimate, price
from megatron_mesh.planner.methods import mesh_transfers
from megatron_mesh.runtime.peak_memory import pass_peaks
from megatron_mesh.runtime.spawn import run_gloo

MIB = 2**20
FLOOR_BOUND = 0.8  # floor / prediction from which a row is bound by this machine


@dataclass(frozen=True)
class Method:
    """One timed configuration: a heads x rows x cols grid and a schedule (ring and
    all_gather are 1 x P x 1, a2a P x 1 x 1, a2a+p2p A x P/A x 1)."""

    label: str
    rows: int
    cols: int
    schedule: str  # what runs: streamed_kv, streamed_q or gathered
    grad_reduce_dtype: str  # "input" for TE's methods, the default exchange for the mesh
    heads: int = 1
    window_exchange: str = "sparse"  # under a window: "gathered" for TE's all_gather

    @property
    def grid_shape(self) -> tuple[int, int, int]:
        return self.heads, self.rows, self.cols


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp-sizes", default="8,16", help="comma-separated P (default 8,16)")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes; G = P / nodes")
    p.add_argument("--seq-lengths", default="16384,65536", help="comma-separated S")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", default="32,8", help="comma-separated kv heads (MHA, GQA)")
    p.add_argument("--head-dim", type=int, default=4,
                   help="head dim of the real tensors (small: compute is emulated, and "
                   "bytes and FLOPs both scale with it, so their ratio does not)")
    p.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="bf16")
    p.add_argument("--slowdown", type=float, default=500.0,
                   help="play the modelled cluster this many times slower (default 500)")
    p.add_argument("--intra-node-bw", type=float, default=360.0, help="modelled GB/s per GPU")
    p.add_argument("--inter-node-bw", type=float, default=45.0, help="modelled GB/s per GPU")
    p.add_argument("--attention-tflops", type=float, default=400.0, help="modelled per GPU")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--overlap", action="store_true",
                   help="also time each method with compute off and with compute 8x longer, "
                   "and report the fraction of communication hidden")
    p.add_argument("--floor", action="store_true",
                   help="also time each method with links unshaped and compute off: what this "
                   "machine itself takes (Python, gloo moving the real bytes), below which no "
                   "measurement can go; rows whose floor is 0.8 of the prediction or more are "
                   "marked bound by this machine")
    p.add_argument("--window-size", type=int, default=None, metavar="L",
                   help="a causal sliding window of L tokens back (window_size (L, 0)): time the "
                   "windowed layer with all_gather, a2a and the mesh")
    docs = p.add_mutually_exclusive_group()
    docs.add_argument("--doc-length-dist", metavar="lognormal:MEDIAN:MAX[:SEED[:MIN]]",
                      help="packed documents drawn log-normal (sigma 1, median MEDIAN, clipped "
                      "to [MIN, MAX], in units of 2P tokens so THD needs no padding): time THD "
                      "against the document placement (scripts/cluster_documents.py)")
    docs.add_argument("--doc-lengths", metavar="L1,L2,...",
                      help="packed documents of these lengths (multiples of 2P summing to S): "
                      "THD against the document placement")
    p.add_argument("--doc-long", type=int, default=None, metavar="L",
                   help="with --doc-length-dist: one document of L tokens first, the drawn ones "
                   "fill the rest")
    p.add_argument("--real-links", action="store_true",
                   help="documents mode: do not shape links (count them only): the links the "
                   "ranks run on are the clock (scripts/netns_cluster.sh)")
    p.add_argument("--rank", type=int, default=None,
                   help="run only this rank (documents mode; with --master, as "
                   "scripts/netns_cluster.sh starts each rank in its node's namespace)")
    p.add_argument("--master", default=None, metavar="ADDR:PORT",
                   help="with --rank: gloo's rendezvous over TCP")
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--plot", default=None, help="measured vs predicted PNG (needs matplotlib)")
    args = p.parse_args(argv)
    try:
        args.cp_sizes = [int(n) for n in args.cp_sizes.split(",")]
        args.seq_lengths = [int(n) for n in args.seq_lengths.split(",")]
        args.kv_heads = [int(n) for n in args.kv_heads.split(",")]
    except ValueError as exc:
        p.error(f"--cp-sizes, --seq-lengths and --kv-heads take comma-separated integers ({exc})")
    for n in args.cp_sizes:
        if n < 2 or n % args.nodes:
            p.error(f"--cp-sizes entry {n} must be at least 2 and divisible by --nodes "
                    f"{args.nodes}")
        for s in args.seq_lengths:
            if s % (2 * n):
                p.error(f"--seq-lengths entry {s} must be divisible by 2 * P = {2 * n}")
    for h in args.kv_heads:
        if h < 1 or args.heads % h:
            p.error(f"--kv-heads entry {h} must divide --heads {args.heads}")
    if args.window_size is not None and args.window_size < 1:
        p.error(f"--window-size must be a positive number of tokens, got {args.window_size}")
    args.doc_mode = args.doc_length_dist is not None or args.doc_lengths is not None
    if args.doc_mode:
        if len(args.seq_lengths) != 1:
            p.error("the documents mode takes one --seq-lengths S")
        args.doc_source = args.doc_lengths and "--doc-lengths" or (
            f"log-normal {args.doc_length_dist}"
            + (f" after one of {args.doc_long}" if args.doc_long else ""))
        args.lengths = {n: parse_lengths(args, p, args.seq_lengths[0], n) for n in args.cp_sizes}
    elif args.doc_long or args.real_links or args.rank is not None:
        p.error("--doc-long, --real-links and --rank belong to the documents mode "
                "(--doc-length-dist / --doc-lengths)")
    if (args.rank is None) != (args.master is None) or (
            args.rank is not None and len(args.cp_sizes) != 1):
        p.error("--rank and --master go together, with one --cp-sizes P")
    for name in ("repeats", "slowdown"):
        if not getattr(args, name) > 0:
            p.error(f"--{name} must be positive, got {getattr(args, name)}")
    return args


def emulation_for(args: argparse.Namespace, cp_size: int) -> Emulation:
    modelled = Cluster(gpus=cp_size, gpus_per_node=cp_size // args.nodes,
                       intra_node_bw=args.intra_node_bw, inter_node_bw=args.inter_node_bw,
                       attention_tflops=args.attention_tflops)
    return Emulation(modelled, args.slowdown)


def workloads(args: argparse.Namespace) -> list[Workload]:
    window = None if args.window_size is None else window_of((args.window_size, 0), True)
    return [Workload(seq_length=s, num_heads=args.heads, num_kv_heads=h, head_dim=args.head_dim,
                     dtype=args.dtype, window=window)
            for s in args.seq_lengths for h in args.kv_heads]


def window_methods(workload: Workload, cluster: Cluster) -> list[Method]:
    """Under a window: all_gather (whole chunks), a2a where the heads allow, every 2D shape
    and the planner's best grid (the sparse exchange, whatever the schedule)."""
    p = cluster.gpus
    out = [Method("all_gather", p, 1, "gathered", "input", window_exchange="gathered")]
    if workload.num_heads % p == 0 and workload.num_kv_heads % p == 0:
        out.append(Method("a2a", 1, 1, "gathered", "input", p))
    out += [Method(f"mesh {r}x{c} sparse", r, c, "gathered", DEFAULT_GRAD_DTYPE)
            for r, c in mm.mesh_shapes(p)]
    a, r, c = search(workload, cluster).best_grid.grid_shape
    if all(m.grid_shape != (a, r, c) for m in out):
        out.append(Method(f"mesh {a}x{r}x{c} sparse", r, c, "gathered", DEFAULT_GRAD_DTYPE, a))
    return out


def methods_for(workload: Workload, cluster: Cluster) -> list[Method]:
    """ring, all_gather, a2a and every a2a+p2p the heads allow, every 2D shape with
    'streamed', the planner's best 2D shape with each schedule and its best grid."""
    if workload.window is not None:
        return window_methods(workload, cluster)
    p = cluster.gpus
    shape = workload.attention_shape()
    out = [Method("ring", p, 1, "streamed_kv", "input"),
           Method("all_gather", p, 1, "gathered", "input")]
    heads, kv_heads = workload.num_heads, workload.num_kv_heads
    for a in (a for a in range(2, p + 1) if p % a == 0 and heads % a == 0 and kv_heads % a == 0):
        label = "a2a" if a == p else f"a2a+p2p {a}x{p // a}"
        out.append(Method(label, p // a, 1, "gathered" if a == p else "streamed_kv", "input", a))
    for r, c in mm.mesh_shapes(p)[1:]:
        ran = streamed_schedule(shape, r, c)
        out.append(Method(f"mesh {r}x{c} {ran}", r, c, ran, DEFAULT_GRAD_DTYPE))
    best = search(workload, cluster).best_mesh.mesh_shape
    for schedule in ("streamed_kv", "streamed_q", "gathered"):
        degenerate = (schedule == "streamed_kv" and best[0] == 1) or (
            schedule == "streamed_q" and best[1] == 1)  # no such ring: the gathered code runs
        if best[0] != p and not degenerate and all(
                (m.rows, m.schedule) != (best[0], schedule) for m in out[2:]):
            out.append(Method(f"mesh {best[0]}x{best[1]} {schedule}", *best, schedule,
                              DEFAULT_GRAD_DTYPE))
    a, r, c = search(workload, cluster).best_grid.grid_shape
    if a > 1 and all(m.grid_shape != (a, r, c) for m in out):
        ran = workload.mesh_plan(r, c, a).schedule.value
        out.append(Method(f"mesh {a}x{r}x{c} {ran}", r, c, ran, DEFAULT_GRAD_DTYPE, a))
    return out


def predict(method: Method, workload: Workload, cluster: Cluster) -> Estimate:
    """The planner's estimate of `method` on `cluster` (the emulated one)."""
    plan = search(workload, cluster)
    if method.label == "ring":
        return plan.ring
    if method.label == "all_gather":
        found = plan.method("all_gather")
        assert found is not None
        return found
    w = replace(workload, mesh_schedule=method.schedule,
                mesh_grad_reduce_dtype=method.grad_reduce_dtype)
    transfers = mesh_transfers(w, cluster, method.rows, method.cols, method.heads)
    return price("mesh", method.label, transfers, w, cluster, True, (method.rows, method.cols),
                 method.heads)


def time_method(method: Method, grid: mm.MeshGrid, workload: Workload, emulation: Emulation,
                repeats: int, warmup: int, compute_scale: float = 1.0, shaped: bool = True) -> dict:
    """Median / min / max seconds of forward + backward over `repeats` (every rank's clock
    runs from a barrier to a barrier, so it is the slowest rank's time), with the emulated
    compute and link seconds of this rank; compute_scale 0: no compute; shaped False: links
    as fast as this machine moves the bytes."""
    w, dtype = workload, TORCH_DTYPES[workload.dtype]
    s = w.seq_length // grid.cp_size
    gen = torch.Generator().manual_seed(grid.cp_rank)
    q, k, v = (torch.randn(s, w.batch, h, w.head_dim, generator=gen, dtype=dtype).requires_grad_()
               for h in (w.num_heads, w.num_kv_heads, w.num_kv_heads))
    dout = torch.randn(s, w.batch, w.num_heads, w.head_dim, generator=gen, dtype=dtype)
    rate = emulation.flops_rate / compute_scale if compute_scale else float("inf")
    times, compute, links, sent = [], 0.0, {}, {}
    for it in range(warmup + repeats):
        kernel = EmulatedKernel(rate)
        q.grad = k.grad = v.grad = None
        dist.barrier()
        links_here = ShapedLinks(emulation, dist.get_rank())
        with links_here if shaped else contextlib.nullcontext():
            t0 = time.perf_counter()
            out = mm.mesh_attention(q, k, v, grid, w.causal, w.head_dim ** -0.5, kernel,
                                    method.schedule, method.grad_reduce_dtype,
                                    window_size=window_size(w),
                                    window_exchange=method.window_exchange)
            out.backward(dout)
            dist.barrier()
            elapsed = time.perf_counter() - t0
        if it >= warmup:
            times.append(elapsed)
        compute, links, sent = kernel.seconds, dict(links_here.seconds), dict(links_here.bytes)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "compute_s": compute, "link_s": links, "link_bytes": sent}


def measure_memory(method: Method, grid: mm.MeshGrid, workload: Workload) -> int:
    """Peak extra bytes of one forward + backward (CPU tensors tracked), no shaping, on the
    rank that holds most (the rank the memory model describes)."""
    w, dtype = workload, TORCH_DTYPES[workload.dtype]
    s = w.seq_length // grid.cp_size
    q, k, v = (torch.randn(s, w.batch, h, w.head_dim, dtype=dtype).requires_grad_()
               for h in (w.num_heads, w.num_kv_heads, w.num_kv_heads))
    dout = torch.randn(s, w.batch, w.num_heads, w.head_dim, dtype=dtype)
    kernel = EmulatedKernel(float("inf"))
    peaks = pass_peaks(lambda: mm.mesh_attention(
        q, k, v, grid, True, 1.0, kernel, method.schedule, method.grad_reduce_dtype,
        window_size=window_size(w), window_exchange=method.window_exchange), dout)
    mine = torch.tensor(max(peaks.values()))
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return int(mine)


def window_size(workload: Workload) -> tuple[int, int] | None:
    """mesh_attention's window_size of the workload's window."""
    w = workload.window
    return None if w is None else (w.left, w.right)


def model_memory(method: Method, workload: Workload) -> int:
    """`memory.extra_memory` of the rank holding most: under a window the sparse exchange's
    bound (every peer's whole chunk exchanged, `windowed=True`; `cost_models.sparse.window_extra_memory`
    counts a given window's rows), all_gather's whole chunks the gathered schedule's."""
    attention = workload.attention_shape()
    plan = resolve_plan(attention, method.rows, method.cols, method.schedule,
                        method.grad_reduce_dtype, heads=method.heads)
    sparse = workload.window is not None and method.window_exchange == "sparse"
    return max(extra_memory(attention, plan, windowed=sparse).values())


def run_rank(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    """Every workload and method on this P; rows (rank 0's view) for the report."""
    emulation = emulation_for(args, world)
    cluster = emulation.cluster
    grids: dict[tuple[int, int, int], mm.MeshGrid] = {}
    rows = []
    for workload in workloads(args):
        for method in methods_for(workload, cluster):
            shape = method.grid_shape
            if shape not in grids:
                grids[shape] = mm.MeshGrid.build(rows=method.rows, cols=method.cols,
                                                 heads=method.heads)
            grid = grids[shape]
            row = {"P": world, "nodes": args.nodes, "S": workload.seq_length,
                   "heads": workload.num_heads, "kv_heads": workload.num_kv_heads,
                   "method": method.label, "shape": list(shape), "schedule": method.schedule}
            row.update(time_method(method, grid, workload, emulation, args.repeats, args.warmup))
            est = predict(method, workload, cluster)
            row.update(predicted_s=est.total_s, predicted_comm_s=est.total_comm_s,
                       predicted_compute_s=sum(est.compute_s.values()))
            if args.overlap:
                timed = (method, grid, workload, emulation, args.repeats, args.warmup)
                off, heavy = time_method(*timed, 0.0), time_method(*timed, 8.0)
                row.update(comm_only_s=off["median_s"], heavy_s=heavy["median_s"],
                           heavy_compute_s=heavy["compute_s"])
            if args.floor:
                floor = time_method(method, grid, workload, emulation, args.repeats, args.warmup,
                                    0.0, shaped=False)
                row.update(floor_s=floor["median_s"])
            attention = workload.attention_shape()
            row.update(memory=measure_memory(method, grid, workload),
                       model_memory=model_memory(method, workload),
                       te_ring_memory=max(extra_memory(attention, world, 1, "ring").values()))
            rows.append(row)
    return rows


def hidden_fraction(comm_only: float, compute: float, measured: float) -> float:
    """Share of the communication time that ran under compute: (compute + comm - measured)
    / comm, with comm the time measured with compute off."""
    return (compute + comm_only - measured) / comm_only if comm_only > 0 else 0.0


def report(rows: list[dict], args: argparse.Namespace) -> str:
    lines = []
    for key in dict.fromkeys((r["P"], r["S"], r["kv_heads"]) for r in rows):
        case = [r for r in rows if (r["P"], r["S"], r["kv_heads"]) == key]
        p, s, kv = key
        ring = next(r for r in case if r["method"] in ("ring", "all_gather"))
        ref = ring["method"]
        window = ("" if args.window_size is None else
                  f", sliding window ({args.window_size}, 0): ring (p2p) and a2a+p2p not run "
                  "(Transformer Engine refuses windows)")
        lines += ["", emulation_for(args, p).describe(),
                  f"P={p} ({args.nodes} x {p // args.nodes}), S={s}, heads {case[0]['heads']}/{kv} "
                  f"x {args.head_dim} (real tensors), {args.dtype}, causal{window}; EMULATED "
                  f"compute and links; {args.repeats} repeats",
                  f"{'method':<24} {'EMULATED ms':>11} {'spread':>7} {'MODEL ms':>9} "
                  f"{'ratio':>6} {'vs ' + ref:>13} {'MODEL vs ' + ref:>19} {'extra MiB':>9} "
                  f"{'model MiB':>9}" + ("  hidden  heavy/compute" if args.overlap else "")
                  + ("  floor ms  floor/pred" if args.floor else "")]
        measured_rank = sorted(case, key=lambda r: r["median_s"])
        for r in case:
            spread = (r["max_s"] - r["min_s"]) / r["median_s"]
            line = (f"{r['method']:<24} {r['median_s'] * 1e3:11.1f} {spread:7.1%} "
                    f"{r['predicted_s'] * 1e3:9.1f} {r['median_s'] / r['predicted_s']:6.2f} "
                    f"{ring['median_s'] / r['median_s']:12.2f}x "
                    f"{ring['predicted_s'] / r['predicted_s']:18.2f}x "
                    f"{r['memory'] / MIB:9.2f} {r['model_memory'] / MIB:9.2f}")
            if args.overlap:
                hidden = hidden_fraction(r["comm_only_s"], r["compute_s"], r["median_s"])
                line += (f"  {hidden:6.0%}  {r['heavy_s'] / r['heavy_compute_s']:13.2f}")
            if args.floor:
                bound = r["floor_s"] / r["predicted_s"]
                line += (f"  {r['floor_s'] * 1e3:8.1f}  {bound:10.2f}"
                         + (" bound by this machine" if bound >= FLOOR_BOUND else ""))
            lines.append(line)
        lines.append("fastest measured (EMULATED): "
                     + ", ".join(r["method"] for r in measured_rank[:3])
                     + "; planner (MODEL): " + ", ".join(
                         r["method"] for r in sorted(case, key=lambda r: r["predicted_s"])[:3]))
    lines += ["", "EMULATED ms = measured median forward + backward per layer on the EMULATED "
              "cluster (shaped links, sleeping tile kernel); spread = (max - min) / median; MODEL "
              "ms = the planner's prediction for the same emulated cluster; ratio = EMULATED / "
              "MODEL; extra MiB = peak extra memory per rank (the rank holding most), measured on "
              "CPU tensors; model MiB = megatron_mesh.cost_models.memory (MODEL)"]
    if args.floor:
        lines.append(f"floor = median time with links unshaped and compute off (this machine "
                     f"alone); a row whose floor is {FLOOR_BOUND} of its prediction or more is "
                     f"bound by this machine, not by the emulated cluster")
    if args.overlap:
        lines.append("hidden = share of communication (measured with compute off) that ran under "
                     "compute; heavy/compute = time with compute 8x longer over that compute")
    return "\n".join(lines)


def draw(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(6, 6))
    for method in dict.fromkeys(r["method"].split(" ")[0] for r in rows):
        mine = [r for r in rows if r["method"].split(" ")[0] == method]
        ax.scatter([r["predicted_s"] * 1e3 for r in mine], [r["median_s"] * 1e3 for r in mine],
                   label=method)
    top = max(max(r["predicted_s"], r["median_s"]) for r in rows) * 1e3 * 1.1
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8, linestyle="--",
            label="measured = predicted")
    ax.set_xlabel("planner prediction, ms (emulated cluster)")
    ax.set_ylabel("measured, ms (EMULATED links and compute)")
    ax.set_title("attention fwd + bwd per layer, emulated cluster", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_documents(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    """The documents mode on one rank (`cluster_documents.run_documents_rank`)."""
    return run_documents_rank(rank, world, args, emulation_for(args, world))


def one_rank(args: argparse.Namespace) -> list[dict] | None:
    """Only --rank of P, rendezvous at --master over TCP; rank 0's rows (None elsewhere)."""
    world = args.cp_sizes[0]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank,
                            world_size=world)
    try:
        rows = run_documents(args.rank, world, args)
    finally:
        dist.destroy_process_group()
    return rows if args.rank == 0 else None


def main_documents(args: argparse.Namespace) -> None:
    """THD against the document placement on every P (`scripts/cluster_documents.py`)."""
    if args.rank is not None:
        rows = one_rank(args)
        if rows is None:
            return
    else:
        rows = []
        for world in args.cp_sizes:
            rows += run_gloo(run_documents, world, args)[0]
    describe = emulation_for(args, args.cp_sizes[0]).describe()
    print(documents_report(rows, args, describe))
    if args.json:
        keep = [{k: v for k, v in r.items() if k != "placement"} for r in rows]
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "lengths"},
                       "lengths": {str(k): v for k, v in args.lengths.items()},
                       "rows": keep}, f, indent=1)
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.doc_mode:
        main_documents(args)
        return
    rows = []
    for world in args.cp_sizes:
        rows += run_gloo(run_rank, world, args)[0]
    print(report(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=1)
    if args.plot:
        draw(rows, args.plot)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
