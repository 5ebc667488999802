"""Time and peak memory of one forward + backward of `mesh_attention` under masks given as
slices, against the causal call of the same shape, on gloo ranks of this machine (CPU).

    python scripts/bench_masks.py --cp-size 2 --local 8192            # the masks' peaks
    python scripts/bench_masks.py --cp-size 2 --local 2048 --documents 16 128 1024

The first form runs causal, a bidirectional prefix (`mm.prefix_lm_mask`, a quarter of the
sequence), 64 causal documents as a block-diagonal `SliceMask` and chunked-causal documents
(8 documents, causal within chunks of 1024) and prints, per mask, the seconds of one
forward + backward (the slowest rank, median of --iters) and the peak extra bytes of each
pass (`runtime.peak_memory`: tracked CPU tensors), and both as a ratio to causal. With
--documents it times equal causal documents, given as slices (`mask=`) and as THD
`cu_seqlens`, at each count. It also times building a `SliceMask` of 10,000 column strips
(the overlap check) and intersecting 1,000 documents with a prefix-LM mask and with 256
causal chunks (`slices.intersect`). Numbers from a shared machine vary from run to run: compare within one.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import megatron_mesh as mm
from megatron_mesh.runtime.peak_memory import pass_peaks
from megatron_mesh.runtime.spawn import run_gloo

MIB = 2 ** 20


def causal_documents(seq: int, count: int) -> list[tuple]:
    """`count` equal causal documents over `seq` positions, as slices."""
    bounds = [seq * n // count for n in range(count + 1)]
    return [(a, b, a, b, "causal") for a, b in zip(bounds, bounds[1:])]


def chunked(seq: int, documents: int, chunk: int) -> list[tuple]:
    """Documents cut into chunks of `chunk` tokens, causal within each chunk."""
    out = []
    for a, b in zip(*(lambda x: (x, x[1:]))([seq * n // documents for n in range(documents + 1)])):
        for c in range(a, b, chunk):
            out.append((c, min(b, c + chunk), c, min(b, c + chunk), "causal"))
    return out


def cases(args: argparse.Namespace, seq: int) -> dict[str, dict]:
    """The masks, as mesh_attention's keyword arguments."""
    if args.documents:
        out = {}
        for n in args.documents:
            slices = causal_documents(seq, n)
            cu = torch.tensor([0] + [b for _, b, *_ in slices], dtype=torch.int32)
            out[f"{n} documents as slices"] = dict(mask=mm.SliceMask(slices, seq))
            out[f"{n} documents, cu_seqlens"] = dict(cu_seqlens=cu)
        return {"causal": dict(causal=True), **out}
    return {"causal": dict(causal=True),
            "prefix (1/4)": dict(mask=mm.prefix_lm_mask(seq, seq // 4)),
            "64 documents": dict(mask=mm.SliceMask(causal_documents(seq, 64), seq)),
            "chunked (8 docs, 1024)": dict(mask=mm.SliceMask(chunked(seq, 8, 1024), seq))}


def worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(rank)
    grid = mm.MeshGrid.build(rows=world, cols=1)
    s, seq = args.local, args.local * world
    out = {}
    for name, kwargs in cases(args, seq).items():
        thd = "cu_seqlens" in kwargs
        shape = (s,) if thd else (s, 1)
        q, k, v = (torch.randn(*shape, h, args.head_dim).requires_grad_()
                   for h in (args.heads, args.heads, args.heads))
        dout = torch.randn(*shape, args.heads, args.head_dim)

        if "mask" in kwargs and args.exchange:
            kwargs = dict(kwargs, window_exchange=args.exchange)

        def forward():
            return mm.mesh_attention(q, k, v, grid, backend="torch", **kwargs)

        times = []
        for _ in range(args.iters + 1):  # the first builds the mask's calls
            start = time.perf_counter()
            forward().backward(dout)
            times.append(time.perf_counter() - start)
        peaks = pass_peaks(forward, dout) if args.memory else {}
        out[name] = {"seconds": statistics.median(times[1:]), **peaks}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp-size", type=int, default=2)
    p.add_argument("--local", type=int, default=8192, help="tokens per rank")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--documents", type=int, nargs="*", help="time documents at these counts")
    p.add_argument("--no-memory", dest="memory", action="store_false")
    p.add_argument("--exchange", choices=("sparse", "gathered"),
                   help="the masks' window_exchange (default: mesh_attention's)")
    args = p.parse_args()
    start = time.perf_counter()
    strips = mm.SliceMask([(0, 1 << 20, 10 * i, 10 * i + 10, "full") for i in range(10_000)])
    print(f"SliceMask of {len(strips)} column strips over one query range: "
          f"{time.perf_counter() - start:.2f} s")
    seq = 1 << 17
    documents = mm.SliceMask(causal_documents(seq, 1000), seq)
    for name, other in (("a prefix-LM mask", mm.prefix_lm_mask(seq, 4096)),
                        ("256 causal chunks", mm.SliceMask(causal_documents(seq, 256), seq))):
        start = time.perf_counter()
        both = documents & other
        print(f"1000 documents & {name}: {time.perf_counter() - start:.4f} s "
              f"({len(both)} slices)")
    per_rank = run_gloo(worker, args.cp_size, args)
    print(f"P={args.cp_size}, {args.local} tokens a rank, {args.heads} heads x {args.head_dim}, "
          "fp32, torch's CPU kernel; the slowest rank")
    base = {key: max(r["causal"][key] for r in per_rank) for key in per_rank[0]["causal"]}
    print(f"{'mask':<28} {'fwd+bwd s':>9} {'x causal':>8}" + (
        f" {'fwd MiB':>8} {'bwd MiB':>8} {'peak x causal':>13}" if args.memory else ""))
    for name in per_rank[0]:
        row = {key: max(r[name][key] for r in per_rank) for key in per_rank[0][name]}
        line = f"{name:<28} {row['seconds']:9.3f} {row['seconds'] / base['seconds']:8.2f}"
        if args.memory:
            peak = max(row["forward"], row["backward"])
            line += (f" {row['forward'] / MIB:8.1f} {row['backward'] / MIB:8.1f} "
                     f"{peak / max(base['forward'], base['backward']):13.2f}")
        print(line)


if __name__ == "__main__":
    main()
