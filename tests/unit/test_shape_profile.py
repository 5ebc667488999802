"""The driver's automatic mesh shape is priced as --mesh-gpu-profile says: by a GPU profile's
kernel calls (h200, h100, or auto: the profile the CUDA device names) or at the flat rate; and
the planner sizes the same grouped kernel calls and memory as the runtime runs."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch

from megatron_mesh.attention import plan_for
from megatron_mesh.cost_models.memory import extra_memory
from megatron_mesh.cost_models.plan import resolve_plan
from megatron_mesh.layer_plan import AttentionShape, Schedule
from megatron_mesh.megatron import add_mesh_args, validate_mesh_args
from megatron_mesh.megatron.arguments import check_mesh_kernel
from megatron_mesh.megatron.shape import (
    MESH_GPU_PROFILES,
    auto_mesh_shape,
    mesh_pricing,
    resolve_mesh_shape,
)
from megatron_mesh.planner import Cluster, Workload, load_profile, plan, search
from megatron_mesh.planner.gpu_profile import GPU_PROFILES, profile_for_device
from megatron_mesh.pretrain_gpt import main
from megatron_mesh.runtime.grid import MeshGrid
from megatron_mesh.training.config.arguments import parse_args

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
K = 1024

# the published case (docs/planner.md): 64 CP ranks in nodes of 8, 128K tokens, head dim 128;
# (query heads, K/V heads) -> the grid at the flat 400 TFLOP/s, the grid by the H200's calls
CASES = {"gqa": ((32, 8), (4, 16, 1), (8, 8, 1)), "mha": ((32, 32), (8, 8, 1), (16, 4, 1))}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_profile_changes_the_driver_shape_as_the_planner_does(name: str) -> None:
    (heads, kv), flat, profiled = CASES[name]
    for gpu, want in ((None, flat), ("h200", profiled)):
        reference = plan(64, seq_length=128 * K, num_heads=heads, num_kv_heads=kv, head_dim=128,
                         gpus_per_node=8, gpu=gpu).best_grid.grid_shape
        profile = None if gpu is None else load_profile(gpu)
        driver = auto_mesh_shape(64, heads, kv, 128, 128 * K, cp_ranks_per_node=8, gpu=profile)
        assert driver == reference == want
        assert resolve_mesh_shape(64, None, num_attention_heads=heads, num_query_groups=kv,
                                  head_dim=128, seq_length=128 * K, cp_ranks_per_node=8,
                                  gpu=profile) == (want, True)
    assert flat != profiled


def _args(profile: str, **over) -> argparse.Namespace:
    args = dict(context_parallel_algo="mesh", cp_comm_type=None, mesh_shape=None,
                mesh_heads=None, context_parallel_size=64, tensor_model_parallel_size=1,
                num_attention_heads=32, num_query_groups=8, group_query_attention=True,
                kv_channels=128, seq_length=128 * K, attention_dropout=0.0,
                mesh_gpu_profile=profile, bf16=True, micro_batch_size=1)
    args.update(over)
    return argparse.Namespace(**args)


@pytest.mark.parametrize("profile, shape, said", [
    ("h200", (8, 8, 1), "MODEL: attention priced by GPU profile h200 (measured cudnn kernel "
     "calls; --mesh-gpu-profile h200)"),
    ("h100", (8, 8, 1), "MODEL: attention priced by GPU profile h100 (SCALED, not measured "
     "cudnn kernel calls; --mesh-gpu-profile h100)"),
    ("flat", (4, 16, 1), "MODEL: attention priced at the flat 400 TFLOP/s "
     "(--mesh-gpu-profile flat)"),
])
def test_flag_check_prices_by_the_flag_and_logs_one_line_saying_so(
        monkeypatch, caplog, profile: str, shape: tuple[int, int, int], said: str) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with caplog.at_level(logging.INFO, logger="megatron_mesh"):
        args = _args(profile)
        assert validate_mesh_args(args) == shape and args.mesh_shape_chosen_by_planner
    (line,) = [r.getMessage() for r in caplog.records if "mesh context parallelism" in r.message]
    grid = "x".join(map(str, shape))
    assert line == (f"mesh context parallelism: {grid} grid (heads x rows x cols) of 64 CP ranks "
                    f"(chosen by the planner for 8 CP ranks per node); {said}")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_mesh"):  # a given shape: no pricing
        assert validate_mesh_args(_args(profile, mesh_shape=(8, 8))) == (1, 8, 8)
    assert "8x8 grid of 64 CP ranks (as given)\n" in caplog.text + "\n"
    assert "priced" not in caplog.text


def test_flag_check_prices_the_calls_of_the_kernel_the_run_uses(monkeypatch, caplog) -> None:
    """--mesh-kernel reaches the planner: on the gathered schedule flex runs a tile in 1 call
    forward and 2 backward, so it takes another grid than cuDNN's calls would; the line says
    its calls are priced at cuDNN's time a call (no flex fit)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    chosen = {}
    for kernel in ("auto", "flex"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megatron_mesh"):
            chosen[kernel] = validate_mesh_args(_args("h200", mesh_kernel=kernel,
                                                      mesh_schedule="gathered"))
    assert chosen == {"auto": (32, 2, 1), "flex": (8, 8, 1)}
    # the kernel priced: the one named; 'auto' what it runs on this CUDA device, none here
    assert check_mesh_kernel(_args("h200", mesh_kernel="flex")) == "flex"
    assert check_mesh_kernel(_args("h200")) == "auto" and not torch.cuda.is_available()
    assert ("MODEL: attention priced by GPU profile h200 (flex kernel calls at the measured "
            "cudnn time a call, no flex fit; --mesh-gpu-profile h200)") in caplog.text


def test_the_shape_is_priced_in_the_dtype_the_run_trains_in(monkeypatch) -> None:
    """At the flat rate the published GQA case takes 4x16x1 in bf16 (--bf16) and 8x8x1 in
    fp32 (neither --bf16 nor --fp16): the bytes double, as the planner says for that dtype;
    the micro-batch goes to the planner too."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    for over, dtype in (({}, "bf16"), ({"bf16": False}, "fp32"),
                        ({"bf16": False, "fp16": True}, "fp16"),
                        ({"micro_batch_size": 2}, "bf16")):
        reference = plan(64, seq_length=128 * K, num_heads=32, num_kv_heads=8, head_dim=128,
                         gpus_per_node=8, dtype=dtype,
                         batch=over.get("micro_batch_size", 1)).best_grid.grid_shape
        assert validate_mesh_args(_args("flat", **over)) == reference, over
    assert validate_mesh_args(_args("flat")) == (4, 16, 1)
    assert validate_mesh_args(_args("flat", bf16=False)) == (8, 8, 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto is flat only without CUDA")
def test_driver_default_is_auto_and_flat_without_cuda(monkeypatch, caplog) -> None:
    monkeypatch.setenv("WORLD_SIZE", "64")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    # the driver trains in fp32 on a CPU (--bf16 needs CUDA): MHA there is 16x4x1 flat and
    # 8x8x1 by the H200's profile
    flags = ["--num-layers", "2", "--hidden-size", "4096", "--num-attention-heads", "32",
             "--seq-length", str(128 * K), "--vocab-size", "255",
             "--context-parallel-size", "64", "--context-parallel-algo", "mesh"]
    with caplog.at_level(logging.INFO, logger="megatron_mesh"):
        args = parse_args(flags)
    assert args.mesh_gpu_profile == "auto" and args.mesh_shape == (16, 4, 1)
    assert ("(chosen by the planner for 8 CP ranks per node); MODEL: attention priced at the "
            "flat 400 TFLOP/s (--mesh-gpu-profile auto: no CUDA device)") in caplog.text
    assert parse_args(flags + ["--mesh-gpu-profile", "h200"]).mesh_shape == (8, 8, 1)


@pytest.mark.parametrize("device, profile", [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H200 NVL", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100"),
    ("nvidia h100", "h100"),
    ("NVIDIA GH200 480GB", None),  # another part: not the H200's profile
    ("NVIDIA H800", None),
    ("NVIDIA A100-SXM4-80GB", None),
    ("Tesla V100-SXM2-32GB", None),
    ("", None),
    (None, None),
])
def test_auto_maps_device_names_to_profiles(device: str | None, profile: str | None) -> None:
    assert profile_for_device(device) == profile
    pricing = mesh_pricing("auto", device)
    if profile is None:
        assert pricing.gpu is None
        why = "no CUDA device" if not device else f"no profile for {device!r}"
        assert pricing.reason == f"--mesh-gpu-profile auto: {why}"
    else:
        assert pricing.gpu == load_profile(profile)
        assert pricing.reason == f"--mesh-gpu-profile auto: CUDA device {device!r}"
    # a named choice ignores the device
    assert mesh_pricing("flat", device).gpu is None
    for name in GPU_PROFILES:
        assert mesh_pricing(name, device).gpu == load_profile(name)


def test_bad_profile_values_are_refused() -> None:
    assert MESH_GPU_PROFILES == ("auto", "h100", "h200", "flat")
    with pytest.raises(ValueError, match=r"--mesh-gpu-profile 'a100' is not one of "
                                         r"auto, h100, h200, flat"):
        mesh_pricing("a100", "NVIDIA A100")
    with pytest.raises(ValueError, match="--mesh-gpu-profile 'H200' is not one of"):
        validate_mesh_args(_args("H200"))


def test_bad_flag_exits_2_with_a_message(monkeypatch, capsys) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    code = main(["--config", TINY, "--context-parallel-size", "4", "--context-parallel-algo",
                 "mesh", "--mesh-gpu-profile", "a100"])
    err = capsys.readouterr().err
    assert code == 2
    assert ("argument --mesh-gpu-profile: invalid choice: 'a100' (choose from 'auto', 'h100', "
            "'h200', 'flat')") in err and "Traceback" not in err
    parser = add_mesh_args(argparse.ArgumentParser(prog="pretrain"))  # Megatron-LM's path
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--mesh-gpu-profile", "b200"])
    assert exit_info.value.code == 2
    assert "argument --mesh-gpu-profile: invalid choice: 'b200'" in capsys.readouterr().err
    assert parser.parse_args([]).mesh_gpu_profile == "auto"


# 2x2 mesh, 4096 tokens, 32 heads of 128 in bf16: with grouped calls (the runtime's default)
# "streamed" holds less as streamed_kv; with each block's own calls (MESH_GROUP_CALLS=0), as
# streamed_q
@pytest.mark.parametrize("group_calls, ring", [(None, "streamed_kv"), ("0", "streamed_q")])
def test_planner_sizes_the_calls_and_memory_the_runtime_runs(
        monkeypatch, group_calls: str | None, ring: str) -> None:
    if group_calls is None:
        monkeypatch.delenv("MESH_GROUP_CALLS", raising=False)
    else:
        monkeypatch.setenv("MESH_GROUP_CALLS", group_calls)
    grouped = group_calls is None
    shape = AttentionShape(4 * K, 1, 32, 32, 128, 2)
    peaks = {s: max(extra_memory(shape, 2, 2, s, grouped=grouped).values())
             for s in ("streamed_kv", "streamed_q")}
    assert min(peaks, key=peaks.get) == ring and len(set(peaks.values())) == 2
    # the runtime's plan, from a rank's q, k on a 2 x 2 grid (no process group needed)
    q = torch.empty(K, 1, 32, 128, dtype=torch.bfloat16, device="meta")
    grid = MeshGrid(rows=2, cols=2, cp_rank=0, cp_ranks=(0, 1, 2, 3), row_group=None,
                    col_group=None)
    runtime = plan_for(q, q, grid).schedule
    workload = Workload(4 * K, 32, 32, 128)
    assert runtime == workload.mesh_plan(2, 2).schedule == resolve_plan(shape, 2, 2).schedule
    assert runtime == Schedule(ring)
    # and the planner prices that ring's calls and traffic, by the profile and flat alike
    for gpu in (None, load_profile("h200")):
        chosen = search(workload, Cluster(gpus=4, gpu=gpu)).mesh(2, 2)
        named = search(Workload(4 * K, 32, 32, 128, mesh_schedule=ring),
                       Cluster(gpus=4, gpu=gpu)).mesh(2, 2)
        assert chosen.time_s == named.time_s and chosen.calls == named.calls
