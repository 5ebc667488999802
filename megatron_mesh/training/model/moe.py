"""Mixture of experts in the driver: Megatron-LM's MoE flags, their checks, megatron-core's
MoE layer spec and config, and the auxiliary (load-balancing) loss as Megatron-LM logs it.

The experts are megatron-core's: with `--num-experts N` every layer's MLP is its MoELayer
(a TopKRouter and, on a CPU or without grouped GEMM, SequentialMLP experts: one MLP per
expert, run one after another). What needs a GPU is refused on a CPU before any process
group exists: `--moe-grouped-gemm` (Transformer Engine's GroupedLinear, or the grouped_gemm
package's CUDA kernels), `--moe-token-dispatcher-type flex` (DeepEP / HybridEP) and alltoall
(megatron-core's dispatcher creates a CUDA stream); allgather, the default, runs on a CPU,
also with --expert-model-parallel-size > 1.
"""
from __future__ import annotations

import argparse
import importlib.util
from typing import TYPE_CHECKING, Any

from megatron_mesh.training.job.device import has_cuda

if TYPE_CHECKING:
    from megatron_mesh.training.config.training_config import TrainingConfig

LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
DISPATCHERS = ("allgather", "alltoall", "flex")
AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss",
                  "seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}
"""The name under which megatron-core's router tracks (and Megatron-LM logs) each aux loss."""

DEFAULTS: dict[str, Any] = {
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": None,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_grouped_gemm": False,
    "expert_model_parallel_size": 1,
    "moe_token_dispatcher_type": "allgather",
}
"""Megatron-LM's defaults of the MoE flags that take effect with --num-experts."""


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    """The mixture-of-experts flags, named and defaulted as in Megatron-LM."""
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None,
                   help="experts per MoE layer (megatron-core's MoELayer in every layer)")
    g.add_argument("--moe-router-topk", type=int, default=DEFAULTS["moe_router_topk"],
                   help="experts each token is routed to")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's hidden size (default --ffn-hidden-size)")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=LOAD_BALANCING, help="the router's load balancing")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="scale of the load-balancing loss added to the LM loss")
    g.add_argument("--moe-grouped-gemm", action=argparse.BooleanOptionalAction, default=False,
                   help="all local experts in one grouped GEMM (needs a GPU)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="ranks the experts are divided among")
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=DISPATCHERS,
                   help="how tokens travel to their experts (flex needs a GPU)")


def check_moe_args(args: argparse.Namespace, world_size: int) -> None:
    """ValueError with one line naming the value and what is valid; fills
    --moe-ffn-hidden-size. Runs after --ffn-hidden-size is derived."""
    experts = args.num_experts
    if experts is None:
        for name, default in DEFAULTS.items():
            if getattr(args, name) != default:
                raise ValueError(f"{_flag(name)} {getattr(args, name)} needs --num-experts "
                                 "(it configures the mixture-of-experts layers)")
        return
    if experts < 1:
        raise ValueError(f"--num-experts {experts}: must be a positive integer")
    if not 1 <= args.moe_router_topk <= experts:
        raise ValueError(f"--moe-router-topk {args.moe_router_topk}: must be between 1 and "
                         f"--num-experts {experts}")
    if args.moe_router_topk == 1 and args.moe_router_load_balancing_type != "sinkhorn":
        raise ValueError("--moe-router-topk 1: megatron-core's softmax router needs "
                         "--moe-router-pre-softmax for top-1 routing, which this driver does "
                         "not take; use --moe-router-topk 2 or more, or "
                         "--moe-router-load-balancing-type sinkhorn")
    if args.moe_aux_loss_coeff < 0:
        raise ValueError(f"--moe-aux-loss-coeff {args.moe_aux_loss_coeff}: must be >= 0")
    if args.moe_router_load_balancing_type == "sinkhorn" and args.moe_aux_loss_coeff:
        raise ValueError(f"--moe-aux-loss-coeff {args.moe_aux_loss_coeff} with "
                         "--moe-router-load-balancing-type sinkhorn: sinkhorn routing takes no "
                         "aux loss; use 0")
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    elif args.moe_ffn_hidden_size < 1:
        raise ValueError(f"--moe-ffn-hidden-size {args.moe_ffn_hidden_size}: must be a "
                         "positive integer")
    if (args.reset_attention_mask and args.pipeline_model_parallel_size > 1
            and args.moe_token_dispatcher_type == "allgather"):
        raise ValueError("--moe-token-dispatcher-type allgather with --reset-attention-mask and "
                         "pipeline stages: megatron-core takes micro-batches of varying length "
                         "only with the alltoall dispatcher (a GPU's); use "
                         "--moe-token-dispatcher-type alltoall")
    _check_expert_parallel(args, world_size)
    _check_device(args)


