"""The attention kernel calls one rank makes per pass, per method: what a GPU profile prices.

With s = S / P tokens per rank (P CP ranks) and Hq query heads:

    ring (p2p, TE's KV-P2P)   P calls a pass, one per ring step: s query rows, Hq heads
    all_gather (TE's)         2 calls a pass, one per zigzag half: s / 2 rows, Hq heads
    a2a (Ulysses)             1 call over the whole sequence: S rows, Hq / P heads
    a2a+p2p (A x P/A)         P / A ring steps: s A rows, Hq / A heads
    mesh A x R x C            `cost_models.tile_calls` (forward_calls / backward_calls of the
                              schedule the plan runs; 'flex': one call a group on hand): s A
                              query rows a call (C s A / calls when fewer calls than the
                              tile's C query chunks), Hq / A heads

A pass's FLOPs (the busiest rank's) are shared evenly by its calls (`GpuProfile.tile_seconds`).
Under a sliding window or placed documents a rank computes only the blocks that hold a pair
(`window_blocks`; `planner.placed` counts the placement's): the mesh's calls are the fewer of
those blocks (the most of any rank) and the dense tile's calls (a window's band tiles within
a tall block are not counted apart).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from megatron_mesh.cost_models.tile_calls import backward_calls, forward_calls
from megatron_mesh.dtypes import TORCH_DTYPES
from megatron_mesh.kernels import BACKEND_KERNELS, backend_folds_diagonal
from megatron_mesh.layer_plan import check_positive_int
from megatron_mesh.masks.window import Window
from megatron_mesh.planner.pricing.workload import Workload


@dataclass(frozen=True)
class TileCalls:
    """One rank's kernel calls in each pass, each over `rows` query rows of `heads` heads
    (`batch`, input `dtype`)."""

    forward: int
    backward: int
    rows: int
    heads: int
    batch: int = 1
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "rows", "heads", "batch"):
            check_positive_int(name, getattr(self, name))

    def count(self, phase: str) -> int:
        """Calls in `phase` ('forward' or 'backward')."""
        return self.forward if phase == "forward" else self.backward

    def one_call(self) -> TileCalls:
        """A single call of the same rows and heads (a rank's own block, a floor)."""
        return replace(self, forward=1, backward=1)


def _calls(workload: Workload, forward: int, backward: int, rows: int, heads: int) -> TileCalls:
    return TileCalls(forward, backward, max(1, rows), max(1, heads), workload.batch,
                     workload.dtype)


def ring_calls(workload: Workload, cp_size: int) -> TileCalls:
    return _calls(workload, cp_size, cp_size, workload.seq_length // cp_size, workload.num_heads)


def all_gather_calls(workload: Workload, cp_size: int) -> TileCalls:
    return _calls(workload, 2, 2, workload.seq_length // (2 * cp_size), workload.num_heads)


def a2a_calls(workload: Workload, cp_size: int) -> TileCalls:
    return _calls(workload, 1, 1, workload.seq_length, workload.num_heads // cp_size)


def a2a_p2p_calls(workload: Workload, cp_size: int, a2a_size: int) -> TileCalls:
    ring = cp_size // a2a_size
    return _calls(workload, ring, ring, workload.seq_length // ring, workload.num_heads // a2a_size)


@dataclass(frozen=True)
class KernelCalls:
    """How a backend's kernel takes a rank's blocks, for the call counts and the memory
    model (`memory.extra_memory`): `bottom_right`, the causal diagonal folded into a call of
    more keys than queries (`kernels.backend_folds_diagonal`); `whole_tile`, each group on
    hand as one call (`KernelCaps.whole_tile`: 'flex')."""

    bottom_right: bool
    whole_tile: bool

    @classmethod
    def of(cls, backend: str | None, dtype: str) -> KernelCalls:
        """The kernels of `backend` ('torch', 'cudnn', 'te', 'flex'; None: 'torch') in
        `dtype` on a GPU."""
        backend = backend or "torch"
        return cls(backend_folds_diagonal(backend, TORCH_DTYPES[dtype]),
                   BACKEND_KERNELS[backend].caps.whole_tile)


def mesh_calls(workload: Workload, cp_size: int, rows: int, cols: int, heads: int = 1,
               blocks: int | None = None, backend: str | None = None) -> TileCalls:
    """The calls of a heads x rows x cols grid's tile (module docstring); `blocks`: the
    most blocks holding a pair on any rank (placed documents; a window's are counted here);
    `backend`: the kernels' ('torch', 'cudnn', 'te', 'flex'; None: 'torch'): the causal
    diagonal is folded into a call of more keys than queries only where that kernel does so
    for the workload's dtype on a GPU (`kernels.backend_folds_diagonal`: torch's in fp16 /
    bf16); 'flex' takes each group of blocks on hand as one call (`KernelCaps.whole_tile`)."""
    schedule = workload.mesh_plan(rows, cols, heads).schedule
    kernel = KernelCalls.of(backend, workload.dtype)
    chunk = workload.seq_length * heads // cp_size
    fwd = forward_calls(rows, cols, workload.causal, schedule, bottom_right=kernel.bottom_right,
                        chunk_tokens=chunk, whole_tile=kernel.whole_tile)
    bwd = backward_calls(rows, cols, workload.causal, schedule,
                         bottom_right=kernel.bottom_right, chunk_tokens=chunk,
                         whole_tile=kernel.whole_tile)
    if blocks is None and workload.window is not None:
        blocks = window_blocks(workload.seq_length, rows, cols, workload.window, workload.causal)
    if blocks is not None:
        fwd, bwd = min(fwd, max(1, blocks)), min(bwd, max(1, blocks))
    per_call = chunk * max(1, cols // min(fwd, bwd))
    return _calls(workload, fwd, bwd, per_call, workload.num_heads // heads)


def window_blocks(seq_length: int, rows: int, cols: int, window: Window, causal: bool) -> int:
    """The most blocks (x, y) holding a pair the window keeps on any rank of a rows x cols
    mesh (zigzag over M = rows x cols ranks: rank x holds sub-chunks x and 2M - 1 - x of
    h = S / 2M positions; sub-chunk u sees v < u when L > (u - v - 1) h, v > u when
    R > (v - u - 1) h, `planner.windows`)."""
    m = rows * cols
    h = seq_length // (2 * m)
    left = math.inf if window.left < 0 else window.left
    right = 0 if causal else (math.inf if window.right < 0 else window.right)
    sub = np.arange(2 * m)
    gap = sub[:, None] - sub[None, :]  # u - v
    sees = (gap == 0) | ((gap > 0) & (left > (gap - 1) * h)) | ((gap < 0) & (right > (-gap - 1) * h))
    owner = np.minimum(sub, 2 * m - 1 - sub)  # the rank holding each sub-chunk
    block = np.zeros((m, m), dtype=bool)
    np.logical_or.at(block, (owner[:, None], owner[None, :]), sees)
    # x = i * cols + c (rank x's row i), y = r * cols + j (its column j)
    per_rank = block.reshape(rows, cols, rows, cols).sum(axis=(1, 2))  # [i, j]
    return int(per_rank.max())
