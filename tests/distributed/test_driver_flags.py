"""Megatron-LM flags the driver honours as Megatron-LM does, in real driver runs
on gloo with mock data and the tiny config: the LR schedule on resume, sample-based training
with a batch-size ramp, --rotary-percent, --use-checkpoint-args and megatron-core DDP's
communication overlap."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from preloaded import ROOT, TINY, Run, job_env, launch

from megatron_mesh.runtime.spawn import free_port

pytestmark = pytest.mark.distributed

CONSTANT = ["--config", TINY, "--lr-decay-style", "constant", "--lr-warmup-iters", "0"]
DP2_CP2 = ["--context-parallel-size", "2", "--cp-comm-type", "mesh"]


def _column(run: Run, name: str) -> dict[int, float]:
    """Iteration -> the float value of field `name` in its log line."""
    return {it: float(fields[name]) for it, fields in run.lines().items()}


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root: (size, modification time)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


def _errors(run: Run) -> list[str]:
    return [line for line in run.output.splitlines() if line.startswith("pretrain_gpt: error")]


@pytest.fixture(scope="module")
def saved(work: Path) -> tuple[Run, Path]:
    """Two iterations at the constant LR 3e-3 of tiny-cpu.yaml, saved."""
    root = work / "constant-lr"
    run = launch(1, [*CONSTANT, "--train-iters", "2", "--save", str(root)])
    assert run.returncode == 0, run.output[-3000:]
    return run, root


def test_resume_with_another_lr_is_refused_unless_a_scheduler_flag_says_which(
        saved: tuple[Run, Path]) -> None:
    """Resuming with --lr 1e-2 (and one more iteration): by default exit 2 with one line naming
    each differing setting, both values and both flags, the checkpoint untouched;
    --override-opt_param-scheduler trains at 1e-2, --use-checkpoint-opt_param-scheduler at the
    checkpoint's 3e-3. The latter also takes the model's shape from the checkpoint
    (--use-checkpoint-args over a wrong --hidden-size / --num-layers)."""
    _, root = saved
    before = _files(root)
    resume = [*CONSTANT, "--train-iters", "3", "--load", str(root), "--lr", "1e-2"]
    refused = launch(1, resume)
    assert refused.returncode == 2 and "Traceback" not in refused.output, refused.output[-3000:]
    (line,) = _errors(refused)
    for part in ("--lr: 0.01 here, 0.003 in the checkpoint",
                 "--lr-decay-iters / --lr-decay-samples (default --train-iters / --train-samples):"
                 " 12 samples here, 8 samples in the checkpoint",
                 "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"):
        assert part in line, line
    assert _files(root) == before

    override = launch(1, [*resume, "--override-opt_param-scheduler"])
    assert override.returncode == 0, override.output[-3000:]
    assert _column(override, "learning rate") == {3: pytest.approx(1e-2)}

    kept = launch(1, [*resume, "--use-checkpoint-opt_param-scheduler", "--use-checkpoint-args",
                      "--hidden-size", "32", "--num-layers", "1"])
    assert kept.returncode == 0, kept.output[-3000:]
    assert _column(kept, "learning rate") == {3: pytest.approx(3e-3)}
    assert ("--use-checkpoint-args: from the checkpoint --num-layers 2 (was 1), --hidden-size "
            "64 (was 32)") in kept.output
    assert "model: 2 layers, hidden 64" in kept.output


def test_rotary_percent_changes_the_model(saved: tuple[Run, Path]) -> None:
    """--rotary-percent 0.5 rotates half of each head's dims: the first loss (before any
    update, same weights and data) differs from the full rotation's (5.575309 against
    5.575325)."""
    full, _ = saved
    half = launch(1, [*CONSTANT, "--train-iters", "1", "--rotary-percent", "0.5"])
    assert half.returncode == 0, half.output[-3000:]
    # CPU runs repeat to the bit; at init (std 0.02) attention is near uniform, so positions
    # move the loss little, but by 16 units of the logged 7th digit
    assert abs(_column(half, "lm loss")[1] - _column(full, "lm loss")[1]) > 5e-6


def test_train_samples_with_batch_ramp_and_sample_schedule() -> None:
    """--train-samples 20 with --rampup-batch-size 2 2 4: batches 2, 2, then 4 (6 iterations,
    20 samples); the LR decays linearly over --lr-decay-samples 20 by consumed samples; the
    ramp's first two iterations are those of a constant batch of 2 (same samples, same LR)."""
    common = ["--config", TINY, "--lr-decay-style", "linear", "--lr-decay-samples", "20",
              "--lr-warmup-samples", "0"]
    ramp = launch(1, [*common, "--train-samples", "20", "--rampup-batch-size", "2", "2", "4"])
    assert ramp.returncode == 0, ramp.output[-3000:]
    assert "batch-size ramp-up: global batch 2 -> 4 in steps of 2 over 4 samples; 6 " \
        "iterations for --train-samples 20" in ramp.output
    assert list(_column(ramp, "global batch size").values()) == [2, 2, 4, 4, 4, 4]
    consumed = _column(ramp, "consumed samples")
    assert list(consumed.values()) == [2, 4, 8, 12, 16, 20]
    lr_max, lr_min = 3e-3, 3e-4  # tiny-cpu.yaml
    for it, lr in _column(ramp, "learning rate").items():
        assert lr == pytest.approx(lr_max - (lr_max - lr_min) * consumed[it] / 20, rel=1e-5)
    constant = launch(1, [*common, "--train-samples", "4", "--global-batch-size", "2"])
    assert constant.returncode == 0, constant.output[-3000:]
    ref, got = _column(constant, "lm loss"), _column(ramp, "lm loss")
    assert sorted(ref) == [1, 2]
    for it in ref:
        assert got[it] == pytest.approx(ref[it], rel=1e-6)


