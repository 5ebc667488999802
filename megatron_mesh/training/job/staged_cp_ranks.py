"""--mesh-host-staged-collectives: several context-parallel ranks of the driver on one GPU.

For checking, not for speed: a single GPU trains the mesh at CP > 1 (every rank of the job
on it, or on `LOCAL_RANK % device count` with several), over gloo, which takes several ranks
per GPU where NCCL takes one. The mesh's collectives run on host copies
(`megatron_mesh.runtime.host_staging`: gloo cannot send CUDA tensors point to point);
megatron-core's own (the gradient and loss all-reduces) are gloo's, which reduce CUDA
tensors through host memory themselves. So no tensor, tensor-, pipeline- or expert-parallel
communication beyond those: TP = PP = EP = 1, and at CP > 1 the mesh. On a CPU the flag
stages the same collectives (fresh host copies), so its path is checked without a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
from typing import TYPE_CHECKING, Iterator

from megatron_mesh.runtime import comm
from megatron_mesh.runtime.host_staging import HostStaging

if TYPE_CHECKING:
    from megatron_mesh.training.config.training_config import TrainingConfig

FLAG = "--mesh-host-staged-collectives"


def add_host_staging_args(group: argparse._ActionsContainer) -> None:
    """The flag, in the parallelism group."""
    group.add_argument(FLAG, dest="mesh_host_staged_collectives", action="store_true",
                       default=False,
                       help="for checking, not speed: run several CP ranks on one GPU over "
                            "gloo, the mesh's collectives staged through host memory (needs "
                            "TP = PP = EP = 1 and --context-parallel-algo mesh at CP > 1)")


def default_backend(args: argparse.Namespace, cuda: bool) -> str:
    """The backend without --distributed-backend: nccl with CUDA, gloo without CUDA or with
    the flag."""
    return "nccl" if cuda and not args.mesh_host_staged_collectives else "gloo"


def check_host_staging(args: argparse.Namespace) -> None:
    """With the flag, ValueError naming what it cannot run with. Runs once the backend
    (`default_backend`) and the context-parallel algorithm are decided."""
    if not args.mesh_host_staged_collectives:
        return
    if args.distributed_backend != "gloo":
        raise ValueError(f"{FLAG} runs over gloo (NCCL takes one rank per GPU); drop "
                         f"--distributed-backend {args.distributed_backend}")
    sizes = {"--tensor-model-parallel-size": args.tensor_model_parallel_size,
             "--pipeline-model-parallel-size": args.pipeline_model_parallel_size,
             "--expert-model-parallel-size": args.expert_model_parallel_size}
    for name, size in sizes.items():
        if size != 1:
            raise ValueError(f"{FLAG} with {name} {size}: only the mesh's collectives are "
                             f"staged through host memory; use {name} 1")
    algo = args.context_parallel_algo
    if args.context_parallel_size > 1 and algo != "mesh":
        raise ValueError(f"{FLAG} with --context-parallel-algo {algo}: it stages the mesh's "
                         "collectives (Transformer Engine's run over NCCL); use "
                         "--context-parallel-algo mesh")


def local_device(local_rank: int, gpus: int) -> int:
    """The GPU of the rank with LOCAL_RANK `local_rank` under the flag, on a node of `gpus`
    GPUs: the ranks share them in turn (all on GPU 0 with one)."""
    return local_rank % gpus


@contextlib.contextmanager
def staged_collectives(args: TrainingConfig) -> Iterator[HostStaging | None]:
    """With the flag, the mesh's collectives run through the `HostStaging` yielded (its
    `calls` count them); without it nothing changes (None)."""
    if not args.parallel.mesh_host_staged_collectives:
        yield None
        return
    with comm.using(HostStaging()) as staging:
        yield staging


def staged_label(staging: HostStaging) -> str:
    """' mesh collectives staged through host memory (...): N calls (name n, ...)'."""
    calls = ", ".join(f"{name} {n}" for name, n in sorted(staging.calls.items()))
    return (f" mesh collectives staged through host memory ({FLAG}, for checking): "
            f"{sum(staging.calls.values())} calls ({calls or 'none'})")
