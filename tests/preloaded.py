"""Driver jobs and spawned ranks started from one preloaded process per test worker.

Importing megatron-core takes about 10 s of CPU, torch about 3 s; a 4-rank job used to pay
that five times (torchrun's agent and each rank). Here a forkserver that has imported them
once forks every rank of every job of a test worker. A rank gets the environment torchrun
gives it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT) and runs the driver's ``main`` as ``python -m megatron_mesh.pretrain_gpt``
would. As under torchrun, when one rank fails the others are stopped (SIGTERM, then SIGKILL).
The ranks are forked from the server, which runs no threads, not from a launcher that does.
torchrun itself runs in the Slurm tests (tests/system/test_slurm.py).
"""
from __future__ import annotations

import multiprocessing
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pytest

from megatron_mesh.runtime.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]
DRIVER = "megatron_mesh.pretrain_gpt"
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")  # the tiny model the driver tests train
# the driver first: it silences megatron-core's import warnings; a module that does not
# import is skipped
PRELOAD = [DRIVER, "torch", "torch.distributed", "megatron_mesh", "megatron.core",
           "megatron.core.models.gpt", "megatron_mesh.megatron", "megatron_mesh.training.config.arguments",
           "megatron_mesh.training.run"]
STOP_GRACE_S = 10  # after SIGTERM, before SIGKILL
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|(.*)\|$", re.MULTILINE)
LOSS = re.compile(r"^\d\.\d{6}E[+-]\d\d$")  # Megatron-LM's "lm loss: 5.575325E+00"


def context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context; its server (started at first use) has PRELOAD imported."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    return multiprocessing.get_context("forkserver")


def _fields(line: str) -> dict[str, str]:
    return dict(part.strip().split(": ", 1) for part in line.split(" | ") if ": " in part)


@dataclass
class Run:
    """A finished job: exit status (the first failing rank's), what it printed, wall seconds."""

    returncode: int
    output: str
    seconds: float

    def lines(self) -> dict[int, dict[str, str]]:
        """Iteration -> the fields of its log line."""
        return {int(m[1]): _fields(m[3]) for m in LOG_LINE.finditer(self.output)}

    def losses(self) -> dict[int, float]:
        out = {}
        for it, fields in self.lines().items():
            assert LOSS.match(fields["lm loss"]), fields
            out[it] = float(fields["lm loss"])
        return out

    def traffic(self) -> list[str]:
        return [f["attention traffic per rank (MiB)"] for f in self.lines().values()]

    def assert_trains_like(self, ref: Run, iterations: Iterable[int],
                           ref_iterations: Iterable[int] | None = None) -> None:
        """Both runs ended well, this one logged `iterations` and `ref` `ref_iterations`
        (default: the same), and each of this run's lines has ref's loss (to 2e-5
        relative) and gradient norm (to 2e-3)."""
        for r in (self, ref):
            assert r.returncode == 0, r.output[-3000:]
        got, want = self.lines(), ref.lines()
        iterations = list(iterations)
        assert sorted(got) == iterations, self.output[-3000:]
        assert sorted(want) == list(iterations if ref_iterations is None else ref_iterations)
        for it, fields in got.items():
            assert float(fields["lm loss"]) == pytest.approx(float(want[it]["lm loss"]),
                                                             rel=2e-5)
            assert float(fields["grad norm"]) == pytest.approx(float(want[it]["grad norm"]),
                                                               abs=2e-3)


def build_indexed_dataset(prefix: str) -> None:
    """Arithmetic token sequences (learnable) as a Megatron indexed dataset."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(64):
        start, step, n = rng.integers(0, 255), rng.integers(1, 4), rng.integers(40, 120)
        builder.add_document((start + step * np.arange(n)) % 255, [int(n)])
    builder.finalize(prefix + ".idx")


def driver_data_args(work: Path, iters: int, documents: tuple[int, int] | None = None,
                     seed: int = 0) -> list[str]:
    """The tiny driver's flags for `iters` iterations on data built once in `work`:
    arithmetic sequences, or 300 EOD-separated documents of lengths documents[0] ..
    documents[1] - 1 (the one fixture the driver tests share)."""
    prefix = str(work / ("arith" if documents is None else "docs"))
    if documents is None:
        build_indexed_dataset(prefix)
    else:
        build_eod_documents(prefix, 300, documents, seed=seed)
    return ["--config", TINY, "--train-iters", str(iters), "--data-path", prefix,
            "--data-cache-path", str(work / "index-cache")]


TINY_VOCAB = 255  # tiny-cpu.yaml's --vocab-size: ids 0 .. 254; the NullTokenizer's EOD is 255


def build_eod_documents(prefix: str, documents: int, lengths: tuple[int, int],
                        seed: int = 0) -> None:
    """`documents` short arithmetic documents of lengths[0] .. lengths[1] - 1 tokens (ids below
    TINY_VOCAB), each ending with the EOD id TINY_VOCAB, as Megatron-LM's preprocess_data.py
    --append-eod writes them, as a Megatron indexed dataset."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    rng = np.random.default_rng(seed)
    for _ in range(documents):
        start, step = rng.integers(0, TINY_VOCAB), rng.integers(1, 4)
        n = rng.integers(*lengths)
        ids = np.append((start + step * np.arange(n)) % TINY_VOCAB, TINY_VOCAB)
        builder.add_document(ids, [len(ids)])
    builder.finalize(prefix + ".idx")


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of the event files in `folder`, read by TensorBoard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)}
            for tag in events.Tags()["scalars"]}