def test_overlapped_grad_reduce_and_param_gather_match_the_plain_run(work: Path) -> None:
    """DP 2 x CP 2 (mesh) on gloo: megatron-core's DDP with --overlap-grad-reduce (alone, and
    with the distributed optimizer and --overlap-param-gather) says so at start-up, and the
    losses, grad norms and validation losses equal those of the run without overlap."""
    common = ["--config", TINY, "--train-iters", "4", *DP2_CP2, "--eval-interval", "2",
              "--eval-iters", "1"]
    ref = launch(4, [*common, "--use-distributed-optimizer"])
    assert ref.returncode == 0, ref.output[-3000:]
    assert "gradient reduction overlapped" not in ref.output
    runs = {
        "parameters gathered after the step": launch(4, [*common, "--overlap-grad-reduce"]),
        "parameter all-gather overlapped with the next forward": launch(
            4, [*common, "--use-distributed-optimizer", "--overlap-grad-reduce",
                "--overlap-param-gather", "--save", str(work / "overlap-ckpt")]),
    }
    want_val = [ln for ln in ref.output.splitlines() if "validation loss" in ln]
    for gather, run in runs.items():
        assert run.returncode == 0, run.output[-3000:]
        assert ("DDP on CPU (gloo): gradient reduction overlapped with backward "
                f"(--overlap-grad-reduce, bucket size 40000000); {gather}") in run.output
        for name, rel in (("lm loss", 1e-5), ("grad norm", 1e-3)):
            want, got = _column(ref, name), _column(run, name)
            assert sorted(got) == [1, 2, 3, 4]
            for it in want:
                assert got[it] == pytest.approx(want[it], rel=rel), (gather, name, it)
        assert [ln for ln in run.output.splitlines() if "validation loss" in ln] == want_val
    assert os.path.isdir(work / "overlap-ckpt" / "iter_0000004")


def _without(root: Path, *packages: str) -> str:
    """A folder that, first on PYTHONPATH, makes `packages` fail to import (each a package of
    that name whose import raises ImportError, as a missing or broken install does)."""
    for name in packages:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(f"raise ImportError('no {name} here')\n")
    return str(root)


def _ranks(nproc: int, args: list[str], pythonpath: str, timeout: float = 200) -> tuple[list[int], str]:
    """The driver on `nproc` fresh processes with torchrun's environment (not forked from the
    preloaded server, whose imports are done): (exit codes, their output)."""
    port = str(free_port())
    procs = []
    for rank in range(nproc):
        env = job_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port)
        env["PYTHONPATH"] = pythonpath + os.pathsep + env["PYTHONPATH"]
        procs.append(subprocess.Popen([sys.executable, "-m", "megatron_mesh.pretrain_gpt", *args],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outputs.append(out)
        codes.append(p.returncode)
    return codes, "".join(outputs)


def test_logger_flags_without_their_package_exit_2_before_any_group(tmp_path: Path) -> None:
    """--tensorboard-dir where tensorboard does not import, on 2 ranks: each exits 2 at the
    flag check (before any process group: nothing else is printed, no traceback, no gloo
    error), the one line printed once, naming the flag and the extra; --wandb-project
    without wandb the same."""
    broken = _without(tmp_path / "absent", "tensorboard", "wandb")
    for flags, nproc, line in (
            (["--tensorboard-dir", str(tmp_path / "tb")], 2,
             "pretrain_gpt: error: --tensorboard-dir needs the tensorboard package, which does "
             "not import (no tensorboard here): pip install 'megatron-mesh[tensorboard]'"),
            (["--wandb-project", "p"], 1,
             "pretrain_gpt: error: --wandb-project needs the wandb package, which does not "
             "import (no wandb here): pip install 'megatron-mesh[wandb]'")):
        codes, output = _ranks(nproc, [*CONSTANT, "--train-iters", "1", *flags], broken)
        assert codes == [2] * nproc, output[-3000:]
        assert output.strip() == line, output[-3000:]
    assert not (tmp_path / "tb").exists()
