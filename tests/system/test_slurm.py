"""The CPU sbatch script, submitted to a real single-node Slurm (slurmctld + slurmd + munged
started here under a temporary directory), trains the tiny GPT with a 2x2 mesh.

Slurm comes from Debian's packages (slurmctld slurmd slurm-client munge); when missing they
are installed with apt-get, and the tests skip only when that is impossible.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_cluster import TERMINAL_STATES, SlurmCluster, ensure_slurm, free_ports

REPO = Path(__file__).resolve().parents[2]
CPU_SCRIPT = REPO / "scripts" / "slurm" / "pretrain_gpt_mesh_cpu.sbatch"
ITERS = 20
WAIT_AT = 3  # the time-limited job's ranks wait at this iteration for Slurm's warning
JOB_TIMEOUT = 600

ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|(.*)")
LOSS = re.compile(r"lm loss: (\d\.\d{6}E[+-]\d{2})")
TOKENS_PER_S = re.compile(r"tokens/s: ([\d.]+)")
TFLOPS = re.compile(r"TFLOP/s[^|:]*: ([\d.]+)")


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


def _submit(slurm, root: Path, *sbatch_args: str, **extra_env: str) -> tuple[int, Path, Path]:
    """The CPU script as a job of ITERS iterations: (job id, its log, its output folder)."""
    log, runs = root / "job.out", root / "runs"
    env = {
        "PYTHON": sys.executable,
        "MESH_HOME": str(REPO),
        "OUTPUT_DIR": str(runs),
        "TRAIN_ITERS": str(ITERS),
        "LOG_INTERVAL": "1",
        # Job ids restart at 1 in every test cluster: keep rendezvous ports apart.
        "MASTER_PORT": str(free_ports(1)[0]),
        "WANDB_PROJECT": "megatron-mesh-slurm-test",
        "WANDB_MODE": "offline",
        **extra_env,
    }
    try:
        socket.gethostbyname(slurm.node)
    except OSError:  # the script takes MASTER_ADDR from the node list: only if it resolves
        env["MASTER_ADDR"] = "127.0.0.1"
    job = slurm.sbatch(CPU_SCRIPT, sbatch_args=(f"--output={log}", f"--chdir={REPO}",
                                                *sbatch_args), env=env, cwd=REPO)
    return job, log, runs


def _losses(text: str) -> dict[int, str]:
    """Iteration -> lm loss as logged (6 significant decimals)."""
    return {int(m.group(1)): LOSS.search(m.group(3)).group(1)
            for m in (ITERATION.search(ln) for ln in text.splitlines()) if m}


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory) -> tuple[int, str, Path]:
    """One job of ITERS iterations that nothing stops: (job id, its log text, output folder)."""
    job, log, runs = _submit(slurm, tmp_path_factory.mktemp("uninterrupted"))
    info = slurm.wait(job, JOB_TIMEOUT)
    text = log.read_text() if log.exists() else "(no job log)"
    assert info["JobState"] == "COMPLETED" and info.get("ExitCode") == "0:0", (
        f"job {job} ended {info.get('JobState')} {info.get('ExitCode')}\n{text[-4000:]}"
    )
    return job, text, runs


def test_cpu_sbatch_trains_tiny_gpt_with_mesh(uninterrupted):
    job, text, runs = uninterrupted
    lines = [m for m in (ITERATION.search(ln) for ln in text.splitlines()) if m]
    assert [int(m.group(1)) for m in lines] == list(range(1, ITERS + 1)), text[-4000:]
    for m in lines:
        assert int(m.group(2)) == ITERS
        fields = m.group(3)
        loss = LOSS.search(fields)
        assert loss and 0.0 < float(loss.group(1)) < 100.0, m.group(0)
        tokens, tflops = TOKENS_PER_S.search(fields), TFLOPS.search(fields)
        assert tokens and tflops, f"no tokens/s and TFLOP/s in: {m.group(0)}"
        assert float(tokens.group(1)) > 0 and float(tflops.group(1)) >= 0

    # The job's own directory: the command that ran, a copy of the training log, the
    # checkpoint saved at the end and the offline wandb run.
    run_dir = runs / f"mesh-cpu-{job}"
    command = (run_dir / "command.txt").read_text()
    assert "--context-parallel-algo mesh" in command and "--mesh-shape 2x2" in command
    assert "--rdzv-backend c10d" in command
    train_log = (run_dir / "train.log").read_text()
    assert [int(m.group(1)) for m in ITERATION.finditer(train_log)] == list(range(1, ITERS + 1))
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() \
        == str(ITERS)
    assert list((run_dir / "wandb").rglob("offline-run-*")), sorted(run_dir.rglob("*"))
    assert "--exit-signal-handler --exit-signal SIGUSR1" in command


def test_time_limit_saves_requeues_and_losses_continue(slurm, uninterrupted, tmp_path):
    """A two-minute job warned 115 s before its limit (Slurm's `--signal=B:USR1@115`, sent at
    Slurm's next time-limit check, 5 to about 35 s in): the ranks save after their
    iteration, the job requeues itself and its next start goes on from the checkpoint, with
    the losses of the uninterrupted job. However fast the machine, the job cannot finish
    first: its ranks wait at iteration WAIT_AT until the warning comes (the fault injection's
    `wait`), and the warning itself stops them, at WAIT_AT or before."""
    job, log, runs = _submit(slurm, tmp_path, "--time=2", "--signal=B:USR1@115",
                             MEGATRON_MESH_FAULT=f"*:{WAIT_AT}:wait")
    deadline, held_since = time.monotonic() + JOB_TIMEOUT, None
    while (info := slurm.job_info(job))["JobState"] not in TERMINAL_STATES:
        assert time.monotonic() < deadline, f"job {job} still {info['JobState']}"
        if info["JobState"] == "PENDING" and info.get("Reason") == "BeginTime":
            # Slurm holds a requeued job for two minutes; the test cluster starts it after
            # 5 s (slurmd refuses a credential of the same second as the requeue), with time
            # enough to finish (else each start would be warned again).
            held_since = held_since or time.monotonic()
            if time.monotonic() - held_since > 5:
                slurm._run("scontrol", "update", f"JobId={job}", "StartTime=now",
                           "TimeLimit=10", check=False)
        time.sleep(1.0)
    text = log.read_text() if log.exists() else "(no job log)"
    assert info["JobState"] == "COMPLETED" and info.get("ExitCode") == "0:0", text[-4000:]
    assert int(info["Restarts"]) >= 1, text[-4000:]
    stops = [int(n) for n in re.findall(r"SIGUSR1 received: saving and exiting after "
                                        r"iteration (\d+)", text)]
    assert stops and 0 < stops[0] <= WAIT_AT, text[-4000:]
    assert text.count("requeued to go on from the checkpoint") == len(stops)
    assert f"loaded checkpoint {runs / f'mesh-cpu-{job}' / 'checkpoints' / f'iter_{stops[0]:07d}'}" \
        in text, text[-4000:]
    got, want = _losses(text), _losses(uninterrupted[1])
    assert sorted(got) == list(range(1, ITERS + 1)), text[-4000:]  # no iteration lost or repeated
    for it in got:  # to the logged digits (gloo's sums may differ in the last float bit)
        assert float(got[it]) == pytest.approx(float(want[it]), rel=1e-6), (it, got, want)


def _driver_args(tmp_path, **env) -> list[str]:
    """DRIVER_ARGS as common.sh assembles them from the environment (no Slurm involved)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    base.update(MESH_HOME=str(REPO), OUTPUT_DIR=str(tmp_path / "runs"), SLURM_JOB_ID="41",
                SLURM_JOB_NAME="t", PROCS_PER_NODE="8", CONFIG="configs/x.yaml")
    base.update(env)
    proc = subprocess.run(
        ["bash", "-c", 'source scripts/slurm/common.sh && printf "%s\\n" "${DRIVER_ARGS[@]}"'],
        cwd=REPO, env=base, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_script_settings_become_driver_flags(tmp_path):
    args = _driver_args(tmp_path, SLURM_JOB_NUM_NODES="2", TP_SIZE="2")
    assert args[args.index("--context-parallel-size") + 1] == "8"  # 2 nodes x 8 / TP 2
    assert "--mesh-shape" not in args and "--load" not in args and "--data-path" not in args
    assert args[args.index("--save") + 1] == str(tmp_path / "runs" / "t-41" / "checkpoints")

    ckpt = tmp_path / "shared-ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("5")
    args = _driver_args(tmp_path, CHECKPOINT_DIR=str(ckpt), MESH_SHAPE="2x4",
                        DATA_PATH="/data/web_text_document",
                        TOKENIZER_ARGS="--tokenizer-type GPT2BPETokenizer")
    assert args[args.index("--load") + 1] == str(ckpt)
    assert args[args.index("--mesh-shape") + 1] == "2x4"
    assert args[args.index("--data-path") + 1] == "/data/web_text_document"
    assert args[-2:] == ["--tokenizer-type", "GPT2BPETokenizer"]
