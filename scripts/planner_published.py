"""The planner's tables against the published figures (docs/planner.md), from the model.

    python scripts/planner_published.py

Prices the configurations docs/planner.md compares with the Mesh-Attention and ATTENTION2D
abstracts (bf16, causal, batch 1, head dim 128) and prints the markdown tables: the best 2D
mesh against ring (traffic cut, times, speedup with and without overlap), a2a+p2p's speedup
and the heads x rows x cols choice's. Then the 64-GPU, 128K cases (GQA 32/8, MHA, packed
documents) priced at the flat 400 TFLOP/s and by the H200's measured kernel-call profile
(`--gpu h200`), and the choice where they differ. Every number is the planner's model, not a
measurement.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_mesh.planner import plan
from megatron_mesh.planner.gpu_profile import load_profile
from megatron_mesh.planner.pricing.placed_documents import price_placement
from megatron_mesh.planner.search import grid_key

K = 1024


@dataclass(frozen=True)
class Hardware:
    name: str
    gpus_per_node: int
    intra_node_bw: float
    inter_node_bw: float
    attention_tflops: float


H100 = Hardware("H100", 8, 360, 45, 400)
A100 = Hardware("A100", 8, 200, 25, 180)
A100_X4 = Hardware("A100 x 4", 4, 200, 25, 180)
H100_X1 = Hardware("H100 x 1", 1, 360, 45, 400)

HEADER = ("| cluster | heads q/kv | S | mesh | traffic cut | ring ms | mesh ms | speedup | "
          "no overlap | a2a+p2p | heads x mesh |\n|---|---|---|---|---|---|---|---|---|---|---|")


def row(hw: Hardware, gpus: int, heads: int, kv_heads: int, seq: int) -> str:
    options = dict(seq_length=seq, num_heads=heads, num_kv_heads=kv_heads, head_dim=128,
                   gpus_per_node=hw.gpus_per_node, intra_node_bw=hw.intra_node_bw,
                   inter_node_bw=hw.inter_node_bw, attention_tflops=hw.attention_tflops)
    p = plan(gpus, **options)
    flat = plan(gpus, overlap=False, **options)
    mesh, ring = p.best_mesh, p.ring
    a2a_p2p = p.method("a2a+p2p")
    a2a_text = f"{p.speedup(a2a_p2p):.2f}x {a2a_p2p.label.split()[-1]}" if a2a_p2p else "n/a"
    grid = p.best_grid
    nodes = gpus // hw.gpus_per_node
    length = f"{seq // K // K}M" if seq >= K * K else f"{seq // K}K"
    return (f"| {hw.name}, {nodes} nodes | {heads}/{kv_heads} | {length} | "
            f"{mesh.mesh_shape[0]}x{mesh.mesh_shape[1]} | "
            f"{100 * (1 - mesh.total_bytes / ring.total_bytes):.1f}% | {1e3 * ring.total_s:.0f} | "
            f"{1e3 * mesh.total_s:.0f} | **{p.speedup(mesh):.2f}x** | "
            f"{flat.speedup(flat.best_mesh):.2f}x | {a2a_text} | "
            f"{'x'.join(map(str, grid.grid_shape))} {p.speedup(grid):.2f}x |")


def traffic_cut(heads: int, kv_heads: int, dtype: str, grads: str) -> str:
    """Least-traffic 2D mesh against ring on 256 GPUs (hardware-free)."""
    p = plan(256, seq_length=256 * K, num_heads=heads, num_kv_heads=kv_heads, head_dim=128,
             dtype=dtype, mesh_grad_reduce_dtype=grads)
    least = min(p.meshes, key=lambda e: e.total_bytes)
    cut = 1 - least.total_bytes / p.ring.total_bytes
    return f"{100 * cut:.1f}% ({least.mesh_shape[0]}x{least.mesh_shape[1]})"


PROFILE_HEADER = ("| case | pricing | choice | its calls fwd/bwd | its ms | best 2D mesh, ms (calls) | "
                  "ring ms (calls) | choice over ring |\n|---|---|---|---|---|---|---|---|")


def _choices(p, docs: bool) -> tuple:
    """(choice, best 2D mesh, ring, label suffix, every estimate) of a plan: with `docs`,
    the placement's grids, THD's best named beside them."""
    if not docs:
        return p.best_grid, p.best_mesh, p.ring, "", p.estimates
    placed = price_placement(p)
    mesh = min((e for e in placed.estimates if e.heads == 1), key=grid_key)
    return placed.best, mesh, p.ring, (f"; placed (THD's best {p.best_grid.label.split()[-1]}: "
                                       f"{1e3 * p.best_grid.total_s:.2f} ms)"), placed.estimates


def profile_rows(name: str, heads: int, kv_heads: int, docs: int | None = None) -> list[str]:
    """The case at the flat rate and by the H200 profile (64 GPUs, 128K, H100 links), the
    profile's choice in bold where it differs; with `docs`, packed documents of that
    length: the placement's grids (the choice), THD's best beside it. Calls are counted
    where the profile prices (the flat rows show the same grid's count from there)."""
    options = dict(seq_length=128 * K, num_heads=heads, num_kv_heads=kv_heads, head_dim=128,
                   gpus_per_node=8, intra_node_bw=360, inter_node_bw=45)
    if docs:
        options["doc_lengths"] = (docs,) * (128 * K // docs)
    flat = _choices(plan(64, **options), bool(docs))
    profiled = _choices(plan(64, gpu=load_profile("h200"), **options), bool(docs))
    counted = {e.label: e.calls for e in (profiled[2], *profiled[4])}

    def calls(e) -> str:
        k = counted[e.label]
        return f"{k.forward}/{k.backward}"

    out = []
    for label, (choice, mesh, ring, suffix, _) in (("flat 400 TFLOP/s", flat),
                                                   ("H200 profile", profiled)):
        grid = "x".join(map(str, choice.grid_shape))
        if choice is profiled[0] and choice.label != flat[0].label:
            grid = f"**{grid}** (flat: {'x'.join(map(str, flat[0].grid_shape))})"
        out.append(f"| {name} | {label}{suffix} | {grid} | {calls(choice)} | "
                   f"{1e3 * choice.total_s:.2f} | {mesh.label.split()[-1]} {1e3 * mesh.total_s:.2f} "
                   f"({calls(mesh)}) | {1e3 * ring.total_s:.2f} ({calls(ring)}) | "
                   f"{ring.total_s / choice.total_s:.2f}x |")
    return out


def main() -> None:
    print("planner model (not measurements): bf16, causal, batch 1, head dim 128\n")
    print("Mesh-Attention, 256 GPUs:\n")
    print(HEADER)
    for hw, heads, kv, seqs in ((H100, 32, 32, (256, 512, 1024, 2048)),
                                (H100, 32, 8, (256, 512, 1024)),
                                (A100, 32, 32, (256, 512, 1024)),
                                (A100, 32, 8, (256, 512))):
        for s in seqs:
            print(row(hw, 256, heads, kv, s * K))
    print("\ntraffic, least-traffic mesh against ring, 256 GPUs, 32 query heads:\n")
    print("| exchange | g=1 (MHA) | 2 | 4 | 8 |\n|---|---|---|---|---|")
    for label, dtype, grads in (("bf16, gradients mixed (default)", "bf16", "mixed"),
                                ("bf16, gradients fp32", "bf16", "fp32"),
                                ("fp32", "fp32", "fp32")):
        cells = " | ".join(traffic_cut(32, 32 // g, dtype, grads) for g in (1, 2, 4, 8))
        print(f"| {label} | {cells} |")
    print("\nATTENTION2D, 64 GPUs, 96 heads x 128, MHA:\n")
    print(HEADER)
    for hw in (A100_X4, H100_X1):
        for s in (32, 64, 128, 256, 512):
            print(row(hw, 64, 96, 96, s * K))
    print(f"\nflat rate against the {load_profile('h200').describe()}; 64 GPUs (8 nodes x 8, "
          "360 / 45 GB/s), S = 128K, head dim 128; calls = kernel calls per rank and pass\n")
    print(PROFILE_HEADER)
    for case in (("GQA 32/8", 32, 8), ("MHA 32/32", 32, 32), ("GQA 32/8, 32 docs of 4K", 32, 8, 4096),
                 ("MHA 32/32, 32 docs of 4K", 32, 32, 4096)):
        print("\n".join(profile_rows(*case)))


if __name__ == "__main__":
    main()
