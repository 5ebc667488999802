"""Why the training loop stops early: a signal, the clock, or a loss that is not finite.

A signal (``--exit-signal-handler``, the signal of ``--exit-signal``) only sets a flag; at the
end of the iteration every rank all-reduces its flag together with "past
``--exit-duration-in-mins``" (one tiny MAX all-reduce), so all ranks stop after the same
iteration, save and exit 0. A NaN or Inf loss or gradient norm
(``--check-for-nan-in-loss-and-grad``) raises NonFiniteError on every rank: both values are
already reduced over the ranks that share them, so every rank reaches the same verdict
without a collective.
"""
from __future__ import annotations

import math
import signal
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_mesh.training.job.device import device

if TYPE_CHECKING:
    from megatron_mesh.training.config.training_config import TrainingConfig

JOB_START = time.monotonic()  # import time of the driver: the clock --exit-duration-in-mins reads


class NonFiniteError(RuntimeError):
    """Training reached a NaN or Inf loss or gradient norm; nothing of it was saved."""


def check_finite(iteration: int, loss: float, grad_norm: float | None) -> None:
    """Raise NonFiniteError naming the iteration and the value that is not finite.

    grad_norm is None when fp16's loss scaler skipped the step (its own business)."""
    for name, value in (("lm loss", loss), ("grad norm", grad_norm)):
        if value is not None and not math.isfinite(value):
            raise NonFiniteError(
                f"iteration {iteration}: {name} is {value}; stopping without saving this state "
                "(resume from the last checkpoint with a lower --lr or more warmup; "
                "--no-check-for-nan-in-loss-and-grad trains on)")


class ExitConditions:
    """The signal flag and the time limit, agreed on by every rank at the end of an iteration."""

    def __init__(self, args: TrainingConfig) -> None:
        self.signal_name = args.stopping.exit_signal if args.stopping.exit_signal_handler else None
        self.deadline = (JOB_START + 60 * args.stopping.exit_duration_in_mins
                         if args.stopping.exit_duration_in_mins else None)
        self.received = False
        self._previous = None
        if self.signal_name:
            signum = getattr(signal, self.signal_name)
            self._previous = (signum, signal.signal(signum, self._handle))

    def _handle(self, signum: int, frame: object) -> None:
        self.received = True

    @property
    def active(self) -> bool:
        return self.signal_name is not None or self.deadline is not None

    def reason(self) -> str | None:
        """Why every rank stops now ('SIGTERM received', 'time limit'), or None to go on."""
        if not self.active:
            return None
        flags = torch.tensor([float(self.received),
                              float(self.deadline is not None and time.monotonic() > self.deadline)],
                             device=device())
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0]:
            return f"{self.signal_name} received"
        if flags[1]:
            return "--exit-duration-in-mins reached"
        return None

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(*self._previous)
            self._previous = None
