"""Assemble a training job from parsed flags: groups, data, model, optimizer, resume, loop."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch.distributed as dist

from megatron_mesh.cost_models.plan import resolve_plan
from megatron_mesh.dtypes import flag_dtype_name
from megatron_mesh.layer_plan import DEFAULT_BACKEND, DTYPE_BYTES, STREAMED, AttentionShape
from megatron_mesh.megatron.arguments import is_mesh, mesh_active
from megatron_mesh.megatron.cpu import megatron_on_cpu
from megatron_mesh.megatron.placed_documents import placed_rope
from megatron_mesh.runtime.grid import MeshGrid
from megatron_mesh.runtime.host_staging import HostStaging
from megatron_mesh.training.checkpoints.store import TrainState, load_checkpoint
from megatron_mesh.training.config.megatron_lm_flags import no_effect_report
from megatron_mesh.training.data.datasets import build_datasets, build_tokenizer, micro_batches
from megatron_mesh.training.data.document_ranks import placement_label, uses_placement
from megatron_mesh.training.job import distributed
from megatron_mesh.training.job.distributed import print_rank0
from megatron_mesh.training.job.staged_cp_ranks import staged_collectives, staged_label
from megatron_mesh.training.logs.metrics import Loggers
from megatron_mesh.training.loop.evaluation import Evaluator
from megatron_mesh.training.loop.optimizer import build_optimizer, build_scheduler
from megatron_mesh.training.loop.trainer import train
from megatron_mesh.training.model.flops import attention_count_note, flops_per_iteration
from megatron_mesh.training.model.gpt import (
    attention_algo,
    build_model,
    padded_vocab_size,
    unwrap,
    use_transformer_engine,
    wrap_model,
)
from megatron_mesh.training.model.moe import moe_label

if TYPE_CHECKING:
    from megatron_mesh.training.config.training_config import TrainingConfig


def _mesh_label(args: TrainingConfig, grid: MeshGrid | None) -> str:
    """' RxC, schedule S' of the grid this job built ('' without one); for 'streamed', the
    ring it runs on this TP rank's share of the heads."""
    if not mesh_active(args) or grid is None:
        return ""
    tp, model, training = args.parallel.tensor_model_parallel_size, args.model, args.training
    local = AttentionShape(training.seq_length, training.micro_batch_size,
                           model.num_attention_heads // tp,
                           max(1, (model.num_query_groups or model.num_attention_heads) // tp),
                           args.derived.k_channels,
                           DTYPE_BYTES[flag_dtype_name(training.bf16, training.fp16)],
                           v_head_dim=args.derived.v_channels)
    plan = resolve_plan(local, grid.rows, grid.cols, args.mesh.mesh_schedule,
                        args.mesh.mesh_grad_reduce_dtype, heads=grid.heads)
    how = f" ({STREAMED})" if args.mesh.mesh_schedule == STREAMED else ""
    return f" {plan.shape_label}, schedule {plan.schedule}{how}"


def _cp_label(args: TrainingConfig, mesh: str) -> str:
    """'4 (mesh 2x2, schedule ...)'; '1' at CP = 1, where no CP algorithm runs."""
    if args.parallel.context_parallel_size == 1:
        return "1"
    return f"{args.parallel.context_parallel_size} ({args.mesh.context_parallel_algo}{mesh})"


def _attention_label(args: TrainingConfig) -> str:
    """Which core attention the layers run (`model.attention_algo`), the mesh's with the
    tile kernel --mesh-kernel names."""
    algo = attention_algo(args, use_transformer_engine(args))
    if algo is None:
        return "megatron-core local (unfused)"
    if not is_mesh(algo):
        return f"Transformer Engine ({algo})"
    kernel = args.mesh.mesh_kernel
    return "mesh tile kernel" + ("" if kernel == DEFAULT_BACKEND else f" {kernel}")


def _heads_label(args: TrainingConfig) -> str:
    """'query groups G', or multi-latent attention's head dims and latent ranks."""
    if not args.model.multi_latent_attention:
        return f"query groups {args.model.num_query_groups}"
    q_rank = "none" if args.model.q_lora_rank is None else args.model.q_lora_rank
    return (f"multi-latent attention: Q/K head dim {args.derived.k_channels} = {args.model.qk_head_dim} + "
            f"{args.model.qk_pos_emb_head_dim} RoPE, V head dim {args.derived.v_channels}, latent ranks "
            f"Q {q_rank}, KV {args.model.kv_lora_rank}")


def _data_label(args: TrainingConfig) -> str:
    """'mock', the --data-path prefixes with --split, or the per-split prefixes."""
    if args.data.mock_data:
        return "mock"
    if args.data.data_path:
        return f"{' '.join(args.data.data_path)} (split {args.data.split})"
    paths = (("train", args.data.train_data_path), ("valid", args.data.valid_data_path),
             ("test", args.data.test_data_path))
    return ", ".join(f"{name} {' '.join(p)}" for name, p in paths if p)


def _masks_label(args: TrainingConfig) -> str:
    """' | documents masked (...) | window ...': what cuts the causal attention ('' if none)."""
    parts = []
    if args.data.reset_attention_mask:
        parts.append("documents masked (--reset-attention-mask: each attends only within itself)")
    if args.model.window_size is not None:
        left, right = args.model.window_size
        every = args.model.window_attn_skip_freq
        layers = f"one layer in {every} global" if every else "all layers"
        parts.append(f"window {left} left, {right} right (--window-size; {layers})")
    if args.attention_chunk_size is not None:
        nope = args.no_rope_freq
        layers = ("all layers" if not nope else f"one layer in {nope} global" if isinstance(
            nope, int) else f"{sum(nope)} of {len(nope)} layers global")
        parts.append(f"chunks of {args.attention_chunk_size} (--attention-chunk-size; {layers})")
    if args.mesh_mask_builder is not None:
        parts.append(f"mask per micro-batch from {args.mesh_mask_builder}")
    return "".join(f" | {p}" for p in parts)


def _features_label(args: TrainingConfig) -> str:
    """', sinks learnable, qk layernorm, MoE ...': the model's optional features ('' if none)."""
    parts = [f"sinks {args.model.softmax_type} (--softmax-type)"] if args.model.softmax_type != "vanilla" \
        else []
    if args.model.qk_layernorm:
        parts.append("qk layernorm")
    moe = moe_label(args)
    return "".join(f", {p}" for p in parts + ([moe] if moe else []))


def banner_lines(args: TrainingConfig, grid: MeshGrid | None, n_params: int, vocab: int,
                 flops: float) -> list[str]:
    """The start-up banner (rank 0 prints it): layout, model, FLOPs and their counting
    convention under masks, batch and data."""
    mesh = _mesh_label(args, grid)
    note = attention_count_note(args)
    return [
        f" world {args.derived.world_size} = TP {args.parallel.tensor_model_parallel_size} x PP "
        f"{args.parallel.pipeline_model_parallel_size} x CP {_cp_label(args, mesh)} x DP "
        f"{args.derived.data_parallel_size} | backend {args.parallel.distributed_backend} | attention "
        f"{_attention_label(args)}{_masks_label(args)} | "
        f"{flag_dtype_name(args.training.bf16, args.training.fp16)}",
        f" model: {args.model.num_layers} layers, hidden {args.model.hidden_size}, heads "
        f"{args.model.num_attention_heads} ({_heads_label(args)}), seq "
        f"{args.training.seq_length}, vocab {vocab}{_features_label(args)} | parameters on this rank "
        f"{n_params:,} | "
        f"model FLOPs per iteration {flops:.4e}" + (f" ({note})" if note else ""),
        f" batch: global {args.training.global_batch_size} = micro {args.training.micro_batch_size} x DP "
        f"{args.derived.data_parallel_size} x {args.derived.num_microbatches} micro-batches | "
        f"data: {_data_label(args)}",
    ]


def _banner(args: TrainingConfig, grid: MeshGrid | None, n_params: int, vocab: int,
            flops: float) -> None:
    print_rank0("\n".join(banner_lines(args, grid, n_params, vocab, flops)))
    for line in no_effect_report(args):
        print_rank0(f" {line}")


def run(args: TrainingConfig) -> int:
    """Train as the flags say; returns the process exit code.

    Without CUDA everything runs inside ``megatron_on_cpu()``: megatron-core puts a few
    bookkeeping tensors on "cuda" (schedule counters, RoPE indices), which it keeps on the CPU.
    """
    rope = placed_rope() if uses_placement(args) else contextlib.nullcontext()
    # placed documents: RoPE at their rows' positions; --mesh-host-staged-collectives
    with megatron_on_cpu(), rope, staged_collectives(args) as staging:
        return _run(args, staging)


def _run(args: TrainingConfig, staging: HostStaging | None = None) -> int:
    distributed.init_distributed(args)
    try:
        grid = distributed.init_model_parallel(args)  # runtime state, not on args
        distributed.set_seed(args.training.seed)
        tokenizer = build_tokenizer(args)
        model = build_model(args, tokenizer.vocab_size, grid)
        vocab = padded_vocab_size(tokenizer.vocab_size, args)
        n_params = sum(p.numel() for p in model.parameters())
        model = wrap_model(model, args)
        optimizer = build_optimizer(model, args)
        if hasattr(optimizer, "scale_loss"):  # megatron-core's: fp16 loss scaling in backward
            unwrap(model).config.grad_scale_func = optimizer.scale_loss
        scheduler = build_scheduler(optimizer, args)
        state = TrainState()
        if args.checkpoint.load:
            state = load_checkpoint(args.checkpoint.load, model, optimizer, scheduler, args)
        train_set, valid_set, test_set = build_datasets(args, tokenizer)
        flops = flops_per_iteration(args, vocab)
        _banner(args, grid, n_params, vocab, flops)
        if placement_label(args):
            print_rank0(f" {placement_label(args)}")
        loggers = Loggers(args, dist.get_rank(), dist.get_world_size())
        exit_code = 1
        try:
            evaluator = Evaluator(model, valid_set, test_set, args, loggers)
            if not args.training.skip_train:
                data = micro_batches(train_set, args, state.consumed_samples)
                state = train(model, optimizer, scheduler, data, state, args, flops, loggers,
                              evaluator)
                print_rank0(f" training done at iteration {state.iteration}")
            # the test set's evaluation at the end, not after an early stop
            if args.training.skip_train or state.iteration >= args.training.train_iters:
                evaluator.finish(state.iteration, state.consumed_samples)
            exit_code = 0
        finally:
            loggers.finish(exit_code)
        if staging is not None:
            print_rank0(staged_label(staging))
        dist.barrier()
    finally:
        distributed.destroy()
    return 0
