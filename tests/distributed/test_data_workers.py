"""--num-workers: the samples are read in torch DataLoader worker processes, and the run is
the same as with the samples read in the training process: identical losses (the printed
values and TensorBoard's fp32 ones), validation and test losses included, also with packed
documents (--reset-attention-mask) over the mesh, and a resumed run with workers continues
the unbroken run exactly.

Two data-parallel ranks (each reads its own samples of every global batch) on EOD-separated
documents; the jobs are shared between tests (module fixtures).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from preloaded import Run, driver_data_args, launch, tensorboard_scalars

from megatron_mesh.training.config.arguments import ConfigError, parse_args
from megatron_mesh.training.data.datasets import SampleIndices

ITERS = 4
SAVE_AT = 2
EVAL = ["--eval-interval", "2", "--eval-iters", "1", "--split", "90,5,5"]
PACKED = ["--context-parallel-size", "2", "--context-parallel-algo", "mesh",
          "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


@pytest.fixture(scope="module")
def data_args(work: Path) -> list[str]:
    return [*driver_data_args(work, ITERS, (20, 50), seed=1), *EVAL]


def _job(work: Path, name: str, args: list[str], *flags: str) -> tuple[Run, dict]:
    folder = work / f"tb-{name}"
    run = launch(2, [*args, *flags, "--tensorboard-dir", str(folder)])
    assert run.returncode == 0, run.output[-3000:]
    return run, tensorboard_scalars(folder)


@pytest.fixture(scope="module")
def in_process(data_args: list[str], work: Path) -> tuple[Run, dict]:
    """--num-workers 0 (the default), data-parallel 2; saves at iteration SAVE_AT."""
    return _job(work, "w0", data_args, "--save", str(work / "ckpt"),
                "--save-interval", str(SAVE_AT))


@pytest.fixture(scope="module")
def two_workers(data_args: list[str], work: Path) -> tuple[Run, dict]:
    return _job(work, "w2", data_args, "--num-workers", "2")


def _same_series(got: tuple[Run, dict], ref: tuple[Run, dict], tags: tuple[str, ...]) -> None:
    (run, scalars), (ref_run, ref_scalars) = got, ref
    assert run.losses() == ref_run.losses() and len(ref_run.losses()) == ITERS
    for tag in tags:
        assert scalars[tag] == ref_scalars[tag], (tag, scalars[tag], ref_scalars[tag])


def test_two_workers_give_the_losses_of_the_training_process_reader(
        two_workers: tuple[Run, dict], in_process: tuple[Run, dict]) -> None:
    """Same samples in the same order: every loss, grad norm, validation and test loss is
    bit-identical (the validation passes read through their own loaders)."""
    _same_series(two_workers, in_process,
                 ("lm loss", "grad-norm", "lm loss validation", "lm loss test"))
    assert sorted(in_process[1]["lm loss validation"]) == [2, 4]
    assert "--num-workers 2: no effect" not in two_workers[0].output


def test_two_workers_with_packed_documents_over_the_mesh(
        data_args: list[str], work: Path) -> None:
    """--reset-attention-mask on CP 2 (mesh): the documents of each micro-batch are packed
    the same way whoever read the samples."""
    ref = _job(work, "packed-w0", data_args, *PACKED)
    got = _job(work, "packed-w2", data_args, *PACKED, "--num-workers", "2")
    _same_series(got, ref, ("lm loss", "grad-norm", "lm loss validation"))


def test_resume_with_workers_continues_the_unbroken_run_exactly(
        in_process: tuple[Run, dict], data_args: list[str], work: Path) -> None:
    """The checkpoint of iteration SAVE_AT (written by the in-process reader) resumed with
    --num-workers 2: the loader starts at the consumed-sample count, and iterations
    SAVE_AT + 1 .. ITERS equal the unbroken run's."""
    ckpt = work / "ckpt"
    run = launch(2, [*data_args, "--load", str(ckpt), "--ckpt-step", str(SAVE_AT),
                    "--num-workers", "2"])
    assert run.returncode == 0, run.output[-3000:]
    assert f"loaded checkpoint {ckpt / f'iter_{SAVE_AT:07d}'}" in run.output
    unbroken, resumed = in_process[0].losses(), run.losses()
    assert sorted(resumed) == list(range(SAVE_AT + 1, ITERS + 1))
    assert resumed == {it: unbroken[it] for it in resumed}


@pytest.mark.unit
def test_sample_indices_are_the_global_batch_layout() -> None:
    """Data-parallel rank d reads, per global batch k, micro-batch m from
    k * GBS + (m * DP + d) * mbs; the sampler starts at the consumed samples and stops
    before a micro-batch that does not fit in the dataset."""
    args = parse_args(["--vocab-size", "255", "--micro-batch-size", "2",
                       "--global-batch-size", "8"])
    assert (args.data_parallel_size, args.num_microbatches) == (1, 4)
    assert list(SampleIndices(8, 20, 0, args)) == list(range(8, 20))

    class TwoReplicas:  # the layout of data-parallel 2, 2 micro-batches of 2
        micro_batch_size, data_parallel_size, num_microbatches, global_batch_size = 2, 2, 2, 8

    assert list(SampleIndices(8, 24, 0, TwoReplicas)) == [8, 9, 12, 13, 16, 17, 20, 21]
    assert list(SampleIndices(8, 24, 1, TwoReplicas)) == [10, 11, 14, 15, 18, 19, 22, 23]
    assert list(SampleIndices(0, 11, 1, TwoReplicas)) == [2, 3, 6, 7]


@pytest.mark.unit
def test_negative_workers_are_refused() -> None:
    with pytest.raises(ConfigError, match="--num-workers -1: must be 0"):
        parse_args(["--vocab-size", "255", "--num-workers", "-1"])
    assert parse_args(["--vocab-size", "255"]).num_workers == 0
