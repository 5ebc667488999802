"""Megatron's zigzag rule, coded once: a sequence (or, in Transformer Engine's THD layout,
each document) is cut into 2P equal sub-chunks and CP rank r holds sub-chunks r and 2P-1-r,
in that order, so token order is kept within the rank's share. With it every rank-block
of a causal mask carries the same work; its precondition, a length divisible by 2P
(`check_zigzag_divisible`). A torch-free leaf: layouts, masks, documents and placements
import it.
"""
from __future__ import annotations


def zigzag_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two sub-chunk indices (of 2 * cp_size) held by `cp_rank`: (r, 2P-1-r)."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def held_pieces(cp_size: int, cp_rank: int) -> tuple[int, ...]:
    """The pieces `cp_rank` holds of a sequence cut for `cp_size` ranks: the zigzag pair,
    or the whole as one piece (index 0) when one rank holds everything."""
    return (cp_rank,) if cp_size == 1 else zigzag_chunks(cp_size, cp_rank)


def check_zigzag_divisible(seq_length: int, cp_size: int, what: str = "sequence length",
                           ranks: str = "CP", single_rank: bool = False) -> None:
    """ValueError unless the zigzag layout can cut seq_length into 2 * cp_size equal chunks
    (the one home of this check; `what` and `ranks` name the caller's flags). A group of
    one rank splits nothing and passes, unless `single_rank` asks for the two chunks anyway."""
    if (cp_size > 1 or single_rank) and (seq_length < 1 or seq_length % (2 * cp_size)):
        raise ValueError(
            f"{what} {seq_length} must be divisible by 2 * {ranks} = {2 * cp_size} (the zigzag "
            f"layout gives each of the {cp_size} ranks 2 of {2 * cp_size} equal chunks)")
