"""Transformer Engine's softmax statistics of a "thd" (packed documents) fused-attention
call, and their exact conversion to and from our lse [1, hq, t_q] fp32.

TE's F16_arbitrary_seqlen backend returns them in one of two layouts (read in TE's
fused_attn_f16_arbitrary_seqlen.cu and its context-parallel code, which calls the choice
`softmax_lse_in_packed_format`):
  per token     [rows, hq, 1], row i = query row i: with cuDNN >= 9.6, except on sm120 from
                TE 2.14; rows = t_q from TE 2.11, before it t_q rounded up (`te_max_tokens`);
  per document  [documents, hq, max_seqlen_q, 1], [j, h, p] = query row cu_q[j] + p.
The same holds for any packed sequences (a call's runs packed by `te_runs`): `rows_from_te`
and `rows_to_te` take the sequences' bounds as a tensor and the lse as [hq, t_q].
"""
from __future__ import annotations

import torch

from ..calls.tile_slices import TileSlices

PACKED_STATS_CUDNN = (9, 6, 0)  # from this cuDNN on, TE's thd softmax stats are per token
SM120 = (12, 0)  # where TE 2.14+ keeps per-document stats for thd (no ragged stats there)
TE_SM120_DENSE_STATS = (2, 14)
TE_STATS_EXACT_TOKENS = (2, 11)  # before: per-token stats rows rounded up (`te_max_tokens`)


def packed_stats(te_minor: tuple[int, int], cudnn: tuple[int, int, int],
                 capability: tuple[int, int]) -> bool:
    """Whether TE's thd softmax stats are per token, [rows, h, 1] (else per document,
    [docs, h, max_q, 1]): from cuDNN 9.6, except on sm120 from TE 2.14 (TE's own
    `softmax_lse_in_packed_format` rule for its fused attention)."""
    if tuple(cudnn) < PACKED_STATS_CUDNN:
        return False
    return not (tuple(te_minor) >= TE_SM120_DENSE_STATS and tuple(capability) == SM120)


def te_max_tokens(tokens: int) -> int:
    """The rows TE before 2.11 gives per-token stats of `tokens` tokens: 1024 up to 1024,
    then the next power of two up to 32768, then the next multiple of 32768."""
    if tokens <= 1024:
        return 1024
    if tokens <= 32768:
        return 1 << (tokens - 1).bit_length()
    return -(-tokens // 32768) * 32768


def stats_rows(te_minor: tuple[int, int], tokens: int) -> int:
    """Rows of TE's per-token thd softmax stats for `tokens` query rows."""
    return tokens if tuple(te_minor) >= TE_STATS_EXACT_TOKENS else te_max_tokens(tokens)


def _token_positions(cu_q: torch.Tensor, tokens: int, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position in it) of each of `tokens` query rows, int64 [tokens] each, on
    `device`, from the sequences' bounds cu_q [n + 1] (a tensor: no copy to the host)."""
    cu = cu_q.to(device=device, dtype=torch.int64)
    doc = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=device), cu.diff(),
                                  output_size=tokens)
    return doc, torch.arange(tokens, device=device) - cu[doc]


def rows_from_te(stats: torch.Tensor, cu_q: torch.Tensor, tokens: int) -> torch.Tensor:
    """TE's thd softmax stats of sequences bounded by cu_q [n + 1] (int tensor) over `tokens`
    query rows -> lse [hq, tokens] fp32.

    Per token: [rows >= tokens, hq, 1], row i = query row i (offsets = cu_seqlens, rows past
    `tokens` unused). Per sequence: [n, hq, >= longest, 1], [j, h, p] = row cu_q[j] + p."""
    if stats.dim() == 3:
        return stats[:tokens, :, 0].t().float().contiguous()
    doc, pos = _token_positions(cu_q, tokens, stats.device)
    return stats[doc, :, pos, 0].t().float().contiguous()


def rows_to_te(lse: torch.Tensor, cu_q: torch.Tensor, longest: int, packed: bool,
               rows: int = 0) -> torch.Tensor:
    """lse [hq, tokens] of sequences bounded by cu_q [n + 1] -> TE's thd softmax stats, fp32:
    per token [max(rows, tokens), hq, 1] (`packed`), else per sequence [n, hq, longest, 1];
    places no row stands for are 0."""
    heads, tokens = lse.shape
    rows_of = lse.t().to(torch.float32)  # [tokens, hq]
    if packed:
        stats = rows_of.new_zeros(max(rows, tokens), heads, 1)
        stats[:tokens, :, 0] = rows_of
        return stats
    doc, pos = _token_positions(cu_q, tokens, lse.device)
    stats = rows_of.new_zeros(cu_q.numel() - 1, heads, longest, 1)
    stats[doc, :, pos, 0] = rows_of
    return stats


def lse_from_te(stats: torch.Tensor, docs: TileSlices) -> torch.Tensor:
    """TE's thd softmax stats of packed documents -> our lse [1, hq, t_q] fp32
    (`rows_from_te` with the documents' bounds)."""
    return rows_from_te(stats, docs.cu_q_tensor, docs.cu_q[-1]).unsqueeze(0)


def lse_to_te(lse: torch.Tensor, docs: TileSlices, packed: bool, rows: int = 0
              ) -> torch.Tensor:
    """Our lse [1, hq, t_q] of packed documents -> TE's thd softmax stats, fp32: per token
    [max(rows, t_q), hq, 1] (`packed`), else per document [docs, hq, max_q, 1]; places no
    row stands for are 0."""
    return rows_to_te(lse[0], docs.cu_q_tensor, docs.max_q, packed, rows)


__all__ = ["lse_from_te", "lse_to_te", "packed_stats", "rows_from_te", "rows_to_te", "stats_rows",
           "te_max_tokens"]
