"""A real single-node Slurm cluster for tests: munged, slurmctld and slurmd run as
child processes with a generated slurm.conf, all state under one temporary directory.

    with SlurmCluster(tmp_path / "slurm") as cluster:
        job = cluster.sbatch("scripts/slurm/pretrain_gpt_mesh_cpu.sbatch", output=log)
        state = cluster.wait(job, timeout=600)

Only the daemons started here are stopped on exit. Slurm comes from Debian's packages
(slurmctld, slurmd, slurm-client, munge); `ensure_slurm()` installs them with apt-get when
they are missing and says why when that is not possible.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DEBIAN_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel", "munged",
            "mungekey")
TERMINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "BOOT_FAIL", "DEADLINE",
}


def _find(name: str) -> str | None:
    # Daemons live in /usr/sbin, which is not on every PATH.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if _find(b) is None]


def ensure_slurm(timeout: float = 600) -> str | None:
    """Make the Slurm and munge binaries available. Returns None when they are, or the
    reason they cannot be installed."""
    missing = missing_binaries()
    if not missing:
        return None
    if shutil.which("apt-get") is None:
        return f"Slurm is not installed ({', '.join(missing)} missing) and apt-get is not available"
    prefix: list[str] = []
    if os.geteuid() != 0:
        if shutil.which("sudo") is None or subprocess.run(
            ["sudo", "-n", "true"], capture_output=True
        ).returncode != 0:
            return (f"Slurm is not installed ({', '.join(missing)} missing) and installing "
                    "it with apt-get needs root or password-less sudo")
        prefix = ["sudo", "-n"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = prefix + ["apt-get", "install", "-y", "-q", "--no-install-recommends",
                        *DEBIAN_PACKAGES]
    deadline = time.monotonic() + timeout
    out = ""
    for refresh in (False, True):
        if refresh:
            subprocess.run(prefix + ["apt-get", "update", "-q"], env=env, capture_output=True,
                           text=True, timeout=max(1.0, deadline - time.monotonic()))
        try:
            proc = subprocess.run(install, env=env, capture_output=True, text=True,
                                  timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return f"apt-get install {' '.join(DEBIAN_PACKAGES)} took longer than {timeout:.0f}s"
        out = proc.stdout + proc.stderr
        if proc.returncode == 0 and not missing_binaries():
            return None
    tail = "\n".join(out.strip().splitlines()[-5:])
    return f"Slurm cannot be installed with apt-get ({' '.join(DEBIAN_PACKAGES)}): {tail}"


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """One controller and one compute node on this host, partition `debug`."""

    def __init__(self, root: str | os.PathLike, cpus: int | None = None,
                 cluster_name: str = "meshtest"):
        self.root = Path(root).resolve()
        self.cpus = cpus or os.cpu_count() or 1
        self.cluster_name = cluster_name
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.logs = self.root / "log"
        self._procs: dict[str, subprocess.Popen] = {}

    # -- environment for client commands and jobs ---------------------------------
    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        path = env.get("PATH", "")
        if "/usr/sbin" not in path.split(":"):
            env["PATH"] = path + ":/usr/sbin"
        return env

    def _run(self, *cmd: str, check: bool = True, timeout: float = 30) -> str:
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} failed ({proc.returncode}): "
                             f"{proc.stdout}{proc.stderr}\n{self.daemon_logs()}")
        return proc.stdout

    # -- start / stop ---------------------------------------------------------------
    def _write_config(self) -> None:
        for d in ("etc", "munge", "state", "spool", "log", "run"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        # munged wants its key private and its socket directory reachable by everyone.
        os.chmod(self.root, 0o755)
        os.chmod(self.root / "munge", 0o755)
        ctld_port, d_port = free_ports(2)
        user = "root" if os.geteuid() == 0 else os.environ.get("USER") or str(os.geteuid())
        r = self.root
        lines = [
            f"ClusterName={self.cluster_name}",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={d_port}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "CredType=cred/munge",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd.log",
            # No cgroups: track job processes through /proc, no task binding.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "ReturnToService=2",
            # Trust the node line below rather than what slurmd detects.
            "SlurmdParameters=config_overrides",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "MinJobAge=600",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.logs / f"{name}.out", "ab")
        self._procs[name] = subprocess.Popen(cmd, env=self.env, stdout=log,
                                             stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def start(self, timeout: float = 60) -> "SlurmCluster":
        if missing_binaries():
            raise SlurmError(f"Slurm binaries missing: {missing_binaries()}")
        self._write_config()
        m = self.root / "munge"
        key = m / "munge.key"
        subprocess.run([_find("mungekey"), "--create", f"--keyfile={key}", "--force"],
                       check=True, capture_output=True)
        os.chmod(key, 0o600)
        self._spawn("munged", [_find("munged"), "--foreground", "--force",
                               f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed",
                               f"--log-file={self.logs}/munged.log"])
        self._wait_for(lambda: self.munge_socket.exists(), timeout, "munged socket")
        self._spawn("slurmctld", [_find("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [_find("slurmd"), "-D", "-N", self.node, "-f", str(self.conf)])
        self._wait_for(self._node_idle, timeout, f"node {self.node} idle in sinfo")
        return self

    def _node_idle(self) -> bool:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise SlurmError(f"{name} exited with {proc.returncode}\n{self.daemon_logs()}")
        try:
            out = self._run("sinfo", "-h", "-N", "-o", "%t", check=False, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return out.strip().startswith("idle")

    def _wait_for(self, pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.25)
        raise SlurmError(f"timed out after {timeout:.0f}s waiting for {what}\n"
                         f"{self.daemon_logs()}")

    def stop(self, timeout: float = 20) -> None:
        # Jobs still running would outlive slurmd (their slurmstepd stays): cancel them first.
        ctld = self._procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            try:
                self._run("scancel", "--partition=debug", check=False, timeout=10)
                deadline = time.monotonic() + timeout
                while (time.monotonic() < deadline
                       and self._run("squeue", "-h", check=False, timeout=10).strip()):
                    time.sleep(0.5)
            except subprocess.TimeoutExpired:
                pass
        # Compute node first, then controller, then munge; each one we started, by its pid.
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def daemon_logs(self, lines: int = 20) -> str:
        out = []
        for f in sorted(self.logs.glob("*")):
            text = f.read_text(errors="replace").strip().splitlines()[-lines:]
            if text:
                out.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(out)

    # -- jobs -------------------------------------------------------------------------
    def sbatch(self, script: str | os.PathLike, *args: str, sbatch_args: tuple = (),
               env: dict | None = None, cwd: str | os.PathLike | None = None) -> int:
        run_env = self.env
        run_env.update(env or {})
        proc = subprocess.run([_find("sbatch"), "--parsable", *sbatch_args, str(script), *args],
                              env=run_env, cwd=cwd, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise SlurmError(f"sbatch failed: {proc.stdout}{proc.stderr}")
        return int(proc.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        out = self._run("scontrol", "show", "job", "-o", str(job_id))
        info = {}
        for tok in out.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                info.setdefault(k, v)
        return info

    def wait(self, job_id: int, timeout: float) -> dict[str, str]:
        """Poll until the job reaches a terminal state; cancel it on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_info(job_id)
            if info.get("JobState") in TERMINAL_STATES:
                return info
            if time.monotonic() > deadline:
                self._run("scancel", str(job_id), check=False)
                raise SlurmError(f"job {job_id} still {info.get('JobState')} after "
                                 f"{timeout:.0f}s; cancelled")
            time.sleep(1.0)


if __name__ == "__main__":  # quick manual check: python tests/slurm_cluster.py
    import tempfile

    reason = ensure_slurm()
    if reason:
        raise SystemExit(reason)
    with tempfile.TemporaryDirectory() as d, SlurmCluster(Path(d) / "slurm") as c:
        print(c._run("sinfo"))
        script = Path(d) / "hello.sh"
        script.write_text("#!/bin/bash\nsrun hostname\n")
        job = c.sbatch(script, sbatch_args=(f"--output={d}/hello-%j.out",))
        print(c.wait(job, 60)["JobState"], (Path(d) / f"hello-{job}.out").read_text())
