"""Choosing and checking the heads x rows x cols grid of a context-parallel group.

A shape is written 'RxC' (the 2D mesh, heads A = 1) or 'AxRxC' (an all-to-all over A
consecutive CP ranks, then the R x C mesh over the ranks sharing a head slice); it is
resolved once, to (A, R, C), by `resolve_mesh_shape`. Where the planner picks it, attention is
priced as `mesh_pricing` decides (--mesh-gpu-profile): by a GPU profile's kernel calls or at
the flat rate.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from megatron_mesh.layer_plan import (
    DEFAULT_BACKEND,
    DEFAULT_GRAD_DTYPE,
    DEFAULT_SCHEDULE,
    DTYPE_BYTES,
    AttentionShape,
    check_positive_int,
    heads_sizes,
    mesh_shapes,
    shape_text,
    shapes_text,
)
from megatron_mesh.masks.zigzag import check_zigzag_divisible
from megatron_mesh.planner import Cluster, Workload, search
from megatron_mesh.planner.gpu_profile import (
    GPU_PROFILES,
    GpuProfile,
    load_profile,
    profile_for_device,
)
from megatron_mesh.planner.hardware import DEFAULT_ATTENTION_TFLOPS
from megatron_mesh.planner.search import grid_key

_SHAPE_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?$")

GridTriple = tuple[int, int, int]
"""(heads, rows, cols): A x R x C = the CP size."""

AUTO, FLAT = "auto", "flat"
MESH_GPU_PROFILES = (AUTO, *GPU_PROFILES, FLAT)
"""--mesh-gpu-profile values: auto (the profile the CUDA device names, else flat), a
profile (`planner.gpu_profile.GPU_PROFILES`) or flat (the planner's flat TFLOP/s)."""


@dataclass(frozen=True)
class MeshPricing:
    """How the planner prices attention when it picks the grid: `gpu` (a GPU profile, or
    None for the flat rate) and why (`reason`, e.g. "--mesh-gpu-profile auto: CUDA device
    'NVIDIA H200'")."""

    gpu: GpuProfile | None
    reason: str

    def describe(self) -> str:
        """The log line's words, e.g. "MODEL: attention priced by GPU profile h200
        (measured cudnn kernel calls; --mesh-gpu-profile auto: CUDA device 'NVIDIA H200')"."""
        if self.gpu is None:
            how, notes = f"at the flat {DEFAULT_ATTENTION_TFLOPS:g} TFLOP/s", [self.reason]
        else:
            gpu = self.gpu
            kind = "measured" if gpu.measured else "SCALED, not measured"
            calls = (f"{kind} {gpu.backend} kernel calls" if gpu.calls_backend == gpu.backend
                     else f"{gpu.kernel} kernel calls at the {kind} {gpu.backend} time a call, "
                     f"no {gpu.kernel} fit")
            how, notes = f"by GPU profile {gpu.name}", [calls, self.reason]
        said = "; ".join(n for n in notes if n)
        return f"MODEL: attention priced {how}" + (f" ({said})" if said else "")


def mesh_pricing(choice: str = AUTO, device_name: str | None = None,
                 kernel: str = DEFAULT_BACKEND) -> MeshPricing:
    """The pricing --mesh-gpu-profile `choice` (one of `MESH_GPU_PROFILES`) means on a
    device called `device_name` (None: no CUDA device) for the tile kernel `kernel`
    (--mesh-kernel: `GpuProfile.for_kernel`): a profile by name, flat, or auto: the profile
    the device names (`gpu_profile.profile_for_device`), else flat. Pure; the driver passes
    `cuda_device_name()`. ValueError naming the valid choices otherwise."""
    if choice not in MESH_GPU_PROFILES:
        raise ValueError(f"--mesh-gpu-profile {choice!r} is not one of "
                         f"{', '.join(MESH_GPU_PROFILES)}")
    flag = f"--mesh-gpu-profile {choice}"
    if choice == FLAT:
        return MeshPricing(None, flag)
    if choice != AUTO:
        return MeshPricing(load_profile(choice).for_kernel(kernel), flag)
    name = profile_for_device(device_name)
    if name is not None:
        return MeshPricing(load_profile(name).for_kernel(kernel),
                           f"{flag}: CUDA device {device_name!r}")
    why = "no CUDA device" if not device_name else f"no profile for {device_name!r}"
    return MeshPricing(None, f"{flag}: {why}")


def cuda_device_name() -> str | None:
    """This process's CUDA device name (`torch.cuda.get_device_name()`), None without one."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def launch_pricing(choice: str = AUTO, kernel: str = DEFAULT_BACKEND) -> MeshPricing:
    """`mesh_pricing(choice, kernel=kernel)` on this process's CUDA device (read only for
    auto)."""
    return mesh_pricing(choice, cuda_device_name() if choice == AUTO else None, kernel)


def parse_mesh_shape(text: str) -> tuple[int, ...]:
    """'RxC' (e.g. '2x4') -> (R, C); 'AxRxC' (e.g. '2x2x1') -> (A, R, C); ValueError else."""
    match = _SHAPE_RE.match(text) if isinstance(text, str) else None
    if match is None or any(int(g) < 1 for g in match.groups() if g is not None):
        raise ValueError(
            f"mesh shape {text!r} must be written RxC or AxRxC (heads x rows x cols) with "
            "positive integers, e.g. '2x4' or '2x2x2'"
        )
    return tuple(int(g) for g in match.groups() if g is not None)


def as_mesh_shape(value: object) -> tuple[int, ...] | None:
    """A mesh shape given as None, 'RxC', 'AxRxC' or a pair / triple of ints -> the ints
    as written ((R, C) or (A, R, C)), or None."""
    if value is None:
        return None
    if isinstance(value, str):
        return parse_mesh_shape(value)
    if (
        isinstance(value, (tuple, list))
        and len(value) in (2, 3)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
    ):
        return tuple(int(v) for v in value)
    raise ValueError(
        f"mesh shape {value!r} must be 'RxC', 'AxRxC' or a pair / triple of positive integers"
    )


def valid_shapes_text(cp_size: int, heads: int | None = None) -> str:
    """'4x1, 2x2, 1x4' for cp_size 4; with heads A, the 'AxRxC' of that A; with
    heads=0, every 'AxRxC'."""
    if heads is None or heads == 1:
        return shapes_text(cp_size)
    if heads == 0:
        return shapes_text(cp_size, heads=True)
    return ", ".join(f"{heads}x{r}x{c}" for r, c in mesh_shapes(cp_size // heads))


def check_mesh_shape(shape: GridTriple, cp_size: int) -> GridTriple:
    """Raise ValueError unless A * R * C == cp_size; returns the shape. The error lists the
    shapes of the same A (A > 1), or every RxC and AxRxC shape (A = 1)."""
    heads, rows, cols = shape
    if heads * rows * cols != cp_size:
        raise ValueError(
            f"mesh shape {shape_text(heads, rows, cols)} has {heads * rows * cols} ranks but "
            f"the context-parallel size is {cp_size}; valid shapes: "
            f"{valid_shapes_text(cp_size, heads if heads > 1 and cp_size % heads == 0 else 0)}"
        )
    return shape


def local_head_counts(num_attention_heads: int | None, num_query_groups: int | None,
                      tensor_parallel_size: int = 1) -> tuple[int | None, int | None]:
    """(query heads, K/V heads) of one TP rank, the heads its attention sees; (None, None)
    when the model's head count is not known. ValueError unless TP divides both."""
    if num_attention_heads is None:
        return None, None
    groups = num_query_groups or num_attention_heads
    if num_attention_heads % tensor_parallel_size or groups % tensor_parallel_size:
        raise ValueError(
            f"tensor-parallel size {tensor_parallel_size} must divide the attention heads "
            f"({num_attention_heads}) and query groups ({groups})"
        )
    return num_attention_heads // tensor_parallel_size, groups // tensor_parallel_size


