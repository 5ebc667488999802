"""Fault injection for failure tests: make a rank die, or wait for a signal, at a chosen
iteration.

Set only by tests: ``MEGATRON_MESH_FAULT=RANK:ITERATION[:MODE]``, RANK a rank or ``*`` (every
rank), with MODE one of ``kill`` (SIGKILL itself, the default), ``exit`` (exit code 13),
``raise`` (an exception), ``hang`` (stop answering collectives) or ``wait`` (sleep until a
signal this process handles arrives, e.g. the time-limit warning of ``--exit-signal``, then
run the iteration: a job that cannot finish before the signal, whatever the machine's
speed). Read once per process; unset, it does nothing.
"""
from __future__ import annotations

import functools
import os
import signal
import time

ENV = "MEGATRON_MESH_FAULT"
MODES = ("kill", "exit", "raise", "hang", "wait")
EVERY_RANK = "*"
_HANDLED = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT")


class InjectedFault(RuntimeError):
    """Raised by the ``raise`` mode."""


def parse(spec: str | None) -> tuple[int | None, int, str] | None:
    """(rank or None for every rank, iteration, mode), or None when `spec` is empty."""
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in MODES):
        raise ValueError(f"{ENV}={spec!r}: expected RANK:ITERATION[:{'|'.join(MODES)}]")
    rank = None if parts[0] == EVERY_RANK else int(parts[0])
    return rank, int(parts[1]), parts[2] if len(parts) == 3 else "kill"


@functools.cache
def configured() -> tuple[int | None, int, str] | None:
    """The fault the environment asks for, read and parsed once per process."""
    return parse(os.environ.get(ENV))


def wait_for_handled_signal() -> str:
    """Sleep until a signal with a Python handler arrives (its handler runs as usual);
    returns its name."""
    seen: list[str] = []
    previous = {}
    for name in _HANDLED:
        signum = getattr(signal, name)
        handler = signal.getsignal(signum)
        if callable(handler):
            def wrapped(s, frame, name=name, handler=handler):
                seen.append(name)
                handler(s, frame)
            previous[signum] = signal.signal(signum, wrapped)
    if not previous:
        raise RuntimeError(f"{ENV} wait: no signal has a handler to wait for")
    try:
        while not seen:
            signal.pause()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return seen[0]


def maybe_fail(rank: int, iteration: int) -> None:
    """Called at the start of each iteration; fails here if the environment asks for it."""
    fault = configured()
    if fault is None or fault[1] != iteration or fault[0] not in (None, rank):
        return
    mode = fault[2]
    what = "waits for a signal" if mode == "wait" else f"fails ({mode})"
    print(f" [fault injection] rank {rank} {what} at iteration {iteration}", flush=True)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "exit":
        os._exit(13)
    elif mode == "raise":
        raise InjectedFault(f"injected fault on rank {rank} at iteration {iteration}")
    elif mode == "wait":
        name = wait_for_handled_signal()
        print(f" [fault injection] rank {rank} got {name}: iteration {iteration} runs", flush=True)
    else:
        while True:
            time.sleep(60)
