"""The gpt-oss-shaped config (configs/gpt-oss-tiny-cpu.yaml: GQA, alternating sliding windows
of 128, learnable attention sinks, a mixture of experts with the load-balancing loss) through
the driver on CPU: on the 2x2 and 2x1x2 meshes its losses and aux losses equal those at
CP = 1 and fall; the sink logits are trained (they differ between two checkpoints); the 2x2
run's checkpoint resumes on a 1x2 grid with the losses of the unbroken run. Bad MoE flags
exit 2 with one line naming the value."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from preloaded import ROOT, TINY, Run, build_indexed_dataset, launch

CONFIG = str(ROOT / "configs" / "gpt-oss-tiny-cpu.yaml")
ITERS = 4
SINKS = "decoder.layers.self_attention.core_attention.softmax_offset"  # [layers, heads]
AUX = "load_balancing_loss"


def _mesh(shape: str) -> list[str]:
    cp = 1
    for n in shape.split("x"):
        cp *= int(n)
    return ["--context-parallel-size", str(cp), "--context-parallel-algo", "mesh",
            "--mesh-shape", shape]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run | Path]:
    work = tmp_path_factory.mktemp("gpt-oss")
    prefix = str(work / "arith")
    build_indexed_dataset(prefix)
    common = ["--config", CONFIG, "--train-iters", str(ITERS), "--data-path", prefix,
              "--data-cache-path", str(work / "index-cache")]
    save = ["--save-interval", "2", "--save"]
    out: dict[str, Run | Path] = {"work": work, "common": common}
    out["cp1"] = launch(1, [*common, *save, str(work / "cp1")])
    out["2x2"] = launch(4, [*common, *_mesh("2x2"), *save, str(work / "2x2")])
    out["2x1x2"] = launch(4, [*common, *_mesh("2x1x2")])
    out["resumed 1x2"] = launch(2, [*common, *_mesh("1x2"), "--load", str(work / "2x2"),
                                    "--ckpt-step", "2"])
    return out


def _aux(run: Run) -> dict[int, float]:
    return {it: float(fields[AUX]) for it, fields in run.lines().items()}


def _sinks(checkpoint: Path) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    state = {SINKS: torch.empty(2, 4)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(checkpoint)), no_dist=True)
    return state[SINKS]


@pytest.mark.parametrize("grid", ["2x2", "2x1x2"])
def test_gpt_oss_mesh_matches_cp1_and_falls(runs, grid: str) -> None:
    ref, mesh = runs["cp1"], runs[grid]
    for run in (ref, mesh):
        assert run.returncode == 0, run.output[-3000:]
    ref_l, mesh_l = ref.losses(), mesh.losses()
    assert sorted(ref_l) == sorted(mesh_l) == list(range(1, ITERS + 1))
    for it in ref_l:
        assert mesh_l[it] == pytest.approx(ref_l[it], rel=2e-5), (it, ref_l, mesh_l)
        assert _aux(mesh)[it] == pytest.approx(_aux(ref)[it], rel=2e-5)
    assert mesh_l[ITERS] < mesh_l[1] - 0.05, mesh_l
    assert "window 128 left, 0 right" in mesh.output


def test_sinks_are_trained_and_checkpointed(runs) -> None:
    first, last = (_sinks(runs["work"] / "cp1" / f"iter_{it:07d}") for it in (2, ITERS))
    assert first.shape == (2, 4)  # megatron-core's [layers, heads] entry
    assert (first - last).abs().min() > 0, (first, last)  # every head's sink moved
    mesh = _sinks(runs["work"] / "2x2" / f"iter_{ITERS:07d}")
    torch.testing.assert_close(mesh, last, rtol=1e-4, atol=1e-6)


def test_checkpoint_resumes_on_another_grid(runs) -> None:
    resumed, unbroken = runs["resumed 1x2"], runs["2x2"]
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "loaded checkpoint" in resumed.output and "iter_0000002" in resumed.output
    got, want = resumed.losses(), unbroken.losses()
    assert sorted(got) == list(range(3, ITERS + 1))
    for it in got:
        assert got[it] == pytest.approx(want[it], rel=2e-5), (it, got, want)


def test_expert_parallel_2_on_a_mesh_matches_ep1(runs) -> None:
    """The CP = 1 checkpoint's weights (iteration 2) trained on, with a fresh optimizer, by
    EP 1 on one rank and by EP 2 over a 1x2 mesh (the experts split between the two CP
    ranks, megatron-core's allgather dispatcher over gloo): the same losses. Its optimizer
    state does not load with EP 2 (megatron-core chains an expert optimizer): exit 2."""
    load = [*runs["common"], "--load", str(runs["work"] / "cp1"), "--ckpt-step", "2"]
    ep1 = launch(1, [*load, "--no-load-optim"])
    ep2 = launch(2, [*load, "--no-load-optim", *_mesh("1x2"),
                     "--expert-model-parallel-size", "2"])
    for run in (ep1, ep2):
        assert run.returncode == 0, run.output[-3000:]
    want, got = ep1.losses(), ep2.losses()
    assert sorted(got) == sorted(want) and len(got) >= 2
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=2e-5), (it, got, want)
    refused = launch(2, [*load, *_mesh("1x2"), "--expert-model-parallel-size", "2"])
    assert refused.returncode == 2
    assert "saved with --expert-model-parallel-size 1, which does not load with 2" in (
        refused.output)


def test_tp2_sp_ep2_on_a_mesh_matches_cp1(runs) -> None:
    """The CP = 1 checkpoint's weights (--finetune: weights only) trained by TP 2 (each rank
    2 of the 4 heads' sinks) x CP 2 (mesh) with sequence parallelism and the experts over EP
    2, and at CP = 1: the same losses, load-balancing losses and grad norms."""
    load = [*runs["common"], "--load", str(runs["work"] / "cp1"), "--ckpt-step", "2",
            "--finetune"]
    ref = launch(1, load)
    tp = launch(4, [*load, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                    *_mesh("1x2"), "--expert-model-parallel-size", "2"])
    for run in (ref, tp):
        assert run.returncode == 0, run.output[-3000:]
    want, got = ref.lines(), tp.lines()
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1))
    for it in want:
        for field in ("lm loss", AUX, "grad norm"):
            assert float(got[it][field]) == pytest.approx(float(want[it][field]), rel=2e-5), (
                it, field, got[it], want[it])


def test_qk_layernorm_and_off_by_one_on_a_mesh_match_cp1() -> None:
    """--qk-layernorm with --softmax-type off-by-one (the tiny config): 2x2 equals CP = 1;
    both flags change the model (the losses differ from the run without them)."""
    common = ["--config", TINY, "--train-iters", "3", "--mock-data"]
    flags = ["--qk-layernorm", "--softmax-type", "off-by-one"]
    ref, mesh, plain = (launch(1, [*common, *flags]), launch(4, [*common, *flags, *_mesh("2x2")]),
                        launch(1, common))
    for run in (ref, mesh, plain):
        assert run.returncode == 0, run.output[-3000:]
    want, got, without = ref.losses(), mesh.losses(), plain.losses()
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=2e-5), (it, got, want)
    assert all(abs(without[it] - want[it]) > 1e-4 for it in want), (without, want)
    # the Q and K norms: 2 layers x 2 norms x head dim 16 weights more than without
    params = [int(re.search(r"parameters on this rank ([\d,]+)", run.output)[1].replace(",", ""))
              for run in (ref, plain)]
    assert params[0] - params[1] == 2 * 2 * 16, params


@pytest.mark.parametrize("flags, says", [
    (["--moe-grouped-gemm"], "--moe-grouped-gemm needs a GPU"),
    (["--moe-router-topk", "5"], "--moe-router-topk 5: must be between 1 and --num-experts 4"),
    (["--expert-model-parallel-size", "3"], "--expert-model-parallel-size 3: must divide"),
    (["--no-disable-bias-linear"], "add --disable-bias-linear"),
    (["--moe-token-dispatcher-type", "flex"], "flex needs a GPU"),
    (["--moe-token-dispatcher-type", "alltoall"], "alltoall needs a GPU"),
])
def test_bad_moe_flags_exit_2(flags: list[str], says: str) -> None:
    run = launch(1, ["--config", CONFIG, "--mock-data", *flags])
    assert run.returncode == 2, run.output[-2000:]
    assert says in run.output, run.output[-2000:]


def test_moe_flags_need_num_experts() -> None:
    run = launch(1, ["--num-experts", "0"])
    assert run.returncode == 2 and "--num-experts 0: must be a positive integer" in run.output
    run = launch(1, ["--moe-router-topk", "4", "--vocab-size", "255"])
    assert run.returncode == 2 and "--moe-router-topk 4 needs --num-experts" in run.output
