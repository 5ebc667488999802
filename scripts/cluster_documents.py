"""Packed documents on the EMULATED cluster (`bench_cluster.py --doc-length-dist / --doc-lengths`):
Transformer Engine's THD layout against the document placement, each on the planner's best
grid for it, forward + backward of one attention layer.

THD: every document cut into 2P pieces over all ranks (`mesh_attention(cu_seqlens=...)`),
the bytes of one sequence of the packed length. Placement: `place_documents` (whole
documents on one rank, long ones zigzag over consecutive ranks of a node) run by
`mesh_attention(placement=...)`, the sparse exchange of the documents that span ranks.
Compute is the emulated kernel's (in-document pairs only, varlen tiles included), links
the emulated ones (`ShapedLinks`), or, with `--real-links`, whatever links the ranks run
on (`scripts/netns_cluster.sh`: network namespaces joined by tbf-shaped veth pairs).
Rows: EMULATED time (median of --repeats; slowest rank), the planner's MODEL for the same
emulated cluster, bytes per rank counted at the exchange (the most any rank sends) beside
the model's, and the compute floor: the busiest rank's in-document FLOPs at the emulated
GPU's rate.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import megatron_mesh as mm
from megatron_mesh.cost_models.traffic import mesh_traffic
from megatron_mesh.dtypes import TORCH_DTYPES
from megatron_mesh.emulation import EmulatedKernel, Emulation, ShapedLinks
from megatron_mesh.layer_plan import DEFAULT_GRAD_DTYPE
from megatron_mesh.planner import Cluster, Workload, search
from megatron_mesh.planner.pricing.placed_documents import lognormal_lengths, price_placement

MIB = 2**20


def parse_lengths(args: argparse.Namespace, parser: argparse.ArgumentParser, seq_length: int,
                  cp_size: int) -> tuple[int, ...]:
    """--doc-lengths, or --doc-length-dist lognormal:MEDIAN:MAX[:SEED[:MIN]] drawn in units
    of 2P tokens (so THD runs without padding), after --doc-long's document if given."""
    unit = 2 * cp_size
    if args.doc_lengths is not None:
        try:
            lengths = tuple(int(n) for n in args.doc_lengths.split(","))
        except ValueError:
            parser.error(f"--doc-lengths {args.doc_lengths!r}: give comma-separated tokens")
        if sum(lengths) != seq_length or any(n < 1 or n % unit for n in lengths):
            parser.error(f"--doc-lengths: multiples of 2P = {unit} summing to {seq_length}")
        return lengths
    fields = args.doc_length_dist.split(":")
    usage = (f"--doc-length-dist {args.doc_length_dist!r}: give lognormal:MEDIAN:MAX[:SEED"
             f"[:MIN]], multiples of 2P = {unit} with MIN <= MEDIAN <= MAX")
    try:
        assert fields[0] == "lognormal" and 3 <= len(fields) <= 5
        median, longest, *rest = (int(f) for f in fields[1:])
        seed, shortest = (rest + [0, unit])[:2] if len(rest) < 2 else rest
        assert all(n % unit == 0 and n > 0 for n in (median, longest, shortest))
        long = args.doc_long or 0
        assert long % unit == 0 and long < seq_length
        drawn = lognormal_lengths((seq_length - long) // unit, median // unit, longest // unit,
                                  seed, shortest // unit)
    except (AssertionError, ValueError):
        parser.error(usage)
    return ((long,) if long else ()) + tuple(n * unit for n in drawn)


def cumulative(lengths: tuple[int, ...]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def cases(args: argparse.Namespace, cluster: Cluster, lengths: tuple[int, ...]) -> list[dict]:
    """THD on the planner's best grid for it, the placement on its best, with the MODEL."""
    s = sum(lengths)
    w = Workload(seq_length=s, num_heads=args.heads, num_kv_heads=args.kv_heads[-1],
                 head_dim=args.head_dim, dtype=args.dtype, doc_lengths=lengths)
    plan = search(w, cluster)
    placed = price_placement(plan)
    thd, best = plan.best_grid, placed.best
    a, r, c = thd.grid_shape
    shape = w.attention_shape()
    thd_bytes = mesh_traffic(shape, w.mesh_plan(r, c, a)).total
    pa, pr, pc = best.grid_shape
    placed_bytes = mm.placement_traffic(shape, placed.placement, pr, pc, pa, True,
                                        grad_reduce_dtype=DEFAULT_GRAD_DTYPE).total
    return [
        {"layout": "THD", "grid": thd.grid_shape, "schedule": w.mesh_plan(r, c, a).schedule.value,
         "model_s": thd.total_s, "model_bytes": thd_bytes},
        {"layout": "placed", "grid": best.grid_shape, "schedule": "sparse",
         "model_s": best.total_s, "model_bytes": placed_bytes, "placement": placed.placement,
         "floor_s": placed.floor_total_s, "summary": placed.placement.summary()},
    ]


def inputs(case: dict, lengths: tuple[int, ...], grid: mm.MeshGrid, args: argparse.Namespace):
    """This rank's q, k, v, dout and the mesh_attention keywords of the case's layout."""
    s = sum(lengths) // grid.cp_size
    dtype = TORCH_DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(grid.cp_rank)
    q, k, v = (torch.randn(s, h, args.head_dim, generator=gen, dtype=dtype).requires_grad_()
               for h in (args.heads, args.kv_heads[-1], args.kv_heads[-1]))
    dout = torch.randn(s, args.heads, args.head_dim, generator=gen, dtype=dtype)
    if case["layout"] == "THD":
        extra = {"cu_seqlens": torch.tensor(cumulative(lengths), dtype=torch.int32),
                 "schedule": case["schedule"]}
    else:
        extra = {"placement": case["placement"]}
    return q, k, v, dout, extra


def time_case(case: dict, lengths: tuple[int, ...], grid: mm.MeshGrid, emulation: Emulation,
              args: argparse.Namespace, machine: bool = False) -> dict:
    """Median / min / max seconds of forward + backward (barrier to barrier: the slowest
    rank), the most bytes any rank sent and the most emulated compute any rank slept in
    one layer; `machine`: compute off and links unshaped (this machine's own time)."""
    q, k, v, dout, extra = inputs(case, lengths, grid, args)
    times, sent, slept = [], 0, 0.0
    for it in range(args.warmup + args.repeats):
        kernel = EmulatedKernel(float("inf") if machine else emulation.flops_rate)
        q.grad = k.grad = v.grad = None
        dist.barrier()
        links = ShapedLinks(emulation, dist.get_rank(), shape=not (args.real_links or machine))
        with links:
            t0 = time.perf_counter()
            out = mm.mesh_attention(q, k, v, grid, True, args.head_dim ** -0.5, kernel,
                                    grad_reduce_dtype=DEFAULT_GRAD_DTYPE, **extra)
            out.backward(dout)
            dist.barrier()
            elapsed = time.perf_counter() - t0
        if it >= args.warmup:
            times.append(elapsed)
        sent, slept = sum(links.bytes.values()), kernel.seconds
    most = torch.tensor([sent, round(slept * 1e9)], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "bytes": int(most[0]), "compute_s": int(most[1]) / 1e9}


def run_documents_rank(rank: int, world: int, args: argparse.Namespace, emulation: Emulation
                       ) -> list[dict]:
    """Both layouts on this P; rank 0's rows."""
    lengths = args.lengths[world]
    rows = []
    for case in cases(args, emulation.cluster, lengths):
        a, r, c = case["grid"]
        grid = mm.MeshGrid.build(rows=r, cols=c, heads=a)
        row = {"P": world, "S": sum(lengths), "documents": len(lengths), "layout": case["layout"],
               "grid": list(case["grid"]), "schedule": case["schedule"],
               "model_s": case["model_s"], "model_bytes": case["model_bytes"]}
        row.update({k: case[k] for k in ("floor_s", "summary") if k in case})
        row.update(time_case(case, lengths, grid, emulation, args))
        if args.floor:
            row["machine_s"] = time_case(case, lengths, grid, emulation, args, True)["median_s"]
        rows.append(row)
    return rows


def documents_report(rows: list[dict], args: argparse.Namespace, describe: str) -> str:
    """One table per P: THD and the placement, EMULATED beside MODEL, and the floor."""
    clock = ("REAL links (network namespaces, tbf between nodes; compute EMULATED)"
             if args.real_links else "EMULATED compute and links")
    clock_ms = "NETNS ms" if args.real_links else "EMULATED ms"
    lines = []
    for p in dict.fromkeys(r["P"] for r in rows):
        thd, placed = (next(r for r in rows if r["P"] == p and r["layout"] == lay)
                       for lay in ("THD", "placed"))
        floor = placed["floor_s"]
        lines += ["", describe,
                  f"P={p} ({args.nodes} x {p // args.nodes}), S={thd['S']}, {thd['documents']} "
                  f"packed documents ({args.doc_source}), heads {args.heads}/{args.kv_heads[-1]} x "
                  f"{args.head_dim} (real tensors), {args.dtype}, causal; {clock}; "
                  f"{args.repeats} repeats",
                  "  " + placed["summary"],
                  f"{'layout':<8} {'grid':>8} {clock_ms:>11} {'spread':>7} {'MODEL ms':>9} "
                  f"{'ratio':>6} {'THD/this':>9} {'MODEL THD/this':>14} {'/floor':>7} "
                  f"{'MiB/rank':>9} {'MODEL MiB':>9} {'slept ms':>8}"
                  + (f" {'machine ms':>10}" if args.floor else "")]
        for r in (thd, placed):
            spread = (r["max_s"] - r["min_s"]) / r["median_s"]
            lines.append(
                f"{r['layout']:<8} {'x'.join(map(str, r['grid'])):>8} {r['median_s'] * 1e3:11.1f} "
                f"{spread:7.1%} {r['model_s'] * 1e3:9.1f} {r['median_s'] / r['model_s']:6.2f} "
                f"{thd['median_s'] / r['median_s']:8.2f}x {thd['model_s'] / r['model_s']:13.2f}x "
                f"{r['median_s'] / floor:6.2f}x {r['bytes'] / MIB:9.3f} "
                f"{r['model_bytes'] / MIB:9.3f} {r['compute_s'] * 1e3:8.1f}"
                + (f" {r['machine_s'] * 1e3:10.1f}" if args.floor else ""))
        lines.append(f"compute floor (busiest rank's in-document FLOPs at the emulated GPU's "
                     f"rate, MODEL): {floor * 1e3:.1f} ms")
    lines += ["", f"{clock_ms} = measured median forward + backward per layer (slowest rank"
              + ("; links shaped by the kernel, compute EMULATED" if args.real_links else "")
              + "); MODEL ms = the planner's prediction for the same emulated cluster; "
              f"ratio = {clock_ms.split()[0]} / MODEL; THD/this = THD's time over this "
              "row's; /floor = this row's time over the compute floor; MiB/rank = bytes the "
              "busiest rank sent, counted at the exchange; MODEL MiB = mesh_traffic (THD) / "
              "placement_traffic (placed); slept ms = "
              "the most emulated compute one rank slept"]
    if args.floor:
        lines.append("machine ms = the same layer with compute off and links unshaped: what "
                     "this machine alone takes (Python, gloo, the schedules' copies)")
    return "\n".join(lines)
