"""Mask builders for `--mesh-mask-builder MODULE:FUNCTION` (the driver and Megatron-LM).

A builder is called once per micro-batch, on every rank, with the whole micro-batch before
it is split over the context-parallel ranks: tokens and position_ids, int64 [b, s] on the
CPU. It returns one mask for all b samples, a `megatron_mesh.SliceMask` or its list of
slices (q_start, q_end, k_start, k_end, 'full' | 'causal') over the s positions; every
layer uses it. Raise ValueError for a micro-batch it cannot mask: the run stops with that
message.

    python -m megatron_mesh.pretrain_gpt ... --context-parallel-algo mesh \\
        --mesh-mask-builder examples.mask_builders:prefix_lm
"""
from __future__ import annotations

import torch

import megatron_mesh as mm

PREFIX_SHARE = 4  # prefix_lm: the first s // PREFIX_SHARE tokens are the prefix
IMAGE_TOKEN = 0  # image_bidirectional: the id of an image's placeholder tokens


def prefix_lm(tokens: torch.Tensor, position_ids: torch.Tensor) -> mm.SliceMask:
    """Prefix-LM: the first quarter of the sequence sees itself both ways, the rest sees
    the prefix and, causally, itself."""
    seq_len = tokens.shape[-1]
    return mm.prefix_lm_mask(seq_len, max(1, seq_len // PREFIX_SHARE))


def image_bidirectional(tokens: torch.Tensor, position_ids: torch.Tensor) -> list[tuple]:
    """A multimodal mask: text causal; each run of image tokens (`IMAGE_TOKEN`) sees all of
    itself and everything before it. The image runs must sit at the same positions in every
    sample of the micro-batch (one mask serves them all)."""
    image = tokens == IMAGE_TOKEN
    if not bool((image == image[:1]).all()):
        raise ValueError("the samples of the micro-batch have images at different positions; "
                         "use --micro-batch-size 1 or align them")
    flags = image[0].tolist()
    slices, start = [], 0
    for i in range(1, len(flags) + 1):
        if i == len(flags) or flags[i] != flags[start]:  # a run [start, i) ends
            if start:
                slices.append((start, i, 0, start, "full"))  # everything before the run
            slices.append((start, i, start, i, "full" if flags[start] else "causal"))
            start = i
    return slices
