"""`core_attention.documents_of` reads Megatron's PackedSeqParams once per object and
contents: a caller that reuses one object and refills its cu_seqlens in place (static
buffers, CUDA-graph style) gets the new documents, not the first ones."""
from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_mesh.masks.documents import Documents
from megatron_mesh.megatron.core_attention import documents_of


def params_of(cu: torch.Tensor, padded: torch.Tensor | None = None) -> PackedSeqParams:
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)


def test_documents_of_sees_cu_seqlens_refilled_in_place() -> None:
    cu = torch.tensor([0, 8, 32], dtype=torch.int32)
    padded = torch.tensor([0, 8, 32], dtype=torch.int32)
    params = params_of(cu, padded)
    first = documents_of(params)
    assert first == Documents.from_cu_seqlens([0, 8, 32])
    assert documents_of(params) is first  # unchanged: not read again
    for values, real in (([0, 16, 32], [0, 16, 32]), ([0, 24, 32], [0, 20, 27])):
        padded.copy_(torch.tensor(values, dtype=torch.int32))  # the static buffers, refilled
        cu.copy_(torch.tensor(real, dtype=torch.int32))
        assert documents_of(params) == Documents.from_cu_seqlens(real, values), values
    cu[2] = 26  # an in-place write of one element
    assert documents_of(params) == Documents.from_cu_seqlens([0, 20, 26], [0, 24, 32])
    params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = None  # attributes replaced
    params.cu_seqlens_q = params.cu_seqlens_kv = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert documents_of(params) == Documents.from_cu_seqlens([0, 8, 16])