def balancing_per_micro_batch(args: argparse.Namespace) -> str | None:
    """Why the routers' results depend on which tokens share a micro-batch (None when they
    do not: without --num-experts, or top-k routing without a load-balancing loss, which
    routes each token by its own logits): megatron-core computes the load-balancing loss
    over each micro-batch's tokens (the expert counts of the micro-batch times its mean
    router probabilities; global_aux_loss averages the counts over the micro-batches run
    so far), and sinkhorn routing balances each micro-batch's tokens."""
    if getattr(args, "num_experts", None) is None:
        return None
    kind = args.moe_router_load_balancing_type
    if kind == "sinkhorn":
        return ("--moe-router-load-balancing-type sinkhorn routes by balancing each "
                "micro-batch's tokens")
    if kind in AUX_LOSS_NAMES and args.moe_aux_loss_coeff > 0:
        return (f"megatron-core computes the load-balancing loss ({kind}, --moe-aux-loss-coeff "
                f"{args.moe_aux_loss_coeff:g}) over each micro-batch's tokens")
    return None


def _check_expert_parallel(args: argparse.Namespace, world_size: int) -> None:
    ep, experts = args.expert_model_parallel_size, args.num_experts
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if ep < 1 or experts % ep:
        raise ValueError(f"--expert-model-parallel-size {ep}: must divide --num-experts "
                         f"{experts}")
    if (world_size // pp) % (ep * tp):
        raise ValueError(f"--expert-model-parallel-size {ep}: expert x tensor parallel "
                         f"{ep * tp} must divide the {world_size // pp} ranks of a pipeline "
                         "stage")
    if tp > 1 and not args.sequence_parallel:  # megatron-core's MoELayer refuses it in training
        raise ValueError(f"--num-experts {experts} with --tensor-model-parallel-size {tp} needs "
                         "--sequence-parallel (as in Megatron-LM)")


def check_saved_experts(common: dict[str, Any], path: str, args: TrainingConfig) -> None:
    """CheckpointError when the checkpoint's optimizer state cannot load for this run's
    --expert-model-parallel-size: megatron-core steps experts in a second (chained)
    optimizer with EP > 1 only, whose state is keyed apart from EP 1's."""
    from megatron_mesh.training.checkpoints.checksums import CheckpointError

    saved, ep = common.get("expert_model_parallel_size", 1), args.moe.expert_model_parallel_size
    if (saved > 1) != (ep > 1):
        raise CheckpointError(
            f"checkpoint {path} holds optimizer state saved with --expert-model-parallel-size "
            f"{saved}, which does not load with {ep} (megatron-core chains a separate expert "
            "optimizer with EP > 1 only): resume with EP "
            f"{'> 1' if saved > 1 else '1'}, or load the weights only with --no-load-optim")


def _check_device(args: argparse.Namespace) -> None:
    """Refuse what needs a GPU on a CPU, grouped GEMM without its kernels, and linear biases
    in megatron-core's local experts."""
    te = importlib.util.find_spec("transformer_engine") is not None
    te_layers = args.transformer_impl != "local" and te and has_cuda()
    if not args.disable_bias_linear and not te_layers:
        raise ValueError("--num-experts with linear biases (no --disable-bias-linear) in "
                         "megatron-core's local layers: its SequentialMLP adds the expert "
                         "bias in place on a view autograd refuses (megatron-core 0.16 to "
                         "0.19); add --disable-bias-linear, or run Transformer Engine layers "
                         "on a GPU")
    if args.moe_grouped_gemm:
        if not has_cuda():
            raise ValueError("--moe-grouped-gemm needs a GPU (Transformer Engine's "
                             "GroupedLinear or the grouped_gemm package's CUDA kernels); on a "
                             "CPU drop it: the experts run as megatron-core's SequentialMLP")
        if not te and importlib.util.find_spec("grouped_gemm") is None:
            raise ValueError("--moe-grouped-gemm needs Transformer Engine or the grouped_gemm "
                             "package, neither is installed; drop it (SequentialMLP experts)")
    if args.moe_token_dispatcher_type == "flex" and not has_cuda():
        raise ValueError("--moe-token-dispatcher-type flex needs a GPU (DeepEP / HybridEP); "
                         "on a CPU use allgather")
    if args.moe_token_dispatcher_type == "alltoall" and not has_cuda():
        raise ValueError("--moe-token-dispatcher-type alltoall needs a GPU (megatron-core's "
                         "alltoall dispatcher creates a CUDA stream); on a CPU use allgather")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def moe_config(args: TrainingConfig) -> dict[str, Any]:
    """TransformerConfig keywords of the MoE flags ({} without --num-experts)."""
    if args.moe.num_experts is None:
        return {}
    return {
        "num_moe_experts": args.moe.num_experts,
        "moe_router_topk": args.moe.moe_router_topk,
        "moe_ffn_hidden_size": args.moe.moe_ffn_hidden_size,
        "moe_router_load_balancing_type": args.moe.moe_router_load_balancing_type,
        "moe_aux_loss_coeff": args.moe.moe_aux_loss_coeff,
        "moe_grouped_gemm": args.moe.moe_grouped_gemm,
        "expert_model_parallel_size": args.moe.expert_model_parallel_size,
        "moe_token_dispatcher_type": args.moe.moe_token_dispatcher_type,
    }


def moe_spec(args: TrainingConfig) -> dict[str, Any]:
    """Layer-spec keywords (megatron-core's get_gpt_layer_*_spec) of the MoE flags."""
    if args.moe.num_experts is None:
        return {}
    from megatron_mesh.megatron.compat import define_moe_names_without_te

    define_moe_names_without_te()
    return {"num_experts": args.moe.num_experts, "moe_grouped_gemm": args.moe.moe_grouped_gemm}


def moe_label(args: TrainingConfig) -> str:
    """'MoE 4 experts, top 2, ...' for the start-up banner ('' without --num-experts)."""
    if args.moe.num_experts is None:
        return ""
    experts = "grouped GEMM" if args.moe.moe_grouped_gemm else "SequentialMLP"
    return (f"MoE {args.moe.num_experts} experts ({experts}, hidden {args.moe.moe_ffn_hidden_size}), "
            f"top {args.moe.moe_router_topk}, {args.moe.moe_router_load_balancing_type} coeff "
            f"{args.moe.moe_aux_loss_coeff:g}, EP {args.moe.expert_model_parallel_size}, "
            f"{args.moe.moe_token_dispatcher_type} dispatcher")


def router_padding_mask(batch: dict, model: Any) -> dict[str, Any]:
    """GPTModel.forward's `padding_mask` keyword ({} when the batch has none): the packer's
    [1, t] mask (True: a padding token) that megatron-core's routers (0.16 to 0.19) leave out
    of the load-balancing loss. GPTModel splits it over TP under sequence parallelism on the
    first pipeline stage only; a later stage's is split here, as the hidden states are."""
    mask = batch.get("padding_mask")
    if mask is None:
        return {}
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model

    config = get_attr_wrapped_model(model, "config")
    if config.sequence_parallel and not parallel_state.is_pipeline_first_stage():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        n = mask.shape[1] // tp
        rank = parallel_state.get_tensor_model_parallel_rank()
        mask = mask[:, rank * n:(rank + 1) * n]
    return {"padding_mask": mask}


def aux_loss_names(args: TrainingConfig) -> list[str]:
    """The aux losses Megatron-LM logs for this run (none without --num-experts)."""
    if args.moe.num_experts is None:
        return []
    name = AUX_LOSS_NAMES.get(args.moe.moe_router_load_balancing_type)
    return [name] if name else []


def aux_losses(args: TrainingConfig) -> dict[str, float]:
    """This iteration's aux losses, as Megatron-LM's training_log reads them: megatron-core's
    tracker reduced over the ranks, each layer's loss (without its coefficient) summed over
    the micro-batches scaled by 1 / micro-batches, averaged over the MoE layers; the tracker
    is cleared for the next iteration. `args` is the step's own (during --rampup-batch-size
    a step runs fewer micro-batches than args.num_microbatches). A collective: every rank
    calls it."""
    names = aux_loss_names(args)
    if not names:
        return {}
    from megatron.core.transformer.moe import moe_utils

    totals: dict[str, Any] = {}
    kwargs = dict(loss_scale=1.0 / args.derived.num_microbatches, iteration=0, writer=None,
                  total_loss_dict=totals, force_initialize=True, track_names=names,
                  num_layers=args.model.num_layers)
    if hasattr(moe_utils, "get_moe_metrics_tracker"):  # megatron-core >= 0.17
        moe_utils.get_moe_metrics_tracker().report(**kwargs)
    else:
        moe_utils.track_moe_metrics(**kwargs)  # both clear the tracker after reading it
    return {name: float(value) for name, value in totals.items() if name in names}
