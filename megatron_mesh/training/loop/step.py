"""One micro-batch's forward and loss, and the global batch's loss: what training and
evaluation share (megatron-core's forward_step_func and loss function)."""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_mesh.megatron.core_attention import plan_micro_batch
from megatron_mesh.training.job.device import device
from megatron_mesh.training.model.moe import router_padding_mask
from megatron_mesh.training.model.pipeline import report_to_all_stages

if TYPE_CHECKING:
    from megatron_mesh.training.config.training_config import TrainingConfig


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, per_token_loss: bool = False):
    """(loss, token count, {"lm loss": [loss sum, token count]}) of this rank's micro-batch
    (the loss over its CP chunks), as megatron-core's schedules take it.

    The schedule divides the loss by the count (and the number of micro-batches) unless
    ``per_token_loss``; gradients are then averaged over the DP x CP group. So that the
    loss of a micro-batch is the mean over ALL its unmasked tokens whatever CP is (with
    --eod-mask-loss the CP chunks hold different numbers of them), the count is summed over
    the CP group and the sum scaled by the CP size: averaging over CP then gives
    (sum over CP of the sums) / (count over CP). With ``per_token_loss``
    (--calculate-per-token-loss) the loss is the plain sum and the count this rank's; the
    schedule adds the counts up and the gradient reduction divides the summed gradients by
    the global batch's token count.
    """
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses * mask)
    count = mask.sum()
    report = torch.stack([loss_sum.detach().clone(), count.detach().clone()])
    cp_group = parallel_state.get_context_parallel_group()
    cp = dist.get_world_size(cp_group)
    if per_token_loss or cp == 1:
        return loss_sum, count.detach().to(torch.int), {"lm loss": report}
    total = count.detach().clone()
    dist.all_reduce(total, group=cp_group)
    return loss_sum * cp, total.to(torch.int), {"lm loss": report}


def forward_step(data_iterator: Iterator[dict], model: torch.nn.Module,
                 per_token_loss: bool = False):
    """megatron-core's forward_step_func: GPT forward on the next micro-batch (the fields
    this pipeline stage reads; a later stage's input comes from the previous stage; the
    packed documents' padding mask for a mixture of experts' routers), its attention blocks
    planned first (`core_attention.plan_micro_batch`)."""
    batch = next(data_iterator)
    # this rank's blocks of the micro-batch's documents, made once before the first layer
    plan_micro_batch(model, batch.get("packed_seq_params"), device())
    output = model(batch.get("tokens"), batch.get("position_ids"), None,
                   labels=batch.get("labels"), packed_seq_params=batch.get("packed_seq_params"),
                   **router_padding_mask(batch, model))
    return output, partial(loss_func, batch.get("loss_mask"), per_token_loss=per_token_loss)


def global_batch(model: torch.nn.Module, data_iterator: Iterator[dict], args: TrainingConfig,
                 forward_only: bool) -> list[dict]:
    """megatron-core's forward/backward schedule over one global batch of `data_iterator`
    (`forward_step` on each micro-batch): the last stage's reports (`loss_func`)."""
    return get_forward_backward_func()(
        forward_step_func=partial(forward_step, per_token_loss=args.training.calculate_per_token_loss),
        data_iterator=data_iterator,
        model=[model],
        num_microbatches=args.derived.num_microbatches,
        seq_length=args.training.seq_length,
        micro_batch_size=args.training.micro_batch_size,
        forward_only=forward_only,
    )


def global_loss(reports: list[dict]) -> float:
    """Mean token loss over the global batch (all micro-batches, DP and CP ranks), on every
    rank: only the last pipeline stage has reports."""
    total = torch.zeros(2, dtype=torch.float64, device=device())  # NCCL reduces device tensors
    if reports:
        total = torch.stack([r["lm loss"] for r in reports]).sum(0).double()
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dist.all_reduce(total, group=group)
    total = report_to_all_stages(total)
    return (total[0] / total[1].clamp(min=1)).item()
