"""Checkpoints with megatron-core's dist_checkpointing, written atomically.

    SAVE/iter_0000040/                     one complete checkpoint (dist_checkpointing format)
    SAVE/latest_checkpointed_iteration.txt the newest complete one

A checkpoint is written to ``iter_N.tmp`` and renamed when every rank has finished; only
then does the marker move (written to a temp file and renamed). A job that dies while
saving leaves the previous checkpoint and marker untouched; the next save removes the
unfinished ``iter_N.tmp`` it left. Every checkpoint carries a manifest of its files' checksums
(checksums.py), checked before anything is loaded.
"""
from __future__ import annotations

import contextlib
import glob
import multiprocessing
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_mesh.megatron.patches import patched
from megatron_mesh.training.checkpoints.checksums import (
    CheckpointError,
    verify_files,
    verify_manifest,
    write_manifest,
)
from megatron_mesh.training.checkpoints.model_description import describe
from megatron_mesh.training.checkpoints.save_failure import agreed, folder_bytes, save_failed
from megatron_mesh.training.job.device import has_cuda
from megatron_mesh.training.job.distributed import print_rank0
from megatron_mesh.training.loop.optimizer import (
    OPTIMIZER_CHECKPOINT_METADATA,
    check_saved_optimizer,
    optimizer_kind,
)
from megatron_mesh.training.model.gpt import unwrap
from megatron_mesh.training.model.moe import check_saved_experts

if TYPE_CHECKING:
    from megatron_mesh.training.config.training_config import TrainingConfig

LATEST = "latest_checkpointed_iteration.txt"
# the files every rank reads before the collective load: dist_checkpointing's metadata, the
# common state, the tensors' index
EARLY_FILES = ("metadata.json", "common.pt", ".metadata")
MEGATRON_LM_CHECKPOINT_VERSION = 3.0  # Megatron-LM's mark of megatron-core's Q, K, V layout


@dataclass
class TrainState:
    """Where training stands; consumed_samples is also the data position."""

    iteration: int = 0
    consumed_samples: int = 0


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def complete_iterations(root: str) -> list[int]:
    """Iterations of the iter_N folders under root that hold a checkpoint, oldest first."""
    found = []
    for path in glob.glob(os.path.join(root, "iter_*")):
        name = os.path.basename(path)
        if name[5:].isdigit() and os.path.isfile(os.path.join(path, "metadata.json")):
            found.append(int(name[5:]))
    return sorted(found)


def _older(root: str, below: int | None = None) -> str:
    """What to load instead: the complete checkpoints under root (below an iteration)."""
    its = [i for i in complete_iterations(root) if below is None or i < below]
    if not its:
        return "no other complete checkpoint is there (start afresh without --load)"
    return (f"load an older one with --ckpt-step N (complete here: "
            f"{', '.join(map(str, its))})")


def read_common_state(path: str, older: str) -> dict[str, Any]:
    """The common state of checkpoint `path` (iteration, optimizer kind, model description),
    its early files checked against the manifest first, on this rank alone; CheckpointError
    naming the file (and `older`, what to load instead) when one differs or is unreadable."""
    verify_files(path, EARLY_FILES, older)
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception as e:  # garbage bytes: pickle, zip, torch errors of many kinds
        why = f"{type(e).__name__}: {e}" if isinstance(e, OSError) else type(e).__name__
        raise CheckpointError(f"checkpoint {path}: its common state (common.pt, metadata.json) "
                              f"cannot be read ({why}); {older}") from None
    if not isinstance(common, dict):
        raise CheckpointError(f"checkpoint {path}: common.pt holds a {type(common).__name__}, "
                              f"not a checkpoint's common state; {older}")
    return common


def latest_iteration(root: str) -> int | None:
    """The iteration of the newest complete checkpoint under root, or None without any.

    Raises CheckpointError when the marker cannot be read or there are checkpoints but no
    marker (never a silent start from iteration 0 next to saved work)."""
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        if complete_iterations(root):
            raise CheckpointError(f"--load {root}: {LATEST} is missing but checkpoints are "
                                  f"there; {_older(root)}")
        return None
    try:
        with open(path) as f:
            text = f.read()
        return int(text.strip())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"--load {root}: marker {LATEST} is unreadable or truncated "
                              f"({e}); {_older(root)}") from None


