"""Per-tile overhead on one device: one rank's mesh tile against one kernel call.

A rank of a P-rank mesh computes P rank-blocks on chunks of s = S / P tokens (a P x 1 tile:
one query chunk against the column's P K/V chunks): with causal masking one diagonal block
(s x s, causal) and P - 1 half blocks (s x s/2 or s/2 x s), merged by log-sum-exp (forward)
or accumulated in fp32 (backward), exactly as `megatron_mesh.schedules.blocks.forward_tile` /
`backward_tile` do inside mesh attention: grouped into few kernel calls (`calls.groups`;
--calls blocks: one call per block, the A/B baseline). The same FLOPs in one call: the s
query rows against P * s / 2 keys (P * s without causal masking), no mask. Each row gives
the tile's kernel calls in that pass ('calls', counted on the kernel), 'grouped' and
'folded' (the causal diagonal in one bottom-right call with the keys before it:
`kernels.base.folds_diagonal`, torch's kernel on CUDA's flash op). --documents N: the
sequence is N packed documents of P s / N tokens (THD), the tile's blocks variable-length
calls joined document by document (`calls/document_groups.py`); its single call is one
variable-length call of the same documents' FLOPs (each document's s / N query rows against
P s / 2N keys, P s / N without causal masking). --calls grouped,blocks gives both rows.

    python scripts/bench_tiles.py --chunk 2048,4096,8192 --cp-size 8    # CUDA, every backend
    python scripts/bench_tiles.py --device cpu --chunk 256 --cp-size 4   # smoke run (CPU)
    python scripts/bench_tiles.py --chunk 2048 --documents 16 --calls grouped,blocks

Prints milliseconds, TFLOP/s, efficiency (single-call time / tile time) and, on CUDA, the
peak memory of each pass, per chunk size and backend (torch, cudnn, te; one that cannot
run here says why). --backends flex adds FlexAttention (`kernels/flex.py`): the tile in one
call with a block mask (its single call: one flex call of the same FLOPs); on CUDA its first
call of a shape compiles (the warm-up call of `timed` takes it):

    python scripts/bench_tiles.py --chunk 2048,4096 --cp-size 8 --backends torch,flex

--clock cpu times this process's CPU seconds (`time.process_time`, all its threads) in place
of wall time: what a CPU shared with other jobs leaves measurable (not for CUDA). --json
appends the rows to a file, one JSON object a line, each with the merge used: 'triton' (one fused kernel, CUDA
with Triton) or 'torch' (MESH_TRITON_MERGE=0 forces it, for an A/B).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatron_mesh.calls.layout import AttentionMask
from megatron_mesh.calls.tile_slices import TileSlices
from megatron_mesh.common import merge_triton
from megatron_mesh.common.merge import empty_accumulators
from megatron_mesh.dtypes import TORCH_DTYPES
from megatron_mesh.kernels import get_kernel
from megatron_mesh.kernels.base import folds_diagonal
from megatron_mesh.masks.documents import Documents
from megatron_mesh.schedules.blocks import backward_tile, forward_tile, kv_grads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunk", default="8192", help="tokens per rank s (even; comma-separated list)")
    p.add_argument("--cp-size", type=int, default=8, help="P: blocks per tile")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default=None,
                   help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--backends", default="torch,cudnn,te",
                   help="comma-separated: torch, cudnn, te, flex (FlexAttention: the tile in one "
                        "call; compiled on CUDA, eager on the CPU; asked for by name only)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time, or this process's CPU time (a shared CPU machine)")
    p.add_argument("--documents", type=int, default=0,
                   help="N packed documents of equal length (0: one dense sequence)")
    p.add_argument("--calls", default="grouped",
                   help="grouped (the tile's blocks in few kernel calls, the default), blocks "
                        "(one call per block), or grouped,blocks for both rows")
    p.add_argument("--json", default=None, help="append one JSON object per row to this file")
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    if args.clock == "cpu" and args.device.startswith("cuda"):
        p.error("--clock cpu times the CPU's work: use it with --device cpu")
    try:
        args.chunks = [int(c) for c in args.chunk.split(",")]
    except ValueError:
        p.error(f"--chunk {args.chunk!r} must be even integers, comma-separated")
    if any(c <= 0 or c % 2 for c in args.chunks):
        p.error(f"--chunk {args.chunk} must be positive and even (two zigzag halves)")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    args.call_modes = args.calls.split(",")
    if not args.call_modes or any(c not in ("grouped", "blocks") for c in args.call_modes):
        p.error(f"--calls {args.calls!r} must be grouped, blocks or both, comma-separated")
    if args.documents < 0:
        p.error(f"--documents {args.documents} must be 0 (one sequence) or a positive count")
    if args.documents:
        unit = 2 * args.cp_size * args.documents  # each document a multiple of 2P tokens
        bad = [c for c in args.chunks if c * args.cp_size % unit]
        if bad:
            p.error(f"--chunk {bad[0]} x --cp-size {args.cp_size} must split into "
                    f"--documents {args.documents} documents of a multiple of 2P = "
                    f"{2 * args.cp_size} tokens each")
        if args.batch != 1:
            p.error(f"--documents takes one packed sequence: --batch must be 1, got {args.batch}")
    return args


def timed(fn, device: torch.device, iters: int, clock: str = "wall") -> float:
    """Median seconds of fn() over iters runs after one warm-up: wall time, or this
    process's CPU time (clock 'cpu')."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = now()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(now() - t0)
    return statistics.median(times)


