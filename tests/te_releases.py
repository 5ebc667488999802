"""Transformer Engine's attention API as released, kept as data (facts read from each
release's wheel): the parameters of `fused_attn_fwd` / `fused_attn_bwd`
(transformer_engine/pytorch/cpp_extensions/fused_attn.py) and the fields of the backend
query's AttentionParams, for the tests of the TE tile kernels."""
from __future__ import annotations

FWD_REQUIRED = [
    "is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv",
    "q", "k", "v", "fake_dtype", "fused_attention_backend",
]
_BWD_REQUIRED_OLD = [
    "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v", "o",
    "d_o", "fake_dtype", "dqkv_dtype", "aux_ctx_tensors", "fused_attention_backend",
]
_BWD_REQUIRED_NEW = [n for n in _BWD_REQUIRED_OLD if n != "dqkv_dtype"]

# name -> (fwd parameters, bwd parameters, bwd required), in signature order.
SIGNATURES = {
    "2.1": (
        FWD_REQUIRED + [
            "attn_bias", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "s_quantizer",
            "o_quantizer", "attn_scale", "dropout", "fast_zero_fill", "qkv_layout",
            "attn_bias_type", "attn_mask_type", "window_size", "rng_gen",
        ],
        _BWD_REQUIRED_OLD + [
            "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "s_quantizer", "dp_quantizer",
            "dqkv_quantizer", "attn_scale", "dropout", "fast_zero_fill", "qkv_layout",
            "attn_bias_type", "attn_mask_type", "window_size", "deterministic",
        ],
        _BWD_REQUIRED_OLD,
    ),
    "2.2": (
        FWD_REQUIRED + [
            "attn_bias", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "page_table_k",
            "page_table_v", "s_quantizer", "o_quantizer", "attn_scale", "dropout",
            "fast_zero_fill", "qkv_layout", "attn_bias_type", "attn_mask_type", "window_size",
            "rng_gen",
        ],
        _BWD_REQUIRED_OLD + [
            "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "s_quantizer", "dp_quantizer",
            "dqkv_quantizer", "attn_scale", "dropout", "fast_zero_fill", "qkv_layout",
            "attn_bias_type", "attn_mask_type", "window_size", "deterministic",
        ],
        _BWD_REQUIRED_OLD,
    ),
    "2.8": (
        FWD_REQUIRED + [
            "attn_bias", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "page_table_k",
            "page_table_v", "s_quantizer", "o_quantizer", "attn_scale", "dropout",
            "fast_zero_fill", "qkv_layout", "attn_bias_type", "attn_mask_type", "softmax_type",
            "window_size", "rng_gen", "softmax_offset",
        ],
        _BWD_REQUIRED_OLD + [
            "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "s_quantizer", "dp_quantizer",
            "dqkv_quantizer", "attn_scale", "dropout", "fast_zero_fill", "qkv_layout",
            "attn_bias_type", "attn_mask_type", "softmax_type", "window_size", "deterministic",
        ],
        _BWD_REQUIRED_OLD,
    ),
    "2.9": (
        FWD_REQUIRED + [
            "attn_bias", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "page_table_k",
            "page_table_v", "s_quantizer", "o_quantizer", "attn_scale", "dropout",
            "fast_zero_fill", "qkv_layout", "attn_bias_type", "attn_mask_type", "softmax_type",
            "window_size", "rng_gen", "softmax_offset", "return_max_logit",
        ],
        _BWD_REQUIRED_OLD + [
            "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "s_quantizer", "dp_quantizer",
            "dqkv_quantizer", "attn_scale", "dropout", "fast_zero_fill", "qkv_layout",
            "attn_bias_type", "attn_mask_type", "softmax_type", "window_size", "deterministic",
        ],
        _BWD_REQUIRED_OLD,
    ),
    "2.10": (
        FWD_REQUIRED + [
            "attn_bias", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "page_table_k",
            "page_table_v", "s_quantizer", "o_quantizer", "attn_scale", "dropout",
            "fast_zero_fill", "qkv_layout", "attn_bias_type", "attn_mask_type", "softmax_type",
            "window_size", "rng_gen", "softmax_offset", "return_max_logit", "cuda_graph",
        ],
        _BWD_REQUIRED_OLD + [
            "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "s_quantizer", "dp_quantizer",
            "dqkv_quantizer", "attn_scale", "dropout", "fast_zero_fill", "qkv_layout",
            "attn_bias_type", "attn_mask_type", "softmax_type", "window_size", "deterministic",
            "cuda_graph",
        ],
        _BWD_REQUIRED_OLD,
    ),
    "2.12": (
        FWD_REQUIRED + [
            "attn_bias", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "page_table_k",
            "page_table_v", "s_quantizer", "o_quantizer", "attn_scale", "dropout",
            "fast_zero_fill", "qkv_layout", "attn_bias_type", "attn_mask_type", "softmax_type",
            "window_size", "bottom_right_diagonal", "rng_gen", "softmax_offset",
            "return_max_logit", "cuda_graph",
        ],
        _BWD_REQUIRED_OLD + [
            "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "s_quantizer", "dp_quantizer",
            "dqkv_quantizer", "attn_scale", "dropout", "fast_zero_fill", "qkv_layout",
            "attn_bias_type", "attn_mask_type", "softmax_type", "window_size",
            "bottom_right_diagonal", "deterministic", "cuda_graph",
        ],
        _BWD_REQUIRED_OLD,
    ),
    "2.15": (
        FWD_REQUIRED + [
            "attn_bias", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "page_table_k",
            "page_table_v", "s_quantizer", "o_quantizer", "attn_scale", "dropout",
            "fast_zero_fill", "qkv_layout", "o_format", "qkv_scale_inv_format",
            "attn_bias_type", "attn_mask_type", "softmax_type", "window_size",
            "bottom_right_diagonal", "rng_gen", "softmax_offset", "return_max_logit",
            "cuda_graph",
        ],
        _BWD_REQUIRED_NEW + [
            "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "s_quantizer", "dp_quantizer",
            "dqkv_quantizer", "attn_scale", "dropout", "fast_zero_fill", "qkv_layout",
            "o_format", "do_format", "dqkv_layout", "qkv_scale_inv_format",
            "do_scale_inv_format", "attn_bias_type", "attn_mask_type", "softmax_type",
            "window_size", "bottom_right_diagonal", "deterministic", "cuda_graph",
        ],
        _BWD_REQUIRED_NEW,
    ),
}

