"""Optimizer and learning-rate schedule.

megatron-core's get_megatron_optimizer over its DDP's grad buffers on every device (fp32
main weights for bf16 / fp16, optionally the distributed optimizer, whose Adam state is
sharded over DP x CP); on a CPU inside ``MegatronOptimizerOnCpu``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_mesh.dtypes import flag_dtype
from megatron_mesh.training.checkpoints.checksums import CheckpointError
from megatron_mesh.training.job.device import has_cuda
from megatron_mesh.training.job.distributed import print_rank0

if TYPE_CHECKING:
    from megatron_mesh.training.config.training_config import TrainingConfig


# The distributed optimizer saves its state as its DP x CP shards of the grad buffers
# (Megatron-LM's default, "dp_reshardable"): a checkpoint loads with another DP x CP size,
# not another TP or PP size. ("fully_reshardable", per parameter, cannot load into
# megatron-core's optimizer over torch's Adam: its loader drops Adam's step, which that
# optimizer then asks for.)
OPTIMIZER_CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def optimizer_kind(args: TrainingConfig) -> str:
    """The optimizer whose state a checkpoint of this run holds; each kind lays it out its
    own way, so a checkpoint's optimizer state loads only into the same kind."""
    return "megatron-core distributed" if args.training.use_distributed_optimizer else "megatron-core"


_KIND_FLAGS = {"megatron-core distributed": "with --use-distributed-optimizer",
               "megatron-core": "without --use-distributed-optimizer"}

LEGACY_TORCH_KIND = "torch"
"""The kind of checkpoints from CPU runs of earlier releases, which stepped a torch AdamW /
SGD outside megatron-core (its state per parameter plus a 'common_step'); no run makes it
now, and megatron-core's optimizer does not load it."""


def check_saved_optimizer(common: dict[str, Any], layout: list[int], path: str,
                          args: TrainingConfig) -> None:
    """Raise CheckpointError, naming what to do instead, when the optimizer state of the checkpoint
    at `path` (its common state dict) cannot load into this run's optimizer: another kind,
    or the distributed optimizer's shards under another TP or PP size. `layout` is this run's
    [PP, TP, DP x CP]."""
    saved, kind = common.get("optimizer_kind"), optimizer_kind(args)
    if saved is None:  # saved before the kind was recorded
        return
    if saved == LEGACY_TORCH_KIND:
        raise CheckpointError(
            f"checkpoint {path} holds optimizer state of the old 'torch' kind (a torch "
            "optimizer outside megatron-core, written by CPU runs of earlier megatron-mesh "
            "releases); every run now steps megatron-core's optimizer, which cannot load "
            "it: load the weights only with --no-load-optim (the optimizer starts afresh)")
    if saved != kind:
        raise CheckpointError(
            f"checkpoint {path} holds {saved} optimizer state (saved {_KIND_FLAGS[saved]}); this "
            f"run's optimizer is {kind}'s: resume {_KIND_FLAGS[saved]}, or load the weights only "
            "with --no-load-optim")
    saved_layout = list(common.get("layout", layout))
    if kind == "megatron-core distributed" and saved_layout[:2] != layout[:2]:
        raise CheckpointError(
            f"checkpoint {path}: the distributed optimizer's state was saved with PP "
            f"{saved_layout[0]} x TP {saved_layout[1]} and loads only with those (any DP x CP); "
            f"this run has PP {layout[0]} x TP {layout[1]}: use the saved sizes, or load the "
            "weights only with --no-load-optim")


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state a torch Adam(W) / SGD creates at its first step (zero moments, step 0)
    where it is missing, so that a checkpoint can load into it before any step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            else:
                state["momentum_buffer"] = torch.zeros_like(p)


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron-core optimizer (one per chained optimizer)."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


class MegatronOptimizerOnCpu:
    """megatron-core's optimizer over torch's Adam, as it runs without Transformer Engine or
    Apex, with three things loading a distributed-optimizer checkpoint needs there:

    - state before the first step: its `state_dict()` reads torch Adam's per-parameter step,
      which exists only after a step (a job that resumes has taken none);
    - no autograd while loading: with fp32 parameters its main parameters are views of the
      model's, which it overwrites in place;
    - the step itself: it restores torch Adam's per-parameter step from its param groups and
      then overwrites it with the value in the loading template; it is set again from them.

    Everything else is megatron-core's optimizer itself.
    """

    def __init__(self, optimizer: Any) -> None:
        self.megatron_optimizer = optimizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.megatron_optimizer, name)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           metadata: dict | None = None) -> dict:
        if is_loading:
            for optimizer in _torch_optimizers(self.megatron_optimizer):
                init_state(optimizer)
        return self.megatron_optimizer.sharded_state_dict(
            model_sharded_state_dict, is_loading=is_loading, metadata=metadata)

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.megatron_optimizer.load_state_dict(state)
        for optimizer in _torch_optimizers(self.megatron_optimizer):
            for group in optimizer.param_groups:
                for p in group["params"] if "step" in group else ():
                    if "step" in optimizer.state[p]:
                        optimizer.state[p]["step"] = torch.tensor(float(group["step"]))


def build_optimizer(model: torch.nn.Module, args: TrainingConfig):
    """megatron-core's optimizer over its DDP's grad buffers (`model.wrap_model`)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt, training = args.optimization, args.training
    config = OptimizerConfig(
        optimizer=opt.optimizer, lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
        sgd_momentum=opt.sgd_momentum, bf16=training.bf16, fp16=training.fp16,
        params_dtype=flag_dtype(training.bf16, training.fp16),
        clip_grad=opt.clip_grad, use_distributed_optimizer=training.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, [model])
    if training.use_distributed_optimizer:
        print_rank0(f" distributed optimizer: {opt.optimizer} state of "
                    f"{_state_numel(optimizer):,} of {sum(p.numel() for p in model.parameters()):,} "
                    f"parameters on this rank (sharded over DP x CP "
                    f"{args.derived.data_parallel_size * args.parallel.context_parallel_size})")
    return optimizer if has_cuda() else MegatronOptimizerOnCpu(optimizer)


def _state_numel(optimizer: Any) -> int:
    """Elements this rank's optimizer steps: its shard of the parameters."""
    return sum(p.numel() for o in _torch_optimizers(optimizer)
               for g in o.param_groups for p in g["params"])


def build_scheduler(optimizer: Any, args: TrainingConfig) -> OptimizerParamScheduler:
    """megatron-core's LR / weight-decay schedule, counted in samples as Megatron-LM does
    (`schedule_length`); on --load it checks the checkpoint's schedule (`lr_schedule`)."""
    from megatron_mesh.training.loop.lr_schedule import CheckedParamScheduler

    return CheckedParamScheduler(
        optimizer,
        init_lr=0.0 if args.derived.lr_warmup_steps > 0 else args.optimization.lr,
        max_lr=args.optimization.lr,
        min_lr=args.optimization.min_lr,
        lr_warmup_steps=args.derived.lr_warmup_steps,
        lr_decay_steps=args.derived.lr_decay_steps,
        lr_decay_style=args.optimization.lr_decay_style,
        start_wd=args.optimization.weight_decay,
        end_wd=args.optimization.weight_decay,
        wd_incr_steps=args.derived.wd_incr_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=not args.optimization.override_opt_param_scheduler,
        override_opt_param_scheduler=args.optimization.override_opt_param_scheduler,
        refuse_mismatch=not (args.optimization.override_opt_param_scheduler
                             or args.optimization.use_checkpoint_opt_param_scheduler),
        load_root=args.checkpoint.load,
    )
