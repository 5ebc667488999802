"""The GPT model: TransformerConfig from flags, the layer spec for the CP algorithm, wrapping."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from megatron_mesh.dtypes import flag_dtype
from megatron_mesh.megatron.arguments import te_cp_comm_type
from megatron_mesh.training.job.device import has_cuda
from megatron_mesh.training.job.distributed import print_rank0
from megatron_mesh.training.model.core_attention import core_attention, te_layers
from megatron_mesh.training.model.moe import moe_config, moe_spec
from megatron_mesh.training.model.pipeline import varies_in_length

if TYPE_CHECKING:
    from megatron_mesh.runtime.grid import MeshGrid
    from megatron_mesh.training.config.training_config import TrainingConfig


def padded_vocab_size(vocab_size: int, args: TrainingConfig) -> int:
    """Round the vocabulary up so that every tensor-parallel shard is equally sized."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size  # flat: a namespace too
    return -(-vocab_size // multiple) * multiple


def transformer_config(args: TrainingConfig) -> TransformerConfig:
    """megatron-core's TransformerConfig of the flags; with --multi-latent-attention its
    MLATransformerConfig (RoPE as 'rope': Megatron-LM's MLA default, YaRN, with its default
    --rotary-scaling-factor 1 gives the same frequencies and softmax scale)."""
    model, parallel, training, masks = args.model, args.parallel, args.training, args.masks
    dtype = flag_dtype(training.bf16, training.fp16)
    common = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        window_size=None if model.window_size is None else tuple(model.window_size),
        window_attn_skip_freq=model.window_attn_skip_freq,
        no_rope_freq=(list(masks.no_rope_freq) if isinstance(masks.no_rope_freq, tuple)
                      else masks.no_rope_freq),
        softmax_type=model.softmax_type,
        qk_layernorm=model.qk_layernorm,
        init_method_std=model.init_method_std,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        add_bias_linear=not model.disable_bias_linear,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        cp_comm_type=_cp_comm_type(args),
        bf16=training.bf16,
        fp16=training.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        variable_seq_lengths=varies_in_length(args),
        # megatron-core refuses variable lengths beside its default MoE dispatcher even
        # without experts; without them the dispatcher named is never built
        **({"moe_token_dispatcher_type": "alltoall"}
           if varies_in_length(args) and args.moe.num_experts is None else {}),
        **moe_config(args),
        use_cpu_initialization=not has_cuda(),
        recompute_granularity=training.recompute_granularity,
        recompute_method=training.recompute_method,
        recompute_num_layers=training.recompute_num_layers,
        calculate_per_token_loss=training.calculate_per_token_loss,
    )
    if not model.multi_latent_attention:
        return TransformerConfig(**common)
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        **common,
        multi_latent_attention=True,
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_head_dim=model.qk_head_dim,
        qk_pos_emb_head_dim=model.qk_pos_emb_head_dim,
        v_head_dim=model.v_head_dim,
        rope_type="rope",
        rotary_base=model.rotary_base,
    )


def _cp_comm_type(args: TrainingConfig) -> str | None:
    if args.parallel.context_parallel_size == 1:
        return None
    return te_cp_comm_type(args.mesh.context_parallel_algo)


def use_transformer_engine(args: TrainingConfig) -> bool:
    """Transformer Engine layers when asked, or with ``auto`` when TE imports and CUDA is
    there (`core_attention.te_layers`)."""
    return te_layers(args.parallel.transformer_impl)


def attention_algo(args: TrainingConfig, use_te: bool) -> str | None:
    """The core attention the layers use (`core_attention.core_attention`): 'mesh' or one
    of TE's context-parallel algorithms, or None for megatron-core's local attention."""
    return core_attention(args.parallel.attention_backend, args.mesh.context_parallel_algo,
                          args.parallel.context_parallel_size, use_te)


