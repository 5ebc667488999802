"""Attention sinks (config.softmax_type) in a megatron-core GPTModel with the mesh core
attention against the same model at CP = 1 with megatron-core's own unfused
DotProductAttention (its SoftmaxOne over the S x S scores), on 4 gloo ranks: 2x2, 1x4 and
the heads x mesh 2x1x2 grid. "learnable" with a sliding window of 3 on layer 1
(window_attn_skip_freq 2) and sink logits drawn large enough to matter; "off-by-one"
without a window. The model loads the reference's state dict strictly (the parameter's
name and shape are megatron-core's), its loss and every gradient (the sink's summed over
the CP group, as megatron-core's DDP reduction does) match to 1e-5; with TP 2 each TP rank
holds its heads' slice and the dist-checkpoint entry is megatron-core's."""
from __future__ import annotations

import math

import pytest
import torch
from gpt_parity import compare_on_grids, init_parallel, random_batch

from dist_utils import run_distributed

WORLD, SEQ, BATCH, VOCAB = 4, 32, 2, 64
HEADS, GROUPS, HIDDEN, LAYERS = 4, 2, 64, 2
GRIDS = [(2, 2), (1, 4), (2, 1, 2)]
CASES = {"learnable": (3, 0), "off-by-one": None}  # softmax_type: window of layer 1
SINK = "decoder.layers.{}.self_attention.core_attention.softmax_offset"


def _config(cp: int, softmax_type: str, tp: int = 1):
    from megatron.core.transformer import TransformerConfig

    window = CASES[softmax_type]
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, context_parallel_size=cp,
        tensor_model_parallel_size=tp, masked_softmax_fusion=False,
        softmax_type=softmax_type, window_size=window,
        window_attn_skip_freq=2 if window else None)


def _model(cp: int, reference: bool, softmax_type: str):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_mesh.megatron import get_gpt_layer_spec

    # the reference is megatron-core's local layer: its own DotProductAttention
    spec = get_gpt_layer_local_spec() if reference else get_gpt_layer_spec("mesh")
    return GPTModel(_config(cp, softmax_type), spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope")


def _describe(model) -> dict:
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    offsets = [c.softmax_offset for c in cores]
    return {"core": type(cores[0]).__name__, "windows": [c.window_size for c in cores],
            "offset_is_param": [isinstance(o, torch.nn.Parameter) for o in offsets],
            "offset": [None if o is None else o.detach().clone() for o in offsets]}


def _tp_job(out: dict) -> None:
    """TP 2 x CP 2: this TP rank's heads, and the sharded-state entry next to megatron's."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mesh.megatron import initialize_mesh_grids
    from megatron_mesh.megatron.core_attention import (
        MeshDotProductAttention,
        MeshDotProductAttentionInTEState,
    )
    from megatron_mesh.megatron.groups import destroy_mesh_grids

    destroy_mesh_grids()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(2, 1, context_parallel_size=2, create_gloo_process_groups=False)
    initialize_mesh_grids((2, 1), num_attention_heads=HEADS, num_query_groups=GROUPS,
                          seq_length=SEQ)
    kwargs = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    entries = {}
    for name, cls, cp in (("megatron", DotProductAttention, 1), ("mesh", MeshDotProductAttention, 2)):
        config = _config(cp, "learnable", tp=2)
        config.context_parallel_size = 2 if name == "mesh" else 1
        core = cls(config=config, **kwargs)
        metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
        tensor = core.sharded_state_dict(prefix="x.", metadata=metadata)["x.softmax_offset"]
        entries[name] = (tuple(core.softmax_offset.shape), tensor.key,
                         tuple(tensor.global_shape), tuple(tensor.global_offset),
                         tuple(tensor.axis_fragmentations))
    te_state = MeshDotProductAttentionInTEState(config=_config(2, "learnable", tp=2), **kwargs)
    out["tp2"] = entries | {"tp_rank": ps.get_tensor_model_parallel_rank(),
                            "te_state_keys": sorted(te_state.sharded_state_dict(
                                prefix="x.", metadata=metadata))}


def _job(rank: int, world: int) -> dict:
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from megatron_mesh.megatron.cpu import megatron_on_cpu

    out = {}
    with megatron_on_cpu():
        full, denominator = random_batch(BATCH, SEQ, VOCAB)
        for softmax_type in CASES:
            init_parallel(1)
            # megatron's attention forks its RNG tracker: the pass-through one on a CPU
            initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
            torch.manual_seed(1234)
            reference = _model(1, True, softmax_type)
            if softmax_type == "learnable":  # logits that take a visible share of each row
                g = torch.Generator().manual_seed(5)
                with torch.no_grad():
                    for layer in range(LAYERS):
                        reference.get_parameter(SINK.format(layer)).copy_(
                            torch.randn(HEADS, generator=g) * 1.5)
            per_grid = compare_on_grids(
                reference, lambda t=softmax_type: _model(world, False, t), GRIDS, world, HEADS,
                GROUPS, SEQ, full, denominator, _describe)
            ref_sink = (None if softmax_type != "learnable" else
                        reference.get_parameter(SINK.format(0)).grad.abs().max().item())
            for shape, r in per_grid.items():
                out[softmax_type, shape] = r | {"ref_sink_grad": ref_sink}
        _tp_job(out)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_job, WORLD)


@pytest.mark.parametrize("softmax_type", list(CASES))
@pytest.mark.parametrize("shape", GRIDS)
def test_sinks_match_megatron_unfused_attention(results, softmax_type, shape) -> None:
    window = CASES[softmax_type]
    for rank, res in enumerate(results):
        r = res[softmax_type, shape]
        assert r["core"] == "MeshDotProductAttention"
        assert r["windows"] == [window, None]
        loss, ref = r["loss"]
        assert math.isclose(loss, ref, rel_tol=1e-5), (rank, loss, ref)
        assert r["grad_err"] < 1e-5, (rank, r["grad_err"])
        if softmax_type == "learnable":
            assert r["offset_is_param"] == [True, True]
            for layer in range(LAYERS):
                assert r["grad_errs"][SINK.format(layer)] < 1e-5
            assert r["ref_sink_grad"] > 1e-4  # the sink's gradient is not trivially 0
        else:  # megatron's off-by-one: zeros, no parameter, nothing in the state dict
            assert r["offset_is_param"] == [False, False]
            assert all(torch.equal(o, torch.zeros(HEADS)) for o in r["offset"])
            assert not any("softmax_offset" in n for n in r["grad_errs"])


def test_tp2_holds_its_heads_and_checkpoints_as_megatron(results) -> None:
    for res in results:
        entries = res["tp2"]
        assert entries["mesh"] == entries["megatron"]
        shape, key, global_shape, offset, fragments = entries["mesh"]
        assert shape == (HEADS // 2,) and key == "x.softmax_offset"
        assert global_shape == (HEADS,) and offset == (entries["tp_rank"] * HEADS // 2,)
        assert fragments == (2,)
        # in place of TE's attention: TE's learnable entries, the offset and the extra state
        assert entries["te_state_keys"] == ["x._extra_state", "x.softmax_offset"]
