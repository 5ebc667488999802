"""The training loop: one megatron-core forward/backward per step, then the optimizer."""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist

from megatron_mesh.megatron.arguments import mesh_active
from megatron_mesh.training.checkpoints.store import TrainState, save_checkpoint
from megatron_mesh.training.config.batch_ramp import batch_at, ramp_calculator
from megatron_mesh.training.job.device import peak_memory_bytes, synchronize
from megatron_mesh.training.job.distributed import print_rank0
from megatron_mesh.training.logs.metrics import IntervalStats, Loggers, interval_metrics, log_line
from megatron_mesh.training.loop import faults
from megatron_mesh.training.loop.step import global_batch, global_loss
from megatron_mesh.training.loop.stopping import ExitConditions, check_finite
from megatron_mesh.training.model.moe import aux_losses

if TYPE_CHECKING:
    from megatron_mesh.training.config.training_config import TrainingConfig
    from megatron_mesh.training.loop.evaluation import Evaluator


def train_step(model: torch.nn.Module, optimizer: Any, scheduler: Any,
               data_iterator: Iterator[dict], args: TrainingConfig) -> tuple[float, float | None, bool]:
    """One iteration over the global batch; returns (loss, grad norm, update applied)."""
    if hasattr(model, "zero_grad_buffer"):  # megatron-core DDP
        model.zero_grad_buffer()
    optimizer.zero_grad()
    reports = global_batch(model, data_iterator, args, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    if ok:
        scheduler.step(increment=args.training.global_batch_size)
    return global_loss(reports), grad_norm, ok


def _sync_params(model: torch.nn.Module, args: TrainingConfig) -> None:
    """With --overlap-param-gather the updated parameters arrive in the next forward's
    pre-hooks; gather them now (before evaluation, a save or the end of training)."""
    if args.training.overlap_param_gather:
        model.start_param_sync(force_sync=True)


def _step_args(args: TrainingConfig, calculator: Any, consumed_samples: int) -> TrainingConfig:
    """`args` with this iteration's global batch and micro-batch count (--rampup-batch-size);
    `args` itself without a ramp."""
    if calculator is None:
        return args
    gbs, micro = batch_at(calculator, args, consumed_samples)
    if (gbs, micro) == (args.training.global_batch_size, args.derived.num_microbatches):
        return args
    return dataclasses.replace(
        args, training=dataclasses.replace(args.training, global_batch_size=gbs),
        derived=dataclasses.replace(args.derived, num_microbatches=micro))


def _traffic_counter(args: TrainingConfig):
    """A byte counter of mesh collectives when the mesh runs, else None (traffic n/a)."""
    if not mesh_active(args):
        return None
    from megatron_mesh.runtime.comm import TrafficCounter

    return TrafficCounter()


def train(model: torch.nn.Module, optimizer: Any, scheduler: Any, data_iterator: Iterator[dict],
          state: TrainState, args: TrainingConfig, flops_per_iter: float, loggers: Loggers,
          evaluator: Evaluator | None = None) -> TrainState:
    """Iterate to --train-iters (or --exit-interval, a signal, the time limit), logging,
    validating and saving on their intervals; a NaN / Inf loss or grad norm raises before
    anything is saved."""
    exits = ExitConditions(args)
    stats = IntervalStats()
    rank = dist.get_rank()
    last = args.training.train_iters
    ramp = ramp_calculator(args)
    if ramp is not None:
        start, increment, samples = args.training.rampup_batch_size
        print_rank0(f" batch-size ramp-up: global batch {start} -> {args.training.global_batch_size} in "
                    f"steps of {increment} over {samples} samples; {args.training.train_iters} "
                    f"iterations for --train-samples {args.training.train_samples}")
    model.train()
    try:
        while state.iteration < last:
            faults.maybe_fail(rank, state.iteration + 1)
            counter = _traffic_counter(args)
            synchronize()
            start = time.perf_counter()
            step_args = _step_args(args, ramp, state.consumed_samples)
            flops = flops_per_iter * step_args.training.global_batch_size / args.training.global_batch_size
            with counter if counter is not None else contextlib.nullcontext():
                loss, grad_norm, ok = train_step(model, optimizer, scheduler, data_iterator,
                                                 step_args)
            synchronize()
            aux = aux_losses(step_args)  # MoE aux losses, scaled by this step's micro-batches
            seconds = time.perf_counter() - start
            state.iteration += 1
            state.consumed_samples += step_args.training.global_batch_size
            if args.stopping.check_for_nan_in_loss_and_grad:
                check_finite(state.iteration, loss, grad_norm)
            traffic = counter.total_bytes if counter else 0
            stats.add(loss, seconds, grad_norm, traffic, ok, aux)
            lr = optimizer.param_groups[0]["lr"]
            one = IntervalStats()
            one.add(loss, seconds, grad_norm, traffic, ok, aux)
            loggers.iteration(
                interval_metrics(one, step_args, flops, lr, state.consumed_samples,
                                 peak_memory_bytes(), traffic_known=counter is not None),
                state.iteration, seconds)
            if state.iteration % args.logging.log_interval == 0 or state.iteration == last:
                m = interval_metrics(stats, step_args, flops, lr, state.consumed_samples,
                                     peak_memory_bytes(), traffic_known=counter is not None)
                print_rank0(log_line(state.iteration, step_args, m))
                loggers.interval(m, state.iteration)
                stats = IntervalStats()
            if evaluator is not None and evaluator.due(state.iteration):
                _sync_params(model, args)
                evaluator.validate(state.iteration, state.consumed_samples)
            stop = state.iteration == last or bool(
                args.training.exit_interval and state.iteration % args.training.exit_interval == 0)
            reason = exits.reason()
            if reason:
                print_rank0(f" {reason}: saving and exiting after iteration {state.iteration}")
                stop = True
            if args.checkpoint.save and (stop or (
                    args.checkpoint.save_interval and state.iteration % args.checkpoint.save_interval == 0)):
                _sync_params(model, args)
                save_checkpoint(args.checkpoint.save, model, optimizer, scheduler, state, args)
            if stop:
                break
    finally:
        exits.restore()
    _sync_params(model, args)
    return state
