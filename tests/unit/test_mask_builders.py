"""The mask-builder hook (`megatron/mask_builder.py`) and the example builders: the masks
they make against the definition, bad returns named with the builder, chunked layers by
no_rope_freq."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import megatron_mesh as mm
from examples import mask_builders
from megatron_mesh.masks.packed import packed_slices
from megatron_mesh.megatron.mask_builder import (
    MaskBuilderError,
    MaskedSeqParams,
    build_mask,
    layer_chunk,
    load_mask_builder,
    masked_seq_params,
)

SPEC = "examples.mask_builders:image_bidirectional"


def _dense(mask: mm.SliceMask, seq: int) -> torch.Tensor:
    """[seq, seq] bool of the mask's slices (full, or causal aligned at the bottom right)."""
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    seen = torch.zeros(seq, seq, dtype=torch.bool)
    for s in mask.slices:
        inside = (i >= s.q_start) & (i < s.q_end) & (j >= s.k_start) & (j < s.k_end)
        if s.kind == "causal":
            inside &= j - i <= s.k_end - s.q_end
        seen |= inside
    return seen


def test_image_tokens_see_their_whole_image_and_text_is_causal():
    tokens = torch.tensor([[5, 0, 0, 0, 7, 8, 0, 0, 9, 9]] * 2)
    mask = build_mask(mask_builders.image_bidirectional, SPEC, tokens, tokens * 0)
    image = tokens[0] == mask_builders.IMAGE_TOKEN
    run = torch.tensor([0, 1, 1, 1, 2, 3, 4, 4, 5, 6])  # the run each position is in
    i, j = torch.arange(10)[:, None], torch.arange(10)[None, :]
    want = (j <= i) | (image[:, None] & (run[:, None] == run[None, :]))
    assert torch.equal(_dense(mask, 10), want)
    assert mask.seq_len == 10  # a list of slices is a mask of the micro-batch's length


def test_prefix_lm_builder_is_the_prefix_lm_mask():
    tokens = torch.zeros(2, 64, dtype=torch.int64)
    assert mask_builders.prefix_lm(tokens, tokens) == mm.prefix_lm_mask(64, 16)


@pytest.mark.parametrize("returned,words", [
    (None, "returned None; it must return a SliceMask or a list of slices"),
    (3, "returned 3; it must return"),
    (torch.ones(8, 8, dtype=torch.bool), "returned a tensor of shape (8, 8)"),
    ([(0, 9, 0, 9, "causal")], "returned no mask of the micro-batch's 8 positions: slice "
                               "(0, 9, 0, 9, 'causal') reaches past"),
    (mm.prefix_lm_mask(16, 4), "built for a sequence of 16 tokens"),
    ([(0, 8, 0, 8, "sideways")], "returned no mask of the micro-batch's 8 positions"),
])
def test_bad_returns_name_the_builder_and_the_value(returned, words):
    tokens = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(MaskBuilderError, match=re.escape(words)) as info:
        build_mask(lambda t, p: returned, "my.module:fn", tokens, tokens)
    assert str(info.value).startswith("--mesh-mask-builder my.module:fn ")
    assert "\n" not in str(info.value)


def test_a_builder_that_raises_is_named():
    def fails(tokens, positions):
        raise ValueError("images out of line")

    with pytest.raises(MaskBuilderError, match=re.escape(
            "--mesh-mask-builder m:f raised ValueError: images out of line")):
        build_mask(fails, "m:f", torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 4))


def test_builders_load_from_a_module_or_a_file(tmp_path):
    assert load_mask_builder("examples.mask_builders:prefix_lm") is mask_builders.prefix_lm
    path = tmp_path / "mine.py"
    path.write_text("def build(tokens, positions):\n    return [(0, 4, 0, 4, 'full')]\n")
    built = build_mask(load_mask_builder(f"{path}:build"), "x", torch.zeros(1, 4), None)
    assert built == mm.SliceMask([(0, 4, 0, 4, "full")], 4)  # the micro-batch's length
    with pytest.raises(MaskBuilderError, match="cannot import .*FileNotFoundError"):
        load_mask_builder(f"{tmp_path / 'absent.py'}:build")


