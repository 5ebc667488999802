"""--rampup-batch-size START INCREMENT SAMPLES: Megatron-LM's batch-size ramp.

The global batch starts at START and grows by INCREMENT, one step per SAMPLES / steps
consumed samples (steps = (--global-batch-size - START) / INCREMENT), until it reaches
--global-batch-size; past SAMPLES consumed samples it stays there. Every batch of the ramp
is a multiple of micro batch x DP (checked here), so none is rounded down and the sampler
reads consecutive micro-batches as with a constant batch. The schedule is computed here
(`BatchRamp`): megatron-core 0.16 ships it as a calculator class that 0.19 replaced by a
step-schedule calculator, so the driver keeps Megatron-LM's arithmetic itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BatchRamp:
    """The ramp of one run: global batch and micro-batches per DP rank by samples consumed."""

    start: int
    increment: int
    samples: int
    global_batch_size: int
    micro_times_dp: int  # micro batch x data-parallel size

    @property
    def steps(self) -> int:
        return (self.global_batch_size - self.start) // self.increment

    def batch(self, consumed_samples: int) -> int:
        """The global batch of the iteration after `consumed_samples`."""
        if consumed_samples > self.samples or self.steps == 0:  # past it, or START is all
            return self.global_batch_size
        per_step = self.samples / self.steps
        return min(self.global_batch_size,
                   self.start + int(consumed_samples / per_step) * self.increment)

    def at(self, consumed_samples: int) -> tuple[int, int]:
        """(global batch, micro-batches per DP rank) after `consumed_samples`."""
        gbs = self.batch(consumed_samples)
        return gbs, gbs // self.micro_times_dp


def check_ramp(args: Any) -> None:
    """Raise ValueError naming the values when the ramp cannot run with these sizes."""
    start, increment, samples = args.rampup_batch_size
    gbs, step = args.global_batch_size, args.micro_batch_size * args.data_parallel_size
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    if start < 1 or increment < 1 or samples < 1:
        raise ValueError(f"{flag}: START, INCREMENT and SAMPLES must be positive")
    if start > gbs or (gbs - start) % increment:
        raise ValueError(f"{flag}: --global-batch-size {gbs} must be START plus a whole number "
                         f"of INCREMENTs (START <= {gbs})")
    if start % step or increment % step:
        raise ValueError(f"{flag}: START and INCREMENT must be multiples of micro batch "
                         f"{args.micro_batch_size} x data-parallel {args.data_parallel_size} "
                         f"= {step} (every batch of the ramp is whole micro-batches on every "
                         "data-parallel rank)")


def ramp_calculator(args: Any) -> BatchRamp | None:
    """The run's ramp, or None without one (or START equal to the global batch: nothing to
    ramp). The trainer announces it."""
    if not args.rampup_batch_size:
        return None
    start, increment, samples = args.rampup_batch_size
    if start == args.global_batch_size:
        return None
    ramp = BatchRamp(start, increment, samples, args.global_batch_size,
                     args.micro_batch_size * args.data_parallel_size)
    return ramp


def ramp_iterations(args: Any) -> int:
    """Iterations --train-samples takes with the ramp (Megatron-LM's count): the ramp's
    batches while consumed samples are within both the ramp and --train-samples, then
    whole global batches of what is left."""
    check_ramp(args)
    ramp = ramp_calculator(args)
    if ramp is None:
        return args.train_samples // args.global_batch_size
    consumed = iterations = 0
    while consumed <= ramp.samples and consumed <= args.train_samples:
        consumed += ramp.batch(consumed)
        iterations += 1
    if args.train_samples > consumed:
        iterations += (args.train_samples - consumed) // args.global_batch_size
    return iterations


def batch_at(ramp: BatchRamp | None, args: Any, consumed_samples: int) -> tuple[int, int]:
    """(global batch, micro-batches per DP rank) of the iteration after `consumed_samples`."""
    if ramp is None:
        return args.global_batch_size, args.num_microbatches
    return ramp.at(consumed_samples)
