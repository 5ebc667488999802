"""Model FLOPs of one training iteration (the formula is in docs/training.md)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_mesh.training.config.training_config import TrainingConfig


def _qkv_projection_flops(args: TrainingConfig) -> float:
    """Forward FLOPs per token of the projections that make Q, K and V from the hidden state."""
    h, n_q, d_k = args.model.hidden_size, args.model.num_attention_heads, args.derived.k_channels
    if not args.model.multi_latent_attention:
        return 2 * h * (n_q + 2 * args.model.num_query_groups) * d_k
    r_q, r_kv = args.model.q_lora_rank, args.model.kv_lora_rank
    q = 2 * h * n_q * d_k if r_q is None else 2 * h * r_q + 2 * r_q * n_q * d_k
    kv_down = 2 * h * (r_kv + args.model.qk_pos_emb_head_dim)  # latent + the shared RoPE key part
    kv_up = 2 * r_kv * n_q * (args.model.qk_head_dim + args.derived.v_channels)
    return q + kv_down + kv_up


def _mlp_width(args: TrainingConfig) -> int:
    """The MLP hidden width a token passes through: --ffn-hidden-size, or with experts its
    top-k experts' --moe-ffn-hidden-size each (Megatron-LM's count: the router not counted)."""
    if args.moe.num_experts is None:
        return args.model.ffn_hidden_size
    return args.moe.moe_router_topk * args.moe.moe_ffn_hidden_size


def flops_per_token_forward(args: TrainingConfig, vocab_size: int) -> float:
    """Forward FLOPs per token: matmuls count 2 per multiply-add; causal attention is halved."""
    h, s, n_q = args.model.hidden_size, args.training.seq_length, args.model.num_attention_heads
    d_k, d_v = args.derived.k_channels, args.derived.v_channels
    mlp_mats = 3 if args.model.swiglu else 2
    per_layer = (
        _qkv_projection_flops(args)           # Q, K, V projections
        + 2 * s * n_q * (d_k + d_v) / 2       # Q K^T and P V over s keys, causal: half
        + 2 * n_q * d_v * h                   # output projection
        + 2 * mlp_mats * h * _mlp_width(args)  # MLP (each token's routed experts)
    )
    return args.model.num_layers * per_layer + 2 * h * vocab_size  # + logits


COUNT_CONVENTION = ("Megatron-LM's count: causal attention over the whole --seq-length, "
                    "not reduced for {what}")


def attention_count_note(args: TrainingConfig) -> str:
    """How the model FLOPs count attention when masks cut it: '' without document masks or a
    window, else the convention (Megatron-LM's num_floating_point_operations counts every
    layer's attention as causal over the whole sequence, whatever the masks; so does this
    driver, so that TFLOP/s compare across the two)."""
    what = [name for flag, name in ((args.data.reset_attention_mask, "document masks"),
                                    (args.model.window_size is not None, "the window"),
                                    (args.masks.attention_chunk_size is not None, "the chunks"),
                                    (args.masks.mesh_mask_builder is not None, "the mask"))
            if flag]
    return COUNT_CONVENTION.format(what=" or ".join(what)) if what else ""


def flops_per_iteration(args: TrainingConfig, vocab_size: int) -> float:
    """Forward + backward (2x forward) over one global batch; --reset-attention-mask and
    --window-size do not change it (`attention_count_note`)."""
    tokens = args.training.global_batch_size * args.training.seq_length
    return 3 * tokens * flops_per_token_forward(args, vocab_size)
