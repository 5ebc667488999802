"""--mesh-host-staged-collectives: what it runs with (gloo; TP = PP = EP = 1; the mesh at
CP > 1), decided with the flags, and where its ranks go on a node's GPUs."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from megatron_mesh.pretrain_gpt import main
from megatron_mesh.training.config.arguments import parse_args
from megatron_mesh.training.job.staged_cp_ranks import default_backend, local_device

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
FLAG = "--mesh-host-staged-collectives"
MESH = ["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-shape", "2x2"]


@pytest.fixture(autouse=True)
def _world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")


def test_the_flag_runs_over_gloo_also_where_cuda_would_take_nccl() -> None:
    args = parse_args(["--config", TINY, *MESH, FLAG])
    assert args.mesh_host_staged_collectives and args.distributed_backend == "gloo"
    assert not parse_args(["--config", TINY, *MESH]).mesh_host_staged_collectives
    with_flag = argparse.Namespace(mesh_host_staged_collectives=True)
    without = argparse.Namespace(mesh_host_staged_collectives=False)
    assert default_backend(with_flag, cuda=True) == "gloo"
    assert default_backend(without, cuda=True) == "nccl"
    assert default_backend(without, cuda=False) == "gloo"


@pytest.mark.parametrize("flags, message", [
    (["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
      "--context-parallel-algo", "mesh"],
     f"{FLAG} with --tensor-model-parallel-size 2: only the mesh's collectives are staged "
     "through host memory; use --tensor-model-parallel-size 1"),
    (["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",
      "--context-parallel-algo", "mesh"], f"{FLAG} with --pipeline-model-parallel-size 2"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "p2p"],
     f"{FLAG} with --context-parallel-algo p2p: it stages the mesh's collectives"),
])
def test_what_the_flag_cannot_stage_exits_2_naming_it(flags: list[str], message: str,
                                                      capsys: pytest.CaptureFixture) -> None:
    assert main(["--config", TINY, "--global-batch-size", "8", *flags, FLAG]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_ranks_share_the_gpus_in_turn() -> None:
    assert [local_device(r, 1) for r in range(4)] == [0, 0, 0, 0]
    assert [local_device(r, 2) for r in range(4)] == [0, 1, 0, 1]
