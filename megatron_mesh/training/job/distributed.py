"""Process groups: torch.distributed, megatron-core's parallel state, the mesh grids, seeds."""
from __future__ import annotations

import datetime
import os
import random
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_mesh.megatron.arguments import is_mesh
from megatron_mesh.runtime.grid import MeshGrid
from megatron_mesh.training.job.device import has_cuda
from megatron_mesh.training.job.staged_cp_ranks import local_device

if TYPE_CHECKING:
    from megatron_mesh.training.config.training_config import TrainingConfig


def init_distributed(args: TrainingConfig) -> None:
    """Start torch.distributed from torchrun's environment (a single process works too).

    The timeout bounds every collective: if a peer dies without torchrun noticing (say on
    another node), the survivors raise after ``--distributed-timeout-minutes`` and exit non-zero.
    With --mesh-host-staged-collectives the ranks share the GPUs there are (`host_staging`).
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = args.parallel.distributed_backend  # resolved by the flag check (nccl needs CUDA)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    elif args.parallel.mesh_host_staged_collectives and has_cuda():  # several ranks on one GPU
        torch.cuda.set_device(local_device(local_rank, torch.cuda.device_count()))
    dist.init_process_group(
        backend=backend, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(minutes=args.parallel.distributed_timeout_minutes),
    )


def init_model_parallel(args: TrainingConfig) -> MeshGrid | None:
    """megatron-core's TP / PP / CP / DP groups, then the mesh's groups built from the shape
    the flag check decided (args.mesh_shape); returns this rank's grid (None without one)."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.parallel.pipeline_model_parallel_size,
        context_parallel_size=args.parallel.context_parallel_size,
        expert_model_parallel_size=args.moe.expert_model_parallel_size,
        distributed_timeout_minutes=args.parallel.distributed_timeout_minutes,
    )
    if not is_mesh(args.mesh.context_parallel_algo):
        return None
    from megatron_mesh.megatron.groups import initialize_mesh_grids

    return initialize_mesh_grids(
        args.mesh.mesh_shape,
        num_attention_heads=args.model.num_attention_heads,
        num_query_groups=args.model.num_query_groups,
        seq_length=args.training.seq_length,
        head_dim=args.derived.k_channels,
        timeout=datetime.timedelta(minutes=args.parallel.distributed_timeout_minutes),
        schedule=args.mesh.mesh_schedule,
        grad_reduce_dtype=args.mesh.mesh_grad_reduce_dtype,
        chosen_by_planner=bool(args.derived.mesh_shape_chosen_by_planner),
    )


def set_seed(seed: int) -> None:
    """Same seed on every data- and context-parallel rank, as Megatron-LM does.

    On a GPU megatron-core's tracker keeps a separate CUDA RNG for tensor-parallel regions.
    On a CPU there is one generator: the tracker is switched to megatron-core's pass-through
    tracker, so regions that fork it (attention dropout) draw from the default generator.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if has_cuda():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def destroy() -> None:
    """Tear down in reverse order; safe to call after a partial setup."""
    try:
        from megatron_mesh.megatron.groups import destroy_mesh_grids

        destroy_mesh_grids()
    except ImportError:
        pass
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print_rank0(*msg: object) -> None:
    if is_rank0():
        print(*msg, flush=True)