def _exit_with_parent() -> None:
    """Runs in the checkpoint writer's manager process: end it when its rank process ends."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


_RESULTS_MANAGER: Any = None  # the writer's results manager process and its queue
_RESULTS_QUEUE: Any = None


@contextlib.contextmanager
def _handled_signals_ignored():
    """A signal this rank handles (--exit-signal: Slurm delivers it to every process of the
    job step) is ignored by the processes started inside: they inherit SIG_IGN, where a
    handler would reset to the default action (exit) in the new program."""
    handled = [s for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
               if callable(signal.getsignal(s))]
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in handled}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


_QUEUE_PATCH = "megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue"


def _writer_patches() -> tuple[tuple[str, ...], dict[str, Any]]:
    """The patches a save runs under (`megatron.patches`), and their values.

    megatron-core's checkpoint writer keeps its results in a queue served by a spawned
    multiprocessing manager. If the rank is killed (a failed job torn down by torchrun) that
    process would linger; it is started here instead, set to exit when the rank does, and
    the writer is given its queue. Forked, as megatron-core forks its writer processes: a
    spawned one re-imports the driver and megatron-core first (several seconds per rank at
    the first save). Without CUDA the writer's torch.cuda.synchronize() (called after
    staging tensors in host memory, which CPU tensors need not wait for) is a no-op."""
    global _RESULTS_MANAGER, _RESULTS_QUEUE
    if _RESULTS_MANAGER is None:
        from multiprocessing.managers import SyncManager

        _RESULTS_MANAGER = SyncManager(ctx=multiprocessing.get_context("fork"))
        with _handled_signals_ignored():
            _RESULTS_MANAGER.start(initializer=_exit_with_parent)
        _RESULTS_QUEUE = _RESULTS_MANAGER.Queue()
    names = (_QUEUE_PATCH,) + (() if has_cuda() else ("torch.cuda.synchronize",))
    return names, {_QUEUE_PATCH: _RESULTS_QUEUE}


def _layout() -> list[int]:
    return [parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size(with_context_parallel=True)]


def _rng_object() -> ShardedObject:
    """This rank's RNG states, one shard per (PP, TP, DP x CP) position."""
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if has_cuda() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states() if has_cuda() else None,
    }
    offset = (parallel_state.get_pipeline_model_parallel_rank(),
              parallel_state.get_tensor_model_parallel_rank(),
              parallel_state.get_data_parallel_rank(with_context_parallel=True))
    return ShardedObject("rng_state", state, tuple(_layout()), offset, replica_id=0)


