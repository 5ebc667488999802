"""Run a function on N gloo ranks and collect each rank's result
(`megatron_mesh.runtime.spawn.run_gloo`, the one harness).

CPU ranks are forked from a preloaded server (tests/preloaded.py): megatron-core and torch
are imported once. Ranks that use CUDA (`cuda=True`) are spawned, each a fresh interpreter:
CUDA cannot be initialized in a process forked from one that has asked CUDA anything (torch
raises "Cannot re-initialize CUDA in forked subprocess"), and what the server imports may ask.
"""
from __future__ import annotations

from typing import Any, Callable

from preloaded import context

from megatron_mesh.runtime.spawn import run_gloo


def start_method(cuda: bool) -> str:
    """How ranks start: 'spawn' for ranks that use CUDA, else 'forkserver' (preloaded)."""
    return "spawn" if cuda else "forkserver"


def run_distributed(fn: Callable, world: int, *args: Any, cuda: bool = False,
                    **options: Any) -> list[Any]:
    """fn(rank, world, *args) on `world` gloo ranks; returns the per-rank return values.
    `cuda`: the ranks use CUDA (spawned, see the module doc); `options`: `run_gloo`'s
    (timeout_s, job_timeout_s)."""
    if not cuda:
        context()  # the server's preload list, set before it starts
    return run_gloo(fn, world, *args, start_method=start_method(cuda), **options)
