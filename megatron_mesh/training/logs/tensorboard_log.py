"""TensorBoard event files of a run, written on the last rank as Megatron-LM does.

torch's ``SummaryWriter`` (the `tensorboard` package) writes them; TensorBoard's own
``EventAccumulator`` reads them back. Series, by iteration: the wandb keys of the log line
(``lm loss``, ``learning-rate``, ``grad-norm``, ``throughput/...``, ``memory/peak-bytes``,
``attention/traffic-bytes-per-rank``) and ``batch-size`` every --tensorboard-log-interval
iterations; ``iteration-time`` (seconds) with --log-timers-to-tensorboard; ``world-size``
with --log-world-size-to-tensorboard; ``lm loss validation`` and ``lm loss test`` (and their
``... ppl`` with --log-validation-ppl-to-tensorboard), plus ``... vs samples`` over the
consumed training samples, at each evaluation.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_mesh.training.config.training_config import TrainingConfig


class TensorBoardLogger:
    """A SummaryWriter on --tensorboard-dir when `enabled` (the last rank), else nothing."""

    def __init__(self, args: TrainingConfig, enabled: bool) -> None:
        self.args = args
        self.writer = None
        if not (enabled and args.logging.tensorboard_dir):
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's writer needs the tensorboard package
            raise RuntimeError("--tensorboard-dir needs the tensorboard package: "
                               "pip install tensorboard") from e
        self.writer = SummaryWriter(log_dir=args.logging.tensorboard_dir,
                                    max_queue=args.logging.tensorboard_queue_size)

    def iteration(self, metrics: dict, iteration: int, seconds: float) -> None:
        """One training iteration's figures (every --tensorboard-log-interval)."""
        if self.writer is None or iteration % self.args.tensorboard_log_interval:
            return
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, iteration)
        self.writer.add_scalar("batch-size", self.args.global_batch_size, iteration)
        if self.args.log_timers_to_tensorboard:
            self.writer.add_scalar("iteration-time", seconds, iteration)
        if self.args.log_world_size_to_tensorboard:
            self.writer.add_scalar("world-size", self.args.world_size, iteration)

    def evaluation(self, loss: float, ppl: float, iteration: int, consumed_samples: int,
                   split: str) -> None:
        """A validation / test pass: 'lm loss {split}' by iteration and vs samples."""
        if self.writer is None:
            return
        key = f"lm loss {split}"
        self.writer.add_scalar(key, loss, iteration)
        self.writer.add_scalar(f"{key} vs samples", loss, consumed_samples)
        if self.args.log_validation_ppl_to_tensorboard:
            self.writer.add_scalar(f"{key} ppl", ppl, iteration)
            self.writer.add_scalar(f"{key} ppl vs samples", ppl, consumed_samples)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
