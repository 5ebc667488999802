"""The pretraining driver end to end on CPU: gloo, megatron-core, real data files; each job's
ranks are forked from a preloaded process with the environment torchrun gives (tests/preloaded.py).

Runs are shared between tests (module fixtures): a CP = 1 reference, an unbroken 4-rank
2x2 mesh run with wandb offline, a 4-rank run in which one rank dies, and the resume of it,
a DP 2 x CP 2 run with the distributed optimizer.
"""
from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest
from preloaded import Run, driver_data_args, launch, launch_nodes
from wandb_records import wandb_history, wandb_run

ROOT = Path(__file__).resolve().parents[2]
ITERS = 8
SAVE_EVERY = 4
DIES_AT = 6  # rank 2 dies when iteration 6 starts, after the checkpoint of iteration 4
MESH = ["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-shape", "2x2"]


@pytest.fixture(scope="module")
def data_args(work: Path) -> list[str]:
    return driver_data_args(work, ITERS)


@pytest.fixture(scope="module")
def cp1_run(data_args: list[str], work: Path) -> Run:
    """The CP = 1 reference; its checkpoint of iteration 4 starts the pipeline run."""
    return launch(1, [*data_args, "--save", str(work / "cp1-ckpt"),
                        "--save-interval", str(SAVE_EVERY)])


@pytest.fixture(scope="module")
def mesh_run(data_args: list[str], work: Path) -> Run:
    return launch(4, [*data_args, *MESH, "--wandb-project", "mesh-tests",
                        "--wandb-exp-name", "tiny-2x2", "--wandb-save-dir", str(work / "wandb")])


@pytest.fixture(scope="module")
def fault_run(data_args: list[str], work: Path) -> Run:
    return launch(4, [*data_args, *MESH, "--save", str(work / "ckpt"),
                        "--save-interval", str(SAVE_EVERY)],
                    MEGATRON_MESH_FAULT=f"2:{DIES_AT}:kill")


@pytest.fixture(scope="module")
def distopt_run(data_args: list[str], work: Path) -> Run:
    """DP 2 x CP 2 (mesh, chosen by Megatron's --cp-comm-type) with selective recomputation
    and the distributed optimizer: iterations 1..4 of the reference's LR schedule, saved."""
    return launch(4, [*data_args, "--context-parallel-size", "2", "--cp-comm-type", "mesh",
                        "--recompute-granularity", "selective", "--use-distributed-optimizer",
                        "--exit-interval", str(SAVE_EVERY), "--save", str(work / "distopt-ckpt")])


def test_data_parallel_with_cp_and_distributed_optimizer_matches_cp1(
        cp1_run: Run, distopt_run: Run) -> None:
    """DP 2 x CP 2: the sampler splits the batch; megatron-core's DDP grad buffers and
    DistributedOptimizer on gloo reduce-scatter the gradients over DP x CP, each rank steps
    Adam on a quarter of the parameters, and loss and grad norm match CP = 1."""
    assert cp1_run.returncode == 0, cp1_run.output[-3000:]
    assert distopt_run.returncode == 0, distopt_run.output[-3000:]
    assert "x DP 2" in distopt_run.output
    shard = re.search(r"distributed optimizer: adam state of ([\d,]+) of ([\d,]+) parameters "
                      r"on this rank \(sharded over DP x CP 4\)", distopt_run.output)
    assert shard, distopt_run.output[-3000:]
    held, total = (int(g.replace(",", "")) for g in shard.groups())
    assert total // 4 <= held < total // 2, (held, total)
    ref, got = cp1_run.lines(), distopt_run.lines()
    assert sorted(got) == [1, 2, 3, 4]
    for it, fields in got.items():
        assert float(fields["lm loss"]) == pytest.approx(float(ref[it]["lm loss"]), rel=2e-5)
        assert float(fields["grad norm"]) == pytest.approx(float(ref[it]["grad norm"]), abs=2e-3)


