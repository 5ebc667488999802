"""Checkpoints move between Megatron's attention and the mesh, strictly, both formats.

One process (gloo, world 1): a GPTModel with megatron-core's own local spec (its
DotProductAttention; in the dist-checkpoint format its keys are the Transformer Engine
spec's, through the spec's sharded_state_dict_keys_map) saves, the mesh model loads with
strict checking, trains a step, saves, and Megatron's model loads that back. The core
attention holds no parameters; what Transformer Engine's attention adds, `_extra_state`
(FP8 metadata), is carried through by MeshDotProductAttentionInTEState.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import socket

import pytest
import torch
import torch.distributed as dist

SEQ, BATCH, VOCAB = 16, 2, 64


@pytest.fixture(scope="module")
def megatron_world():
    from megatron.core import parallel_state as ps

    from megatron_mesh.megatron.cpu import megatron_on_cpu

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    ps.initialize_model_parallel(1, 1)
    try:
        with megatron_on_cpu():
            yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        # destroy_model_parallel leaves some group globals set (megatron-core 0.16.1:
        # _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP); a process forked later would free that
        # group on its first initialize_model_parallel and wait forever on threads it lacks
        for name, value in list(vars(ps).items()):
            if isinstance(value, dist.ProcessGroup):
                setattr(ps, name, None)


def _gpt(layer_spec):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               attention_dropout=0.0, hidden_dropout=0.0,
                               use_cpu_initialization=True)
    return GPTModel(config, layer_spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def _te_state_mesh_spec():
    """The mesh layer spec with the core attention that keeps TE's `_extra_state` (what
    use_mesh_core_attention picks on the TE spec; built here on the local spec)."""
    from megatron_mesh.megatron import use_mesh_core_attention
    from megatron_mesh.megatron.core_attention import MeshDotProductAttentionInTEState

    spec = use_mesh_core_attention(_local_spec())
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = dataclasses.replace(attention.core_attention,
                                                   module=MeshDotProductAttentionInTEState)
    return spec


def _local_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec()


def _train_step(model) -> None:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1], torch.arange(SEQ).expand(BATCH, SEQ), None,
                 labels=tokens[:, 1:]).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad


def _dist_roundtrip(source, target, path) -> None:
    """dist-checkpoint save of source, strict load into target."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    os.makedirs(path)
    dist_checkpointing.save(source.sharded_state_dict(), str(path))
    loaded = dist_checkpointing.load(target.sharded_state_dict(), str(path),
                                     strict=StrictHandling.RAISE_ALL)
    target.load_state_dict(loaded, strict=True)


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))


def test_dist_checkpoint_moves_between_megatron_attention_and_the_mesh(megatron_world, tmp_path):
    from megatron_mesh.megatron import MeshDotProductAttention, use_mesh_core_attention

    torch.manual_seed(1)
    megatron = _gpt(_local_spec())
    mesh = _gpt(use_mesh_core_attention(_local_spec()))
    mesh_te = _gpt(_te_state_mesh_spec())
    assert type(mesh.decoder.layers[0].self_attention.core_attention) is MeshDotProductAttention
    # the same sharded keys in all three: the core attention adds none, as TE's does not
    keys = [set(m.sharded_state_dict()) for m in (megatron, mesh, mesh_te)]
    assert keys[0] == keys[1] == keys[2]
    assert not any("core_attention" in k for k in keys[0])

    _dist_roundtrip(megatron, mesh, tmp_path / "megatron")
    assert _same_weights(megatron, mesh)
    _train_step(mesh)
    assert not _same_weights(megatron, mesh)
    _dist_roundtrip(mesh, mesh_te, tmp_path / "mesh")
    _dist_roundtrip(mesh_te, megatron, tmp_path / "mesh_te")
    assert _same_weights(mesh, megatron) and _same_weights(megatron, mesh)


def test_torch_state_dict_keeps_transformer_engine_extra_state(megatron_world):
    """TE's attention saves `_extra_state`: an empty uint8 tensor without FP8, pickled
    bytes with it. The mesh in its place loads either strictly and saves it back as is."""
    from megatron_mesh.megatron import use_mesh_core_attention

    spec = _te_state_mesh_spec()
    torch.manual_seed(2)
    mesh = _gpt(spec)
    state = mesh.state_dict()
    extra = [k for k in state if k.endswith("core_attention._extra_state")]
    assert len(extra) == 2  # one per layer, where TE's attention has it
    assert all(state[k].dtype == torch.uint8 and state[k].numel() == 0 for k in extra)

    fp8 = {"recipe": "delayed", "scale_fwd": torch.ones(3), "extra_fp8_variables": {"num_gemms": 1}}
    payload = torch.frombuffer(bytearray(pickle.dumps(fp8)), dtype=torch.uint8)
    state[extra[0]] = payload
    other = _gpt(spec)
    other.load_state_dict(state, strict=True)
    saved = other.state_dict()
    assert torch.equal(saved[extra[0]], payload)
    assert saved[extra[1]].numel() == 0
    with pytest.raises(RuntimeError, match="Unexpected key"):
        _gpt(use_mesh_core_attention(_local_spec())).load_state_dict(saved, strict=True)


def test_spec_keeps_extra_state_where_the_replaced_attention_had_it():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_mesh.megatron import get_gpt_layer_spec, use_mesh_core_attention
    from megatron_mesh.megatron.core_attention import (
        MeshDotProductAttention,
        MeshDotProductAttentionInTEState,
    )

    def core(spec):
        return spec.submodules.self_attention.submodules.core_attention.module

    assert core(use_mesh_core_attention(get_gpt_layer_local_spec())) is MeshDotProductAttention
    try:
        te_spec = get_gpt_layer_spec(use_te=True)
    except ValueError:
        pytest.skip("needs a GPU: Transformer Engine (which needs CUDA) is not installed")
    assert core(te_spec) is MeshDotProductAttentionInTEState