def test_masked_seq_params_carry_the_mask_over_the_whole_sequence():
    params = masked_seq_params(mm.chunked_mask(32, 8))
    assert isinstance(params, MaskedSeqParams)
    assert (params.qkv_format, params.max_seqlen_q, params.max_seqlen_kv) == ("sbhd", 32, 32)
    with pytest.raises(ValueError, match="must be a SliceMask"):
        MaskedSeqParams(qkv_format="sbhd", mask=[(0, 4, 0, 4, "full")])


@pytest.mark.parametrize("no_rope,chunks", [(None, [8] * 4), ([0, 1, 0, 1], [8, None, 8, None]),
                                            (4, [8, 8, 8, None]), (2, [8, None, 8, None])])
def test_layers_with_rope_are_chunked(no_rope, chunks):
    config = SimpleNamespace(no_rope_freq=no_rope)
    assert [layer_chunk(config, n, 8) for n in range(1, 5)] == chunks
    assert [layer_chunk(config, n, None) for n in range(1, 5)] == [None] * 4


def test_generation_refuses_a_builder_masked_model_and_keeps_the_chunks():
    """A builder's mask is a whole micro-batch's: generation refuses it, naming why; a
    chunked model passes, and the generation spec keeps its chunks."""
    from megatron_mesh.inference.megatron.arguments import _check_layout
    from megatron_mesh.inference.megatron.cached_attention import (
        _mesh_params,
        cached_attention_spec,
    )
    from megatron_mesh.megatron.spec import get_gpt_layer_spec
    from megatron_mesh.training.config.arguments import ConfigError

    args = SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                           data_parallel_size=1, world_size=1, context_parallel_size=1,
                           context_parallel_algo="mesh", attention_chunk_size=8,
                           mesh_mask_builder=None)
    _check_layout(args)
    args.attention_chunk_size, args.mesh_mask_builder = None, "examples.mask_builders:prefix_lm"
    with pytest.raises(ConfigError, match=re.escape(
            "trained with --mesh-mask-builder examples.mask_builders:prefix_lm: the builder "
            "masks a whole micro-batch")):
        _check_layout(args)
    spec = get_gpt_layer_spec(context_parallel_algo="mesh", attention_chunk_size=8)
    assert _mesh_params(cached_attention_spec(spec))["attention_chunk_size"] == 8


def test_a_builder_mask_on_packed_documents_is_the_mask_within_each_document():
    """Two samples of 8 tokens, documents [3, 5] and [8], packed THD-padded to multiples of
    4: each document's rows see what the sample's mask gives them inside the document;
    padding sees nothing."""
    sample = mm.prefix_lm_mask(8, 2)
    lengths, padded = [3, 5, 8], [4, 8, 8]
    starts = [0, 4, 12]
    packed = packed_slices(sample, 8, lengths, starts, sum(padded))
    want = torch.zeros(20, 20, dtype=torch.bool)
    dense, flat = _dense(sample, 8), 0
    for n, start in zip(lengths, starts):
        first = flat % 8
        want[start:start + n, start:start + n] = dense[first:first + n, first:first + n]
        flat += n
    assert torch.equal(_dense(packed, 20), want)
    with pytest.raises(ValueError, match="crosses the end of its sample"):
        packed_slices(sample, 8, [6, 6], [0, 6], 12)


def test_chunks_restart_at_each_document():
    mask = mm.chunked_mask(12, 4, cu_seqlens=[0, 6, 12])
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    doc_i, doc_j = i // 6, j // 6
    want = (j <= i) & (doc_i == doc_j) & ((i % 6) // 4 == (j % 6) // 4)
    assert torch.equal(_dense(mask, 12), want)