def test_distributed_optimizer_resumes_on_fewer_ranks(
        cp1_run: Run, distopt_run: Run, data_args: list[str], work: Path) -> None:
    """The DP 2 x CP 2 distributed-optimizer checkpoint of iteration 4 resumes on DP 1 x CP 2
    (optimizer state resharded from 4 ranks to 2): iterations 5..8 match CP = 1, so Adam's
    moments and step came back."""
    assert distopt_run.returncode == 0, distopt_run.output[-3000:]
    save = work / "distopt-ckpt"
    resumed = launch(2, [*data_args, "--context-parallel-size", "2", "--cp-comm-type", "mesh",
                           "--use-distributed-optimizer", "--load", str(save)])
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"loaded checkpoint {save / 'iter_0000004'}" in resumed.output
    assert "sharded over DP x CP 2" in resumed.output
    ref, got = cp1_run.lines(), resumed.lines()
    assert sorted(got) == list(range(SAVE_EVERY + 1, ITERS + 1))
    for it, fields in got.items():
        assert float(fields["lm loss"]) == pytest.approx(float(ref[it]["lm loss"]), rel=2e-5)
        assert float(fields["grad norm"]) == pytest.approx(float(ref[it]["grad norm"]), abs=2e-3)


def test_no_load_optim_keeps_the_iteration_and_data_position(
        cp1_run: Run, data_args: list[str], work: Path) -> None:
    """--no-load-optim (as Megatron-LM): the weights, iteration and data position of the
    checkpoint, a fresh optimizer; so iteration 5's loss (the weights of iteration 4 on
    iteration 5's batch) is the unbroken run's, and the log says the LR schedule restarts."""
    assert cp1_run.returncode == 0, cp1_run.output[-3000:]
    resumed = launch(1, [*data_args, "--load", str(work / "cp1-ckpt"), "--ckpt-step",
                           str(SAVE_EVERY), "--no-load-optim", "--train-iters",
                           str(SAVE_EVERY + 2)])
    assert resumed.returncode == 0, resumed.output[-3000:]
    got, ref = resumed.lines(), cp1_run.lines()
    assert sorted(got) == [SAVE_EVERY + 1, SAVE_EVERY + 2]
    first = SAVE_EVERY + 1
    assert float(got[first]["lm loss"]) == pytest.approx(float(ref[first]["lm loss"]), rel=2e-5)
    assert "the LR schedule starts again from its first step" in resumed.output


