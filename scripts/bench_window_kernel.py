"""The bias bytes, op calls and time of one tile-kernel call (forward + backward) on an op
without windows of its own: a sliding window of W keys over S rows, and equal causal
documents, on torch's kernel (the CPU op timed; CUDA's memory-efficient and cuDNN ops on
'meta' tensors: shapes only, no time).

    python scripts/bench_window_kernel.py --rows 8192 --windows 128 1024 4096
    python scripts/bench_window_kernel.py --rows 8192 --documents 64 512

Per case: the largest bias one op call takes ([block rows, keys] fp32 on the CPU op; on
CUDA the op's [b, h, rows, keys] view of a [rows, keys] tensor: its storage is counted),
the bias bytes made per pass, the bytes the block-bias cache holds after the call
(`run_calls._block_bias`, at most 64 MiB; a larger bias is made on every call), the op
calls of the forward and of the backward, and the seconds of one forward + backward
(the fastest of --iters after a first call, CPU only: on a shared machine the fastest is
the one least slowed by other work).
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_mesh.calls.tile_slices import TileSlices
from megatron_mesh.kernels import run_calls
from megatron_mesh.kernels.cudnn import CudnnKernel
from megatron_mesh.kernels.torch_flash import TorchFlashKernel

MIB = 2 ** 20


class OpCalls(TorchDispatchMode):
    """Attention op calls, and the storage bytes of every bias one takes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.bias_bytes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "attention" in func.overloadpacket.__name__:
            self.calls += 1
            given = dict(zip((a.name for a in func._schema.arguments), args), **(kwargs or {}))
            for name in ("attn_mask", "attn_bias"):
                t = given.get(name)
                if isinstance(t, torch.Tensor):
                    self.bias_bytes.append(t.untyped_storage().nbytes() if t.device.type != "meta"
                                           else _meta_bytes(t))
        return func(*args, **(kwargs or {}))


def _meta_bytes(t: torch.Tensor) -> int:
    """The bytes a meta tensor's strided view spans (its storage on a device)."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0)
    return span * t.element_size()


def one_call(kernel, slices: TileSlices, device: str, dtype: torch.dtype, heads: int,
             dim: int) -> tuple[OpCalls, OpCalls, float]:
    sq, sk = slices.shape
    q = torch.randn(sq, 1, heads, dim, dtype=dtype) if device == "cpu" else \
        torch.empty(sq, 1, heads, dim, dtype=dtype, device=device)
    k = torch.randn(sk, 1, heads, dim, dtype=dtype) if device == "cpu" else \
        torch.empty(sk, 1, heads, dim, dtype=dtype, device=device)
    run_calls._block_bias.cache_clear()
    t0 = time.perf_counter()
    with OpCalls() as fwd:
        out, lse = kernel.forward(q, k, k, False, dim ** -0.5, slices=slices)
    with OpCalls() as bwd:
        kernel.backward(out, q, k, k, out, lse, False, dim ** -0.5, slices=slices)
    return fwd, bwd, time.perf_counter() - t0


def timed(slices: TileSlices, heads: int, dim: int, iters: int) -> float:
    sq, sk = slices.shape
    q, k = torch.randn(sq, 1, heads, dim), torch.randn(sk, 1, heads, dim)
    kernel, times = TorchFlashKernel(), []
    for _ in range(iters + 1):  # the first call warms up
        t0 = time.perf_counter()
        out, lse = kernel.forward(q, k, k, False, dim ** -0.5, slices=slices)
        kernel.backward(out, q, k, k, out, lse, False, dim ** -0.5, slices=slices)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def report(name: str, slices: TileSlices, heads: int, dim: int, iters: int) -> None:
    branches = (("CPU op", TorchFlashKernel(), "cpu", torch.float32),
                ("memory-efficient (meta)", TorchFlashKernel(flash=False), "meta", torch.float32),
                ("cuDNN (meta)", CudnnKernel(), "meta", torch.bfloat16))
    for branch, kernel, device, dtype in branches:
        fwd, bwd, _ = one_call(kernel, slices, device, dtype, heads, dim)
        made = fwd.bias_bytes + bwd.bias_bytes
        held = sum(t.untyped_storage().nbytes() for t in run_calls._block_bias.values())
        kept = f"{held / MIB:.3f}" if device == "cpu" else "-"
        seconds = f"{timed(slices, heads, dim, iters):.3f}" if device == "cpu" else "-"
        print(f"| {name} | {branch} | {max(made, default=0) / MIB:.3f} | "
              f"{sum(made) / MIB:.2f} | {kept} | {fwd.calls} / {bwd.calls} | {seconds} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--windows", type=int, nargs="*", default=[])
    parser.add_argument("--documents", type=int, nargs="*", default=[])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads of the op (1: steadier times on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"S = {args.rows}, {args.heads} heads x {args.dim}, batch 1; largest bias / biases "
          "made per forward + backward / kept after, MiB; op calls forward / backward; s")
    print("| case | op | largest bias | made | kept | calls | fwd + bwd s |")
    print("|---|---|---|---|---|---|---|")
    s = args.rows
    for w in args.windows:
        report(f"window W = {w}", TileSlices.band(s, s, w - 1, 0), args.heads, args.dim,
               args.iters)
    for n in args.documents:
        bounds = [s * i // n for i in range(n + 1)]
        slices = TileSlices.documents(tuple(bounds), tuple(bounds), True, torch.device("cpu"))
        report(f"{n} causal documents", slices, args.heads, args.dim, args.iters)


if __name__ == "__main__":
    main()
