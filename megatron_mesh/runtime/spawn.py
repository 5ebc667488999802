"""Run a function on N gloo ranks on this machine and collect what each rank returns.

The one harness of the tests and the scripts that spawn CPU ranks themselves:

    results = run_gloo(fn, world, *args)  # fn(rank, world, *args) on every rank

Each rank runs one thread (`threads`), joins a fresh gloo group whose rendezvous is a file
of the job's own folder (no TCP port to race other jobs for), and returns a picklable
value; `run_gloo` returns them by rank. A rank that raises fails the whole call
(torch.multiprocessing's ProcessRaisedException names it); a job past `job_timeout_s` is
killed and raises TimeoutError.
"""
from __future__ import annotations

import datetime
import os
import random
import socket
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_gloo"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, drawn below the kernel's ephemeral range where it
    has one: a port the kernel hands out itself (binding port 0) is freed on return, and any
    socket the kernel numbers meanwhile (gloo's connections, a client's) may take it before
    the job's store binds it; below that range only another job's draw can. Below
    `PORTS_TO` too: the Slurm scripts' rendezvous ports (20000 + job id) lie above it."""
    low = min(_ephemeral_low(), PORTS_TO)
    draw = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(64 if low > PORTS_FROM + 1024 else 0):
        port = draw.randrange(PORTS_FROM, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORTS_FROM = 10000  # the first port `free_port` draws
PORTS_TO = 20000  # the first it does not: scripts/slurm/common.sh derives ports from here


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux), or 0 where unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _entry(rank: int, world: int, port: int, outdir: str, threads: int,
           timeout_s: float | None, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # for code that reads them
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(outdir, 'rendezvous')}",
                            rank=rank, world_size=world,
                            **({} if timeout is None else {"timeout": timeout}))
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(outdir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_gloo(fn: Callable[..., Any], world: int, *args: Any, threads: int = 1,
             start_method: str = "spawn", timeout_s: float | None = None,
             job_timeout_s: float | None = None) -> list[Any]:
    """fn(rank, world, *args) on `world` gloo ranks; their return values, by rank.

    `threads`: torch threads per rank; `start_method`: how ranks start ('spawn', or
    'forkserver' with the caller's preload list set); `timeout_s`: the collectives'
    timeout (torch's default when None); `job_timeout_s`: the whole job's bound (None:
    unbounded).
    """
    with tempfile.TemporaryDirectory() as outdir:
        job = mp.start_processes(_entry, args=(world, free_port(), outdir, threads, timeout_s,
                                               fn, args),
                                 nprocs=world, join=False, start_method=start_method)
        deadline = None if job_timeout_s is None else time.monotonic() + job_timeout_s
        try:
            while not job.join(timeout=None if deadline is None
                               else max(1.0, deadline - time.monotonic())):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the {world}-rank job did not finish in {job_timeout_s} s")
        finally:
            for p in job.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False)
                for r in range(world)]
