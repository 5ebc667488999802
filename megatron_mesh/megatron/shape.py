"""Choosing and checking the R x C mesh shape of a context-parallel group."""
from __future__ import annotations

import re

from megatron_mesh.checks import DEFAULT_SCHEDULE
from megatron_mesh.planner import choose_mesh_shape
from megatron_mesh.traffic import mesh_shapes

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
    return ", ".join(f"{r}x{c}" for r, c in mesh_shapes(cp_size))


def check_mesh_shape(shape: tuple[int, int], cp_size: int) -> tuple[int, int]:
    """Raise ValueError unless R * C == cp_size; returns the shape."""
    rows, cols = shape
    if rows * cols != cp_size:
        raise ValueError(
            f"mesh shape {rows}x{cols} has {rows * cols} ranks but the context-parallel size "
            f"is {cp_size}; valid shapes: {valid_shapes_text(cp_size)}"
        )
    return shape


def auto_mesh_shape(
    cp_size: int,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    head_dim: int | None = None,
    seq_length: int | None = None,
    cp_ranks_per_node: int | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    grad_reduce_dtype: str = "fp32",
) -> tuple[int, int]:
    """The grid the planner predicts fastest for cp_size ranks (`planner.choose_mesh_shape`,
    its default bandwidths and attention TFLOP/s; rows of consecutive CP ranks).

    Missing head counts mean multi-head attention, a missing head_dim means 128, a missing
    seq_length 4096 tokens per rank; cp_ranks_per_node defaults to the planner's GPUs per
    node (with TP inside a node, pass GPUs per node // TP). schedule and grad_reduce_dtype
    are the mesh's (they decide which traffic overlaps and how many gradient bytes travel).
    """
    if cp_size == 1:
        return 1, 1
    heads = num_attention_heads or 1
    node = {"gpus_per_node": cp_ranks_per_node} if cp_ranks_per_node else {}
    return choose_mesh_shape(
        cp_size,
        num_heads=heads,
        num_kv_heads=num_query_groups or heads,
        head_dim=head_dim or 128,
        seq_length=seq_length or 4096 * cp_size,
        mesh_schedule=schedule,
        mesh_grad_reduce_dtype=grad_reduce_dtype,
        **node,
    )


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
    grad_reduce_dtype: str = "fp32",
) -> tuple[tuple[int, int], bool]:
    """(shape, chosen_automatically) for a CP group of cp_size; ValueError when invalid."""
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"context-parallel size {cp_size!r} must be a positive integer")
    if seq_length is not None and cp_size > 1 and seq_length % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length {seq_length} must be divisible by 2 * context-parallel size = "
            f"{2 * cp_size} (Megatron's zigzag layout gives each CP rank 2 sub-chunks)"
        )
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
