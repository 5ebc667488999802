"""Mesh attention with its collectives staged through host memory (tests/host_staging.py),
the layer that lets several ranks share one GPU over gloo.

CPU: every schedule on 2x1, 1x2 (P = 2) and 2x2 (P = 4) through the staging layer stays
exact against whole-sequence SDPA, and the staged collectives really ran.
GPU (`gpu` marker): the same on one CUDA device shared by 2 and 4 ranks, fp32 / bf16 /
fp16, MHA / GQA / MQA, against SDPA in fp64 within `reference.merged_error_limit` of the
error SDPA itself makes on that GPU in that dtype; and each schedule's peak CUDA memory
against `megatron_mesh.cost_models.memory`.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.cost_models.memory import extra_memory
from megatron_mesh.cost_models.plan import resolve_plan
from megatron_mesh.layer_plan import Schedule

import host_staging
from dist_utils import run_distributed
from reference import (
    Case,
    Failure,
    assert_no_failures,
    beyond_tolerance,
    case_id,
    errors,
    full_inputs,
    mesh_result,
    partial_results,
    sdpa_reference,
)

SCHEDULES = tuple(str(s) for s in Schedule)
SHAPES = {2: ((2, 1), (1, 2)), 4: ((2, 2),)}


def cpu_worker(rank: int, world: int) -> list[Failure]:
    bad = []
    with host_staging.staged_through_host():
        for rows, cols in SHAPES[world]:
            grid = mm.MeshGrid.build(rows=rows, cols=cols)
            for i, schedule in enumerate(SCHEDULES):
                case = Case(4 * world, 2, 4, (4, 2, 1)[i], 16, causal=bool(i % 2 == 0),
                            dtype=(torch.float32, torch.bfloat16)[i % 2], seed=60 + i,
                            schedule=schedule)
                x = full_inputs(case)
                bad += errors(case, mesh_result(case, x, grid, grid.cp_rank), grid,
                              grid.cp_rank, x)
    staged = host_staging.staged_calls
    if not staged["batch_isend_irecv"] or not sum(staged[n] for n in host_staging.GATHER_LIKE):
        bad.append(Failure(f"P{world} staging", f"rank {rank}: the collectives were not staged: "
                           f"{dict(staged)}"))
    return bad


@pytest.mark.parametrize("world", [2, 4])
def test_schedules_through_host_staging_stay_exact(world: int) -> None:
    assert_no_failures(run_distributed(cpu_worker, world))


# ------------------------------------------------------------------------------- GPU

def how_started(rank: int, world: int, preloaded: list[str]) -> dict:
    """This rank's parent process and which of the server's preloaded modules it has."""
    import sys

    return {"parent": os.getppid(), "preloaded": [m for m in preloaded if m in sys.modules]}


def test_ranks_that_use_cuda_are_spawned_not_forked_from_the_preloaded_server() -> None:
    """A rank forked from the preloaded server cannot initialize CUDA once the server's
    imports have asked CUDA anything; the GPU tests' ranks (`cuda=True`) start as fresh
    interpreters of this process: none of the server's imports, this process their parent."""
    from preloaded import PRELOAD

    heavy = [m for m in PRELOAD if m.startswith("megatron.core")]
    for started in run_distributed(how_started, 2, heavy, cuda=True):
        assert started == {"parent": os.getpid(), "preloaded": []}, started
    forked = run_distributed(how_started, 2, heavy)  # the CPU tests' ranks: preloaded
    assert all(f["parent"] != os.getpid() and f["preloaded"] == heavy for f in forked), forked


def gpu_cases(world: int) -> list[Case]:
    s = 64 * world
    heads = ((8, 8), (8, 2), (8, 1))
    return [Case(s, 2, hq, hkv, 64, causal=causal, dtype=dtype, seed=70 + i, schedule=schedule,
                 device="cuda")
            for i, (schedule, dtype, (hq, hkv), causal) in enumerate(
                (sch, dt, hd, c) for sch in SCHEDULES
                for dt in (torch.float32, torch.bfloat16, torch.float16)
                for hd in heads for c in (True, False))
            if i % 3 == 0 or dtype != torch.float32]


