"""Model FLOPs of one training iteration (the formula is in docs/training.md)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_mesh.training.arguments import TrainingConfig


def flops_per_token_forward(args: TrainingConfig, vocab_size: int) -> float:
    """Forward FLOPs per token: matmuls count 2 per multiply-add; causal attention is halved."""
    h, s, d = args.hidden_size, args.seq_length, args.kv_channels
    q_width = args.num_attention_heads * d
    kv_width = args.num_query_groups * d
    mlp_mats = 3 if args.swiglu else 2
    per_layer = (
        2 * h * (q_width + 2 * kv_width)      # Q, K, V projections
        + 2 * 2 * s * q_width / 2             # Q K^T and P V over s keys, causal: half
        + 2 * q_width * h                     # output projection
        + 2 * mlp_mats * h * args.ffn_hidden_size  # MLP
    )
    return args.num_layers * per_layer + 2 * h * vocab_size  # + logits


def flops_per_iteration(args: TrainingConfig, vocab_size: int) -> float:
    """Forward + backward (2x forward) over one global batch."""
    tokens = args.global_batch_size * args.seq_length
    return 3 * tokens * flops_per_token_forward(args, vocab_size)
