"""Optimizer and learning-rate schedule.

GPU: megatron-core's get_megatron_optimizer (fp32 main weights for bf16 / fp16, optionally
the distributed optimizer). CPU: a torch optimizer in ``TorchOptimizer``, which adds what the
loop needs from a megatron-core optimizer: tensor-parallel aware gradient clipping and a
sharded state dict for dist_checkpointing.
"""
from __future__ import annotations

import math
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron_mesh.training.device import has_cuda

if TYPE_CHECKING:
    from megatron_mesh.training.arguments import TrainingConfig


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only; biases and norm weights get none."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() > 1 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
            {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]


class TorchOptimizer:
    """A torch optimizer with megatron-core's optimizer interface, for CPU runs."""

    def __init__(self, model: torch.nn.Module, args: TrainingConfig) -> None:
        groups = _param_groups(model, args.weight_decay)
        if args.optimizer == "adam":
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
                groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
        else:
            self.optimizer = torch.optim.SGD(groups, lr=args.lr, momentum=args.sgd_momentum)
        self.clip_grad = args.clip_grad

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(chain.from_iterable(g["params"] for g in self.optimizer.param_groups))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def grad_norm(self) -> float:
        """L2 norm of the full gradient: TP shards and pipeline stages summed, TP duplicates
        and the last stage's copy of tied embeddings (`param.shared`) counted once."""
        sq = torch.zeros((), dtype=torch.float64)
        for p in self.parameters():
            if (p.grad is not None and param_is_not_tensor_parallel_duplicate(p)
                    and param_is_not_shared(p)):
                sq += p.grad.detach().double().pow(2).sum()
        mp_group = parallel_state.get_model_parallel_group()  # TP x PP
        if dist.get_world_size(mp_group) > 1:
            dist.all_reduce(sq, group=mp_group)
        return math.sqrt(sq.item())

    @torch.no_grad()
    def step(self) -> tuple[bool, float, None]:
        """Clip, then step; returns (success, grad norm, zeros) like megatron-core's."""
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return False, norm, None
        if self.clip_grad > 0 and norm > self.clip_grad:
            scale = self.clip_grad / (norm + 1e-6)
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        self.optimizer.step()
        return True, norm, None

    def _init_state(self) -> None:
        """Create empty state (as after zero steps) so that a checkpoint can load into it."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state[p]
                if state:
                    continue
                if isinstance(self.optimizer, torch.optim.AdamW):
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                else:
                    state["momentum_buffer"] = torch.zeros_like(p)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """Optimizer state sharded like the parameters it belongs to."""
        if is_loading:
            self._init_state()
        state = self.optimizer.state_dict()
        steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.parameters())
        optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
        if steps:
            state["common_step"] = steps.pop()
        return state

    def load_state_dict(self, state: dict) -> None:
        step = state.pop("common_step", None)
        if step is not None:
            for s in state["state"].values():
                s["step"] = torch.tensor(step, dtype=torch.float32)
        self.optimizer.load_state_dict(state)


def build_optimizer(model: torch.nn.Module, args: TrainingConfig):
    """megatron-core's optimizer on a GPU, TorchOptimizer on a CPU."""
    if not has_cuda():
        return TorchOptimizer(model, args)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, bf16=args.bf16, fp16=args.fp16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32,
        clip_grad=args.clip_grad, use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, [model])


def build_scheduler(optimizer: Any, args: TrainingConfig) -> OptimizerParamScheduler:
    """megatron-core's LR / weight-decay schedule, counted in samples as Megatron-LM does."""
    gbs = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters > 0 else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
    )
