"""Extra memory of each schedule, measured on CPU tensors, against `memory.extra_memory`:
streaming holds two K/V chunks instead of R, and the model stays close to measurement."""
from __future__ import annotations

import torch

import megatron_mesh as mm
from dist_utils import run_distributed
from megatron_mesh.memory import extra_memory
from megatron_mesh.peak_memory import CpuPeakMemory


def test_peak_memory_counts_live_storages() -> None:
    with CpuPeakMemory() as mem:
        a = torch.ones(1000, 250)  # 1 MB
        view = a[:10]
        b = torch.ones(500, 1000)  # 2 MB
        del a
        assert mem.live_bytes == 3_000_000  # the view keeps a's storage alive
        del view
        b.add_(1)  # in place: nothing new
        assert mem.live_bytes == 2_000_000
    assert mem.peak_bytes == 3_000_000


def measure_worker(rank: int, world: int) -> dict:
    s, b, hq, hkv, d = 64, 1, 8, 2, 32
    results = {}
    for rows, cols in mm.mesh_shapes(world):
        grid = mm.MeshGrid.build(rows=rows, cols=cols)
        for schedule in ("gathered", "streamed"):
            g = torch.Generator().manual_seed(rank)
            q, k, v = (torch.randn(s, b, h, d, generator=g).requires_grad_() for h in (hq, hkv, hkv))
            dout = torch.randn(s, b, hq, d, generator=g)
            with CpuPeakMemory() as fwd:
                out = mm.mesh_attention(q, k, v, grid, schedule=schedule)
            with CpuPeakMemory() as bwd:
                out.backward(dout)
            model = extra_memory(mm.AttentionShape(s * world, b, hq, hkv, d, 4), rows, cols, schedule)
            results[(rows, cols, schedule)] = {
                "forward": (fwd.peak_bytes - fwd.live_bytes, model["forward"]),
                "backward": (bwd.peak_bytes - bwd.live_bytes, model["backward"]),
            }
    return results


def test_streaming_bounds_kv_memory_and_the_model_matches() -> None:
    per_rank = run_distributed(measure_worker, 8)
    problems = []
    for rank, results in enumerate(per_rank):
        for (rows, cols, schedule), phases in results.items():
            for phase, (measured, model) in phases.items():
                if not 0.75 * model <= measured <= 1.25 * model:
                    problems.append(f"rank {rank} {rows}x{cols} {schedule} {phase}: measured "
                                    f"{measured} B, model {model} B")
        for rows, cols in ((8, 1), (4, 2)):  # K/V: two chunks streamed instead of R gathered
            streamed = results[(rows, cols, "streamed")]["backward"][0]
            gathered = results[(rows, cols, "gathered")]["backward"][0]
            if not streamed < gathered:
                problems.append(f"rank {rank} {rows}x{cols}: streamed backward {streamed} B "
                                f"is not below gathered {gathered} B")
        tall = results[(8, 1, "streamed")]["backward"][0] / results[(8, 1, "gathered")]["backward"][0]
        if tall > 0.6:
            problems.append(f"rank {rank} 8x1: streamed/gathered backward memory {tall:.2f} > 0.6")
    assert not problems, "\n".join(problems)
