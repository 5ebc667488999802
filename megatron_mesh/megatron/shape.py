"""Choosing and checking the R x C mesh shape of a context-parallel group."""
from __future__ import annotations

import os
import re
from typing import Mapping

from megatron_mesh.checks import check_zigzag_divisible
from megatron_mesh.plan import DEFAULT_GRAD_DTYPE, DEFAULT_SCHEDULE
from megatron_mesh.planner import Cluster, Workload, search
from megatron_mesh.traffic import shapes_text

_SHAPE_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_mesh_shape(text: str) -> tuple[int, int]:
    """'RxC' (e.g. '2x4') -> (R, C); ValueError for anything else."""
    match = _SHAPE_RE.match(text) if isinstance(text, str) else None
    if match is None or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise ValueError(
            f"mesh shape {text!r} must be written RxC with positive integers, e.g. '2x4'"
        )
    return int(match.group(1)), int(match.group(2))


def as_mesh_shape(value: object) -> tuple[int, int] | None:
    """A mesh shape given as None, 'RxC' or a pair of ints -> (R, C) or None."""
    if value is None:
        return None
    if isinstance(value, str):
        return parse_mesh_shape(value)
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
    ):
        return int(value[0]), int(value[1])
    raise ValueError(f"mesh shape {value!r} must be 'RxC' or a pair of positive integers")


def valid_shapes_text(cp_size: int) -> str:
    """'4x1, 2x2, 1x4' for cp_size 4."""
    return shapes_text(cp_size)


def check_mesh_shape(shape: tuple[int, int], cp_size: int) -> tuple[int, int]:
    """Raise ValueError unless R * C == cp_size; returns the shape."""
    rows, cols = shape
    if rows * cols != cp_size:
        raise ValueError(
            f"mesh shape {rows}x{cols} has {rows * cols} ranks but the context-parallel size "
            f"is {cp_size}; valid shapes: {valid_shapes_text(cp_size)}"
        )
    return shape


def cp_ranks_per_node(tensor_parallel_size: int = 1,
                      environ: Mapping[str, str] | None = None) -> int | None:
    """CP ranks sharing a node: the launcher's processes per node (torchrun's
    LOCAL_WORLD_SIZE, else Slurm's SLURM_NTASKS_PER_NODE) over the TP size, since TP ranks
    are consecutive and CP ranks strided by TP; None when the launcher does not say."""
    env = os.environ if environ is None else environ
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        local = env.get(name, "")
        if local.isdigit() and int(local) > 0:
            return max(1, int(local) // max(1, tensor_parallel_size))
    return None


def mesh_workload(
    cp_size: int,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    head_dim: int | None = None,
    seq_length: int | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE,
) -> Workload:
    """The layer the planner sizes when choosing a mesh shape for Megatron's flags.

    Missing head counts mean multi-head attention, a missing head_dim means 128, a missing
    seq_length 4096 tokens per rank. schedule and grad_reduce_dtype are the mesh's (they
    decide which traffic overlaps and how many gradient bytes travel).
    """
    heads = num_attention_heads or 1
    return Workload(seq_length=seq_length or 4096 * cp_size, num_heads=heads,
                    num_kv_heads=num_query_groups or heads, head_dim=head_dim or 128,
                    mesh_schedule=schedule, mesh_grad_reduce_dtype=grad_reduce_dtype)


def auto_mesh_shape(
    cp_size: int,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    head_dim: int | None = None,
    seq_length: int | None = None,
    cp_ranks_per_node: int | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE,
) -> tuple[int, int]:
    """The grid the planner predicts fastest for cp_size ranks (`planner.search` of
    `mesh_workload` on the default cluster, rows of consecutive CP ranks).

    cp_ranks_per_node defaults to the planner's GPUs per node (with TP inside a node, pass
    GPUs per node // TP; `cp_ranks_per_node()` reads it from the launcher).
    """
    if cp_size == 1:
        return 1, 1
    workload = mesh_workload(cp_size, num_attention_heads, num_query_groups, head_dim,
                             seq_length, schedule, grad_reduce_dtype)
    node = {"gpus_per_node": cp_ranks_per_node} if cp_ranks_per_node else {}
    return search(workload, Cluster(gpus=cp_size, **node)).mesh_plan.shape


def resolve_mesh_shape(
    cp_size: int,
    mesh_shape: object = None,
    *,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    head_dim: int | None = None,
    seq_length: int | None = None,
    cp_ranks_per_node: int | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE,
) -> tuple[tuple[int, int], bool]:
    """(shape, chosen_automatically) for a CP group of cp_size; ValueError when invalid.

    A pure function of its arguments: the flag check and the group builder call it with
    the same values (`cp_ranks_per_node()` for the node size), so they cannot disagree.
    """
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"context-parallel size {cp_size!r} must be a positive integer")
    if seq_length is not None:
        check_zigzag_divisible(seq_length, cp_size)
    if num_attention_heads is not None and num_query_groups is not None:
        if num_query_groups < 1 or num_attention_heads % num_query_groups != 0:
            raise ValueError(
                f"num_query_groups={num_query_groups} must divide "
                f"num_attention_heads={num_attention_heads}"
            )
    shape = as_mesh_shape(mesh_shape)
    if shape is not None:
        return check_mesh_shape(shape, cp_size), False
    auto = auto_mesh_shape(cp_size, num_attention_heads, num_query_groups, head_dim, seq_length,
                           cp_ranks_per_node, schedule, grad_reduce_dtype)
    return auto, True


def describe_mesh_shape(shape: tuple[int, int], cp_size: int, automatic: bool,
                        ranks_per_node: int | None = None) -> str:
    """The log line naming the shape a job builds, e.g. 'mesh context parallelism: 2x8 grid
    of 16 CP ranks (chosen by the planner for 4 CP ranks per node)'."""
    if automatic:
        node = f"{ranks_per_node} CP ranks per node" if ranks_per_node else "the default node"
        how = f"chosen by the planner for {node}"
    else:
        how = "as given"
    return f"mesh context parallelism: {shape[0]}x{shape[1]} grid of {cp_size} CP ranks ({how})"