def test_optimizer_state_of_another_kind_or_tp_is_refused_by_name(
        cp1_run: Run, distopt_run: Run, data_args: list[str], work: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each optimizer lays out its checkpoint state its own way (megatron-core's, the
    distributed optimizer's DP x CP shards): the saved kind is checked on load, before any
    tensor is read, with an error that says which flags resume it or --no-load-optim."""
    from megatron.core import dist_checkpointing

    from megatron_mesh.training.checkpoints.checksums import CheckpointError
    from megatron_mesh.training.config.arguments import parse_args
    from megatron_mesh.training.loop.optimizer import check_saved_optimizer

    assert cp1_run.returncode == 0 and distopt_run.returncode == 0
    monkeypatch.setenv("WORLD_SIZE", "2")
    plain_args = parse_args(data_args)
    distopt_args = parse_args([*data_args, "--use-distributed-optimizer"])
    sp_args = parse_args([*data_args, "--tensor-model-parallel-size", "2", "--sequence-parallel"])
    name = f"iter_{SAVE_EVERY:07d}"
    plain_saved = dist_checkpointing.load_common_state_dict(str(work / "cp1-ckpt" / name))
    distopt_saved = dist_checkpointing.load_common_state_dict(str(work / "distopt-ckpt" / name))
    assert plain_saved["optimizer_kind"] == "megatron-core"
    check_saved_optimizer(plain_saved, [1, 2, 2], "ckpt", plain_args)
    check_saved_optimizer(plain_saved, [1, 2, 2], "ckpt", sp_args)  # same kind with SP
    check_saved_optimizer(distopt_saved, [1, 1, 2], "ckpt", distopt_args)  # DP x CP reshards
    with pytest.raises(CheckpointError, match="holds megatron-core optimizer state .* this run's "
                       "optimizer is megatron-core distributed's: resume without "
                       "--use-distributed-optimizer, or load the weights only with "
                       "--no-load-optim"):
        check_saved_optimizer(plain_saved, [1, 1, 4], "ckpt", distopt_args)
    with pytest.raises(CheckpointError, match="holds megatron-core distributed optimizer state "
                       r"\(saved with --use-distributed-optimizer\); this run's optimizer is "
                       "megatron-core's"):
        check_saved_optimizer(distopt_saved, [1, 2, 2], "ckpt", sp_args)
    with pytest.raises(CheckpointError, match="saved with PP 1 x TP 1 and loads only with "
                       "those .* this run has PP 1 x TP 2"):
        check_saved_optimizer(distopt_saved, [1, 2, 2], "ckpt", parse_args(
            [*data_args, "--use-distributed-optimizer", "--tensor-model-parallel-size", "2"]))


def test_checkpoint_of_the_old_torch_optimizer_is_refused_naming_it(
        cp1_run: Run, data_args: list[str], work: Path) -> None:
    """Earlier releases stepped a torch optimizer outside megatron-core on a CPU and recorded
    its checkpoints' optimizer kind as 'torch'. Every run now steps megatron-core's optimizer,
    which cannot read that state: --load of such a checkpoint exits 2 before training, naming
    the old format and --no-load-optim, with no traceback."""
    import shutil

    import torch
    from megatron.core import dist_checkpointing

    from megatron_mesh.training.checkpoints.checksums import write_manifest

    assert cp1_run.returncode == 0, cp1_run.output[-3000:]
    legacy = work / "legacy-torch-ckpt"
    shutil.copytree(work / "cp1-ckpt", legacy)
    folder = legacy / f"iter_{ITERS:07d}"  # the latest
    common = dist_checkpointing.load_common_state_dict(str(folder))
    assert common["optimizer_kind"] == "megatron-core"
    common["optimizer_kind"] = "torch"  # what a CPU run of an earlier release recorded
    # common.pt: where megatron-core up to 0.18 keeps the common state; 0.19 reads it first
    torch.save(common, folder / "common.pt")
    write_manifest(str(folder))  # a consistent checkpoint, not a corrupted one
    run = launch(1, [*data_args, "--load", str(legacy)])
    assert run.returncode == 2, run.output[-3000:]
    assert "Traceback" not in run.output
    assert (f"checkpoint {folder} holds optimizer state of the old 'torch' kind (a torch "
            "optimizer outside megatron-core, written by CPU runs of earlier megatron-mesh "
            "releases); every run now steps megatron-core's optimizer, which cannot load it: "
            "load the weights only with --no-load-optim") in run.output


def _checkpoint_tensors(checkpoint: Path, scratch: Path) -> dict:
    """Every tensor of a dist-checkpoint as one full (unsharded) tensor, read in this process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(scratch))
    return {k: v for k, v in torch.load(scratch, weights_only=False).items()
            if isinstance(v, torch.Tensor) and v.is_floating_point()}


def test_sequence_parallel_tp2_x_mesh_2_matches_cp1(cp1_run: Run, data_args: list[str],
                                                    work: Path) -> None:
    """TP 2 x CP 2 (mesh) with --sequence-parallel on gloo: activations between the layers
    are [s / (CP x TP), b, h] (reduce-scatter / all-gather around the linears), the norms
    are torch's with their weights marked sequence-parallel, whose gradients megatron-core's
    finalize_model_grads sums over TP. Loss and grad norm match CP = 1, and after 4 steps
    every weight and Adam moment does too (a norm gradient not summed over TP moves the norm
    weights by ~1e-3 here)."""
    assert cp1_run.returncode == 0, cp1_run.output[-3000:]
    save = work / "tp2-sp-ckpt"
    run = launch(4, [*data_args, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                       "--context-parallel-size", "2", "--cp-comm-type", "mesh",
                       "--exit-interval", str(SAVE_EVERY), "--save", str(save)])
    assert run.returncode == 0, run.output[-3000:]
    assert "world 4 = TP 2 x PP 1 x CP 2" in run.output
    ref, got = cp1_run.lines(), run.lines()
    assert sorted(got) == [1, 2, 3, 4]
    for it, fields in got.items():
        assert float(fields["lm loss"]) == pytest.approx(float(ref[it]["lm loss"]), rel=2e-5)
        assert float(fields["grad norm"]) == pytest.approx(float(ref[it]["grad norm"]), abs=2e-3)
    name = f"iter_{SAVE_EVERY:07d}"
    expected = _checkpoint_tensors(work / "cp1-ckpt" / name, work / "cp1-iter4.pt")
    saved = _checkpoint_tensors(save / name, work / "tp2-sp-iter4.pt")
    assert sorted(saved) == sorted(expected)
    assert "decoder.final_layernorm.weight" in saved
    for key, tensor in expected.items():
        diff = (saved[key] - tensor).abs().max().item()
        assert diff < 1e-5, (key, diff)


def test_pipeline_2_x_mesh_2_matches_cp1(cp1_run: Run, data_args: list[str], work: Path) -> None:
    """PP 2 x CP 2 (mesh) from CP = 1's checkpoint of iteration 4 (each stage loads its
    layers; a pipeline run initializes its stages differently from one stage, as Megatron-LM
    does, so the two start from the same weights this way): megatron-core's 1F1B schedule
    over 2 micro-batches, tied embeddings on both stages, loss and grad norm (reduced over
    the stages) match CP = 1."""
    assert cp1_run.returncode == 0, cp1_run.output[-3000:]
    run = launch(4, [*data_args, "--pipeline-model-parallel-size", "2",
                       "--context-parallel-size", "2", "--cp-comm-type", "mesh",
                       "--mesh-shape", "1x2", "--load", str(work / "cp1-ckpt"),
                       "--ckpt-step", str(SAVE_EVERY)])
    assert run.returncode == 0, run.output[-3000:]
    assert "world 4 = TP 1 x PP 2 x CP 2 (mesh 1x2, schedule" in run.output
    assert "parameters on this rank 53,376" in run.output  # rank 0: embedding and layer 1
    ref, got = cp1_run.lines(), run.lines()
    assert sorted(got) == list(range(SAVE_EVERY + 1, ITERS + 1))
    for it, fields in got.items():
        assert float(fields["lm loss"]) == pytest.approx(float(ref[it]["lm loss"]), rel=2e-5)
        assert float(fields["grad norm"]) == pytest.approx(float(ref[it]["grad norm"]), abs=2e-3)


def test_cp1_attention_is_the_fused_kernel_and_matches_local_attention(
        cp1_run: Run, data_args: list[str]) -> None:
    """Without TE, CP = 1 runs the mesh tile kernel (one fused call over the sequence), not
    megatron-core's local attention with its S x S scores; both give the same losses."""
    assert cp1_run.returncode == 0, cp1_run.output[-3000:]
    assert "| attention mesh tile kernel |" in cp1_run.output
    assert "world 1 = TP 1 x PP 1 x CP 1 x DP 1 |" in cp1_run.output  # no CP algorithm runs
    local = launch(1, [*data_args, "--attention-backend", "local", "--train-iters", "4",
                         "--lr-decay-iters", str(ITERS)])
    assert local.returncode == 0, local.output[-3000:]
    assert "| attention megatron-core local (unfused) |" in local.output
    ref, got = cp1_run.losses(), local.losses()
    assert sorted(got) == [1, 2, 3, 4]
    for it, loss in got.items():
        assert loss == pytest.approx(ref[it], rel=2e-5)
    bad = launch(1, [*data_args, "--attention-backend", "local", *MESH])
    assert bad.returncode == 2 and "--attention-backend local with " \
        "--context-parallel-size 4" in bad.output, bad.output[-2000:]


def test_mesh_2x2_matches_cp1_and_loss_falls(cp1_run: Run, mesh_run: Run) -> None:
    assert cp1_run.returncode == 0, cp1_run.output[-3000:]
    assert mesh_run.returncode == 0, mesh_run.output[-3000:]
    ref, mesh = cp1_run.losses(), mesh_run.losses()
    assert sorted(ref) == sorted(mesh) == list(range(1, ITERS + 1))
    for it in ref:
        assert mesh[it] == pytest.approx(ref[it], rel=2e-5), (it, ref, mesh)
    assert mesh[ITERS] < mesh[1] - 0.2, mesh
    assert set(cp1_run.traffic()) == {"n/a"}
    for fields in mesh_run.lines().values():
        assert float(fields["tokens/s"]) > 0
        assert float(fields["throughput per GPU (TFLOP/s/GPU)"]) > 0
        assert float(fields["elapsed time per iteration (ms)"]) > 0
        assert float(fields["peak memory RSS (MiB)"]) > 0


def test_the_flex_kernel_trains_as_cp1(cp1_run: Run, data_args: list[str]) -> None:
    """--mesh-kernel flex (FlexAttention, eager on the CPU) with the gathered schedule, whose
    tile it takes in one call: the 2x2 mesh trains to CP = 1's losses; the banner names it
    and the layers' kernel log says they built it."""
    run = launch(4, [*data_args, *MESH, "--mesh-kernel", "flex", "--mesh-schedule", "gathered",
                     "--train-iters", "3", "--lr-decay-iters", str(ITERS)])
    assert run.returncode == 0, run.output[-3000:]
    assert "mesh tile kernel flex" in run.output, run.output[-3000:]  # the banner
    assert "tile kernel for backend='flex' on cpu" in run.output  # what the layers built
    ref, got = cp1_run.losses(), run.losses()
    assert sorted(got) == [1, 2, 3]
    for it, loss in got.items():
        assert loss == pytest.approx(ref[it], rel=2e-5), (it, ref, got)


def test_host_staged_collectives_train_as_without(mesh_run: Run, data_args: list[str]) -> None:
    """--mesh-host-staged-collectives (several CP ranks on one GPU, for checking), here on
    gloo over the CPU: the 2x2 mesh's collectives run on host copies and train to the same
    losses, to the last printed digit, as without."""
    staged = launch(4, [*data_args, *MESH, "--mesh-host-staged-collectives"])
    assert staged.returncode == 0, staged.output[-3000:]
    assert staged.losses() == mesh_run.losses()
    calls = re.search(r"mesh collectives staged through host memory \(.*\): (\d+) calls "
                      r"\((.*)\)", staged.output)
    assert calls and int(calls[1]) > 0 and "batch_isend_irecv" in calls[2], staged.output[-2000:]
    assert "staged through host memory" not in mesh_run.output


def test_mesh_traffic_and_wandb_series(mesh_run: Run, work: Path) -> None:
    from megatron_mesh.cost_models.memory import streamed_schedule
    from megatron_mesh.cost_models.traffic import mesh_traffic
    from megatron_mesh.layer_plan import AttentionShape

    assert mesh_run.returncode == 0, mesh_run.output[-3000:]
    # tiny-cpu.yaml: 2 layers, 2 micro-batches of 2 x 64 tokens, 4 heads / 2 groups of 16, fp32
    per_layer = mesh_traffic(AttentionShape(64, 2, 4, 2, 16, dtype_bytes=4), 2, 2).total
    expected = 2 * 2 * per_layer
    (run_dir,) = glob.glob(str(work / "wandb" / "wandb" / "offline-run-*"))
    rows = wandb_history(run_dir)
    assert [r["_step"] for r in rows] == list(range(1, ITERS + 1))
    losses = mesh_run.losses()
    for row in rows:
        assert row["lm loss"] == pytest.approx(losses[row["_step"]], rel=1e-6)
        assert row["throughput/tokens-per-sec"] > 0
        assert row["throughput/tflops-per-gpu"] > 0
        assert row["throughput/step-time-ms"] > 0
        assert row["memory/peak-bytes"] > 0
        assert row["attention/traffic-bytes-per-rank"] == expected
    assert set(mesh_run.traffic()) == {f"{expected / 2**20:.3f}"}
    # the banner names the ring the default schedule runs for this shape
    ring = streamed_schedule(AttentionShape(64, 2, 4, 2, 16, dtype_bytes=4), 2, 2)
    assert f"(mesh 2x2, schedule {ring} (streamed))" in mesh_run.output


def _logged_shapes(output: str) -> list[str]:
    """Every mesh shape the job names: the flag check's log line, the group builder's and
    the banner's."""
    return (re.findall(r"mesh context parallelism: (\d+(?:x\d+)+) grid", output)
            + re.findall(r"\(mesh (\d+(?:x\d+)+), schedule", output))


def test_3d_grid_chosen_for_the_node_matches_cp1_and_is_logged_as_built(
        cp1_run: Run, mesh_run: Run, data_args: list[str], work: Path) -> None:
    """Given (--mesh-shape 2x2) and chosen by the planner on two nodes of two ranks (the
    planner's grid for 2 CP ranks per node, read from the launcher: a heads x rows x cols
    grid, A = 4 here, which repeats the model's 2 K/V heads): the flag check's log line, the
    group builder's, the banner and wandb name the grid built, and its losses match CP = 1."""
    from megatron_mesh.megatron.shape import auto_mesh_shape

    assert "2x2 grid of 4 CP ranks (as given)" in mesh_run.output
    assert _logged_shapes(mesh_run.output) == ["2x2"] * 3
    chosen = auto_mesh_shape(4, 4, 2, 16, 64, cp_ranks_per_node=2)
    grid = "x".join(map(str, chosen))
    assert chosen[0] > 1, chosen  # the case covers a heads dimension
    run = launch_nodes(2, 2, [*data_args, "--train-iters", "3", "--lr-decay-iters", str(ITERS),
                                "--context-parallel-size", "4", "--context-parallel-algo", "mesh",
                                "--wandb-project", "mesh-tests",
                                "--wandb-save-dir", str(work / "wandb-3d")])
    assert run.returncode == 0, run.output[-3000:]
    assert (f"{grid} grid (heads x rows x cols) of 4 CP ranks (chosen by the planner for 2 CP "
            "ranks per node)") in run.output
    assert _logged_shapes(run.output) == [grid] * 3
    assert "(as given)" not in run.output  # the group builder's line says the planner chose it
    ref, got = cp1_run.losses(), run.losses()
    assert sorted(got) == [1, 2, 3]
    for it, loss in got.items():
        assert loss == pytest.approx(ref[it], rel=2e-5), (it, ref, got)
    (run_dir,) = glob.glob(str(work / "wandb-3d" / "wandb" / "offline-run-*"))
    name, config = wandb_run(run_dir)
    assert name == f"mesh-{grid}-tp1-dp1"
    assert config["mesh_grid"] == grid and config["mesh_heads"] == chosen[0]
    assert config["mesh_shape"] == list(chosen)


def test_dead_rank_fails_job_and_resume_matches_unbroken_run(
        fault_run: Run, mesh_run: Run, data_args: list[str], work: Path) -> None:
    assert fault_run.returncode != 0
    assert fault_run.seconds < 150, fault_run.seconds
    assert f"rank 2 fails (kill) at iteration {DIES_AT}" in fault_run.output
    ckpt = work / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(SAVE_EVERY)
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000004", "latest_checkpointed_iteration.txt"]

    resumed = launch(4, [*data_args, *MESH, "--load", str(ckpt)])
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"loaded checkpoint {ckpt / 'iter_0000004'}" in resumed.output
    unbroken, again = mesh_run.losses(), resumed.losses()
    assert sorted(again) == list(range(SAVE_EVERY + 1, ITERS + 1))
    for it in again:
        assert again[it] == pytest.approx(unbroken[it], rel=1e-6), (it, unbroken, again)
