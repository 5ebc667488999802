"""A tile kernel on torch's FlexAttention: a rank's whole tile in one call per pass.

The blocks a rank has on hand together (its row's query chunks x the K/V chunks held,
`schedules/whole_tile.py`) are one call: the query chunks concatenated against the K/V
chunks concatenated once, with a block mask (`TileMask`) holding which (query, key)
pairs each block keeps: causal, documents, windows, any slices, blocks computed elsewhere
left out. No call per query chunk, no copy of keys per query chunk.

The mask is kept at FlexAttention's block granularity (`BLOCK` rows x `BLOCK` keys): each
block empty, full, or partial, and only the partial blocks' pairs are stored (a causal
tile's diagonals, documents' edges, a window's borders), so a tile's mask grows with its
edges, not with its area. It is made so too, from the calls' slices at their rows' places
(`TileMask.of_pieces`, `calls/band_blocks.py`): no mask of the call's rows x keys.

Forward: `flex_attention` with the log-sum-exp the merge needs (`AuxRequest(lse=True)`).
Backward: FlexAttention's backward op given the WHOLE row's out and lse (`base.TileKernel`):
P = exp(S - lse) and D = rowsum(dO * O) of the whole row, so its gradients are the tile's
exact partial sums, with no forward recomputed. On CUDA both are `torch.compile`d; on the
CPU both run eagerly: the forward and backward ops' own dense implementations (torch's
public `flex_attention` refuses a CPU backward, the op itself has one).

Shapes: q [sq, b, hq, d], k [sk, b, hkv, d], v [sk, b, hkv, dv], lse [b, hq, sq] fp32.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from torch._higher_order_ops.flex_attention import create_fw_bw_graph
from torch._higher_order_ops.flex_attention import flex_attention as forward_op
from torch._higher_order_ops.flex_attention import flex_attention_backward as backward_op
from torch.nn.attention import flex_attention as flex_api

from ..calls.band_blocks import (
    Pieces,
    block_kinds,
    bucket,
    call_pieces,
    row_runs,
    slice_table,
)
from ..calls.tile_slices import TileSlices
from .base import check_call, dense_last_dim
from .caps import KernelCaps

BLOCK = 128  # FlexAttention's block of rows and keys (its default sparse block size)
LN2 = math.log(2.0)
EMPTY, FULL = 0, 1  # a block's entry in `TileMask.kinds` (2 + n: the n-th partial block)


def _identity_score(score, b, h, q_idx, kv_idx):
    return score


@dataclass(frozen=True, eq=False)
class TileMask:
    """The pairs one call keeps, at FlexAttention's block granularity: `kinds` int32
    [q blocks, kv blocks] (EMPTY, FULL, or 2 + the index of a partial block) and `partial`
    bool [a power of two >= 2 + partial blocks, BLOCK, BLOCK] (entry 0 all False, entry 1
    all True, then the partial blocks' pairs); `shape` (sq, sk). Build with `of_pieces`
    or `of_slices` (no mask of sq x sk made), or `of` a bool mask (checks)."""

    shape: tuple[int, int]
    kinds: torch.Tensor
    partial: torch.Tensor
    _block_masks: dict = field(default_factory=dict, repr=False)  # device -> BlockMask

    @classmethod
    def of(cls, seen: torch.Tensor) -> TileMask:
        """The mask of bool `seen` [sq, sk] (True: query i sees key j; for checks: the
        driver's masks come from pieces)."""
        kinds, some = _blocks_of(seen)
        return cls(tuple(seen.shape), kinds, _partial(some, seen.device))

    @classmethod
    def of_pieces(cls, shape: tuple[int, int], pieces: Pieces, device: torch.device
                  ) -> TileMask:
        """The mask of `shape` (sq, sk) keeping the union of band `pieces` (tile positions,
        `calls.band_blocks`): each block decided from the pieces' bounds, only the partial
        ones made (no tensor of sq x sk)."""
        return cls(tuple(shape), *block_kinds(pieces, tuple(shape), BLOCK,
                                              torch.device(device)))

    @classmethod
    def of_slices(cls, slices: TileSlices | None, shape: tuple[int, int], causal: bool,
                  device: torch.device) -> TileMask:
        """The mask of one call of `shape`: its `slices`, else all pairs or `causal` at the
        bottom right."""
        sq, sk = shape
        pieces = call_pieces([slice_table(slices, shape, causal)], [row_runs(0, sq)],
                             [row_runs(0, sk)])
        return cls.of_pieces(shape, pieces, device)

    @functools.cached_property
    def empty(self) -> bool:
        """No query sees any key (read once: on a GPU a wait for the device, not one a
        call)."""
        return not bool((self.kinds != EMPTY).any())

    def seen(self) -> torch.Tensor:
        """bool [sq, sk] (checks; made on each call)."""
        nq, nk = self.kinds.shape
        blocks = self.partial[self.kinds.long()]  # [nq, nk, B, B]
        return blocks.transpose(1, 2).reshape(nq * BLOCK, nk * BLOCK)[:self.shape[0],
                                                                      :self.shape[1]]

    def block_mask(self, device: torch.device) -> flex_api.BlockMask:
        """FlexAttention's `BlockMask` of these pairs on `device`, made once per device."""
        device = torch.device(device)
        found = self._block_masks.get(device)
        if found is None:
            found = self._block_masks[device] = self._make_block_mask(device)
        return found

    def _make_block_mask(self, device: torch.device) -> flex_api.BlockMask:
        kinds, partial = self.kinds.to(device), self.partial.to(device)

        def mask_mod(b, h, q_idx, kv_idx):
            kind = kinds[q_idx // BLOCK, kv_idx // BLOCK]
            return partial[kind, q_idx % BLOCK, kv_idx % BLOCK]

        some, full = kinds >= 2, kinds == FULL
        return flex_api.BlockMask.from_kv_blocks(
            *_indices(some), *_indices(full), BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
            seq_lengths=self.shape)


def _blocks_of(seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool `seen` [sq, sk] cut into blocks: its kinds int32 [q blocks, kv blocks] (EMPTY,
    FULL, 2 + n: the n-th partial block) and its partial blocks bool [n, BLOCK, BLOCK]."""
    sq, sk = seen.shape
    nq, nk = -(-sq // BLOCK), -(-sk // BLOCK)
    padded = torch.zeros(nq * BLOCK, nk * BLOCK, dtype=torch.bool, device=seen.device)
    padded[:sq, :sk] = seen
    blocks = padded.view(nq, BLOCK, nk, BLOCK).transpose(1, 2)  # [nq, nk, B, B]
    everything = blocks.all((2, 3))
    some = blocks.any((2, 3)) & ~everything
    kinds = everything.to(torch.int32)  # EMPTY 0, FULL 1
    kinds[some] = 2 + torch.arange(int(some.sum()), dtype=torch.int32, device=seen.device)
    return kinds, blocks[some]


def _partial(some: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`TileMask.partial` of the partial blocks `some` [n, BLOCK, BLOCK]: entries 0 (none)
    and 1 (all), the n blocks, unused ones up to a power of two (the compiled kernel sees
    few shapes of it, each a compile, whatever the mask)."""
    n = len(some)
    partial = torch.zeros(bucket(2 + n), BLOCK, BLOCK, dtype=torch.bool, device=device)
    partial[1] = True
    partial[2:2 + n] = some
    return partial


def _indices(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(how many, which) kv blocks of each q block are set in bool `blocks` [nq, nk]:
    [1, 1, nq] and [1, 1, nq, nk] int32, the set ones first in order (as BlockMask takes)."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = torch.sort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).indices
    return count[None, None], order.to(torch.int32)[None, None].contiguous()


@functools.lru_cache(maxsize=64)
def plain_mask(sq: int, sk: int, causal: bool) -> TileMask:
    """A call without slices: all pairs, or causal aligned at the bottom right."""
    return TileMask.of_slices(None, (sq, sk), causal, torch.device("cpu"))


def call_mask(q: torch.Tensor, k: torch.Tensor, causal: bool,
              slices: TileSlices | None) -> TileMask:
    """The `TileMask` of one call (`base.TileKernel`): its slices' (kept with them), else
    plain."""
    if slices is None:
        return plain_mask(q.shape[0], k.shape[0], causal)
    return slices.made_on("flex", torch.device("cpu"), lambda cpu: TileMask.of_slices(
        slices, slices.shape, False, cpu))


def check_mask_shape(mask: TileMask, q: torch.Tensor, k: torch.Tensor) -> None:
    """ValueError unless `mask` is of q's rows x k's rows (a mask of other rows would be
    read at the wrong pairs, or past its blocks)."""
    if mask.shape != (q.shape[0], k.shape[0]):
        raise ValueError(f"the call's mask is of {mask.shape[0]} x {mask.shape[1]} (rows x "
                         f"keys) but q has {q.shape[0]} rows and k {k.shape[0]}; a call's "
                         "mask (or slices) must be of its q rows x k rows")


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return dense_last_dim(t).permute(1, 2, 0, 3)


def _sbhd(t: torch.Tensor) -> torch.Tensor:
    return t.permute(2, 0, 1, 3)


def _forward(q, k, v, block_mask, scale: float):
    """FlexAttention on [b, h, s, d] tensors -> out [b, hq, sq, dv], lse [b, hq, sq] (natural
    log). CPU: the forward op's dense implementation, eagerly."""
    if q.device.type == "cpu":
        options = flex_api._apply_kernel_options(q, k, v, True, None)
        out, lse, _ = forward_op(q, k, v, _identity_score, block_mask.as_tuple(), scale,
                                 options)
        return out, lse * LN2  # the op's lse is in base 2
    out, aux = _compiled_forward()(q, k, v, block_mask=block_mask, scale=scale,
                                   enable_gqa=q.shape[1] != k.shape[1],
                                   return_aux=flex_api.AuxRequest(lse=True))
    return out, aux.lse


def _backward(dout, q, k, v, out, lse, block_mask, scale: float):
    """Gradients of `_forward`'s call given the whole row's out and lse [b, hq, sq] (natural
    log): dq, dk, dv [b, h, s, d]."""
    options = flex_api._apply_kernel_options(q, k, v, True, None)
    args = (q, k, v, out, lse / LN2, dout, None)  # the op takes lse in base 2
    if q.device.type == "cpu":
        joint = _joint_graph(q.dtype)
        dq, dk, dv, _ = backward_op(*args, _identity_score, joint, block_mask.as_tuple(),
                                    scale, options, (), ())
        return dq, dk, dv
    return _compiled_backward()(*args, block_mask.as_tuple(), scale, options)


def _backward_op(q, k, v, out, lse2, dout, dlse, block_mask: tuple, scale: float, options):
    """The backward op as CUDA compiles it: the score function's gradient graph left to
    Dynamo to derive (joint graph None), lse2 in base 2, dlse None."""
    dq, dk, dv, _ = backward_op(q, k, v, out, lse2, dout, dlse, _identity_score, None,
                                block_mask, scale, options, (), ())
    return dq, dk, dv


@functools.lru_cache(maxsize=None)
def _compiled_forward():
    return torch.compile(flex_api.flex_attention)


@functools.lru_cache(maxsize=None)
def _compiled_backward():
    return torch.compile(_backward_op, fullgraph=True)


@functools.lru_cache(maxsize=None)
def _joint_graph(dtype: torch.dtype):
    """The score function's gradient graph the CPU backward op takes (made once a dtype)."""
    example = (torch.zeros((), dtype=dtype, requires_grad=True),
               *(torch.zeros((), dtype=torch.int) for _ in range(4)))
    return create_fw_bw_graph(_identity_score, example, ())[1]


class FlexTileKernel:
    """The TileKernel of `kernels/base.py` on FlexAttention, and whole tiles in one call.

    Takes everything `KernelCaps` names: a call's slices, causal (bottom-right aligned
    where sq < sk) or plain become a `TileMask`; `whole_tile`: the blocks on hand together
    go to `tile_forward` / `tile_backward` as one call with the tile's mask
    (`schedules/whole_tile.py`). Selected by name only (backend='flex'): 'auto' never
    builds it. CUDA: compiled; CPU: eager (the ops' dense implementations, a score matrix
    of sq x sk a call: for checks, not speed).
    """

    name = "flex"
    caps = KernelCaps(documents=True, tile_mask=True, window=True, v_head_dim=True,
                      bottom_right=True, whole_tile=True)

    def forward(self, q, k, v, causal: bool, softmax_scale: float, *,
                slices: TileSlices | None = None):
        check_call(self, q, v, slices, causal)
        return self.tile_forward(q, k, v, call_mask(q, k, causal, slices), softmax_scale)

    def backward(self, dout, q, k, v, out, lse, causal: bool, softmax_scale: float, *,
                 slices: TileSlices | None = None):
        check_call(self, q, v, slices, causal)
        return self.tile_backward(dout, q, k, v, out, lse, call_mask(q, k, causal, slices),
                                  softmax_scale)

    def tile_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: TileMask,
                     softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One call of q [sq, b, hq, d] against k, v [sk, b, hkv, d|dv] keeping `mask`'s
        pairs: out [sq, b, hq, dv] in q's dtype (0 on rows that see no key), lse [b, hq, sq]
        fp32 (-inf there). ValueError where `mask` is not of sq x sk."""
        check_mask_shape(mask, q, k)
        out, lse = _forward(_bhsd(q).detach(), _bhsd(k).detach(), _bhsd(v).detach(),
                            mask.block_mask(q.device), softmax_scale)
        return _sbhd(out), lse.float()

    def tile_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, mask: TileMask,
                      softmax_scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq [sq, b, hq, d], dk [sk, b, hkv, d], dv [sk, b, hkv, dv] of `tile_forward`'s
        call; out and lse [b, hq, sq] fp32 are the whole row's. ValueError where `mask` is
        not of sq x sk."""
        check_mask_shape(mask, q, k)
        dq, dk, dv = _backward(*(_bhsd(t).detach() for t in (dout, q, k, v, out)),
                               lse.contiguous(), mask.block_mask(q.device), softmax_scale)
        return _sbhd(dq), _sbhd(dk), _sbhd(dv)


__all__ = ["BLOCK", "FlexTileKernel", "TileMask", "call_mask", "check_mask_shape", "plain_mask"]