def _set_rng(state: dict[str, Any]) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if has_cuda() and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(model: torch.nn.Module, optimizer: Any, scheduler: Any, state: TrainState,
                   args: TrainingConfig, *, loading: bool, with_optim: bool,
                   with_rng: bool) -> dict[str, Any]:
    model_sd = unwrap(model).sharded_state_dict()
    sd: dict[str, Any] = {"model": model_sd, "layout": _layout()}
    if with_optim:
        sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=loading,
                                                       metadata=OPTIMIZER_CHECKPOINT_METADATA)
        sd["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        sd["rng_state"] = _rng_object()
    if not loading:
        sd["checkpoint_version"] = MEGATRON_LM_CHECKPOINT_VERSION
        sd["optimizer_kind"] = optimizer_kind(args)
        sd["expert_model_parallel_size"] = args.expert_model_parallel_size
        sd["iteration"] = state.iteration
        sd["consumed_samples"] = state.consumed_samples
        sd["model_shape"] = describe(args)  # every flag of the model (model_description)
    return sd


def _newest(root: str) -> int | None:
    """The iteration the marker under root names (None without one or when unreadable)."""
    try:
        return latest_iteration(root)
    except CheckpointError:
        return None


def save_checkpoint(root: str, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                    state: TrainState, args: TrainingConfig) -> str:
    """Write SAVE/iter_N atomically and point the marker at it; returns its path.

    Four steps, each agreed by every rank (`save_failure.agreed`): make iter_N.tmp, write
    the tensors, write the manifest, rename and move the marker. A step that fails on any
    rank (a full disk) raises SaveError on every rank; the unfinished folder is removed and
    the previous checkpoint stays as it was."""
    final = checkpoint_dir(root, state.iteration)
    tmp = final + ".tmp"
    rank0 = dist.get_rank() == 0

    def prepare() -> None:
        if rank0:
            for stale in glob.glob(os.path.join(root, "iter_*.tmp")):
                if stale != tmp:
                    print(f" removing {stale}: an unfinished save of an earlier run", flush=True)
                shutil.rmtree(stale, ignore_errors=True)
            os.makedirs(tmp)

    def write() -> None:
        sd = _sharded_state(model, optimizer, scheduler, state, args, loading=False,
                            with_optim=True, with_rng=True)
        names, values = _writer_patches()
        with patched(*names, values=values):
            dist_checkpointing.save(sd, tmp)

    def publish() -> None:
        if not rank0:
            return
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker = os.path.join(root, LATEST)
        with open(marker + ".tmp", "w") as f:
            f.write(f"{state.iteration}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(marker + ".tmp", marker)

    previous = _newest(root)
    # write_manifest is collective: its gather also waits for every rank's files
    for step in (prepare, write, lambda: write_manifest(tmp), publish):
        outcome = agreed(step)
        if outcome is not None:
            previous_bytes = 0 if previous is None else folder_bytes(checkpoint_dir(root, previous))
            raise save_failed(root, state.iteration, tmp, outcome, previous, previous_bytes)
    if dist.get_world_size() > 1:
        dist.barrier()
    print_rank0(f" saved checkpoint at iteration {state.iteration} to {final}")
    return final


def load_checkpoint(root: str, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                    args: TrainingConfig) -> TrainState:
    """Restore the newest complete checkpoint under root into the live objects.

    Weights always; iteration and data position unless --finetune; optimizer and LR
    schedule unless --no-load-optim / --finetune (as Megatron-LM); RNG unless --no-load-rng
    or the parallel layout changed.
    Without any complete checkpoint under root (a first launch) training starts at 0.
    """
    iteration = args.ckpt_step if args.ckpt_step is not None else latest_iteration(root)
    if iteration is None:
        print_rank0(f" no checkpoint under --load {root} ({LATEST} missing): starting from "
                    "iteration 0")
        return TrainState()
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path):
        raise CheckpointError(f"--load {root}: no checkpoint {path}; {_older(root)}")
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        what = "is empty" if not os.listdir(path) else "is not a complete checkpoint"
        raise CheckpointError(f"checkpoint {path} {what}; {_older(root, iteration)}")
    if not verify_manifest(path, _older(root, iteration)):
        print_rank0(f" checkpoint {path} has no checksums (saved by an older version): "
                    "loading it unverified")
    common = read_common_state(path, _older(root, iteration))
    with_optim = not (args.no_load_optim or args.finetune)
    with_rng = not (args.no_load_rng or args.finetune)
    if with_optim:
        check_saved_optimizer(common, _layout(), path, args)
        check_saved_experts(common, path, args)
    if with_rng and list(common.get("layout", [])) != _layout():
        print_rank0(f" checkpoint layout {common.get('layout')} (PP, TP, DPxCP) differs from "
                    f"{_layout()}: RNG state not restored")
        with_rng = False
    template = _sharded_state(model, optimizer, scheduler, TrainState(), args, loading=True,
                              with_optim=with_optim, with_rng=with_rng)
    loaded = dist_checkpointing.load(template, path)
    unwrap(model).load_state_dict(loaded["model"])
    state = TrainState()
    if not args.finetune:  # as Megatron-LM: the iteration and data position go on
        state = TrainState(common["iteration"], common["consumed_samples"])
    if with_optim:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    elif not args.finetune:
        print_rank0(f" --no-load-optim: weights and the data position of iteration "
                    f"{state.iteration} loaded; a fresh optimizer, and the LR schedule starts "
                    "again from its first step (as Megatron-LM does)")
    if with_rng:
        _set_rng(loaded["rng_state"])
    print_rank0(f" loaded checkpoint {path} (iteration {iteration})")
    return state