def peak_bytes(fn, device: torch.device) -> int | None:
    """Peak CUDA memory above what was allocated before fn() (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


class Counting:
    """A tile kernel counting its calls (forward and backward), passing them on."""

    def __init__(self, kernel) -> None:
        self.kernel, self.name, self.caps = kernel, kernel.name, kernel.caps
        if hasattr(kernel, "bottom_right_mask_free"):  # where it folds the diagonal
            self.bottom_right_mask_free = kernel.bottom_right_mask_free
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.kernel.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self.calls += 1
        return self.kernel.backward(*args, **kwargs)

    def tile_forward(self, *args):  # kernels taking whole tiles (`caps.whole_tile`): flex
        self.calls += 1
        return self.kernel.tile_forward(*args)

    def tile_backward(self, *args):
        self.calls += 1
        return self.kernel.tile_backward(*args)


def bench(args: argparse.Namespace, backend: str, s: int, calls_mode: str = "grouped"
          ) -> list[dict]:
    device = torch.device(args.device)
    default = "bf16" if device.type == "cuda" else "fp32"
    dtype = TORCH_DTYPES[args.dtype or default]
    kernel = Counting(get_kernel(backend, device, dtype, args.head_dim))
    grouped = calls_mode == "grouped"
    p, b, hq, hkv, d = args.cp_size, args.batch, args.heads, args.kv_heads, args.head_dim
    scale = d ** -0.5
    make = lambda n, h: torch.randn(n, b, h, d, device=device, dtype=dtype)  # noqa: E731
    x = p // 2  # a middle rank: its tile mixes lower (x > y) and upper (x < y) blocks
    q, dout = make(s, hq), make(s, hq)
    kv = [(make(s, hkv), make(s, hkv)) for _ in range(p)]
    keys_single = p * s // 2 if args.causal else p * s
    k1, v1 = make(keys_single, hkv), make(keys_single, hkv)

    mask, single_slices, docs = AttentionMask(args.causal, ranks=p), None, args.documents
    if docs:  # N documents of p s / N tokens; the single call: their FLOPs in one varlen call
        length = p * s // docs
        cu = torch.arange(docs + 1, dtype=torch.int32) * length
        mask = AttentionMask(args.causal, Documents.from_cu_seqlens(cu), p)
        per_doc = keys_single // docs
        single_slices = TileSlices.documents(tuple(range(0, s + 1, s // docs)),
                                             tuple(range(0, keys_single + 1, per_doc)), False,
                                             device)
    column = [(y, k, v) for y, (k, v) in enumerate(kv)]

    def tile_forward():
        out, lse = empty_accumulators(s, b, hq, d, device)
        forward_tile(kernel, [(x, q, out, lse)], column, mask, scale, grouped=grouped)
        return out.to(dtype), lse

    def single_forward():
        return kernel.forward(q, k1, v1, False, scale, slices=single_slices)

    out, lse = tile_forward()
    out1, lse1 = single_forward()

    def tile_backward():
        dq = torch.zeros(s, b, hq, d, dtype=torch.float32, device=device)
        dkv = torch.zeros(p, 2 * s * b * hkv * d, dtype=torch.float32, device=device)
        backward_tile(kernel, [(x, dout, q, out, lse, dq)],
                      [(y, k, v, kv_grads(dkv[y], k, v)) for y, k, v in column], mask, scale,
                      grouped=grouped)

    calls = {}
    for name, fn in (("forward", tile_forward), ("backward", tile_backward)):
        kernel.calls = 0
        fn()
        calls[name] = kernel.calls
    calls["fwd+bwd"] = calls["forward"] + calls["backward"]

    def single_backward():
        kernel.backward(dout, q, k1, v1, out1, lse1, False, scale, slices=single_slices)

    def tile_both():
        tile_forward()
        tile_backward()

    def single_both():
        single_forward()
        single_backward()

    flops_fwd = 4 * b * hq * d * s * keys_single // max(1, docs)
    merge = "triton" if merge_triton.available(out) else "torch"  # MESH_TRITON_MERGE=0: torch
    rows = []
    for name, tile, single, flops in (("forward", tile_forward, single_forward, flops_fwd),
                                      ("backward", tile_backward, single_backward, 2.5 * flops_fwd),
                                      ("fwd+bwd", tile_both, single_both, 3.5 * flops_fwd)):
        t_tile = timed(tile, device, args.iters, args.clock)
        t_one = timed(single, device, args.iters, args.clock)
        rows.append({"backend": kernel.name, "chunk": s, "pass": name, "tile_ms": 1e3 * t_tile,
                     "single_ms": 1e3 * t_one, "tile_tflops": flops / t_tile / 1e12,
                     "single_tflops": flops / t_one / 1e12, "efficiency": t_one / t_tile,
                     "tile_peak_bytes": peak_bytes(tile, device),
                     "single_peak_bytes": peak_bytes(single, device),
                     "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                     else "cpu", "dtype": str(dtype).removeprefix("torch."), "cp_size": p,
                     "heads": hq, "kv_heads": hkv, "head_dim": d, "causal": args.causal,
                     "merge": merge, "calls": calls[name], "grouped": grouped,
                     "pass_calls": {"forward": calls["forward"],
                                    "backward": calls["backward"]},
                     "documents": docs,
                     "folded": grouped and folds_diagonal(kernel, q)})
    return rows


def format_row(row: dict) -> str:
    mib = lambda n: "-" if n is None else f"{n / 2**20:.0f}"  # noqa: E731
    return (f"{row['backend']:>6} {row['chunk']:>6} {row['pass']:>9} {row['calls']:>5} "
            f"{row['tile_ms']:10.3f} "
            f"{row['single_ms']:10.3f} {row['tile_tflops']:10.2f} {row['single_tflops']:10.2f} "
            f"{100 * row['efficiency']:9.1f}% {mib(row['tile_peak_bytes']):>9} "
            f"{mib(row['single_peak_bytes']):>9}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    where = (f"CUDA ({torch.cuda.get_device_name(args.device)})" if args.device.startswith("cuda")
             else "CPU (not a GPU measurement)")
    docs = f", {args.documents} packed documents" if args.documents else ""
    print(f"one rank's tile: P={args.cp_size} blocks of {args.chunk} tokens, heads "
          f"{args.heads}/{args.kv_heads}, d={args.head_dim}, b={args.batch}, causal={args.causal}"
          f"{docs}, {where}")
    print(f"{'kernel':>6} {'chunk':>6} {'pass':>9} {'calls':>5} {'tile ms':>10} {'single ms':>10} "
          f"{'tile TF/s':>10} {'single TF/s':>10} {'efficiency':>10} {'tile MiB':>9} "
          f"{'single MiB':>9}")
    for s in args.chunks:
        for backend in args.backends.split(","):
            for mode in args.call_modes:
                try:
                    rows = bench(args, backend, s, mode)
                except ValueError as err:  # e.g. 'te' without Transformer Engine or CUDA
                    print(f"{backend:>6} {s:>6} skipped: {err}")
                    break
                for row in rows:
                    print(format_row(row) + ("" if mode == "grouped" else "  (one call a block)"))
                if args.json:
                    with open(args.json, "a") as f:
                        f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
