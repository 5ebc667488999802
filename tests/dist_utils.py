"""Run a function on N gloo ranks in processes forked from a preloaded server (tests/preloaded.py)
and collect each rank's result."""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from preloaded import context, free_port


def _entry(rank: int, world: int, port: int, outdir: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(outdir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world: int, *args: Any) -> list[Any]:
    """fn(rank, world, *args) on `world` gloo ranks; returns the per-rank return values."""
    with tempfile.TemporaryDirectory() as outdir:
        context()  # the server's preload list, set before it starts
        mp.start_processes(_entry, args=(world, free_port(), outdir, fn, args), nprocs=world,
                           join=True, start_method="forkserver")
        return [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False) for r in range(world)]
