"""Pipeline parallelism in the driver: what each stage reads, and its loss made known to
every rank.

megatron-core's schedules do the pipelining (1F1B over the micro-batches, activations sent
between stages as [s / CP, b, h] tensors; with --reset-attention-mask [t, 1, h], t varying
from micro-batch to micro-batch, so the stages send each other the shape first:
`variable_seq_lengths`); its DDP's finalize step reduces the gradients after the last
micro-batch, on every device (`model.wrap_model`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

__all__ = ["batch_keys", "report_to_all_stages"]

_FIRST_STAGE_KEYS = ("tokens", "position_ids")
_LAST_STAGE_KEYS = ("labels", "loss_mask")


def batch_keys(documents: bool = False, mask: bool = False) -> tuple[str, ...]:
    """The batch fields this stage reads: token ids and positions on the first stage,
    labels and loss mask on the last (all four without PP, none on a middle stage). With
    `documents` (--reset-attention-mask) every stage reads the token ids: each stage's
    attention layers take the documents the EOD tokens delimit; with `mask`
    (--mesh-mask-builder) the ids and positions the builder takes."""
    keys: tuple[str, ...] = ()
    if parallel_state.is_pipeline_first_stage() or mask:
        keys += _FIRST_STAGE_KEYS
    elif documents:
        keys += ("tokens",)
    if parallel_state.is_pipeline_last_stage():
        keys += _LAST_STAGE_KEYS
    return keys


def varies_in_length(args) -> bool:
    """Whether the stages' activations change length from micro-batch to micro-batch
    (packed documents with PP), so that megatron-core sends their shapes first."""
    return args.reset_attention_mask and args.pipeline_model_parallel_size > 1


def report_to_all_stages(total: torch.Tensor) -> torch.Tensor:
    """The last stage's reduced loss figures on every stage (zeros elsewhere are summed over
    the pipeline group), so that every rank logs and checks the same number."""
    group = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_world_size(group) > 1:
        if not parallel_state.is_pipeline_last_stage():
            total = torch.zeros_like(total)
        dist.all_reduce(total, group=group)
    return total
