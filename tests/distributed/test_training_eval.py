"""The driver on EOD-separated documents: the loss (with --eod-mask-loss, and per token) does
not depend on CP, validation and test passes run on the training's CP / mesh layout, and
TensorBoard holds the series, read back with TensorBoard's own EventAccumulator.

Every job writes TensorBoard events; grad norms are compared there (fp32 values; the log
line prints three decimals). Jobs are shared between tests (module fixtures).
"""
from __future__ import annotations

import glob
from pathlib import Path

import numpy as np
import pytest
from preloaded import (
    TINY,
    Run,
    driver_data_args,
    launch,
    tensorboard_events,
    tensorboard_scalars,
)
from wandb_records import wandb_history

VOCAB = 255  # tiny-cpu.yaml's --vocab-size: ids 0 .. 254, end of document 255
EOD = VOCAB
ITERS = 4
EVAL = ["--eval-interval", "2", "--eval-iters", "1", "--split", "90,5,5"]


@pytest.fixture(scope="module")
def eod_args(work: Path) -> list[str]:
    return [*driver_data_args(work, ITERS, (20, 50)), "--eod-mask-loss", *EVAL]


def _job(nproc: int, eod_args: list[str], work: Path, name: str, *flags: str) -> tuple[Run, dict]:
    folder = work / f"tb-{name}"
    run = launch(nproc, [*eod_args, *flags, "--tensorboard-dir", str(folder)])
    assert run.returncode == 0, run.output[-3000:]
    return run, tensorboard_scalars(folder)


@pytest.fixture(scope="module")
def cp1(eod_args: list[str], work: Path) -> tuple[Run, dict]:
    return _job(1, eod_args, work, "cp1")


@pytest.fixture(scope="module")
def per_token_cp1(eod_args: list[str], work: Path) -> tuple[Run, dict]:
    return _job(1, eod_args, work, "pt-cp1", "--calculate-per-token-loss")


MESHES = {
    "2x2": ["--mesh-shape", "2x2"],
    "1x4": ["--mesh-shape", "1x4"],
    "2x1x2": ["--mesh-shape", "2x1x2"],
}


def _close(got: dict[int, float], ref: dict[int, float], tol: float, what: str) -> None:
    assert sorted(got) == sorted(ref), (what, got, ref)
    worst = max(abs(got[k] - ref[k]) for k in ref)
    assert worst <= tol, (what, worst, got, ref)


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_eod_masked_loss_and_grad_norm_do_not_depend_on_cp(
        mesh: str, cp1: tuple[Run, dict], eod_args: list[str], work: Path) -> None:
    """--eod-mask-loss on ~35-token documents: the CP ranks' chunks hold different numbers of
    unmasked tokens; loss, grad norm and validation loss of the mesh equal CP = 1's to 1e-6
    (a per-rank mean averaged over CP is off by ~3e-4 here)."""
    ref_run, ref = cp1
    run, got = _job(4, eod_args, work, mesh, "--context-parallel-size", "4",
                    "--context-parallel-algo", "mesh", *MESHES[mesh])
    assert f"(mesh {mesh}, schedule" in run.output
    for tag in ("lm loss", "grad-norm", "lm loss validation", "lm loss test"):
        _close(got[tag], ref[tag], 1e-6, f"{mesh} {tag}")
    assert sorted(ref["lm loss validation"]) == [2, 4]
    assert sorted(ref["lm loss test"]) == [ITERS]


def test_per_token_loss_does_not_depend_on_cp(per_token_cp1: tuple[Run, dict],
                                              cp1: tuple[Run, dict], eod_args: list[str],
                                              work: Path) -> None:
    """--calculate-per-token-loss: the loss is the global batch's token sum over its token
    count; 2x2 mesh equals CP = 1 to 1e-6, and the first step's loss (same weights, same
    batch) is the one reported without the flag, while the gradients differ (each
    micro-batch weighted by its tokens, not equally)."""
    ref_run, ref = per_token_cp1
    run, got = _job(4, eod_args, work, "pt-2x2", "--calculate-per-token-loss",
                    "--context-parallel-size", "4", "--context-parallel-algo", "mesh",
                    "--mesh-shape", "2x2")
    for tag in ("lm loss", "grad-norm", "lm loss validation"):
        _close(got[tag], ref[tag], 1e-6, f"per-token {tag}")
    mean_of_means = cp1[1]
    assert ref["lm loss"][1] == pytest.approx(mean_of_means["lm loss"][1], abs=1e-6)
    assert abs(ref["grad-norm"][1] - mean_of_means["grad-norm"][1]) > 1e-5


