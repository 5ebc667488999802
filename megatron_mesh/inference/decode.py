"""One decode step's attention over a KV cache sharded over the CP group.

Each CP rank holds the same new queries (one token per sequence: the layers before
attention run replicated on every CP rank, on b tokens) and 1 / P of the cache. Per layer:

  1. local_partial: this rank's queries against its cache share, in fp32 -> out [b, hq, dv],
     lse [b, hq] (lse -inf and out 0 where no key of the share is visible);
  2. one all-gather of [b, hq, dv + 1] fp32 (out beside lse) over the CP group;
  3. merge_partials: the log-sum-exp merge of the P partials, in CP-rank order, the same
     on every rank, so every rank gets the same bits (no broadcast needed);
  4. the sink logit (softmax_offset) merged once, after the CP merge (`sink.add_sink`).

Two exchanges, the same result up to rounding (`EXCHANGES`):
  "all_gather" (default): one collective of P - 1 hops (a ring); it sends (P - 1) b hq
      (dv + 1) 4 bytes per rank, and every rank merges in the same order, so every rank gets
      the same bits;
  "all_reduce": a max of the lse (b hq values), then a sum of [out e^(lse - max), e^(lse -
      max)] (b hq (dv + 1) values): two collectives, but each a tree of about 2 log2 P hops
      on NCCL where the all-gather is a ring of P - 1; fewer bytes at large P too. The
      planner prices both (`planner/inference.py`): latency decides, so the all-gather on a
      node or two, the all-reduce pair on many.
A decode step is latency-bound: a few kilobytes per layer. With a heads axis (A > 1) the
same scheme runs over all P ranks: the cache is cut by tokens, every rank holds every head
of its tokens, so splitting heads first would only add an all-to-all.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..common.merge import merge_into
from ..masks.mask import Mask, as_attention_mask, sliding_window_mask
from ..masks.seen import keeps, one_row
from ..masks.sink import add_sink, check_offset
from ..masks.slices import SliceMask
from ..runtime import comm
from .cache import KVShard
from .packed import PackedShard


def decode_mask(window_left: int | None = None,
                attention_mask: Mask | SliceMask | None = None) -> Mask:
    """The `Mask` a decode step reads its rows from: `attention_mask` (the model's, over the
    whole generated sequence's positions; None: causal) within a window of `window_left`
    keys before each query where given."""
    mask = Mask() if attention_mask is None else as_attention_mask(attention_mask)
    if window_left is not None and window_left >= 0:
        mask = mask & sliding_window_mask(window_left, 0, causal=mask.causal)
    return mask


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window_left: int | None,
            attention_mask: Mask | SliceMask | None = None) -> torch.Tensor:
    """[b, n] bool: key slot positions k_pos [n, b] a query at q_pos [b] sees: its row of
    the mask (`decode_mask`, `Mask.row`: causal by default, `seen.one_row`; within
    `window_left` keys before it when given; EMPTY slots never)."""
    if attention_mask is None:
        return keeps(one_row(q_pos, window_left), q_pos[:, None], k_pos.t())
    return decode_mask(window_left, attention_mask).row(q_pos, k_pos.t())


def local_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor,
                  q_pos: torch.Tensor, scale: float, window_left: int | None = None,
                  attention_mask: Mask | SliceMask | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, hq, d] against k [n, b, hkv, d], v [n, b, hkv, dv] at positions k_pos [n, b]
    -> fp32 out [b, hq, dv], lse [b, hq] (hq a multiple of hkv: GQA / MQA by grouping)."""
    b, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.float().view(b, hkv, hq // hkv, d)
    kf = k.float().permute(1, 2, 0, 3)  # [b, hkv, n, d]
    vf = v.float().permute(1, 2, 0, 3)
    scores = torch.einsum("bhgd,bhnd->bhgn", qg, kf) * scale
    mask = visible(q_pos, k_pos, window_left, attention_mask)[:, None, None, :]
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is visible
    probs = torch.exp(scores - lse[..., None]).nan_to_num_(nan=0.0)
    out = torch.einsum("bhgn,bhnd->bhgd", probs, vf)
    return out.reshape(b, hq, -1), lse.reshape(b, hq)


def shared_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, hq, d] against keys every query shares, k [n, hkv, d], v [n, hkv, dv] (the
    packed cache: one copy for all documents), `mask` [b, n] the slots each query sees ->
    fp32 out [b, hq, dv], lse [b, hq]. The scores of every query against every slot come
    from one product (no copy per document); the mask keeps each document's own."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(b, hkv, hq // hkv, d)
    scores = torch.einsum("bhgd,nhd->bhgn", qg, k.float()) * scale
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is visible
    probs = torch.exp(scores - lse[..., None]).nan_to_num_(nan=0.0)
    out = torch.einsum("bhgn,nhd->bhgd", probs, v.float())
    return out.reshape(b, hq, -1), lse.reshape(b, hq)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """P partials out [P, b, hq, dv], lse [P, b, hq] (fp32) -> merged out [b, hq, dv], lse
    [b, hq], folded in CP-rank order by the mesh's log-sum-exp merge (`merge.merge_into`,
    the tiles' one merge: a row of one query position); rows no partial sees stay out 0,
    lse -inf."""
    out, lse = outs[0][None].clone(), lses[0][..., None].clone()  # [1, b, hq, dv], [b, hq, 1]
    for part_out, part_lse in zip(outs[1:], lses[1:]):
        merge_into(out, lse, part_out[None], part_lse[..., None])
    return out[0], lse[..., 0]


def exchange_partials(out: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup | None,
                      cp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather this rank's out [b, hq, dv] and lse [b, hq] (fp32, one message of
    b hq (dv + 1) values) -> every rank's, [P, b, hq, dv] and [P, b, hq]."""
    if cp_size == 1:
        return out[None], lse[None]
    msg = torch.cat([out, lse[..., None]], dim=-1).contiguous()
    gathered = comm.all_gather(msg[None], group, "forward", "row")  # [P, b, hq, dv + 1]
    return gathered[..., :-1], gathered[..., -1]


def reduce_partials(out: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup | None,
                    cp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged out [b, hq, dv], lse [b, hq] of every rank's partial by two all-reduces:
    the max of the lse, then the sum of [out w, w], w = e^(lse - max)."""
    if cp_size == 1:
        return out, lse
    top = lse.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lse - shift)  # 0 where this rank sees no key
    msg = torch.cat([out * w[..., None], w[..., None]], dim=-1)
    dist.all_reduce(msg, group=group)
    total = msg[..., -1]
    merged = msg[..., :-1] / total.clamp_min(torch.finfo(total.dtype).tiny)[..., None]
    return merged, shift + torch.log(total)


EXCHANGES = ("all_gather", "all_reduce")


def decode_attention(q: torch.Tensor, shard: KVShard | PackedShard, q_pos: torch.Tensor, scale: float,
                     group: dist.ProcessGroup | None = None, cp_size: int = 1,
                     window_left: int | None = None,
                     softmax_offset: torch.Tensor | None = None,
                     exchange: str = "all_gather",
                     mask: torch.Tensor | None = None,
                     attention_mask: Mask | SliceMask | None = None) -> torch.Tensor:
    """The new tokens' attention over the whole cache: q [b, hq, d] (the same on every CP
    rank), this rank's `shard` (dense or packed prompts; the new token's K / V already
    appended on its owner),
    q_pos [b] -> out [b, hq, dv] in q's dtype, the same on every rank of `group` (the CP
    group of `cp_size` ranks; None: the default group). `window_left`: keys q_pos - left
    .. q_pos only; `softmax_offset` [hq] fp32: each head's sink logit; `exchange`: how the
    partials merge (`EXCHANGES`, module docstring); `mask`: a packed shard's
    `visible(q_pos, window_left)`, when the caller built it once for the step's layers;
    `attention_mask`: the model's `Mask` (or `SliceMask`) over the whole generated
    sequence's positions (a packed shard's: each document's own), of which each new token
    reads its row (None: causal; e.g. a bidirectional prefix, under which prefill ran)."""
    check_offset(softmax_offset, q.shape[1])
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange {exchange!r}: valid values are {', '.join(EXCHANGES)}")
    if isinstance(shard, PackedShard):
        if mask is None:
            mask = shard.visible(q_pos, window_left, attention_mask)
        n = shard.used
        out, lse = shared_partial(q, shard.k[:n], shard.v[:n], mask, scale)
    else:
        out, lse = local_partial(q, *shard.view(), q_pos, scale, window_left, attention_mask)
    if exchange == "all_reduce":
        out, lse = reduce_partials(out, lse, group, cp_size)
    else:
        out, lse = merge_partials(*exchange_partials(out, lse, group, cp_size))
    if softmax_offset is not None:
        o, lse_s = add_sink(out[None], lse[..., None], softmax_offset)  # [1, b, hq, dv]
        out, lse = o[0], lse_s[..., 0]
    return out.to(q.dtype)
