"""Run a function on N gloo ranks in processes forked from a preloaded server (tests/preloaded.py)
and collect each rank's result (`megatron_mesh.runtime.spawn.run_gloo`, the one harness)."""
from __future__ import annotations

from typing import Any, Callable

from preloaded import context

from megatron_mesh.runtime.spawn import run_gloo


def run_distributed(fn: Callable, world: int, *args: Any, **options: Any) -> list[Any]:
    """fn(rank, world, *args) on `world` gloo ranks; returns the per-rank return values.
    `options`: `run_gloo`'s (timeout_s, job_timeout_s)."""
    context()  # the server's preload list, set before it starts
    return run_gloo(fn, world, *args, start_method="forkserver", **options)