def tensorboard_events(folder: Path, tag: str) -> list[tuple[int, float]]:
    """Every (step, value) written under `tag` in `folder`, in order, repeats kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def job_env(**extra: str) -> dict[str, str]:
    """The environment of a driver job: one thread per rank, wandb offline, no fault."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("MEGATRON_MESH_FAULT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                 "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(extra)
    return env


def _rank(args: list[str], env: dict[str, str], log: str, module: str = DRIVER) -> None:
    """In a forked rank: the command line of `module` (the driver's by default), output
    appended to `log`."""
    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    import importlib

    # a process started from the forkserver inherits its start method; `python -m` starts
    # with the platform's default (what the driver's DataLoader workers use under torchrun)
    multiprocessing.set_start_method(None, force=True)
    sys.argv = [module, *args]
    sys.exit(importlib.import_module(module).main(args))


class Job:
    """A started driver job of `nodes` x `nproc` ranks on this machine."""

    def __init__(self, args: list[str], env: dict[str, str], nproc: int = 1, nodes: int = 1,
                 stop_others: bool = True, module: str = DRIVER):
        self._dir = tempfile.TemporaryDirectory()
        self.log = Path(self._dir.name) / "output.txt"
        self.log.touch()
        self.stop_others = stop_others
        self.start = time.monotonic()
        world = nodes * nproc
        port = str(free_port())
        ctx = context()
        self.ranks = []
        for rank in range(world):
            rank_env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                            LOCAL_RANK=str(rank % nproc),
                            WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(nproc),
                            GROUP_RANK=str(rank // nproc))
            process = ctx.Process(target=_rank, args=(args, rank_env, str(self.log), module))
            process.start()
            self.ranks.append(process)

    @property
    def pid(self) -> int:
        """Rank 0's process id."""
        return self.ranks[0].pid

    def _alive(self) -> bool:
        return any(p.is_alive() for p in self.ranks)

    def follow(self, timeout: float = 240) -> Iterator[str]:
        """The output's lines as they are written, until the job ends or `timeout` passes."""
        with open(self.log) as f:
            pending = ""
            while time.monotonic() - self.start < timeout:
                chunk = f.read()
                if not chunk:
                    if not self._alive():
                        break
                    time.sleep(0.05)
                    continue
                pending += chunk
                *lines, pending = pending.split("\n")
                yield from lines
        if pending:
            yield pending

    def _stop(self, sig: int) -> None:
        for p in self.ranks:
            if p.is_alive():
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    def wait(self, timeout: float = 240) -> Run:
        """Wait for every rank; a failed rank stops the others (stop_others), a rank alive
        past `timeout` is killed. The finished Run."""
        note, failed = "", None
        while self._alive():
            if time.monotonic() - self.start > timeout:
                note = f"\n[killed after {timeout:.0f} s]"
                self._stop(signal.SIGKILL)
                break
            if failed is None:
                failed = next((p for p in self.ranks if p.exitcode not in (None, 0)), None)
                if failed is not None and self.stop_others:
                    self._stop(signal.SIGTERM)
                    deadline = time.monotonic() + STOP_GRACE_S
                    while self._alive() and time.monotonic() < deadline:
                        time.sleep(0.05)
                    self._stop(signal.SIGKILL)
            time.sleep(0.05)
        for p in self.ranks:
            p.join()
        self.exitcodes = [p.exitcode for p in self.ranks]
        if failed is None:
            failed = next((p for p in self.ranks if p.exitcode != 0), self.ranks[0])
        run = Run(failed.exitcode, self.log.read_text() + note, time.monotonic() - self.start)
        self._dir.cleanup()
        return run


def driver(args: list[str], timeout: float = 240, **env: str) -> Run:
    """`python -m megatron_mesh.pretrain_gpt ARGS` as one process (world size 1)."""
    return Job(args, job_env(**env)).wait(timeout)


def launch(nproc: int, args: list[str], timeout: float = 240, module: str = DRIVER,
           **env: str) -> Run:
    """The driver (or another command `module`) on `nproc` ranks, as `torchrun --standalone
    --nproc-per-node N` starts it."""
    return Job(args, job_env(**env), nproc, module=module).wait(timeout)


def launch_nodes(nodes: int, nproc: int, args: list[str], timeout: float = 240) -> Run:
    """The driver on `nodes` x `nproc` ranks, each rank seeing LOCAL_WORLD_SIZE = nproc, as
    torchrun on a cluster of `nodes` nodes starts it (all on this machine)."""
    return Job(args, job_env(), nproc, nodes).wait(timeout)