def test_validation_lines_and_tensorboard_series(cp1: tuple[Run, dict], work: Path) -> None:
    """Megatron-LM's validation lines (loss value and PPL at each --eval-interval, then the
    validation and test sets at the end) match what TensorBoard holds; the final validation
    at the last iteration, itself a validation iteration, is that iteration's pass (one
    value, written once); the training series are there for every iteration."""
    import math
    import re

    run, scalars = cp1
    found = re.findall(r" validation loss at (iteration \d+(?: on \w+ set)?) \| lm loss value: "
                       r"(\S+) \| lm loss PPL: (\S+) \| ", run.output)
    assert [f[0] for f in found] == ["iteration 2", "iteration 4", "iteration 4 on validation set",
                                     "iteration 4 on test set"], run.output[-3000:]
    for _, loss, ppl in found:
        assert float(ppl) == pytest.approx(math.exp(float(loss)), rel=1e-5)
    assert float(found[0][1]) == pytest.approx(scalars["lm loss validation"][2], rel=1e-6)
    assert found[2][1] == found[1][1], found  # the final pass is iteration 4's
    for tag in ("lm loss validation", "lm loss validation vs samples"):
        events = tensorboard_events(work / "tb-cp1", tag)
        assert [step for step, _ in events] == sorted({step for step, _ in events}), events
    assert dict(tensorboard_events(work / "tb-cp1", "lm loss validation")) == pytest.approx(
        {2: float(found[0][1]), ITERS: float(found[1][1])}, rel=1e-6)
    assert float(found[3][1]) == pytest.approx(scalars["lm loss test"][ITERS], rel=1e-6)
    for tag in ("lm loss", "learning-rate", "grad-norm", "batch-size", "memory/peak-bytes",
                "throughput/tokens-per-sec", "throughput/tflops-per-gpu"):
        assert sorted(scalars[tag]) == list(range(1, ITERS + 1)), tag
    assert set(scalars["batch-size"].values()) == {4.0}
    assert all(v > 0 for v in scalars["memory/peak-bytes"].values())
    losses = run.losses()
    for it, loss in losses.items():
        assert scalars["lm loss"][it] == pytest.approx(loss, rel=1e-6)
    assert "attention/traffic-bytes-per-rank" not in scalars  # no mesh at CP = 1


def _build_text_documents(prefix: str, documents: int) -> int:
    """Real text: paragraphs of Python's own library source (argparse, textwrap, ...) as
    byte-level documents (ids 0 .. 127), each ending with the EOD id, written with
    megatron-core's IndexedDatasetBuilder; returns the number of documents."""
    import argparse
    import dataclasses
    import textwrap
    import typing

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    paragraphs = []
    for module in (argparse, textwrap, dataclasses, typing):
        text = Path(module.__file__).read_text(encoding="utf-8")
        paragraphs += [p for p in text.split("\n\n") if 40 <= len(p.encode()) <= 400
                       and p.isascii()]
    paragraphs = paragraphs[:documents]
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for paragraph in paragraphs:
        ids = np.append(np.frombuffer(paragraph.encode(), dtype=np.uint8).astype(np.int32), EOD)
        builder.add_document(ids, [len(ids)])
    builder.finalize(prefix + ".idx")
    return len(paragraphs)


def test_real_documents_train_and_validation_loss_falls(work: Path) -> None:
    """A few hundred EOD-separated documents of real text on a 2x2 mesh, validation every 10
    iterations on held-out documents, TensorBoard events: the validation loss falls (the
    last two passes well below the first), and the log's validation lines are TensorBoard's
    values."""
    prefix = str(work / "text")
    assert _build_text_documents(prefix, 400) >= 300
    folder = work / "tb-text"
    run = launch(4, ["--config", TINY, "--data-path", prefix, "--split", "90,10,0",
                     "--data-cache-path", str(work / "text-cache"), "--eod-mask-loss",
                     "--train-iters", "40", "--log-interval", "10",
                     "--eval-interval", "10", "--eval-iters", "4",
                     "--context-parallel-size", "4", "--cp-comm-type", "mesh",
                     "--mesh-shape", "2x2", "--tensorboard-dir", str(folder),
                     "--wandb-project", "mesh-tests", "--wandb-save-dir", str(work / "wandb")])
    assert run.returncode == 0, run.output[-3000:]
    assert " on test set" not in run.output  # --split 90,10,0: no test set
    valid = tensorboard_scalars(folder)["lm loss validation"]
    assert sorted(valid) == [10, 20, 30, 40], valid
    # each pass reads the next validation samples (as Megatron-LM): the curve is not smooth
    assert max(valid[30], valid[40]) < valid[10] - 0.3, valid
    assert "validation loss at iteration 40 on validation set | lm loss value: " in run.output
    # the final pass at iteration 40, a validation iteration, is iteration 40's own pass
    for it, prefix in ((10, "iteration 10"), (20, "iteration 20"), (30, "iteration 30"),
                       (40, "iteration 40 on validation set")):
        line = run.output.split(f" validation loss at {prefix} | lm loss value: ")[1]
        assert float(line.split(" ")[0]) == pytest.approx(valid[it], rel=1e-6)
    (run_dir,) = glob.glob(str(work / "wandb" / "wandb" / "offline-run-*"))
    logged = [(row["_step"], row["lm loss validation"]) for row in wandb_history(run_dir)
              if "lm loss validation" in row]
    assert [step for step, _ in logged] == [10, 20, 30, 40], logged  # one row per step
    assert logged[-1][1] == pytest.approx(valid[40], rel=1e-6)


def test_per_token_loss_with_megatron_ddp_and_distributed_optimizer(
        per_token_cp1: tuple[Run, dict], eod_args: list[str], work: Path) -> None:
    """--calculate-per-token-loss through megatron-core's DDP (gradients summed, scaling 1)
    and finalize_model_grads (divided by the global token count): DP 2 x CP 2 with the
    distributed optimizer matches CP = 1."""
    ref_run, ref = per_token_cp1
    run, got = _job(4, eod_args, work, "pt-distopt", "--calculate-per-token-loss",
                    "--use-distributed-optimizer", "--context-parallel-size", "2",
                    "--cp-comm-type", "mesh")
    assert "x DP 2" in run.output
    for tag in ("lm loss", "grad-norm", "lm loss validation"):
        _close(got[tag], ref[tag], 1e-5, f"per-token distopt {tag}")
