"""Megatron-LM's GPT pretraining with mesh context parallelism, without patching Megatron-LM.

Megatron-LM's own `pretrain()`, data pipeline and `forward_step` (from its pretrain_gpt.py)
run unchanged; megatron-mesh adds two things through the hooks `pretrain()` already has:

- `extra_args_provider`: --context-parallel-algo {p2p,all_gather,a2a,a2a+p2p,mesh} and
  --mesh-shape RxC (`megatron_mesh.megatron.add_mesh_args`);
- the model provider: with `mesh` it checks the flags, builds the R x C grid of every
  context-parallel group (once, after Megatron-LM has made its model-parallel groups) and
  builds the dense GPT with the mesh core attention in the layer spec. Any other algorithm
  is Megatron's own (--cp-comm-type) and goes to Megatron-LM's gpt_builder untouched.

Run it from a Megatron-LM checkout (tag core_v0.16.1) with your usual arguments:

    cd Megatron-LM
    torchrun --nproc-per-node 8 /path/to/megatron-mesh/examples/megatron_lm_pretrain_mesh.py \\
        <pretrain_gpt.py arguments> --context-parallel-size 8 \\
        --context-parallel-algo mesh --mesh-shape 2x4

The checkout is found through $MEGATRON_LM_DIR, else the current directory.
Dense GPT only: MoE, multi-token prediction, multi-latent attention, legacy models and
--spec/--yaml-cfg need the patch (patches/) or stay on Megatron's algorithms.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(os.environ.get("MEGATRON_LM_DIR", os.getcwd())))

import pretrain_gpt  # noqa: E402  Megatron-LM's: datasets, forward_step, embedding ranks
from gpt_builders import gpt_builder  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.training import get_args, pretrain, print_rank_0  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args  # noqa: E402
from model_provider import model_provider  # noqa: E402

from megatron_mesh.megatron import (  # noqa: E402
    add_mesh_args,
    get_gpt_layer_spec,
    initialize_mesh_grids,
    mesh_grid_is_initialized,
    validate_mesh_args,
)


def extra_args_provider(parser):
    """Megatron-LM's extra arguments for pretrain_gpt.py, plus the mesh flags."""
    if pretrain_gpt.has_nvidia_modelopt:
        parser = pretrain_gpt.add_modelopt_args(parser)
    return add_mesh_args(parser)


def setup_mesh(args) -> None:
    """Check the flags and build the mesh grids; once, on every rank (a collective)."""
    if mesh_grid_is_initialized():
        return
    unsupported = [
        flag
        for flag, value in (
            ("--num-experts", args.num_experts),
            ("--mtp-num-layers", args.mtp_num_layers),
            ("--multi-latent-attention", args.multi_latent_attention),
            ("--use-legacy-models", args.use_legacy_models),
            ("--spec", args.spec),
            ("--yaml-cfg", args.yaml_cfg),
            ("--heterogeneous-layers-config-path", args.heterogeneous_layers_config_path),
            ("--experimental-attention-variant", args.experimental_attention_variant),
        )
        if value
    ]
    if unsupported:
        raise ValueError(
            "--context-parallel-algo mesh in this example builds a dense GPT; not supported "
            f"here: {', '.join(unsupported)} (apply patches/ to Megatron-LM instead)"
        )
    args.mesh_shape = validate_mesh_args(args)
    initialize_mesh_grids(args.mesh_shape)


def mesh_gpt_builder(args, pre_process, post_process, vp_stage=None, config=None,
                     pg_collection=None):
    """A dense megatron-core GPTModel from Megatron-LM's arguments, mesh core attention."""
    setup_mesh(args)
    print_rank_0(f"building GPT model with mesh context parallelism {args.mesh_shape} ...")
    if config is None:
        config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    spec_options = dict(qk_layernorm=args.qk_layernorm, qk_l2_norm=args.qk_l2_norm)
    if not use_te:
        spec_options["normalization"] = args.normalization
    layer_spec = get_gpt_layer_spec("mesh", use_te=use_te, **spec_options)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def mesh_model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                        pg_collection=None):
    """Megatron-LM's model_provider with the builder chosen by --context-parallel-algo."""
    args = get_args()
    if args.context_parallel_algo == "mesh":
        builder = mesh_gpt_builder
    else:
        # Megatron's own algorithms: the flag names a --cp-comm-type unless that was given.
        if args.cp_comm_type == ["p2p"]:
            args.cp_comm_type = [args.context_parallel_algo]
        builder = gpt_builder
    return model_provider(builder, pre_process, post_process, vp_stage, config=config,
                          pg_collection=pg_collection)


def main() -> None:
    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True
    pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        mesh_model_provider,
        ModelType.encoder_or_decoder,
        pretrain_gpt.forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        extra_args_provider=extra_args_provider,
        get_embedding_ranks=pretrain_gpt.get_embedding_ranks,
    )


if __name__ == "__main__":
    main()
