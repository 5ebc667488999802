"""Fault injection for failure tests: make one rank die at a chosen iteration.

Set only by tests: ``MEGATRON_MESH_FAULT=RANK:ITERATION[:MODE]`` with MODE one of
``kill`` (SIGKILL itself, the default), ``exit`` (exit code 13), ``raise`` (an exception)
or ``hang`` (stop answering collectives). Unset, it does nothing.
"""
from __future__ import annotations

import functools
import os
import signal
import time

ENV = "MEGATRON_MESH_FAULT"
MODES = ("kill", "exit", "raise", "hang")


class InjectedFault(RuntimeError):
    """Raised by the ``raise`` mode."""


def parse(spec: str | None) -> tuple[int, int, str] | None:
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in MODES):
        raise ValueError(f"{ENV}={spec!r}: expected RANK:ITERATION[:{'|'.join(MODES)}]")
    return int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else "kill"


@functools.cache
def configured() -> tuple[int, int, str] | None:
    """The fault the environment asks for, read and parsed once per process."""
    return parse(os.environ.get(ENV))


def maybe_fail(rank: int, iteration: int) -> None:
    """Called at the start of each iteration; fails here if the environment asks for it."""
    fault = configured()
    if fault is None or fault[:2] != (rank, iteration):
        return
    mode = fault[2]
    print(f" [fault injection] rank {rank} fails ({mode}) at iteration {iteration}", flush=True)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "exit":
        os._exit(13)
    elif mode == "raise":
        raise InjectedFault(f"injected fault on rank {rank} at iteration {iteration}")
    else:
        while True:
            time.sleep(60)
