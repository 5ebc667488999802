"""The flags that make the model: saved with every checkpoint, compared when generating.

`MODEL_FLAGS` names every flag of the driver that changes what the model computes, weights
or not (RoPE's base, the norm's epsilon, a window, sinks, the router's top-k...). A
checkpoint saves their values as its model description (``model_shape`` in its common
state; `describe`); generation takes them from there and refuses a flag that says otherwise
(`differences`). Every other flag of the parser is named in `OTHER_FLAGS` with the reason it
does not change the model's outputs; tests/unit/test_model_description.py fails on a flag
in neither, so a new flag is classified before it can run a different model silently.
"""
from __future__ import annotations

import argparse
import math
from typing import Any

from megatron_mesh.training.config.megatron_lm_flags import NO_EFFECT

MODEL_FLAGS: tuple[str, ...] = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "kv_channels", "group_query_attention", "swiglu", "normalization", "norm_epsilon",
    "position_embedding_type", "rotary_percent", "rotary_base", "max_position_embeddings",
    "disable_bias_linear", "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by",
    "window_size", "window_attn_skip_freq", "softmax_type", "qk_layernorm",
    "attention_chunk_size", "no_rope_freq", "mesh_mask_builder",
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
    "qk_pos_emb_head_dim", "v_head_dim",
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_load_balancing_type",
)
"""Every flag that changes what the model computes, in the order differences are named."""

SAVED_FLAGS: tuple[str, ...] = (*MODEL_FLAGS, "seq_length")
"""A checkpoint's model description: the model flags and the training sequence length
(--use-checkpoint-args takes it too)."""

LENGTH_FREE = {"rope", "none"}
"""Position embeddings without a table of weights: generation may run them at a longer
--max-position-embeddings than the checkpoint's (learned positions have one row each)."""

_OTHER: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("dropout: off while generating (the model runs in eval mode)",
     ("hidden_dropout", "attention_dropout")),
    ("the initial weights: generation loads trained ones", ("init_method_std",)),
    ("the random seed: training's initial weights and data order, generation's sampling",
     ("seed",)),
    ("the training sequence length: positions are --max-position-embeddings", ("seq_length",)),
    ("the batch and the schedule of training",
     ("micro_batch_size", "global_batch_size", "train_iters", "train_samples",
      "rampup_batch_size", "skip_train", "exit_interval")),
    ("the loss and its gradients, not the forward",
     ("calculate_per_token_loss", "moe_aux_loss_coeff", "eod_mask_loss",
      "check_for_nan_in_loss_and_grad")),
    ("the precision the same model runs at (bf16 / fp16 need CUDA, a CPU runs fp32)",
     ("bf16", "fp16")),
    ("the optimizer, its state and the learning rate",
     ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather", "optimizer",
      "lr", "min_lr", "lr_decay_style", "lr_decay_iters", "lr_decay_samples", "lr_warmup_iters",
      "lr_warmup_samples", "lr_warmup_fraction", "weight_decay", "adam_beta1", "adam_beta2",
      "adam_eps", "sgd_momentum", "clip_grad", "override_opt_param_scheduler",
      "use_checkpoint_opt_param_scheduler", "mesh_grad_reduce_dtype")),
    ("activation recomputation: the same values, less memory",
     ("recompute_granularity", "recompute_method", "recompute_num_layers")),
    ("the parallel layout: the same model on other ranks (generation runs TP = PP = 1 and "
     "loads any layout)",
     ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
      "sequence_parallel", "expert_model_parallel_size", "distributed_backend",
      "distributed_timeout_minutes", "mesh_host_staged_collectives")),
    ("the context-parallel algorithm and its grid: exact, the same outputs on every grid",
     ("context_parallel_algo", "cp_comm_type", "mesh_shape", "mesh_heads", "mesh_schedule",
      "mesh_gpu_profile")),
    ("the kernels and layers' implementation, not the model's math",
     ("transformer_impl", "attention_backend", "mesh_kernel", "moe_grouped_gemm",
      "moe_token_dispatcher_type")),
    ("how training packs documents into its batches (generation attends within each prompt)",
     ("mesh_document_placement", "mesh_balance_data_parallel", "reset_position_ids",
      "reset_attention_mask")),
    ("the training data", ("data_path", "mock_data", "split", "train_data_path",
                           "valid_data_path", "test_data_path", "data_cache_path",
                           "num_workers")),
    ("the tokenizer: its padded vocabulary is checked against the checkpoint's embedding",
     ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size")),
    ("which checkpoint, and what of it training restores",
     ("save", "load", "save_interval", "ckpt_step", "no_load_optim", "no_load_rng", "finetune",
      "use_checkpoint_args")),
    ("evaluation, logging and stopping during training",
     ("eval_interval", "eval_iters", "log_interval", "tensorboard_dir",
      "tensorboard_log_interval", "tensorboard_queue_size", "log_timers_to_tensorboard",
      "log_validation_ppl_to_tensorboard", "log_world_size_to_tensorboard", "wandb_project",
      "wandb_exp_name", "wandb_save_dir", "exit_signal_handler", "exit_signal",
      "exit_duration_in_mins")),
)

