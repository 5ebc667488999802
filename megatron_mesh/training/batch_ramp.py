"""--rampup-batch-size START INCREMENT SAMPLES: megatron-core's ramp-up calculator.

The global batch starts at START and grows by INCREMENT, one step per SAMPLES / steps
consumed samples, until it reaches --global-batch-size; the calculator
(RampupBatchsizeNumMicroBatchesCalculator) gives each iteration's batch and micro-batch
count from the samples consumed so far. Every batch of the ramp is a multiple of
micro batch x DP (checked here), so none is rounded down and the sampler reads consecutive
micro-batches as with a constant batch.
"""
from __future__ import annotations

from typing import Any

from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator


def check_ramp(args: Any) -> None:
    """Raise ValueError naming the values when the ramp cannot run with these sizes."""
    start, increment, samples = args.rampup_batch_size
    gbs, step = args.global_batch_size, args.micro_batch_size * args.data_parallel_size
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    if start < 1 or increment < 1 or samples < 0:
        raise ValueError(f"{flag}: START and INCREMENT must be positive, SAMPLES 0 or more")
    if start > gbs or (gbs - start) % increment:
        raise ValueError(f"{flag}: --global-batch-size {gbs} must be START plus a whole number "
                         f"of INCREMENTs (START <= {gbs})")
    if start % step or increment % step:
        raise ValueError(f"{flag}: START and INCREMENT must be multiples of micro batch "
                         f"{args.micro_batch_size} x data-parallel {args.data_parallel_size} "
                         f"= {step} (every batch of the ramp is whole micro-batches on every "
                         "data-parallel rank)")


def ramp_calculator(args: Any, rank: int = 1) -> RampupBatchsizeNumMicroBatchesCalculator | None:
    """megatron-core's calculator for the ramp, or None without one (or START equal to
    the global batch: nothing to ramp). It logs the batch changes on rank 0."""
    if not args.rampup_batch_size:
        return None
    start, increment, samples = args.rampup_batch_size
    if start == args.global_batch_size:
        return None
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
        data_parallel_size=args.data_parallel_size, decrease_batch_size_if_needed=False,
        rank=rank, start_global_batch_size=start, batch_size_increment=increment,
        ramup_samples=samples)


def ramp_iterations(args: Any) -> int:
    """Iterations --train-samples takes with the ramp (Megatron-LM's count): the ramp's
    batches while consumed samples are within both the ramp and --train-samples, then
    whole global batches of what is left."""
    check_ramp(args)
    calculator = ramp_calculator(args)
    if calculator is None:
        return args.train_samples // args.global_batch_size
    ramp_samples = args.rampup_batch_size[2]
    consumed = iterations = 0
    while consumed <= ramp_samples and consumed <= args.train_samples:
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    if args.train_samples > consumed:
        iterations += (args.train_samples - consumed) // args.global_batch_size
    return iterations


def batch_at(calculator: RampupBatchsizeNumMicroBatchesCalculator | None, args: Any,
             consumed_samples: int) -> tuple[int, int]:
    """(global batch, micro-batches per DP rank) of the iteration after `consumed_samples`."""
    if calculator is None:
        return args.global_batch_size, args.num_microbatches
    calculator.update(consumed_samples, consistency_check=True, verbose=True)
    return calculator.get_current_global_batch_size(), calculator.get()
