"""Megatron-LM flags that mean nothing in this driver: accepted, and named once at start-up.

A Megatron-LM command line (its GPT example scripts) carries flags for fused kernels,
communication overlap, profiling and the like. The driver accepts each of them so that the
command line carries over, and says at start-up which were given and why they change nothing
here, so that none is dropped silently. Flags that do mean something here (evaluation,
TensorBoard, --calculate-per-token-loss, --num-workers, ...) are ordinary flags in `arguments.py`.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

__all__ = ["NO_EFFECT", "NoEffectFlag", "add_no_effect_flags", "no_effect_report"]

_FUSIONS_OFF = "the driver builds its layers without megatron-core's fused kernels"
_KERNEL = ("the attention kernel follows --attention-backend (the mesh tile kernel runs "
           "torch's flash / cuDNN attention where the device has it)")
_NO_RAMP = ("no step schedule of batch sizes here: every iteration uses --global-batch-size "
            "(--rampup-batch-size ramps it linearly)")
_FP32_SOFTMAX = "softmax is computed in fp32 in every attention kernel here"


@dataclass(frozen=True)
class NoEffectFlag:
    """One Megatron-LM flag: its name, how many values it takes (0: a switch; '+': one or
    more) and why it changes nothing in this driver."""

    name: str
    values: int | str
    why: str


NO_EFFECT: tuple[NoEffectFlag, ...] = (
    # fused kernels and kernel choices
    NoEffectFlag("--no-gradient-accumulation-fusion", 0, _FUSIONS_OFF),
    NoEffectFlag("--no-masked-softmax-fusion", 0, _FUSIONS_OFF),
    NoEffectFlag("--no-bias-gelu-fusion", 0, _FUSIONS_OFF),
    NoEffectFlag("--no-bias-swiglu-fusion", 0, _FUSIONS_OFF),
    NoEffectFlag("--no-bias-dropout-fusion", 0, _FUSIONS_OFF),
    NoEffectFlag("--no-rope-fusion", 0, _FUSIONS_OFF),
    NoEffectFlag("--no-persist-layer-norm", 0, _FUSIONS_OFF),
    NoEffectFlag("--cross-entropy-loss-fusion", 0,
                 "the loss is megatron-core's (unfused) vocab-parallel cross entropy"),
    NoEffectFlag("--use-flash-attn", 0, _KERNEL),
    NoEffectFlag("--attention-softmax-in-fp32", 0, _FP32_SOFTMAX),
    NoEffectFlag("--accumulate-allreduce-grads-in-fp32", 0,
                 "gradients are reduced in fp32 with --bf16 / --fp16 already"),
    NoEffectFlag("--use-mcore-models", 0, "the model is megatron-core's GPTModel already"),
    # overlap, memory and profiling
    NoEffectFlag("--manual-gc", 0, "Python's garbage collector runs as usual"),
    NoEffectFlag("--empty-unused-memory-level", 1, "the caching allocator is left alone"),
    NoEffectFlag("--profile", 0, "no profiler here; use torch.profiler around the job"),
    NoEffectFlag("--profile-step-start", 1, "no profiler here"),
    NoEffectFlag("--profile-step-end", 1, "no profiler here"),
    NoEffectFlag("--profile-ranks", "+", "no profiler here"),
    NoEffectFlag("--use-pytorch-profiler", 0, "no profiler here"),
    # batch-size schedules
    NoEffectFlag("--step-batch-size-schedule", 1, _NO_RAMP),
    # logging that is always on, or has nothing to show here
    NoEffectFlag("--log-throughput", 0, "throughput is always in the log line"),
    NoEffectFlag("--log-memory-to-tensorboard", 0,
                 "peak memory always goes to TensorBoard with --tensorboard-dir"),
    NoEffectFlag("--log-batch-size-to-tensorboard", 0,
                 "the batch size always goes to TensorBoard with --tensorboard-dir"),
    NoEffectFlag("--log-loss-scale-to-tensorboard", 0, "the loss scale is not logged here"),
    NoEffectFlag("--no-log-loss-scale-to-tensorboard", 0, "the loss scale is not logged here"),
    NoEffectFlag("--log-params-norm", 0, "the parameter norm is not computed here"),
    NoEffectFlag("--log-num-zeros-in-grad", 0, "zeros in the gradient are not counted here"),
    NoEffectFlag("--log-progress", 0, "no progress.txt is written"),
    NoEffectFlag("--timing-log-level", 1,
                 "the step time is the one timer here (see --log-timers-to-tensorboard)"),
    NoEffectFlag("--timing-log-option", 1, "the step time is the one timer here"),
    # data loading and checkpoint format
    NoEffectFlag("--dataloader-type", 1,
                 "samples are read in order from the consumed-sample count (Megatron-LM's "
                 "'single')"),
    NoEffectFlag("--num-dataset-builder-threads", 1, "the dataset index is built in one thread"),
    NoEffectFlag("--no-mmap-bin-files", 0, "the .bin files are always memory-mapped"),
    NoEffectFlag("--ckpt-format", 1, "checkpoints are megatron-core dist-checkpoints "
                                     "(torch_dist) always"),
)
"""Every Megatron-LM flag accepted without effect, with the reason printed at start-up."""


def _dest(flag: NoEffectFlag) -> str:
    return flag.name.lstrip("-").replace("-", "_")


def add_no_effect_flags(parser: argparse.ArgumentParser) -> None:
    """Add every `NO_EFFECT` flag to `parser` (a switch or its values, as Megatron-LM takes
    it; no help text, listed in docs/training.md)."""
    group = parser.add_argument_group(
        "Megatron-LM flags accepted without effect (named at start-up when given)")
    for flag in NO_EFFECT:
        if flag.values == 0:
            group.add_argument(flag.name, action="store_true", default=False,
                               help=flag.why)
        else:
            group.add_argument(flag.name, nargs=None if flag.values == 1 else flag.values,
                               default=None, metavar="VALUE", help=flag.why)


def no_effect_report(args: Any) -> list[str]:
    """One line per `NO_EFFECT` flag given in `args`: '--flag [values]: no effect here (why)'."""
    lines = []
    for flag in NO_EFFECT:
        value = getattr(args, _dest(flag), None)
        if value is None or value is False:
            continue
        given = "" if value is True else " " + (
            " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value))
        lines.append(f"{flag.name}{given}: no effect here ({flag.why})")
    return lines + _ineffective_together(args)


def _ineffective_together(args: Any) -> list[str]:
    """Flags honoured alone that do nothing with the others given: --reset-position-ids
    moves only learned absolute positions (RoPE rotates by the position in the packed
    sequence, restarted per document under --reset-attention-mask only)."""
    kind = getattr(args, "position_embedding_type", "learned_absolute")
    if not getattr(args, "reset_position_ids", False) or kind == "learned_absolute":
        return []
    if getattr(args, "reset_attention_mask", False):
        return []  # RoPE restarts at each document anyway
    why = ("no position embedding" if kind == "none" else
           "RoPE rotates each token by its position in the whole sequence; it restarts at "
           "each document with --reset-attention-mask")
    return [f"--reset-position-ids: no effect here with --position-embedding-type {kind} "
            f"({why})"]