def check_mesh_heads(heads: int, cp_size: int, q_heads: int | None, kv_heads: int | None,
                     tensor_parallel_size: int = 1) -> None:
    """ValueError unless the all-to-all size A divides the CP size and this TP rank's query
    heads (its K/V heads are then repeated to lcm(A, hkv) where A exceeds them)."""
    fits = heads_sizes(cp_size, q_heads)
    if heads in fits:
        return
    after_tp = f" after tensor parallelism {tensor_parallel_size}" if tensor_parallel_size > 1 else ""
    model = ("" if q_heads is None else
             f" and the {q_heads} query heads ({kv_heads} K/V heads) per rank{after_tp}")
    raise ValueError(
        f"--mesh-heads {heads} (the heads all-to-all size) must divide the context-parallel "
        f"size {cp_size}{model}; valid: {', '.join(map(str, fits))}"
    )


def combine_shape(mesh_shape: object, mesh_heads: int | None) -> tuple[GridTriple | None, int | None]:
    """--mesh-shape and --mesh-heads as one request: (the full (A, R, C) or None, the heads A
    asked for or None). ValueError when an 'AxRxC' shape disagrees with --mesh-heads."""
    if mesh_heads is not None:
        check_positive_int("--mesh-heads", mesh_heads)
    shape = as_mesh_shape(mesh_shape)
    if shape is None:
        return None, mesh_heads
    if len(shape) == 2:
        return ((mesh_heads or 1), *shape), mesh_heads
    if mesh_heads is not None and mesh_heads != shape[0]:
        raise ValueError(
            f"--mesh-heads {mesh_heads} disagrees with --mesh-shape {shape_text(*shape)} (heads "
            f"{shape[0]}); give --mesh-shape {shape_text(mesh_heads, *shape[1:])} or "
            f"--mesh-heads {shape[0]}, or one of the two flags"
        )
    return shape, shape[0]


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
    batch: int = 1,
    dtype: str = "bf16",
) -> Workload:
    """The layer the planner sizes when choosing a mesh shape for Megatron's flags: the
    heads one TP rank's attention sees (`local_head_counts`), `batch` sequences (the
    micro-batch) in `dtype` ('bf16', 'fp16', 'fp32': the bytes, and a GPU profile's rate).

    Missing head counts mean multi-head attention, a missing head_dim means 128, a missing
    seq_length 4096 tokens per rank. schedule and grad_reduce_dtype are the mesh's (they
    decide which traffic overlaps and how many gradient bytes travel).
    """
    heads = num_attention_heads or 1
    shape = AttentionShape(seq_length or 4096 * cp_size, batch, heads, num_query_groups or heads,
                           head_dim or 128, DTYPE_BYTES.get(dtype, 0))
    return Workload.from_shape(shape, dtype=dtype, mesh_schedule=schedule,
                               mesh_grad_reduce_dtype=grad_reduce_dtype)