def gpu_errors(case: Case, got: dict, grid: mm.MeshGrid, x: dict) -> list[Failure]:
    """Against SDPA in fp64, within `reference.merged_error_limit` of SDPA's own error in
    case.dtype on this GPU."""
    split = lambda t: mm.zigzag_split(t, grid.cp_size)[grid.cp_rank]  # noqa: E731
    sdpa = lambda dtype, on: {n: split(t)  # noqa: E731
                              for n, t in sdpa_reference(case, x, dtype, on).items()}
    same32 = None if case.dtype == torch.float32 else sdpa(torch.float32, "cuda")
    return [Failure(case_id(case, grid), message) for message in beyond_tolerance(
        got, sdpa(torch.float64, "cpu"), sdpa(case.dtype, "cuda"), case.dtype,
        f"rank {grid.cp_rank}", partial_results(grid), same32)]


def gpu_worker(rank: int, world: int) -> list[Failure]:
    torch.cuda.set_device(0)  # every rank on the one GPU
    bad = []
    with host_staging.staged_through_host():
        for rows, cols in SHAPES[world]:
            grid = mm.MeshGrid.build(rows=rows, cols=cols)
            for case in gpu_cases(world):
                x = full_inputs(case)
                bad += gpu_errors(case, mesh_result(case, x, grid, grid.cp_rank), grid, x)
    return bad


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_ranks_sharing_one_gpu_match_sdpa_fp64(world: int) -> None:
    assert_no_failures(run_distributed(gpu_worker, world, cuda=True))


def memory_worker(rank: int, world: int) -> list[dict]:
    """Peak CUDA memory of one forward + backward per schedule, less what autograd keeps
    (q, k, v, out, lse) and dout, against the memory model's peak."""
    torch.cuda.set_device(0)
    rows_out = []
    seq, b, hq, hkv, d, dtype = 8192, 1, 16, 16, 128, torch.bfloat16
    shape = mm.AttentionShape(seq, b, hq, hkv, d, 2)
    with host_staging.staged_through_host():
        for rows, cols in SHAPES[world]:
            grid = mm.MeshGrid.build(rows=rows, cols=cols)
            for schedule in SCHEDULES:
                s = seq // world
                make = lambda h: torch.randn(s, b, h, d, device="cuda", dtype=dtype)  # noqa: E731
                q, k, v = (make(h).requires_grad_() for h in (hq, hkv, hkv))
                dout = make(hq)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                out = mm.mesh_attention(q, k, v, grid, schedule=schedule)
                out.backward(dout)
                torch.cuda.synchronize()
                # as scripts/bench_attention.py: less out, dq, dk, dv and the fp32 lse
                kept = 2 * q.nbytes + k.nbytes + v.nbytes + 4 * b * hq * s
                measured = torch.cuda.max_memory_allocated() - base - kept
                plan = resolve_plan(shape, rows, cols, schedule)  # the default exchange, as run
                model = max(extra_memory(shape, plan).values())
                rows_out.append({"shape": f"{rows}x{cols}", "schedule": schedule, "rank": rank,
                                 "measured_bytes": measured, "model_bytes": model})
                del out, q, k, v, dout
    return rows_out


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_peak_memory_of_each_schedule_vs_model(world: int) -> None:
    """Rows are appended as JSON lines to $MESH_GPU_MEMORY_REPORT when it is set."""
    rows = sum(run_distributed(memory_worker, world, cuda=True), [])
    report = os.environ.get("MESH_GPU_MEMORY_REPORT")
    if report:
        with open(report, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    over = host_staging.memory_over_model(rows)
    assert not over, "\n".join(over)


@pytest.mark.unit
def test_memory_rows_are_held_to_the_model_by_their_worst_rank() -> None:
    """The GPU memory test's comparison, on rows as its ranks return them: per grid and
    schedule the worst rank's measurement against 1.5 x the model plus 1 MiB."""
    mib = 2**20
    row = lambda shape, sch, rank, m: {"shape": shape, "schedule": sch, "rank": rank,  # noqa: E731
                                       "measured_bytes": m * mib, "model_bytes": 100 * mib}
    fine = [row("2x2", "streamed", r, m) for r, m in enumerate((90, 151, 120, 40))]
    assert host_staging.memory_over_model(fine) == []
    over = fine + [row("2x2", "gathered", 0, 10), row("2x2", "gathered", 3, 152)]
    assert host_staging.memory_over_model(over) == [
        "2x2 gathered: measured 152.0 MiB > 1.5 x model 100.0 MiB"]
