"""How long training runs and how its LR schedule is counted: in iterations or in samples.

Megatron-LM's two modes, exclusive: ``--train-iters`` with ``--lr-decay-iters`` /
``--lr-warmup-iters``, or ``--train-samples`` with ``--lr-decay-samples`` /
``--lr-warmup-samples`` (and ``--rampup-batch-size``, a ramp being counted in samples).
``--lr-warmup-fraction`` works in both (and wins over the warmup count). Either way the
schedule's steps are samples (megatron-core's OptimizerParamScheduler steps by the global
batch each iteration).
"""
from __future__ import annotations

import argparse

from megatron_mesh.training.config.batch_ramp import ramp_iterations

ITERATION_FLAGS = ("train_iters", "lr_decay_iters", "lr_warmup_iters")
SAMPLE_FLAGS = ("train_samples", "lr_decay_samples", "lr_warmup_samples", "rampup_batch_size")


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """The flags of `names` set to something other than 'not given' (None, 0)."""
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n) not in (None, 0)]


def drop_other_mode(config: dict, command_line: argparse.Namespace) -> dict:
    """Config values without the other mode's keys when the command line picks a mode
    (a YAML ``train-iters`` does not collide with ``--train-samples`` given on the command
    line, and the other way round): the command line wins over the config."""
    if command_line.train_samples is not None:
        return {k: v for k, v in config.items() if k not in ITERATION_FLAGS}
    if command_line.train_iters is not None:
        return {k: v for k, v in config.items() if k not in SAMPLE_FLAGS}
    return config


def resolve(args: argparse.Namespace, default_iters: int) -> None:
    """Check the mode's flags and set train_iters and the schedule's steps in samples
    (lr_warmup_steps, lr_decay_steps, wd_incr_steps). Raises ValueError naming the flag."""
    if args.train_samples is not None:
        _resolve_samples(args)
    else:
        _resolve_iterations(args, default_iters)
    if args.lr_warmup_steps >= args.lr_decay_steps:
        raise ValueError(
            f"the LR warmup ({args.lr_warmup_steps} samples) must be shorter than the decay "
            f"({args.lr_decay_steps} samples): lower --lr-warmup-iters / --lr-warmup-samples / "
            "--lr-warmup-fraction or raise --lr-decay-iters / --lr-decay-samples")


def _positive(flag: str, value: int | None) -> None:
    if value is None or value < 1:
        raise ValueError(f"{flag} {value}: must be a positive integer")


def _resolve_samples(args: argparse.Namespace) -> None:
    iteration_flags = _given(args, ITERATION_FLAGS)
    if iteration_flags:
        raise ValueError(f"--train-samples {args.train_samples} with {', '.join(iteration_flags)}:"
                         " sample-based training counts its schedule in samples; use "
                         "--lr-decay-samples / --lr-warmup-samples (or --train-iters alone)")
    _positive("--train-samples", args.train_samples)
    gbs = args.global_batch_size
    args.train_iters = ramp_iterations(args) if args.rampup_batch_size else (
        args.train_samples // gbs)
    if args.train_iters < 1:
        raise ValueError(f"--train-samples {args.train_samples} is less than one global batch "
                         f"(--global-batch-size {gbs})")
    if args.lr_decay_samples is not None:
        _positive("--lr-decay-samples", args.lr_decay_samples)
    args.lr_decay_steps = args.lr_decay_samples or args.train_samples
    if args.lr_warmup_samples is None or args.lr_warmup_samples < 0:
        raise ValueError(f"--lr-warmup-samples {args.lr_warmup_samples}: must be 0 or more")
    if args.lr_warmup_fraction is not None:  # it wins, as over --lr-warmup-iters
        args.lr_warmup_steps = int(args.lr_warmup_fraction * args.lr_decay_steps)
    else:
        args.lr_warmup_steps = args.lr_warmup_samples
    args.wd_incr_steps = args.train_samples


def _resolve_iterations(args: argparse.Namespace, default_iters: int) -> None:
    sample_flags = _given(args, SAMPLE_FLAGS)
    if sample_flags:
        why = (" (a batch-size ramp is counted in samples, as in Megatron-LM)"
               if args.rampup_batch_size else "")
        raise ValueError(f"{', '.join(sample_flags)} with iteration-based training{why}: give "
                         "--train-samples N instead of --train-iters (sample-based training)")
    if args.train_iters is None:
        args.train_iters = default_iters
    _positive("--train-iters", args.train_iters)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    _positive("--lr-decay-iters", args.lr_decay_iters)
    if args.lr_warmup_fraction is not None:  # it wins over --lr-warmup-iters (a config's)
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.lr_warmup_iters is None or args.lr_warmup_iters < 0:
        raise ValueError(f"--lr-warmup-iters {args.lr_warmup_iters}: must be 0 or more")
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise ValueError(f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than "
                         f"--lr-decay-iters {args.lr_decay_iters} (default: --train-iters)")
    gbs = args.global_batch_size
    args.lr_decay_steps = args.lr_decay_iters * gbs
    args.lr_warmup_steps = args.lr_warmup_iters * gbs
    args.wd_incr_steps = args.train_iters * gbs