# Every release read, and the signature it has (releases in between share it).
RELEASES = {
    "2.1.0": "2.1", "2.2.0": "2.2", "2.3.0": "2.2", "2.4.0": "2.2", "2.5.0": "2.2",
    "2.6.0.post1": "2.2", "2.7.0": "2.2", "2.8.0": "2.8", "2.9.0": "2.9", "2.10.0": "2.10",
    "2.11.0": "2.10", "2.12.0": "2.12", "2.13.0": "2.12", "2.14.1": "2.12", "2.15.0": "2.15",
    "2.16.1": "2.15", "2.17.1": "2.15", "2.18.0": "2.15", "2.19.0": "2.15", "2.20.2": "2.15",
}

BACKEND = object()  # stands in for FusedAttnBackend["F16_arbitrary_seqlen"] (opaque here)
TE_BF16 = object()  # stands in for TE's DType.kBFloat16 (opaque here)


# TE's AttentionParams fields (the backend query's input), read from the wheels of these
# releases (2.1: transformer_engine/pytorch/attention.py; 2.2:
# transformer_engine/pytorch/dot_product_attention/utils.py; 2.5 and later:
# transformer_engine/pytorch/attention/dot_product_attention/utils.py).
_AP_21 = [
    "qkv_type", "qkv_dtype", "qkv_layout", "batch_size", "num_heads", "num_gqa_groups",
    "max_seqlen_q", "max_seqlen_kv", "head_dim_qk", "head_dim_v", "attn_mask_type",
    "window_size", "alibi_slopes_shape", "core_attention_bias_type",
    "core_attention_bias_shape", "core_attention_bias_requires_grad", "pad_between_seqs",
    "attention_dropout", "context_parallel", "deterministic", "is_training", "fp8", "fp8_meta",
]
_AP_25 = _AP_21 + ["inference_params"]
_AP_210 = _AP_25[:19] + ["cp_comm_type"] + _AP_25[19:] + [
    "softmax_type", "return_max_logit", "cuda_graph", "num_splits"]
_AP_214 = _AP_210[:12] + ["bottom_right_diagonal"] + _AP_210[12:]
_AP_220 = _AP_214 + [
    "nominal_dtype", "num_tokens_q", "num_tokens_kv", "softcap", "cp_size", "cp_size_a2a",
    "softmax_scale", "fp8_output", "checkpoint_core_attention", "has_score_mod",
    "has_score_mod_bprop"]
ATTENTION_PARAMS = {"2.1.0": _AP_21, "2.2.0": _AP_25, "2.5.0": _AP_25, "2.10.0": _AP_210,
                    "2.12.0": _AP_214, "2.14.1": _AP_214, "2.20.2": _AP_220}
# Every field we must set for the query to describe our tile (the rest keep TE's defaults).
AP_NEEDED = {"qkv_dtype", "qkv_layout", "batch_size", "num_heads", "num_gqa_groups",
              "max_seqlen_q", "max_seqlen_kv", "head_dim_qk", "head_dim_v", "attn_mask_type",
              "window_size", "attention_dropout", "deterministic", "is_training"}

# The attn_mask_type values fused_attn_fwd / _bwd take (the keys of `AttnMaskType` in
# cpp_extensions/fused_attn.py): the same six in every release read, 2.1 to 2.20.
MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
              "padding_causal_bottom_right")
# From 2.12 (the first release with `bottom_right_diagonal`) the functions default it to
# None and then align the band at the bottom right for these masks, else at the top left.
# Before 2.12 the cuDNN graph (fused_attn_f16_arbitrary_seqlen.cu) set only the band's left
# bound (window_size[0]); window_size[1] was read by the backend check alone.
BOTTOM_RIGHT_BY_DEFAULT = ("causal_bottom_right", "padding_causal_bottom_right")
WINDOW_ALIGNMENT_FROM = "2.12"
