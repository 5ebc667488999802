"""A megatron-core GPTModel on CP ranks against the same model at CP = 1 (run inside a gloo
rank of `dist_utils.run_distributed`): the batch, the loss and gradients, the comparison."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


def random_batch(batch: int, seq: int, vocab: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A seeded batch ([b, s] tokens, labels, loss mask with ~20% masked, positions) and its
    loss denominator (the unmasked token count)."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    full = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": (torch.rand(batch, seq, generator=g) > 0.2).float(),
            "position_ids": torch.arange(seq).expand(batch, seq).contiguous()}
    return full, full["loss_mask"].sum()


def loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                   denominator: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The masked loss over `denominator` tokens and every parameter's gradient."""
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss = (per_token * batch["loss_mask"]).sum() / denominator
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def init_parallel(cp: int) -> None:
    """Megatron's groups for TP = PP = 1 and `cp` CP ranks, the mesh grids cleared."""
    from megatron.core import parallel_state as ps

    from megatron_mesh.megatron.groups import destroy_mesh_grids

    destroy_mesh_grids()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, context_parallel_size=cp, create_gloo_process_groups=False)


def compare_on_grids(reference: torch.nn.Module, build: Callable[[], torch.nn.Module],
                     grids: list[tuple[int, ...]], world: int, heads: int, kv_heads: int,
                     seq: int, full: dict[str, torch.Tensor], denominator: torch.Tensor,
                     describe: Callable[[torch.nn.Module], dict]) -> dict[tuple[int, ...], dict]:
    """For each grid: `build()` on `world` CP ranks with the reference's weights, its loss
    and gradients summed over CP (as finalize_model_grads does) against the reference's:
    {grid: {"loss": (mesh, reference), "grad_err": largest relative error, "grad_errs":
    {parameter: its relative error}, **describe(model)}}."""
    from megatron.core import parallel_state as ps

    from megatron_mesh.megatron import initialize_mesh_grids
    from megatron_mesh.megatron.compat import get_batch_on_this_cp_rank

    ref_loss, ref_grads = loss_and_grads(reference, full, denominator)
    out = {}
    for shape in grids:
        init_parallel(world)
        initialize_mesh_grids(shape, num_attention_heads=heads, num_query_groups=kv_heads,
                              seq_length=seq)
        model = build()
        model.load_state_dict(reference.state_dict())
        loss, grads = loss_and_grads(model, get_batch_on_this_cp_rank(dict(full)), denominator)
        group = ps.get_context_parallel_group()
        dist.all_reduce(loss, group=group)
        for t in grads.values():
            dist.all_reduce(t, group=group)
        errors = {n: (grads[n] - ref_grads[n]).abs().max().item()
                  / (ref_grads[n].abs().max().item() + 1e-6) for n in grads}
        out[shape] = {
            "loss": (loss.item(), ref_loss.item()),
            "grad_err": max(errors.values()),
            "grad_errs": errors,
            **describe(model),
        }
    return out