OTHER_FLAGS: dict[str, str] = {
    **{name: why for why, names in _OTHER for name in names},
    **{f.name[2:].replace("-", "_"): f"accepted without effect: {f.why}" for f in NO_EFFECT},
}
"""Every other flag of the driver -> why it does not change the model's outputs."""


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def describe(args: Any) -> dict[str, Any]:
    """The model description a checkpoint saves: {flag dest: value} of `SAVED_FLAGS`."""
    return {key: getattr(args, key) for key in SAVED_FLAGS}


def value_text(value: Any) -> str:
    """A flag's value as the command line writes it (a switch: on / off; unset: unset)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


def compared(saved: dict[str, Any], args: Any) -> tuple[str, ...]:
    """The model flags a run on `args` must share with a checkpoint's description `saved`:
    all it records, but the position table's length where positions have no weights."""
    free = getattr(args, "position_embedding_type", None) in LENGTH_FREE
    return tuple(k for k in MODEL_FLAGS
                 if k in saved and not (free and k == "max_position_embeddings"))


def differences(saved: dict[str, Any], args: Any) -> list[str]:
    """'--flag SAVED, the flags say GIVEN' for each model flag whose value in `args` differs
    from the checkpoint's description `saved`."""
    return [f"{flag_name(k)} {value_text(saved[k])}, the flags say {value_text(getattr(args, k))}"
            for k in compared(saved, args) if not _same(saved[k], getattr(args, k))]


def unrecorded(saved: dict[str, Any]) -> list[str]:
    """The model flags a description (saved by an older version) does not record."""
    return [k for k in MODEL_FLAGS if k not in saved]


def _invalid(value: Any, action: Any) -> str | None:
    """Why `value` cannot be the value of the flag `action` parses (None: it can)."""
    if value is None:
        return None if action.default is None else "unset, and the flag has no unset value"
    if action.nargs == 0:  # a switch
        return None if isinstance(value, bool) else "not on / off"
    if isinstance(action.nargs, int):  # a fixed number of values (--window-size L R)
        if not isinstance(value, (list, tuple)) or len(value) != action.nargs:
            return f"not {action.nargs} values"
        return next((why for v in value if (why := _invalid_one(v, action))), None)
    return _invalid_one(value, action)


def _invalid_one(value: Any, action: Any) -> str | None:
    if action.choices is not None:
        return None if value in action.choices else \
            f"not one of {', '.join(map(str, action.choices))}"
    if action.type is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else \
            "not an integer"
    if action.type is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value)
        return None if ok else "not a finite number"
    if action.type not in (None, str):  # a flag's own parser (--no-rope-freq's pattern)
        text = repr(list(value)) if isinstance(value, (list, tuple)) else str(value)
        try:
            return None if _same(action.type(text), value) else "not a value the flag takes"
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            return "not a value the flag takes"
    return None if isinstance(value, str) else "not text"


def checked_description(common: dict[str, Any], path: str,
                        parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The model description in the common state of checkpoint `path` ({} when it has none),
    each value checked against its flag in the driver's `parser`: CheckpointError naming the
    first that no command line could give (a description that is not a mapping,
    --hidden-size 64.5)."""
    from megatron_mesh.training.checkpoints.checksums import CheckpointError

    saved = common.get("model_shape") or {}
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {path}: its model description (model_shape in "
                              f"common.pt) is a {type(saved).__name__}, not a mapping of flags "
                              "to values: give another checkpoint")
    actions = {a.dest: a for a in parser._actions}
    for key in SAVED_FLAGS:
        if key in saved:
            why = _invalid(saved[key], actions[key])
            if why:
                raise CheckpointError(f"checkpoint {path}: its model description has "
                                      f"{flag_name(key)} {saved[key]!r}, {why}: give another "
                                      "checkpoint")
    return dict(saved)


def completed(saved: dict[str, Any]) -> dict[str, Any]:
    """`saved` with what older descriptions imply: --group-query-attention from the group
    count (the first descriptions recorded the count, not the switch)."""
    out = dict(saved)
    if ("group_query_attention" not in out and "num_attention_heads" in out
            and out.get("num_query_groups") is not None):
        out["group_query_attention"] = out["num_query_groups"] != out["num_attention_heads"]
    return out
