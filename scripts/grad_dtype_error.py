"""Error of the gradient exchange dtypes in bf16: ring vs mesh; fp32, input-dtype and mixed.

    python scripts/grad_dtype_error.py --cp-sizes 8,16

For each CP size P, spawns P gloo processes and runs, on the same bf16 inputs, the ring
(P x 1, K/V streamed, dK / dV partials rounded to bf16 at each of the P-1 hops, as
Transformer Engine's ring does) and the other mesh shapes with dQ, dK, dV exchanged in fp32,
in bf16, and mixed (dK, dV in bf16, dQ in fp32). Prints, per tensor, the worst error over
ranks against fp32 SDPA on the whole sequence, divided by the error of bf16 SDPA on one
device (1.0 = as exact as single-device bf16 attention). The error is relative RMS
(||got - ref|| / ||ref|| over the rank's share): the largest single error is set by the final
rounding to bf16 and hides what the exchange adds.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_mesh as mm
from megatron_mesh.runtime.spawn import run_gloo

NAMES = ("out", "dq", "dk", "dv")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp-sizes", default="8,16", help="comma-separated CP sizes")
    p.add_argument("--tokens-per-rank", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def sdpa(x: dict, dtype: torch.dtype) -> dict:
    """out, dq, dk, dv [S, b, h, d] (fp32) of causal SDPA on the whole sequence in `dtype`."""
    q, k, v = (x[n].to(dtype).permute(1, 2, 0, 3).requires_grad_() for n in ("q", "k", "v"))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(x["dout"].to(dtype).permute(1, 2, 0, 3))
    sbhd = lambda t: t.detach().permute(2, 0, 1, 3).float()  # noqa: E731
    return {"out": sbhd(out), "dq": sbhd(q.grad), "dk": sbhd(k.grad), "dv": sbhd(v.grad)}


def runs(p: int) -> list[tuple[int, int, str]]:
    """(rows, cols, gradient exchange): the ring, then every other shape in every exchange."""
    meshes = [(r, c) for r, c in mm.mesh_shapes(p) if c > 1]
    return [(p, 1, "input")] + [(r, c, g) for r, c in meshes for g in ("fp32", "input", "mixed")]


def rms_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref||."""
    return ((got.float() - ref).norm() / ref.norm()).item()


def worker(rank: int, world: int, x: dict, ref: dict, single: dict) -> list:
    """This rank's share of every run; every rank returns the same rows (maxima over ranks)."""
    share = {n: mm.zigzag_split(t, world)[rank] for n, t in x.items()}
    mine = {n: mm.zigzag_split(t, world)[rank] for n, t in ref.items()}
    base = {n: rms_error(mm.zigzag_split(single[n], world)[rank], mine[n]) for n in NAMES}
    rows = []
    for r, c, grads in runs(world):
        grid = mm.MeshGrid.build(rows=r, cols=c)
        q, k, v = (share[n].to(torch.bfloat16).requires_grad_() for n in ("q", "k", "v"))
        out = mm.mesh_attention(q, k, v, grid, causal=True, grad_reduce_dtype=grads,
                                schedule="streamed_kv" if c == 1 else "streamed")
        out.backward(share["dout"].to(torch.bfloat16))
        got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        ratio = torch.tensor([rms_error(got[n], mine[n]) / base[n] for n in NAMES])
        dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
        rows.append((r, c, grads, ratio.tolist()))
    return rows


def measure(p: int, args: argparse.Namespace) -> list:
    s = args.tokens_per_rank * p
    g = torch.Generator().manual_seed(args.seed)
    shape = lambda h: (s, 1, h, args.head_dim)  # noqa: E731
    x = {n: torch.randn(*shape(h), generator=g) for n, h in
         (("q", args.heads), ("k", args.kv_heads), ("v", args.kv_heads), ("dout", args.heads))}
    ref = sdpa(x, torch.float32)
    single = sdpa(x, torch.bfloat16)
    return run_gloo(worker, p, x, ref, single)[0]


def main(argv: list[str] | None = None) -> None:

    args = parse_args(argv)
    print(f"bf16, causal, {args.tokens_per_rank} tokens per rank, heads {args.heads}/"
          f"{args.kv_heads}, d={args.head_dim}; worst over ranks of the relative RMS error against "
          "fp32 SDPA, divided by single-device bf16 SDPA's (measured on CPU, gloo)")
    print(f"{'P':>3} {'shape':>6} {'exchange':>9} " + " ".join(f"{n:>6}" for n in NAMES))
    for p in (int(n) for n in args.cp_sizes.split(",")):
        for r, c, grads, ratios in measure(p, args):
            label = "ring" if c == 1 else grads
            print(f"{p:>3} {r:>3}x{c:<2} {label:>9} " + " ".join(f"{x:6.2f}" for x in ratios))


if __name__ == "__main__":
    main()
