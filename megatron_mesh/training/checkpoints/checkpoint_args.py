"""--use-checkpoint-args: the model's shape from the checkpoint at --load, as in Megatron-LM.

Every checkpoint stores its model description in its common state (``model_shape``: the
value of every flag that changes what the model computes, `model_description.MODEL_FLAGS`,
and the sequence length; older ones only the shape, norm, position embedding, RoPE share and
bias / tied-embedding switches). Read before any process group exists, these values replace
the flags'; a checkpoint without them, or no checkpoint at all, is an error naming the
reason.
"""
from __future__ import annotations

import argparse
import os

from megatron_mesh.training.checkpoints.checksums import CheckpointError


def _checkpoint_path(args: argparse.Namespace) -> tuple[str, int]:
    from megatron_mesh.training.checkpoints.store import checkpoint_dir, latest_iteration

    if not args.load:
        raise ValueError("--use-checkpoint-args needs --load DIR (the checkpoint whose model "
                         "shape to use)")
    try:
        iteration = args.ckpt_step if args.ckpt_step is not None else latest_iteration(args.load)
    except CheckpointError as e:
        raise ValueError(f"--use-checkpoint-args: {e}") from None
    if iteration is None:
        raise ValueError(f"--use-checkpoint-args: no checkpoint under --load {args.load} to take "
                         "the model's shape from (give the shape flags for a first run)")
    path = checkpoint_dir(args.load, iteration)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise ValueError(f"--use-checkpoint-args: {path} is not a complete checkpoint")
    return path, iteration


def apply_checkpoint_args(args: argparse.Namespace, parser: argparse.ArgumentParser
                          ) -> list[str]:
    """Set `args`' model-shape values to the checkpoint's; returns a line per value that
    replaced a different one ('--hidden-size 64 (was 32)'), each checked against its flag in
    the driver's `parser`. Raises ValueError with the reason
    when the checkpoint cannot provide them (its files checked against its checksums first)."""
    from megatron_mesh.training.checkpoints.model_description import checked_description, completed
    from megatron_mesh.training.checkpoints.store import _older, read_common_state

    path, iteration = _checkpoint_path(args)
    try:
        common = read_common_state(path, _older(args.load, iteration))
        shape = completed(checked_description(common, path, parser))
    except CheckpointError as e:
        raise ValueError(f"--use-checkpoint-args: {e}") from None
    if not shape:
        raise ValueError(f"--use-checkpoint-args: checkpoint {path} stores no model shape "
                         "(saved by an older version); give the shape flags instead")
    changed = []
    for name, value in shape.items():
        if not hasattr(args, name):
            continue
        if getattr(args, name) != value:
            changed.append(f"--{name.replace('_', '-')} {value} (was {getattr(args, name)})")
        setattr(args, name, value)
    return changed
