"""Sliding windows in a megatron-core GPTModel (config.window_size with
window_attn_skip_freq = 2: layer 1 windowed, layer 2 global) with the mesh core attention
match the same model at CP = 1 whose core attention is torch SDPA on the whole sequence with
the explicit windowed mask, on 4 gloo ranks: 2x2, 4x1, 1x4 and heads x mesh 2x2x1 grids,
windows of 3 tokens (less than a sub-chunk of 4) and 9. Chunked attention the same way
(attention_chunk_size 5 with no_rope_freq [0, 1]: layer 1 chunked, layer 2 global; the
reference's mask from the definition, j <= i and i // 5 == j // 5) on 2x2 and 2x1x2; and a
mask builder attached to the model (`attach_mask_builder`, as Megatron-LM takes it: the
model gathers the zigzag shares of the tokens over CP) giving the prefix-LM mask of the
definition (j < 8 or j <= i)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from gpt_parity import compare_on_grids, init_parallel, loss_and_grads, random_batch

from dist_utils import run_distributed

WORLD, SEQ, BATCH, VOCAB = 4, 32, 2, 64
HEADS, HIDDEN, LAYERS = 4, 64, 2
GRIDS = [(2, 2), (4, 1), (1, 4), (2, 2, 1)]
WINDOWS = [(3, 0), (9, 0)]
CHUNK = 5  # crosses the sub-chunks of 4 tokens
CHUNK_GRIDS = [(2, 2), (2, 1, 2)]
NO_ROPE = [0, 1]  # layer 2 without RoPE: Llama 4's global layer


def _sdpa_class(chunk: int | None = None, prefix: int | None = None):
    from megatron.core.transformer.module import MegatronModule

    class SDPACoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type,
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                     pg_collection=None):
            from megatron_mesh.megatron.core_attention import layer_window
            from megatron_mesh.megatron.mask_builder import layer_chunk

            super().__init__(config=config)
            self.window = layer_window(config, layer_number)
            self.chunk = layer_chunk(config, layer_number, chunk)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            i = torch.arange(q.shape[2])
            seen = i[None, :] <= i[:, None]
            if self.window is not None:
                seen &= i[None, :] >= i[:, None] - self.window[0]
            if self.chunk is not None:
                seen &= i[None, :] // self.chunk == i[:, None] // self.chunk
            if prefix is not None:
                seen |= i[None, :] < prefix
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=True)
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    return SDPACoreAttention


def _config(cp: int, window, no_rope=None):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=2,
        attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, context_parallel_size=cp, window_size=window,
        window_attn_skip_freq=2 if window else None,
        no_rope_freq=no_rope)


def _model(cp: int, reference: bool, window, chunk=None, no_rope=None, prefix=None):
    from megatron.core.models.gpt import GPTModel

    from megatron_mesh.megatron import get_gpt_layer_spec

    spec = get_gpt_layer_spec("mesh", attention_chunk_size=chunk)
    if reference:
        spec.submodules.self_attention.submodules.core_attention = _sdpa_class(chunk, prefix)
    return GPTModel(_config(cp, window, no_rope), spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope")


def _describe(model) -> dict:
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    return {"windows": [c.window_size for c in cores], "core": type(cores[0]).__name__,
            "chunks": [c.chunk for c in cores]}


def _job(rank: int, world: int) -> dict:
    from megatron_mesh.megatron.cpu import megatron_on_cpu

    out = {}
    with megatron_on_cpu():
        full, denominator = random_batch(BATCH, SEQ, VOCAB)
        for window in WINDOWS:
            init_parallel(1)
            torch.manual_seed(1234)
            reference = _model(1, True, window)
            per_grid = compare_on_grids(reference, lambda: _model(world, False, window), GRIDS,
                                        world, HEADS, 2, SEQ, full, denominator, _describe)
            out.update(((window, shape), r) for shape, r in per_grid.items())
        init_parallel(1)
        torch.manual_seed(1234)
        reference = _model(1, True, None, CHUNK, NO_ROPE)
        per_grid = compare_on_grids(reference, lambda: _model(world, False, None, CHUNK, NO_ROPE),
                                    CHUNK_GRIDS, world, HEADS, 2, SEQ, full, denominator,
                                    _describe)
        out.update((("chunk", shape), r) for shape, r in per_grid.items())
        # the mesh at CP = 1 (a 1 x 1 grid, what the driver runs there) is the definition too
        init_parallel(1)
        single = _model(1, False, None, CHUNK, NO_ROPE)
        single.load_state_dict(reference.state_dict())
        (loss, grads), (ref, ref_grads) = (loss_and_grads(m, full, denominator)
                                           for m in (single, reference))
        out["chunk_cp1"] = (loss.item(), ref.item(), max(
            ((grads[n] - ref_grads[n]).abs().max() / (ref_grads[n].abs().max() + 1e-6)).item()
            for n in grads))
        # the chunks change the model: the reference differs from the same without chunks
        init_parallel(1)
        torch.manual_seed(1234)
        causal = _model(1, True, None, None, NO_ROPE)
        out["causal_loss"] = loss_and_grads(causal, full, denominator)[0].item()
        # a prefix-LM builder attached to the model
        init_parallel(1)
        torch.manual_seed(1234)
        reference = _model(1, True, None, prefix=SEQ // 4)
        per_grid = compare_on_grids(reference, lambda: _with_builder(_model(world, False, None)),
                                    CHUNK_GRIDS, world, HEADS, 2, SEQ, full, denominator,
                                    _describe)
        out.update((("builder", shape), r) for shape, r in per_grid.items())
    return out


def _with_builder(model):
    from megatron_mesh.megatron import attach_mask_builder

    attach_mask_builder(model, "examples.mask_builders:prefix_lm")  # prefix: SEQ // 4
    return model


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_job, WORLD)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("shape", GRIDS)
def test_windowed_gpt_matches_cp1(results, window, shape) -> None:
    for rank, res in enumerate(results):
        r = res[window, shape]
        assert r["core"] == "MeshDotProductAttention"
        assert r["windows"] == [window, None]  # layer 2 is global (window_attn_skip_freq)
        loss, ref = r["loss"]
        assert math.isclose(loss, ref, rel_tol=1e-5), (rank, loss, ref)
        assert r["grad_err"] < 1e-5, (rank, r["grad_err"])


def test_chunked_gpt_at_cp1_is_the_definition(results) -> None:
    for res in results:
        loss, ref, grad_err = res["chunk_cp1"]
        assert math.isclose(loss, ref, rel_tol=1e-5) and grad_err < 1e-5, res["chunk_cp1"]


@pytest.mark.parametrize("shape", CHUNK_GRIDS)
def test_chunked_gpt_matches_cp1(results, shape) -> None:
    for rank, res in enumerate(results):
        r = res["chunk", shape]
        assert r["core"] == "MeshDotProductAttention"
        assert r["chunks"] == [CHUNK, None]  # layer 2 has no RoPE: global
        loss, ref = r["loss"]
        assert math.isclose(loss, ref, rel_tol=1e-5), (rank, loss, ref)
        assert r["grad_err"] < 1e-5, (rank, r["grad_err"])
        assert abs(ref - res["causal_loss"]) > 1e-4, (ref, res["causal_loss"])


@pytest.mark.parametrize("shape", CHUNK_GRIDS)
def test_attached_mask_builder_matches_cp1(results, shape) -> None:
    for rank, res in enumerate(results):
        r = res["builder", shape]
        loss, ref = r["loss"]
        assert math.isclose(loss, ref, rel_tol=1e-5), (rank, loss, ref)
        assert r["grad_err"] < 1e-5, (rank, r["grad_err"])
