"""The mesh grids of every context-parallel group of a Megatron-Core job.

Call `initialize_mesh_grids` after `parallel_state.initialize_model_parallel`, on every
rank. Each CP group (in CP-rank order, as parallel_state made it) becomes an A x R x C grid:
an all-to-all over A consecutive CP ranks (A = 1 for the 2D mesh), then an R x C mesh whose
rows hold C consecutive mesh ranks, so that with TP inside a node the all-to-all and the
row traffic stay as local as they can.
"""
from __future__ import annotations

import datetime
import logging

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_mesh.layer_plan import DEFAULT_GRAD_DTYPE, DEFAULT_SCHEDULE, shape_text
from megatron_mesh.megatron.shape import (
    GridTriple,
    describe_mesh_shape,
    launched_mesh_shape,
)
from megatron_mesh.planner.gpu_profile import GpuProfile
from megatron_mesh.runtime.grid import MeshGrid

logger = logging.getLogger(__name__)

# the grids built on this rank, by their CP group's ranks (sorted). A layer takes its grid
# passed in (the spec's params, `get_gpt_layer_spec(..., grid=...)`), as it takes
# `pg_collection`; one given none finds it here from the CP group megatron-core hands it
# (`pg_collection.cp`), as megatron-core's `use_mpu_process_groups` stands in for a
# collection not passed (a model builder that cannot pass it: Megatron-LM's)
_GRIDS: dict[tuple[int, ...], MeshGrid] = {}

__all__ = [
    "initialize_mesh_grids", "get_mesh_grid", "destroy_mesh_grids", "mesh_grid_is_initialized",
]


def _all_cp_groups(shape: GridTriple) -> list[list[int]]:
    """Every CP group of the job (global ranks, CP order), gathered from all ranks.

    Each rank also sends its mesh shape; ranks that disagree fail together, never hang.
    """
    mine = (tuple(parallel_state.get_context_parallel_global_ranks()), shape)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    shapes = {s for _, s in gathered}
    if len(shapes) != 1:
        per_rank = ", ".join(f"rank {r}: {shape_text(*s)}" for r, (_, s) in enumerate(gathered))
        raise ValueError(f"ranks disagree on the mesh shape ({per_rank}); pass the same to all")
    groups = sorted({ranks for ranks, _ in gathered})
    return [list(ranks) for ranks in groups]


def initialize_mesh_grids(
    mesh_shape: tuple[int, ...] | str | None = None,
    *,
    mesh_heads: int | None = None,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    seq_length: int | None = None,
    head_dim: int | None = None,
    timeout: datetime.timedelta | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE,
    chosen_by_planner: bool | None = None,
    gpu: GpuProfile | None = None,
    batch: int = 1,
    dtype: str = "bf16",
) -> MeshGrid | None:
    """Collective over all ranks: build the grid of every CP group; returns this rank's.

    mesh_shape: (A, R, C) / 'AxRxC', or (R, C) / 'RxC' with A = mesh_heads (default 1);
    A * R * C must equal the CP size and A divide this TP rank's query heads. What is not
    given, the planner chooses (`shape.resolve_mesh_shape`, which `validate_mesh_args` calls
    with the same values) for the heads after TP, the schedule, gradient dtype and the
    launcher's ranks per node, `batch` sequences in `dtype`, attention priced by `gpu`'s
    kernel calls (None: the flat rate); pass the shape `validate_mesh_args` returned to build
    exactly what it logged. `chosen_by_planner`: for the log line (default: whether this call
    chose). The shape is checked before any collective; with CP == 1 the grid is 1x1 (plain
    attention) and nothing is created. `timeout` bounds the row and column groups'
    collectives (pass the job's distributed timeout, as Megatron does for its own groups).
    """
    if _GRIDS:
        raise RuntimeError("mesh grids are already initialized; call destroy_mesh_grids() first")
    if not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "initialize_mesh_grids() needs torch.distributed and "
            "parallel_state.initialize_model_parallel() to be initialized first"
        )
    cp_size = parallel_state.get_context_parallel_world_size()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    shape, automatic, per_node = launched_mesh_shape(
        cp_size, mesh_shape, tp_size, mesh_heads=mesh_heads,
        num_attention_heads=num_attention_heads, num_query_groups=num_query_groups,
        head_dim=head_dim, seq_length=seq_length, schedule=schedule,
        grad_reduce_dtype=grad_reduce_dtype, gpu=gpu, batch=batch, dtype=dtype)
    if cp_size == 1:
        grid = single_rank_grid(parallel_state.get_context_parallel_group())
    else:
        grid = MeshGrid.build_many(
            _all_cp_groups(shape), heads=shape[0], rows=shape[1], cols=shape[2],
            cp_group=parallel_state.get_context_parallel_group(),
            timeout=timeout,
        )
        if grid is None or grid.cp_rank != parallel_state.get_context_parallel_rank():
            raise RuntimeError("mesh grid does not match parallel_state's context-parallel rank")
    _GRIDS[tuple(sorted(grid.cp_ranks))] = grid
    if dist.get_rank() == 0:  # names the grid built, not the request
        planner = automatic if chosen_by_planner is None else chosen_by_planner
        built = describe_mesh_shape((grid.heads, grid.rows, grid.cols), cp_size, planner,
                                    per_node)
        logger.info("%s, built for %d CP groups", built, dist.get_world_size() // cp_size)
    return grid


def single_rank_grid(cp_group: dist.ProcessGroup) -> MeshGrid:
    """The 1x1 grid of a CP group of one rank (plain attention); creates no group."""
    return MeshGrid(rows=1, cols=1, cp_rank=0, cp_ranks=(dist.get_rank(),), row_group=cp_group,
                    col_group=cp_group, heads=1, heads_group=cp_group)


def mesh_grid_is_initialized() -> bool:
    """Whether `initialize_mesh_grids` has run (and not been destroyed)."""
    return bool(_GRIDS)


def get_mesh_grid(cp_group: dist.ProcessGroup | None = None) -> MeshGrid:
    """The mesh grid of `cp_group` (the CP group a layer is handed, `pg_collection.cp`), or
    with None this rank's only one; RuntimeError when `initialize_mesh_grids` has not run,
    ValueError when it built none for `cp_group`."""
    if not _GRIDS:
        raise RuntimeError(
            "mesh grids are not initialized: call "
            "megatron_mesh.megatron.initialize_mesh_grids() after "
            "parallel_state.initialize_model_parallel()"
        )
    if cp_group is None:
        if len(_GRIDS) > 1:
            raise RuntimeError(f"{len(_GRIDS)} mesh grids are built on this rank (CP groups "
                               f"{sorted(_GRIDS)}); name the CP group")
        return next(iter(_GRIDS.values()))
    ranks = tuple(sorted(dist.get_process_group_ranks(cp_group)))
    if ranks not in _GRIDS:
        built = ", ".join(str(list(r)) for r in sorted(_GRIDS))
        raise ValueError(f"no mesh grid covers this layer's CP group of ranks {list(ranks)} "
                         f"(grids built for CP ranks {built}); call initialize_mesh_grids() "
                         "after initialize_model_parallel() with the same context-parallel "
                         "size")
    return _GRIDS[ranks]


def destroy_mesh_grids() -> None:
    """Forget this rank's grid (call with parallel_state.destroy_model_parallel)."""
    _GRIDS.clear()
