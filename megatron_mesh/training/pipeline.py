"""Pipeline parallelism in the driver: what each stage reads, and its loss made known to
every rank.

megatron-core's schedules do the pipelining (1F1B over the micro-batches, activations sent
between stages as [s / CP, b, h] tensors); its DDP's finalize step reduces the gradients
after the last micro-batch, on every device (`model.wrap_model`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

__all__ = ["batch_keys", "report_to_all_stages"]

_FIRST_STAGE_KEYS = ("tokens", "position_ids")
_LAST_STAGE_KEYS = ("labels", "loss_mask")


def batch_keys() -> tuple[str, ...]:
    """The batch fields this stage reads: token ids and positions on the first stage,
    labels and loss mask on the last (all four without PP, none on a middle stage)."""
    keys: tuple[str, ...] = ()
    if parallel_state.is_pipeline_first_stage():
        keys += _FIRST_STAGE_KEYS
    if parallel_state.is_pipeline_last_stage():
        keys += _LAST_STAGE_KEYS
    return keys


def report_to_all_stages(total: torch.Tensor) -> torch.Tensor:
    """The last stage's reduced loss figures on every stage (zeros elsewhere are summed over
    the pipeline group), so that every rank logs and checks the same number."""
    group = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_world_size(group) > 1:
        if not parallel_state.is_pipeline_last_stage():
            total = torch.zeros_like(total)
        dist.all_reduce(total, group=group)
    return total
