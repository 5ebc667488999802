"""The LR / weight-decay schedule on resume: the checkpoint's, the command line's, or an error.

A checkpoint holds its schedule (peak and minimum LR, warmup and decay lengths in samples,
decay style, weight decay). As in Megatron-LM, a resume whose flags say otherwise stops
with the settings that differ, unless ``--override-opt_param-scheduler`` (take the command
line's) or ``--use-checkpoint-opt_param-scheduler`` (keep the checkpoint's) is given; a
silent choice between the two is not possible. The check runs while loading, before any
training step or save, so a refused resume leaves every checkpoint as it was.
"""
from __future__ import annotations

from typing import Any

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_mesh.training.checkpoints.checksums import CheckpointError

OVERRIDE = "--override-opt_param-scheduler"
USE_CHECKPOINT = "--use-checkpoint-opt_param-scheduler"

# state-dict key -> (the flags that set it here, its unit)
SETTINGS: dict[str, tuple[str, str]] = {
    "max_lr": ("--lr", ""),
    "min_lr": ("--min-lr", ""),
    "lr_warmup_steps": ("--lr-warmup-iters / --lr-warmup-samples / --lr-warmup-fraction",
                        " samples"),
    "lr_decay_steps": ("--lr-decay-iters / --lr-decay-samples (default --train-iters / "
                       "--train-samples)", " samples"),
    "lr_decay_style": ("--lr-decay-style", ""),
    "start_wd": ("--weight-decay", ""),
    "end_wd": ("--weight-decay", ""),
    "wd_incr_steps": ("--train-iters / --train-samples (weight-decay schedule)", " samples"),
    "wd_incr_style": ("weight-decay style", ""),
}


def schedule_differences(live: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    """'FLAG: X here, Y in the checkpoint' for each setting of the schedule `live` (this
    run's state dict) that differs from `saved` (the checkpoint's). The weight-decay
    length is left out while weight decay is constant in both (it changes nothing then)."""
    constant_wd = all(sd.get("wd_incr_style", "constant") == "constant"
                      and sd.get("start_wd") == sd.get("end_wd") for sd in (live, saved))
    seen, lines = set(), []
    for key, (flags, unit) in SETTINGS.items():
        if key not in saved or (key == "wd_incr_steps" and constant_wd):
            continue
        here, there = live[key], saved[key]
        if here == there or (flags, here, there) in seen:
            continue
        seen.add((flags, here, there))
        lines.append(f"{flags}: {here}{unit} here, {there}{unit} in the checkpoint")
    return lines


class CheckedParamScheduler(OptimizerParamScheduler):
    """megatron-core's OptimizerParamScheduler that, with `refuse_mismatch`, refuses a
    checkpoint whose schedule differs from this one's (CheckpointError, one line naming
    each setting, both values and both flags); otherwise megatron-core's own handling of
    the two flags (override: the class's values; use-checkpoint: the checkpoint's)."""

    def __init__(self, *args: Any, refuse_mismatch: bool, load_root: str | None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refuse_mismatch = refuse_mismatch
        self.load_root = load_root

    def load_state_dict(self, state_dict: dict) -> None:
        if self.refuse_mismatch:
            differences = schedule_differences(self.state_dict(), state_dict)
            if differences:
                raise CheckpointError(
                    f"--load {self.load_root}: the learning-rate schedule on this command line "
                    f"differs from the checkpoint's ({'; '.join(differences)}); give "
                    f"{OVERRIDE} to use this command line's values or {USE_CHECKPOINT} to "
                    "keep the checkpoint's")
        if self.override_opt_param_scheduler:
            self._override_param_groups()
        super().load_state_dict(state_dict)

    def _override_param_groups(self) -> None:
        """megatron-core's param groups carry their own peak and minimum LR, which the
        optimizer's state (loaded just before) brought back from the checkpoint; with
        --override-opt_param-scheduler they follow the command line too."""
        for group in self.optimizer.param_groups:
            if "max_lr" in group:
                group["max_lr"] = self.max_lr
            if "min_lr" in group:
                group["min_lr"] = self.min_lr
