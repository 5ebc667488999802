"""Pipeline parallelism in the driver: what each stage reads, its loss made known to every
rank, and on a CPU the gradient reduction that megatron-core's DDP does on a GPU.

megatron-core's schedules do the pipelining (1F1B over the micro-batches, activations sent
between stages as [s / CP, b, h] tensors). Its 1F1B runs the forward passes of later
micro-batches before the backward passes of earlier ones, which torch's
DistributedDataParallel (its reduction is armed in forward) cannot follow, and megatron-core's
own DDP needs CUDA; so on a CPU with PP > 1 the gradients are reduced once, after the last
micro-batch, by `finalize_grads`, which the schedule calls in place of megatron-core's
finalize_model_grads.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["batch_keys", "finalize_grads", "report_to_all_stages"]

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


def _reduce_coalesced(grads: list[torch.Tensor], group: dist.ProcessGroup,
                      scale: float) -> None:
    """Sum tensors over `group` in one collective and multiply them by `scale`."""
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat *= scale
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)


def _global_token_count(num_tokens: torch.Tensor, dp_cp: dist.ProcessGroup) -> float:
    """The global batch's token count: the last stage's count (the schedule's sum over its
    micro-batches) on every stage, summed over the DP x CP group."""
    total = num_tokens.detach().clone().to(torch.float64)
    total = report_to_all_stages(total)
    dist.all_reduce(total, group=dp_cp)
    return total.item()


def _tied_embedding_weight(gpt: torch.nn.Module) -> torch.nn.Parameter | None:
    """The word embeddings a first / last stage of a GPTModel (unwrapped: `finalize_grads`
    serves the unwrapped model of `model.wrap_model`) shares with the other (None if untied)."""
    if not gpt.share_embeddings_and_output_weights:
        return None
    return gpt.shared_embedding_or_output_weight()


def finalize_grads(model: list[torch.nn.Module], num_tokens: torch.Tensor | None = None,
                   pg_collection: object = None, force_all_reduce: bool = False) -> None:
    """megatron-core's ``finalize_model_grads_func`` on a CPU without its DDP: reduce every
    gradient over the data-parallel-with-CP group, then sum the tied word embeddings'
    gradients over the embedding group (first and last stage).

    Without `num_tokens` the loss is a per-rank mean and the gradients are averaged (what
    DDP does at PP = 1); with it (--calculate-per-token-loss, the schedule's token count of
    this rank) the loss is a per-rank sum, and the gradients are summed and divided by the
    global batch's token count, as megatron-core's finalize_model_grads does. The other
    arguments are the schedule's and are not needed here.
    """
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if num_tokens is None:
        scale = 1.0 / dist.get_world_size(dp_cp)
    else:
        scale = 1.0 / max(_global_token_count(num_tokens, dp_cp), 1.0)
    embedding = parallel_state.get_embedding_group(check_initialized=False)
    for chunk in model:
        grads = [p.grad for p in chunk.parameters() if p.grad is not None]
        if grads and (dist.get_world_size(dp_cp) > 1 or scale != 1.0):
            _reduce_coalesced(grads, dp_cp, scale)
        weight = _tied_embedding_weight(chunk)
        if (weight is not None and weight.grad is not None and embedding is not None
                and parallel_state.is_rank_in_embedding_group()
                and dist.get_world_size(embedding) > 1):
            dist.all_reduce(weight.grad, group=embedding)
