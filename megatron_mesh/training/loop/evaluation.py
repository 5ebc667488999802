"""Validation and test passes: forward only, on the training's own CP / mesh layout.

A pass runs --eval-iters global batches through megatron-core's schedule with
``forward_only=True`` (the same micro-batches, CP split and loss as training) and reduces
(loss sum, token count) over the whole batch, as the training loss is. Validation pass k
(counted from 0 over the run: one every --eval-interval iterations, one at the end) reads
validation samples [k * eval_iters * GBS, (k + 1) * eval_iters * GBS), so a resumed run
evaluates on the samples the unbroken run would have. When the last iteration is itself a
validation iteration, the final "on validation set" pass is that iteration's pass (the same
samples, the same model): its value is printed again under the final name, and the loggers
get it once, so no tag holds two values at one step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from megatron_mesh.training.data.datasets import micro_batches
from megatron_mesh.training.job.distributed import print_rank0
from megatron_mesh.training.logs.metrics import perplexity
from megatron_mesh.training.loop.step import global_batch, global_loss

if TYPE_CHECKING:
    from megatron_mesh.training.config.training_config import TrainingConfig
    from megatron_mesh.training.logs.metrics import Loggers

def evaluation_line(prefix: str, loss: float) -> str:
    """Megatron-LM's three lines: dashes, ' validation loss at PREFIX | lm loss value: X |
    lm loss PPL: Y | ', dashes."""
    text = (f" validation loss at {prefix} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {perplexity(loss):.6E} | ")
    rule = "-" * (len(text) + 1)
    return f"{rule}\n{text}\n{rule}"


def evaluate(model: torch.nn.Module, dataset: Any, first_sample: int,
             args: TrainingConfig) -> float:
    """Mean token loss over --eval-iters global batches of `dataset` from `first_sample`,
    on every rank; the model is left in training mode."""
    data = micro_batches(dataset, args, first_sample)
    reports: list[dict] = []
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(args.evaluation.eval_iters):
                reports += global_batch(model, data, args, forward_only=True)
    finally:
        model.train()
    return global_loss(reports)


class Evaluator:
    """The run's validation and test passes, printed and sent to the loggers."""

    def __init__(self, model: torch.nn.Module, valid: Any, test: Any, args: TrainingConfig,
                 loggers: Loggers) -> None:
        self.model, self.valid, self.test, self.args = model, valid, test, args
        self.loggers = loggers
        self._batch = args.evaluation.eval_iters * args.training.global_batch_size  # samples per pass
        self._passes: dict[int, float] = {}  # iteration -> its validation loss, this run

    def due(self, iteration: int) -> bool:
        """Whether training validates after `iteration` (every --eval-interval)."""
        return (self.valid is not None and self.args.evaluation.eval_iters > 0
                and iteration % self.args.evaluation.eval_interval == 0)

    def validate(self, iteration: int, consumed_samples: int, prefix: str | None = None,
                 index: int | None = None) -> float:
        """Validation pass number `index` (default: the one of `iteration`), logged as
        'validation loss at PREFIX' (default 'iteration N')."""
        index = iteration // self.args.evaluation.eval_interval - 1 if index is None else index
        loss = evaluate(self.model, self.valid, index * self._batch, self.args)
        print_rank0(evaluation_line(prefix or f"iteration {iteration}", loss))
        self.loggers.validation(loss, iteration, consumed_samples, "validation")
        self._passes[iteration] = loss
        return loss

    def finish(self, iteration: int, consumed_samples: int) -> None:
        """Megatron-LM's passes after training: the validation set, then the test set. At a
        validation iteration the validation set's pass is that iteration's (`_final_index`),
        reused when this run made it."""
        if self.valid is not None and self.args.evaluation.eval_iters > 0:
            prefix = f"iteration {iteration} on validation set"
            if iteration in self._passes:  # the same evaluation: printed, logged once
                print_rank0(evaluation_line(prefix, self._passes[iteration]))
            else:
                self.validate(iteration, consumed_samples, prefix,
                              index=self._final_index(iteration))
        if self.test is not None and self.args.evaluation.eval_iters > 0:
            loss = evaluate(self.model, self.test, 0, self.args)
            print_rank0(evaluation_line(f"iteration {iteration} on test set", loss))
            self.loggers.validation(loss, iteration, consumed_samples, "test")

    def _final_index(self, iteration: int) -> int:
        """The final validation pass's number: with --skip-train the first; at a validation
        iteration that iteration's own (a run resumed at its last iteration logs the value
        the run that reached it logged); else the next one."""
        if self.args.training.skip_train:
            return 0
        passes, rest = divmod(iteration, self.args.evaluation.eval_interval)
        return passes - 1 if rest == 0 and passes > 0 else passes
