"""Megatron-LM's GPT pretraining with mesh context parallelism, without patching Megatron-LM.

Megatron-LM's own `pretrain()`, data pipeline and `forward_step` (from its pretrain_gpt.py)
run unchanged; megatron-mesh adds two things through the hooks `pretrain()` already has:

- `extra_args_provider`: --context-parallel-algo {p2p,all_gather,a2a,a2a+p2p,mesh},
  --mesh-shape RxC and the other mesh flags (`megatron_mesh.megatron.add_mesh_args`),
  --attention-chunk-size N (chunked attention in the layers Megatron's --no-rope-freq leaves
  with RoPE) and --mesh-mask-builder MODULE:FUNCTION (a mask per micro-batch);
  Megatron's own `--cp-comm-type mesh` selects the mesh as well;
- the layer spec: with `mesh` the flags are checked, the R x C grid of every
  context-parallel group is built (once, after Megatron-LM has made its model-parallel
  groups) and the core attention of the GPT layer spec becomes the mesh's. Any other
  algorithm is Megatron's own and Megatron-LM builds the model untouched.

Two Megatron-LM generations, told apart by what they import:

- core_v0.18 and later (pretrain_gpt.py builds from a config): the mesh layer spec goes
  into GPTModelConfig.transformer_layer_spec as a callable, wrapping --spec when given, or
  else Megatron-LM's default spec (Transformer Engine or local); no provider sees the
  built model, so a mask builder is attached by the forward step, the hook that gets the
  model (`mesh_forward_step`);
- core_v0.16.1: a model provider around Megatron-LM's model_provider builds the dense GPT.

Run it from a Megatron-LM checkout with your usual arguments:

    cd Megatron-LM
    torchrun --nproc-per-node 8 /path/to/megatron-mesh/examples/megatron_lm_pretrain_mesh.py \\
        <pretrain_gpt.py arguments> --context-parallel-size 8 --cp-comm-type mesh

The checkout is found through $MEGATRON_LM_DIR, else the current directory.
Dense GPT only: MoE, multi-token prediction, multi-latent attention, legacy models and
--yaml-cfg (and, on core_v0.16.1, --spec) need the patch (patches/) or stay on Megatron's
algorithms.
"""

from __future__ import annotations

import os
import sys
import weakref
from functools import partial

sys.path.insert(0, os.path.abspath(os.environ.get("MEGATRON_LM_DIR", os.getcwd())))

import pretrain_gpt  # noqa: E402  Megatron-LM's: datasets, forward_step, embedding ranks
from gpt_builders import gpt_builder  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.utils import unwrap_model  # noqa: E402
from megatron.training import get_args, pretrain, print_rank_0  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args  # noqa: E402
from model_provider import model_provider  # noqa: E402

from megatron_mesh.megatron import (  # noqa: E402
    add_mesh_args,
    attach_mask_builder,
    get_gpt_layer_spec,
    initialize_mesh_grids,
    mesh_grid_is_initialized,
    mesh_spec_options,
    use_mesh_core_attention,
    validate_mesh_args,
)
from megatron_mesh.megatron.arguments import resolve_context_parallel_algo  # noqa: E402

try:  # Megatron-LM core_v0.18 and later: pretrain() takes a config container
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.models.gpt import default_layer_spec
except ImportError:  # core_v0.16.1
    gpt_config_from_args = None

ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def extra_args_provider(parser):
    """Megatron-LM's extra arguments for pretrain_gpt.py, plus the mesh flags."""
    if pretrain_gpt.has_nvidia_modelopt:
        parser = pretrain_gpt.add_modelopt_args(parser)
    return add_mesh_args(parser)


