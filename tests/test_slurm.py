"""The CPU sbatch script, submitted to a real single-node Slurm (slurmctld + slurmd + munged
started here under a temporary directory), trains the tiny GPT with a 2x2 mesh.

Slurm comes from Debian's packages (slurmctld slurmd slurm-client munge); when missing they
are installed with apt-get, and the tests skip only when that is impossible.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster, ensure_slurm

REPO = Path(__file__).resolve().parents[1]
CPU_SCRIPT = REPO / "scripts" / "slurm" / "pretrain_gpt_mesh_cpu.sbatch"
ITERS = 3
JOB_TIMEOUT = 600

ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|(.*)")
LOSS = re.compile(r"lm loss: (\d\.\d{6}E[+-]\d{2})")
THROUGHPUT = re.compile(r"tokens/s[^|:]*: *[\d.]+|TFLOP/s[^|:]*: *[\d.]+", re.IGNORECASE)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = ensure_slurm()
    if reason:
        pytest.skip(f"Slurm cannot be installed: {reason}")
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def test_cluster_allocates_and_runs_steps(slurm, tmp_path):
    """The cluster itself: a batch job whose srun step sees the node list the scripts use."""
    script = tmp_path / "hello.sh"
    script.write_text("#!/bin/bash\nscontrol show hostnames \"$SLURM_JOB_NODELIST\"\n"
                      "srun bash -c 'echo step $SLURM_PROCID of $SLURM_NTASKS'\n")
    log = tmp_path / "hello.out"
    job = slurm.sbatch(script, sbatch_args=(f"--output={log}",), cwd=tmp_path)
    info = slurm.wait(job, 60)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", text
    assert text.splitlines()[0] == slurm.node
    assert "step 0 of 1" in text


def test_cpu_sbatch_trains_tiny_gpt_with_mesh(slurm, tmp_path):
    log = tmp_path / "job.out"
    runs = tmp_path / "runs"
    env = {
        "PYTHON": sys.executable,
        "MESH_HOME": str(REPO),
        "OUTPUT_DIR": str(runs),
        "TRAIN_ITERS": str(ITERS),
        "LOG_INTERVAL": "1",
    }
    job = slurm.sbatch(CPU_SCRIPT, sbatch_args=(f"--output={log}", f"--chdir={REPO}"),
                       env=env, cwd=REPO)
    info = slurm.wait(job, JOB_TIMEOUT)
    text = log.read_text() if log.exists() else "(no job log)"
    assert info["JobState"] == "COMPLETED" and info.get("ExitCode") == "0:0", (
        f"job {job} ended {info.get('JobState')} {info.get('ExitCode')}\n{text[-4000:]}"
    )

    lines = [m for m in (ITERATION.search(ln) for ln in text.splitlines()) if m]
    assert [int(m.group(1)) for m in lines] == list(range(1, ITERS + 1)), text[-4000:]
    for m in lines:
        assert int(m.group(2)) == ITERS
        fields = m.group(3)
        loss = LOSS.search(fields)
        assert loss and 0.0 < float(loss.group(1)) < 100.0, m.group(0)
        assert len(THROUGHPUT.findall(fields)) == 2, f"no tokens/s and TFLOP/s in: {m.group(0)}"

    # The job's own directory: the command that ran and a copy of the training log.
    run_dir = runs / f"mesh-cpu-{job}"
    command = (run_dir / "command.txt").read_text()
    assert "--context-parallel-algo mesh" in command and "--mesh-shape 2x2" in command
    assert "--rdzv-backend c10d" in command
    train_log = (run_dir / "train.log").read_text()
    assert [int(m.group(1)) for m in ITERATION.finditer(train_log)] == list(range(1, ITERS + 1))
