"""The mesh core attention over packed documents (THD, CP = 1) with chunked layers and a
builder's mask, against SDPA with the mask from the definition: chunks of N tokens counted
from each document's start, a prefix-LM mask within each sample's documents."""
from __future__ import annotations

import torch
from gpt_parity import init_parallel

from dist_utils import run_distributed

HEADS, DIM, CHUNK = 4, 8, 4
LENGTHS = [6, 4, 7, 3]  # two samples of 10 tokens: documents [6, 4] and [7, 3]
SAMPLE = 10


def _definition(chunked: bool, prefix: int) -> torch.Tensor:
    """bool [T, T]: what each packed token sees."""
    cu = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    total = cu[-1]
    doc = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    in_doc = torch.arange(total) - torch.tensor(cu[:-1])[doc]
    in_sample = torch.arange(total) % SAMPLE
    i, j = torch.arange(total)[:, None], torch.arange(total)[None, :]
    seen = (doc[:, None] == doc[None, :]) & (j <= i)
    if chunked:
        seen &= in_doc[:, None] // CHUNK == in_doc[None, :] // CHUNK
    if prefix:
        both = (in_sample[:, None] < prefix) & (in_sample[None, :] < prefix)
        seen |= (doc[:, None] == doc[None, :]) & both
    return seen


def _job(rank: int, world: int) -> list[float]:
    import torch.nn.functional as F
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_mesh as mm
    from megatron_mesh.megatron.core_attention import MeshDotProductAttention
    from megatron_mesh.megatron.mask_builder import with_packed_mask

    init_parallel(1)
    config = TransformerConfig(num_layers=2, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               attention_dropout=0.0, use_cpu_initialization=True,
                               context_parallel_size=1, no_rope_freq=[0, 1])
    total = sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, HEADS, DIM, generator=g) for _ in range(3))
    errors = []
    for layer, prefix in ((1, 0), (2, 3)):  # layer 1 chunked (RoPE), layer 2 global (NoPE)
        core = MeshDotProductAttention(config, layer, AttnMaskType.causal, "self",
                                       attention_chunk_size=CHUNK)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                                 max_seqlen_q=7, max_seqlen_kv=7)
        if prefix:
            with_packed_mask(params, mm.prefix_lm_mask(SAMPLE, prefix), SAMPLE, LENGTHS,
                             cu[:-1].tolist(), total)
        out = core(q, k, v, None, packed_seq_params=params)
        seen = _definition(layer == 1, prefix)
        ref = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=seen)
        errors.append((out - ref.transpose(0, 1).reshape(total, -1)).abs().max().item())
    return errors, _planned_ahead(config, q, k, v)


def _planned_ahead(config, q, k, v) -> list[tuple[bool, int, int]]:
    """(planned, blocks cut by the driver's plan, blocks cut by the first layer) of a new
    micro-batch of documents, planned ahead by the driver (`plan_micro_batch`) and not."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mesh.calls import layout
    from megatron_mesh.megatron.core_attention import MeshDotProductAttention, plan_micro_batch

    cuts = []
    cut = layout.tile_parts
    layout.tile_parts = lambda *args: cuts.append(1) or cut(*args)
    out = []
    for ahead, lengths in ((True, [9, 3, 8]), (False, [4, 12, 4])):  # new documents each
        model = torch.nn.Sequential(MeshDotProductAttention(config, 2, AttnMaskType.causal,
                                                            "self"))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                                 max_seqlen_q=12, max_seqlen_kv=12)
        before = len(cuts)
        planned = plan_micro_batch(model, params, "cpu") if ahead else False
        planning = len(cuts) - before
        model[0](q, k, v, None, packed_seq_params=params)
        out.append((planned, planning, len(cuts) - before - planning))
    layout.tile_parts = cut
    return out


def test_chunks_and_a_builder_mask_over_packed_documents_are_the_definition() -> None:
    ((errors, planned),) = run_distributed(_job, 1)
    assert max(errors) < 1e-5, errors
    # the driver's plan of a micro-batch is what its first layer uses: the layer cuts no
    # block; without it the layer cuts them itself
    assert planned[0][:2] == (True, 1) and planned[0][2] == 0, planned
    assert planned[1] == (False, 0, 1), planned
