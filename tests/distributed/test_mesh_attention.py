"""Mesh attention against whole-sequence torch SDPA, forward and backward, on gloo.

One spawned process group per CP size runs every R x C factorization and many cases;
each case also checks the bytes sent (counted on the real collectives) against
`megatron_mesh.cost_models.traffic.mesh_traffic`. The README's API script runs under torchrun.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import megatron_mesh as mm

from dist_utils import run_distributed
from reference import (
    CONCRETE_SCHEDULES,
    LAYOUTS,
    Case,
    Failure,
    assert_no_failures,
    case_id,
    check_cases,
    errors,
    full_inputs,
    mesh_result,
    sdpa_reference,
)


def cases_for(cp_size: int) -> list[Case]:
    s = 4 * cp_size  # two rows per zigzag sub-chunk
    return [
        Case(s, 2, 4, 4, 16, causal=True),  # MHA
        Case(s, 1, 4, 2, 32, causal=False, seed=1),  # GQA
        Case(s, 2, 4, 1, 16, causal=True, softmax_scale=0.3, seed=2),  # MQA, explicit scale
        Case(s, 1, 4, 2, 16, causal=True, dtype=torch.bfloat16, seed=3),
        Case(s, 2, 2, 2, 16, causal=False, dtype=torch.float16, seed=4, grad_reduce_dtype="fp32"),
        Case(s, 2, 4, 2, 32, causal=True, dtype=torch.bfloat16, seed=7, grad_reduce_dtype="input"),
    ]


def extra_cases(cp_size: int) -> list[Case]:
    """Larger head dims, run on one shape per CP size to keep the suite short."""
    s = 4 * cp_size
    return [Case(s, 1, 2, 1, 128, causal=True, seed=5), Case(s, 1, 2, 2, 64, causal=True,
                                                             dtype=torch.bfloat16, seed=6)]


def cases_for_shape(cp_size: int, shape_index: int) -> list[Case]:
    """Up to 6 ranks every shape runs every case; beyond, each shape runs the first case
    (fp32, causal) and one more in turn, so that spawning 8 or 16 ranks on a small CPU
    stays quick while every shape still meets several dtypes and head layouts."""
    cases = cases_for(cp_size)
    if shape_index == 1:
        cases += extra_cases(cp_size)
    if cp_size <= 6:
        return cases
    return [cases[0], cases[1 + shape_index % (len(cases) - 1)]]


def two_schedules_each(cases: list[Case]) -> list[Case]:
    """Case i on schedules i and i + 1 (mod 3) of streamed_kv, streamed_q, gathered: every
    schedule meets most cases, each case runs twice."""
    n = len(CONCRETE_SCHEDULES)
    return [replace(c, schedule=CONCRETE_SCHEDULES[(i + k) % n])
            for k in (0, 1) for i, c in enumerate(cases)]


def all_shapes_worker(rank: int, world: int) -> list[Failure]:
    bad = []
    for idx, (rows, cols) in enumerate(mm.mesh_shapes(world)):
        grid = mm.MeshGrid.build(rows=rows, cols=cols)
        assert (grid.row_index, grid.col_index) == divmod(rank, cols)
        bad += check_cases(grid, two_schedules_each(cases_for_shape(world, idx)))
    return bad


@pytest.mark.parametrize("cp_size", [1, 2, 4, 6, 8])  # P = 16: test_heads.py, every grid
def test_every_mesh_shape_matches_sdpa(cp_size: int) -> None:
    assert_no_failures(run_distributed(all_shapes_worker, cp_size))


def non_contiguous_worker(rank: int, world: int) -> list[Failure]:
    """Inputs that are views, not contiguous tensors: every shape and schedule of P = 4."""
    bad = []
    for rows, cols in mm.mesh_shapes(world):
        grid = mm.MeshGrid.build(rows=rows, cols=cols)
        bad += check_cases(grid, [Case(16, 2, 4, 2, 16, causal=True, seed=30, schedule=schedule,
                                       contiguous=False) for schedule in CONCRETE_SCHEDULES])
    return bad


def test_non_contiguous_inputs() -> None:
    assert_no_failures(run_distributed(non_contiguous_worker, 4))


def strided_worker(rank: int, world: int) -> list[Failure]:
    """Inputs (and dout) whose head dim has stride 2, transposed views whose head dim has
    stride s, and broadcast (stride 0) batches: every shape and schedule, fp32 and bf16."""
    bad = []
    layouts = [lay for lay in LAYOUTS if lay != "dense"]
    for rows, cols in mm.mesh_shapes(world):
        grid = mm.MeshGrid.build(rows=rows, cols=cols)
        for i, schedule in enumerate(CONCRETE_SCHEDULES):
            for j, layout in enumerate(layouts):
                dtype = torch.bfloat16 if (i + j) % 3 == 0 else torch.float32
                bad += check_cases(grid, [Case(16, 2, 4, 2, 16, causal=bool(j % 2), dtype=dtype,
                                               seed=50 + j, schedule=schedule, layout=layout)])
    return bad


def test_strided_inputs() -> None:
    assert_no_failures(run_distributed(strided_worker, 4))


def ring_precision_worker(rank: int, world: int) -> list[Failure]:
    """bf16 at a realistic chunk size: the rings merge partials hop by hop, which must not
    lose more precision than the gathered schedule's single merge of the same partials (one
    per block: MESH_GROUP_CALLS=0; grouped, the gathered tile merges fewer partials, each
    rounded to bf16 once) (nor exceed 2x SDPA's).
    Gradients travel in fp32 here: in the input dtype a ring rounds each hop's dK, dV
    partial, as Transformer Engine's does (docs/schedules.md measures that against it)."""
    bad = []
    for rows, cols, ring in ((1, world, "streamed_q"), (world, 1, "streamed_kv")):
        grid = mm.MeshGrid.build(rows=rows, cols=cols)
        worst = {}
        for schedule in ("gathered", ring):
            case = Case(64 * world, 1, 4, 2, 32, causal=True, dtype=torch.bfloat16, seed=40,
                        schedule=schedule, grad_reduce_dtype="fp32")
            x = full_inputs(case)
            os.environ["MESH_GROUP_CALLS"] = "0" if schedule == "gathered" else "1"
            try:
                got = mesh_result(case, x, grid, grid.cp_rank)
            finally:
                os.environ.pop("MESH_GROUP_CALLS")
            bad += errors(case, got, grid, grid.cp_rank, x)
            ref = {n: mm.zigzag_split(t, world)[grid.cp_rank]
                   for n, t in sdpa_reference(case, x, torch.float32).items()}
            worst[schedule] = {n: (got[n] - ref[n]).abs().max().item() for n in ref}
        for n, err in worst[ring].items():
            if err > 1.25 * worst["gathered"][n] + 1e-6:
                bad.append(Failure(case_id(f"{ring} vs gathered, bf16", grid),
                                   f"{n}: error {err:.3g} > 1.25 x gathered's "
                                   f"{worst['gathered'][n]:.3g}"))
    return bad


def test_rings_keep_the_gathered_precision_in_bf16() -> None:
    assert_no_failures(run_distributed(ring_precision_worker, 8))


def many_groups_worker(rank: int, world: int) -> list[Failure]:
    """DP = 2 x CP = 4 on 8 ranks: CP groups {0,2,4,6} and {1,3,5,7} (strided, as when DP
    is innermost), each with its own 2x2 grid and its own data."""
    groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
    grid = mm.MeshGrid.build_many(groups, rows=2, cols=2)
    mine = groups[rank % 2]
    bad = []
    if grid.cp_ranks != tuple(mine) or grid.cp_rank != mine.index(rank):
        bad.append(Failure(case_id("build_many placement", grid),
                           f"rank {rank}: grid over {grid.cp_ranks} at {grid.cp_rank}"))
    case = Case(16, 1, 4, 2, 16, causal=True, seed=10 + rank % 2)
    return bad + check_cases(grid, [case])


def explicit_group_worker(rank: int, world: int) -> list[Failure]:
    """MeshGrid.build over an explicit subgroup, called by that group's members only."""
    import torch.distributed as dist

    halves = [dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5, 6, 7])]
    grid = mm.MeshGrid.build(rows=1, cols=4, group=halves[rank // 4])
    return check_cases(grid, [Case(16, 1, 2, 2, 16, causal=True, seed=20 + rank // 4)])


def test_two_cp_groups_in_one_job() -> None:
    assert_no_failures(run_distributed(many_groups_worker, 8))


def test_grid_over_explicit_group() -> None:
    assert_no_failures(run_distributed(explicit_group_worker, 8))


ROOT = Path(__file__).resolve().parents[2]
README_CHECK = """
import os
ref = torch.nn.functional.scaled_dot_product_attention(
    *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True).permute(2, 0, 1, 3)
assert full.shape == q.shape
print(f"rank {os.environ['RANK']} worst {(full - ref).abs().max().item():.2e}")
"""


def test_readme_api_script_runs_under_torchrun(tmp_path: Path) -> None:
    """The README's API script (zigzag_split, mesh_attention, zigzag_merge), run as it says:
    torchrun with 4 CPU ranks on gloo; every rank's merged output is whole-sequence SDPA's."""
    readme = (ROOT / "README.md").read_text()
    (script,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
                 if "mm.zigzag_split(" in b]
    assert "torchrun --standalone --nproc-per-node 4 api_demo.py" in " ".join(readme.split())
    (tmp_path / "api_demo.py").write_text(script + README_CHECK)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "4", "api_demo.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # the ranks' lines may interleave in the one pipe: read each number by its own form
    worst = dict(re.findall(r"rank (\d) worst (\d\.\d+e[-+]\d+)", done.stdout))
    assert sorted(worst) == ["0", "1", "2", "3"], done.stdout
    assert all(float(w) < 1e-5 for w in worst.values()), worst