def setup_mesh(args, spec_flag_supported: bool = False) -> None:
    """Check the flags and build the mesh grids; once, on every rank (a collective)."""
    if mesh_grid_is_initialized():
        return
    unsupported = [
        flag
        for flag in (
            "--num-experts",
            "--mtp-num-layers",
            "--multi-latent-attention",
            "--use-legacy-models",  # gone in core_v0.18+
            "--yaml-cfg",
            "--heterogeneous-layers-config-path",
            "--experimental-attention-variant",
            *(() if spec_flag_supported else ("--spec",)),
        )
        if getattr(args, flag[2:].replace("-", "_"), None)
    ]
    if unsupported:
        raise ValueError(
            "--context-parallel-algo mesh in this example builds a dense GPT; not supported "
            f"here: {', '.join(unsupported)} (on Megatron-LM core_v0.16.1 apply patches/; "
            "else keep one of Megatron's algorithms)"
        )
    args.mesh_shape = validate_mesh_args(args)
    initialize_mesh_grids(args.mesh_shape,
                          chosen_by_planner=getattr(args, "mesh_shape_chosen_by_planner", None))


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
    layer_spec = get_gpt_layer_spec("mesh", use_te=use_te, **mesh_spec_options(args),
                                    **spec_options)
    model = GPTModel(
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
    if args.mesh_mask_builder:  # the builder sees the whole micro-batch (gathered over CP)
        attach_mask_builder(model, args.mesh_mask_builder)
    return model


def mesh_layer_spec(args, base, model_config, vp_stage=None):
    """GPTModelConfig.transformer_layer_spec (core_v0.18+): `base` (--spec, a ModuleSpec or
    a callable like this one) or Megatron-LM's default spec, with the mesh core attention."""
    setup_mesh(args, spec_flag_supported=True)
    spec = default_layer_spec(model_config, vp_stage) if base is None else base
    if callable(spec) and not hasattr(spec, "submodules"):
        spec = spec(model_config, vp_stage=vp_stage)
    return use_mesh_core_attention(spec, **mesh_spec_options(args))


def mesh_model_config(args):
    """Megatron-LM's GPTModelConfig (core_v0.18+) with the mesh layer spec when mesh runs."""
    config = gpt_config_from_args(args)
    if args.context_parallel_algo == "mesh":
        config.transformer_layer_spec = partial(mesh_layer_spec, args,
                                                config.transformer_layer_spec)
    return config


def mesh_model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                        pg_collection=None):
    """Megatron-LM's model_provider with the builder chosen by --context-parallel-algo."""
    args = get_args()
    # mesh, or one of Megatron's algorithms (written to args.cp_comm_type for Megatron)
    builder = mesh_gpt_builder if resolve_context_parallel_algo(args) == "mesh" else gpt_builder
    return model_provider(builder, pre_process, post_process, vp_stage, config=config,
                          pg_collection=pg_collection)


_with_builder: weakref.WeakSet = weakref.WeakSet()  # the models the builder is attached to


def mesh_forward_step(data_iterator, model, *args, **kwargs):
    """Megatron-LM's forward_step, the mask builder (--mesh-mask-builder) attached to the
    GPTModel first (once per model): on core_v0.18+ the model comes from a config, and the
    forward step is the first hook that holds it."""
    gpt = unwrap_model(model)
    if gpt not in _with_builder:
        attach_mask_builder(gpt, get_args().mesh_mask_builder)
        _with_builder.add(gpt)
    return pretrain_gpt.forward_step(data_iterator, model, *args, **kwargs)


def main() -> None:
    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True
    if gpt_config_from_args is None:  # core_v0.16.1: pretrain() parses the flags itself
        pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            mesh_model_provider,
            ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            args_defaults=ARGS_DEFAULTS,
            extra_args_provider=extra_args_provider,
            get_embedding_ranks=pretrain_gpt.get_embedding_ranks,
        )
        return
    args = parse_and_validate_args(extra_args_provider=extra_args_provider,
                                   args_defaults=ARGS_DEFAULTS)
    validate_mesh_args(args)  # before any collective: a bad flag stops every rank alike
    if args.mesh_mask_builder and args.pipeline_model_parallel_size > 1:
        raise ValueError(f"--mesh-mask-builder with --pipeline-model-parallel-size "
                         f"{args.pipeline_model_parallel_size}: later stages never see the "
                         "tokens; use the driver (python -m megatron_mesh.pretrain_gpt)")
    pretrain(
        pretrain_cfg_container_from_args(args, mesh_model_config(args)),
        pretrain_gpt.train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        mesh_forward_step if args.mesh_mask_builder else pretrain_gpt.forward_step,
        get_embedding_ranks=pretrain_gpt.get_embedding_ranks,
    )


if __name__ == "__main__":
    main()
