"""Bytes of inference per rank: the prefill (the mesh forward's), a decode step's
exchange, and the KV cache each rank holds.

A decode step, per layer, on P ranks: each rank all-gathers one fp32 message of
b hq (dv + 1) values (its partial out and lse), so it sends (P - 1) b hq (dv + 1) 4 bytes
(`decode.exchange_partials`). The all-reduce alternative (a max of the lse, then a sum of
[out e^(lse - max), e^(lse - max)]) sends about 2 (P - 1) / P of b hq 4 plus of b hq (dv + 1)
4 bytes per rank in two collectives.
"""
from __future__ import annotations

from ..layer_plan import FP32_BYTES, AttentionShape


def decode_step_bytes(batch: int, q_heads: int, v_head_dim: int, cp_size: int) -> int:
    """Bytes one rank sends in one layer's decode exchange (all-gather of (out, lse))."""
    return (cp_size - 1) * batch * q_heads * (v_head_dim + 1) * FP32_BYTES


def decode_allreduce_bytes(batch: int, q_heads: int, v_head_dim: int, cp_size: int) -> int:
    """What the two-all-reduce scheme would send per rank per layer (ring all-reduces)."""
    if cp_size == 1:
        return 0
    per = 2 * (cp_size - 1) / cp_size
    return int(per * batch * q_heads * FP32_BYTES + per * batch * q_heads * (v_head_dim + 1)
               * FP32_BYTES)


def cache_slots(prompt_len: int, max_new: int, cp_size: int) -> int:
    """Slots per rank: the zigzag share of the padded prompt plus its round-robin steps."""
    padded = -(-prompt_len // (2 * cp_size)) * 2 * cp_size
    return padded // cp_size + -(-max_new // cp_size)


def cache_bytes(shape: AttentionShape, layers: int, max_new: int, cp_size: int,
                with_positions: bool = True) -> int:
    """KV cache bytes per rank for `layers` layers: shape.seq_len tokens of prompt (shape.batch
    sequences), room for `max_new` more, in shape.dtype_bytes (K and V, and an int64
    position per slot and sequence)."""
    slots = cache_slots(shape.seq_len, max_new, cp_size)
    per_slot = shape.batch * shape.kv_heads * (shape.head_dim + shape.dv) * shape.dtype_bytes
    if with_positions:
        per_slot += shape.batch * 8
    return layers * slots * per_slot