def auto_mesh_shape(
    cp_size: int,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    head_dim: int | None = None,
    seq_length: int | None = None,
    cp_ranks_per_node: int | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE,
    *,
    mesh_heads: int | None = None,
    tensor_parallel_size: int = 1,
    gpu: GpuProfile | None = None,
    batch: int = 1,
    dtype: str = "bf16",
) -> GridTriple:
    """The (A, R, C) grid the planner predicts fastest for cp_size ranks (`planner.search`
    of `mesh_workload` on the default cluster: the best of every 2D mesh and every heads x
    rows x cols grid whose A divides a TP rank's query heads); with mesh_heads, the best
    R x C for that A. Attention is priced by `gpu`'s kernel calls, or at the flat rate
    (None).

    cp_ranks_per_node defaults to the planner's GPUs per node (with TP inside a node, pass
    GPUs per node // TP; `cp_ranks_per_node()` reads it from the launcher).
    """
    if cp_size == 1:
        return 1, 1, 1
    q_heads, kv_heads = local_head_counts(num_attention_heads, num_query_groups,
                                          tensor_parallel_size)
    workload = mesh_workload(cp_size, q_heads or mesh_heads, kv_heads or mesh_heads, head_dim,
                             seq_length, schedule, grad_reduce_dtype, batch, dtype)
    node = {"gpus_per_node": cp_ranks_per_node} if cp_ranks_per_node else {}
    plan = search(workload, Cluster(gpus=cp_size, gpu=gpu, **node))
    if mesh_heads is None:
        chosen = plan.best_grid
    else:
        chosen = min((e for e in plan.meshes + plan.grids if e.heads == mesh_heads),
                     key=grid_key)
    assert chosen is not None and chosen.grid_shape is not None
    return chosen.grid_shape