def layer_spec(args: TrainingConfig, grid: MeshGrid | None = None):
    """The decoder layer spec: Megatron's GPT layer (TE or local) with the core attention
    `attention_algo` chooses (the mesh's on `grid`, the job's: `init_model_parallel`)."""
    use_te = use_transformer_engine(args)
    algo = attention_algo(args, use_te)
    if algo is None:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(normalization=args.model.normalization,
                                        multi_latent_attention=args.model.multi_latent_attention,
                                        qk_layernorm=args.model.qk_layernorm, **moe_spec(args))
    from megatron_mesh.megatron.spec import get_gpt_layer_spec

    return get_gpt_layer_spec(context_parallel_algo=algo, grid=grid,
                              use_te=use_te, backend=args.mesh.mesh_kernel,
                              schedule=args.mesh.mesh_schedule,
                              grad_reduce_dtype=args.mesh.mesh_grad_reduce_dtype,
                              attention_chunk_size=args.masks.attention_chunk_size,
                              normalization=args.model.normalization,
                              multi_latent_attention=args.model.multi_latent_attention,
                              qk_layernorm=args.model.qk_layernorm, **moe_spec(args))


def build_model(args: TrainingConfig, vocab_size: int, grid: MeshGrid | None = None
                ) -> GPTModel:
    """This rank's pipeline stage of the GPTModel, on its device: num_layers / PP layers,
    the embedding on the first stage, the output layer and loss on the last (with tied
    embeddings the last stage holds a copy of the word embeddings, `param.shared`)."""
    config = transformer_config(args)
    spec = layer_spec(args, grid)
    if args.parallel.sequence_parallel and not use_transformer_engine(args):
        from megatron_mesh.megatron.norm import sequence_parallel_block_spec

        spec = sequence_parallel_block_spec(spec, config)
    return gpt_model(args, vocab_size, config, spec, parallel_state.is_pipeline_first_stage(),
                     parallel_state.is_pipeline_last_stage())


def gpt_model(args: TrainingConfig, vocab_size: int, config, spec, pre_process: bool = True,
              post_process: bool = True) -> GPTModel:
    """megatron-core's GPTModel with the run's embedding, RoPE and output settings (one
    place: training and generation build the same model, so checkpoints load), on the GPU
    when there is one."""
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(vocab_size, args),
        max_sequence_length=args.model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.model.untie_embeddings_and_output_weights,
        position_embedding_type=args.model.position_embedding_type,
        rotary_base=args.model.rotary_base,
        rotary_percent=args.model.rotary_percent,
    )
    if has_cuda():
        model.cuda(torch.cuda.current_device())
    return model


def wrap_model(model: GPTModel, args: TrainingConfig) -> torch.nn.Module:
    """megatron-core's DistributedDataParallel over the data-parallel-with-CP group (and
    Float16Module for bf16 / fp16), on every device (on a CPU inside `megatron_on_cpu()`).

    Gradients live in its grad buffers; its finalize step (megatron-core's
    finalize_model_grads, called by the schedule after the last micro-batch) averages them
    over DP x CP, or with --calculate-per-token-loss sums them and divides by the global
    batch's token count, and also sums sequence-parallel norm gradients over TP and the
    tied embeddings' gradients over the first and last pipeline stage. With the distributed
    optimizer it reduce-scatters the gradients and all-gathers the updated parameters (gloo
    does both on a CPU).
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer.module import Float16Module

    config = model.config
    module = Float16Module(config, model) if (args.training.bf16 or args.training.fp16) else model
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.training.bf16 or args.training.fp16,
        overlap_grad_reduce=args.training.overlap_grad_reduce,
        overlap_param_gather=args.training.overlap_param_gather,
        use_distributed_optimizer=args.training.use_distributed_optimizer,
    )
    wrapped = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    if args.training.overlap_grad_reduce:
        print_rank0(f" {overlap_label(wrapped.ddp_config)}")
    config.no_sync_func = wrapped.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def overlap_label(ddp_config) -> str:
    """The start-up line of what megatron-core's DDP overlaps on this device (both run on
    GPUs and, over gloo, on CPUs)."""
    gather = ("parameter all-gather overlapped with the next forward"
              if ddp_config.overlap_param_gather else "parameters gathered after the step")
    where = "GPU (nccl)" if has_cuda() else "CPU (gloo)"
    return (f"DDP on {where}: gradient reduction overlapped with backward "
            f"(--overlap-grad-reduce, bucket size {ddp_config.bucket_size}); {gather}")


def unwrap(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not isinstance(model, GPTModel):
        model = model.module
    return model
