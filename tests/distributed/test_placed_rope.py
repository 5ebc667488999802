"""RoPE of placed documents (megatron_mesh/megatron/placed_documents.py) against megatron-core's own.

Reference: megatron-core's `apply_rotary_pos_emb` on the WHOLE packed sequence with its
cu_seqlens (its THD path at CP = 1: each document rotated from position 0). Inside
`placed_rope()`, the attention modules' `apply_rotary_pos_emb` given each CP rank's rows
(`placement.token_indices(r)`) and that rank's `PlacedSeqParams` cu_seqlens returns exactly
the reference's rows, for plain and MLA-interleaved RoPE, with a YaRN-like mscale; any
other call is megatron-core's unchanged. `PlacedSeqParams` refuses what does not describe
the placement, and `MeshDotProductAttention`'s lookup refuses one outside `placed_rope()`.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

CU = [0, 3, 40, 41, 58, 90, 96]  # a 37-token document, 1-token ones; total 96 = 4 x 24


def _check(rank: int, world: int) -> str:
    import megatron.core.transformer.attention as attention
    import megatron.core.transformer.multi_latent_attention as mla
    import torch.distributed as dist
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer import TransformerConfig

    from megatron_mesh.masks.document_placer import place_documents
    from megatron_mesh.megatron.cpu import megatron_on_cpu
    from megatron_mesh.megatron.placed_documents import (
        PlacedSeqParams,
        placed_rope,
        placed_seq_params,
        placement_of,
    )

    group = dist.new_group([0])
    placement = place_documents(CU, 4)
    assert max(len(g) for g in placement.groups) > 1  # a document spans ranks
    cu = torch.tensor(CU, dtype=torch.int32)
    torch.manual_seed(0)
    d = 16
    rope = RotaryEmbedding(kv_channels=d, rotary_percent=1.0, use_cpu_initialization=True)
    with megatron_on_cpu():  # RoPE's frequencies go to torch.cuda.current_device()
        freqs = rope(max(placement.lengths), packed_seq=True)
    for mla_style in (False, True):
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2,
                                   multi_latent_attention=mla_style)
        for heads, mscale in ((2, 1.0), (1, 1.3)):
            t = torch.randn(CU[-1], heads, d, dtype=torch.float64)
            want = apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, mscale=mscale,
                                        cp_group=group)
            assert not torch.allclose(want, t)
            for r in range(4):
                params = placed_seq_params(placement, r)
                rows = placement.token_indices(r)
                with placed_rope():
                    for module in (attention, mla):
                        got = module.apply_rotary_pos_emb(
                            t[rows], freqs, config=config, cu_seqlens=params.cu_seqlens_q,
                            mscale=mscale, cp_group=group)
                        torch.testing.assert_close(got, want[rows], rtol=0, atol=1e-12)
                    # not a placement's cu_seqlens: megatron-core's own THD RoPE
                    same = attention.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu,
                                                          mscale=mscale, cp_group=group)
                    torch.testing.assert_close(same, want, rtol=0, atol=0)
                    assert placement_of(params) is placement
    params = placed_seq_params(placement, 0)
    with pytest.raises(RuntimeError, match="placed_rope"):
        placement_of(params)
    assert attention.apply_rotary_pos_emb is apply_rotary_pos_emb  # restored
    with pytest.raises(ValueError, match="cu_seqlens_q must be the placement's"):
        PlacedSeqParams(qkv_format="thd", cu_seqlens_q=cu[:-1], cu_seqlens_kv=cu,
                        placement=placement)
    with pytest.raises(ValueError, match="not padded"):
        PlacedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                        cu_seqlens_q_padded=cu, placement=placement)
    with pytest.raises(ValueError, match="DocumentPlacement"):
        PlacedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    return "ok"


def test_placed_rope_equals_megatron_thd_rope_of_the_whole_sequence() -> None:
    assert run_distributed(_check, 1) == ["ok"]