def resolve_mesh_shape(
    cp_size: int,
    mesh_shape: object = None,
    *,
    mesh_heads: int | None = None,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    head_dim: int | None = None,
    seq_length: int | None = None,
    tensor_parallel_size: int = 1,
    cp_ranks_per_node: int | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE,
    gpu: GpuProfile | None = None,
    batch: int = 1,
    dtype: str = "bf16",
) -> tuple[GridTriple, bool]:
    """((A, R, C), chosen_automatically) for a CP group of cp_size; ValueError when invalid.

    mesh_shape: None, 'RxC' / (R, C) (heads from mesh_heads, else 1) or 'AxRxC' /
    (A, R, C); mesh_heads: the all-to-all size A, or None. What is not given, the planner
    chooses (`auto_mesh_shape` for `batch` sequences in `dtype`, attention priced by `gpu`,
    flat where None). A must divide
    the query heads of one TP rank (num heads / tensor_parallel_size). A pure function of
    its arguments: the flag check and the group builder call it with the same values
    (through `launched_mesh_shape`, with `cp_ranks_per_node()` for the node size), so they
    cannot disagree.
    """
    check_positive_int("context-parallel size", cp_size)
    if seq_length is not None:
        check_zigzag_divisible(seq_length, cp_size)
    if num_attention_heads is not None and num_query_groups is not None:
        if num_query_groups < 1 or num_attention_heads % num_query_groups != 0:
            raise ValueError(
                f"num_query_groups={num_query_groups} must divide "
                f"num_attention_heads={num_attention_heads}"
            )
    q_heads, kv_heads = local_head_counts(num_attention_heads, num_query_groups,
                                          tensor_parallel_size)
    shape, heads = combine_shape(mesh_shape, mesh_heads)
    if shape is not None:
        check_mesh_shape(shape, cp_size)
    if heads is not None:
        check_mesh_heads(heads, cp_size, q_heads, kv_heads, tensor_parallel_size)
    if shape is not None:
        return shape, False
    auto = auto_mesh_shape(cp_size, num_attention_heads, num_query_groups, head_dim, seq_length,
                           cp_ranks_per_node, schedule, grad_reduce_dtype, mesh_heads=heads,
                           tensor_parallel_size=tensor_parallel_size, gpu=gpu, batch=batch,
                           dtype=dtype)
    return auto, True


def launched_mesh_shape(cp_size: int, mesh_shape: object, tensor_parallel_size: int,
                        **layer: Any) -> tuple[GridTriple, bool, int | None]:
    """((A, R, C), chosen automatically, CP ranks per node): `resolve_mesh_shape` of the
    `layer` (mesh_heads, head counts, head_dim, seq_length, schedule, grad_reduce_dtype,
    gpu, batch, dtype) with the launcher's CP ranks per node for this TP size (`cp_ranks_per_node`): the one
    call of the flag check and of the group builder, so they resolve alike."""
    per_node = cp_ranks_per_node(tensor_parallel_size)
    shape, automatic = resolve_mesh_shape(cp_size, mesh_shape,
                                          tensor_parallel_size=tensor_parallel_size,
                                          cp_ranks_per_node=per_node, **layer)
    return shape, automatic, per_node


def describe_mesh_shape(shape: GridTriple, cp_size: int, automatic: bool,
                        ranks_per_node: int | None = None,
                        pricing: MeshPricing | None = None) -> str:
    """The log line naming the shape a job builds, e.g. 'mesh context parallelism: 2x2x4
    grid (heads x rows x cols) of 16 CP ranks (chosen by the planner for 4 CP ranks per
    node)'; a 2D mesh reads '4x4 grid of 16 CP ranks'. With `pricing`, a grid the planner
    chose also says how it priced attention ('...; MODEL: attention priced at the flat
    400 TFLOP/s (--mesh-gpu-profile auto: no CUDA device)')."""
    if automatic:
        node = f"{ranks_per_node} CP ranks per node" if ranks_per_node else "the default node"
        how = f"chosen by the planner for {node}"
    else:
        how = "as given"
    dims = " (heads x rows x cols)" if shape[0] > 1 else ""
    priced = f"; {pricing.describe()}" if automatic and pricing is not None else ""
    return (f"mesh context parallelism: {shape_text(*shape)} grid{dims} of {cp_size} CP ranks "
            f"({how}){priced}")
