"""Document masking for --reset-attention-mask: a micro-batch packed as THD documents.

Megatron-LM's document mask lets a token see only the earlier tokens of its own document,
a document ending at (and including) an EOD token. Instead of an [s, s] mask per sample,
the micro-batch's documents are packed into one sequence: every sample's documents, in
order, each padded to a multiple of 2P (P = CP size; no padding at P = 1), as cumulative
lengths (`documents.Documents`). Each CP rank then keeps its share in Transformer Engine's
THD layout (`documents.thd_split`) and every attention layer gets `PackedSeqParams`.
Padding tokens get token id 0, position 0 and loss mask 0: they neither see nor are seen.
"""
from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_mesh.masks.documents import Documents, thd_partition_indices


def document_lengths(tokens: torch.Tensor, eod: int) -> list[int]:
    """Lengths of the documents of each sample of tokens [b, s], sample after sample: a
    document ends after each EOD token and at the end of its sample."""
    lengths = []
    for sample in tokens.cpu():
        ends = (torch.nonzero(sample == eod).flatten() + 1).tolist()
        if not ends or ends[-1] != sample.numel():
            ends.append(sample.numel())
        lengths += [b - a for a, b in zip([0] + ends, ends)]
    return lengths


def padded_lengths(lengths: list[int], cp_size: int) -> list[int]:
    """Each document's length padded to a multiple of 2P (none at P = 1), as packed."""
    unit = 2 * cp_size if cp_size > 1 else 1
    return [-(-n // unit) * unit for n in lengths]


def pack_documents(batch: dict[str, torch.Tensor], eod: int, cp_size: int, cp_rank: int,
                   multiple: int = 1, lengths: list[int] | None = None) -> dict:
    """This CP rank's share of a micro-batch of [b, s] tensors packed as THD documents:
    each field becomes [1, t] (t = padded total / P), plus 'packed_seq_params'. The padded
    total is rounded up to `multiple` x 2P by one empty padding document (e.g. for
    sequence parallelism's split of the local tokens). `lengths`: the documents, when not
    those the EOD tokens of each sample delimit."""
    if lengths is None:
        lengths = document_lengths(batch["tokens"], eod)
    padded = padded_lengths(lengths, cp_size)
    unit = 2 * cp_size if cp_size > 1 else 1
    extra = -sum(padded) % (unit * multiple)
    if extra:
        lengths, padded = lengths + [0], padded + [extra]
    cum = lambda xs: [0] + torch.tensor(xs).cumsum(0).tolist()  # noqa: E731
    documents = Documents.from_cu_seqlens(cum(lengths), cum(padded))
    # where each token of the flat micro-batch lands in the padded packed sequence
    real = torch.cat([torch.arange(start, start + n)
                      for start, n in zip(documents.cu_padded, lengths)])
    mine = thd_partition_indices(documents, cp_size, cp_rank)
    out = {}
    for key, value in batch.items():
        flat = value.reshape(-1)
        packed = flat.new_zeros(documents.total)
        packed[real.to(flat.device)] = flat
        out[key] = packed[mine.to(flat.device)].unsqueeze(0)
    device = batch["tokens"].device
    as_tensor = lambda cu: torch.tensor(cu, dtype=torch.int32, device=device)  # noqa: E731
    cu, cu_padded = as_tensor(cum(lengths)), as_tensor(list(documents.cu_padded))
    longest = max(documents.padded_lengths)
    out["packed_seq_params"] = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded, max_seqlen_q=longest, max_seqlen_kv=longest)
    return out
