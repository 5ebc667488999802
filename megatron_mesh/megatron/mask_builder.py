"""Masks through Megatron-Core: a user's mask builder per micro-batch, and chunked layers.

A mask builder (`--mesh-mask-builder MODULE:FUNCTION`) is called once per micro-batch with
the WHOLE micro-batch, before it is split over the CP ranks (every rank of a replica reads
the same samples, so every rank builds the same mask; the mesh's agreement check compares
them before the first collective; the ranks of other data-parallel replicas read other
samples, so all of them agree on whether every build succeeded before going on,
`agreed_mask`):

    def builder(tokens: torch.Tensor, position_ids: torch.Tensor) -> SliceMask | list:
        # tokens, position_ids: int64 [micro-batch size, sequence length], on the CPU

It returns one mask for all samples of the micro-batch: a `SliceMask` or its list of slices
(q_start, q_end, k_start, k_end, 'full' | 'causal') over the sequence's positions
(`examples/mask_builders.py`). The mask travels to every layer's core attention as
`MaskedSeqParams`, the PackedSeqParams of an unpacked (sbhd) batch that carries it, on the
route packed documents take. With packed documents (--reset-attention-mask) the mask is laid
on each document (`masks/packed.py`: the builder's mask intersected with the documents')
and rides on the micro-batch's PackedSeqParams / PlacedSeqParams (`with_packed_mask`).

Chunked layers (`--attention-chunk-size N`, Llama 4's local attention): every layer that
applies RoPE (megatron-core's `no_rope_freq`: 0 for the layer) attends causally within
chunks of N tokens (`masks/chunked.py`), restarting at each packed document's first token;
the layers without RoPE attend causally over the whole sequence (or document).

Megatron-LM's own pretrain_gpt.py splits the batch over the CP ranks before the model sees
it; there `attach_mask_builder` puts a forward pre-hook on the GPTModel that gathers the
micro-batch's tokens and positions over the CP group (its zigzag shares, in order), calls
the builder on the whole sequence and passes the mask as `packed_seq_params`.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_mesh.calls.layout import zigzag_merge
from megatron_mesh.masks.packed import packed_slices
from megatron_mesh.masks.slices import SliceMask, as_mask

__all__ = ["MaskBuilderError", "MaskedSeqParams", "agreed_mask", "agreement_group",
           "attach_mask_builder", "build_mask", "layer_chunk", "load_mask_builder",
           "masked_seq_params", "packed_mask", "with_packed_mask"]

FLAG = "--mesh-mask-builder"


class MaskBuilderError(ValueError):
    """A mask builder that cannot be loaded, or returned no mask for a micro-batch."""


@dataclass
class MaskedSeqParams(PackedSeqParams):
    """Megatron's PackedSeqParams of an unpacked batch (qkv_format "sbhd", no cu_seqlens)
    carrying the micro-batch's `mask`, the same on every CP rank; max_seqlen_q / _kv: the
    whole sequence's length (what megatron-core's RoPE reads)."""

    mask: SliceMask | None = None

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)  # megatron-core 0.19 has one
        if parent is not None:
            parent()
        if not isinstance(self.mask, SliceMask):
            raise ValueError(f"MaskedSeqParams.mask must be a SliceMask, got "
                             f"{type(self.mask).__name__}")
        if self.qkv_format != "sbhd" or self.cu_seqlens_q is not None:
            raise ValueError(f"MaskedSeqParams(qkv_format={self.qkv_format!r}): a mask is given "
                             "over one unpacked sequence, 'sbhd' without cu_seqlens")


def masked_seq_params(mask: SliceMask) -> MaskedSeqParams:
    """The MaskedSeqParams of `mask` (built for its sequence, `mask.seq_len`)."""
    return MaskedSeqParams(qkv_format="sbhd", max_seqlen_q=mask.seq_len,
                           max_seqlen_kv=mask.seq_len, mask=mask)


_PACKED_MASK = "mesh_mask"  # the attribute a packed batch's PackedSeqParams carries it in


def with_packed_mask(params: PackedSeqParams, mask: SliceMask, sample_len: int,
                     lengths: list[int], starts: list[int], total: int) -> PackedSeqParams:
    """`params` (packed documents, THD or placed) carrying `mask`, built over one sample's
    `sample_len` positions, laid on its documents (`masks/packed.packed_slices`: document
    d, lengths[d] tokens, at starts[d] of the packed sequence's `total` positions)."""
    setattr(params, _PACKED_MASK, packed_slices(mask, sample_len, lengths, starts, total))
    return params


def packed_mask(params: PackedSeqParams | None) -> SliceMask | None:
    """The mask a packed batch's params carry (`with_packed_mask`), or None."""
    return getattr(params, _PACKED_MASK, None)


def load_mask_builder(spec: str) -> Callable[..., Any]:
    """The function `spec` names, MODULE:FUNCTION (MODULE importable, or a path to a .py
    file); MaskBuilderError naming the flag's value and what is wrong."""
    module_name, sep, name = (spec or "").rpartition(":")
    if not sep or not module_name or not name.isidentifier():
        raise MaskBuilderError(f"{FLAG} {spec!r}: give MODULE:FUNCTION (e.g. "
                               "examples.mask_builders:image_bidirectional, or "
                               "path/to/file.py:FUNCTION)")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise FileNotFoundError(f"no file {module_name}")
            loader = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - whatever the user's module raises
        raise MaskBuilderError(f"{FLAG} {spec}: cannot import {module_name!r} "
                               f"({type(error).__name__}: {error})") from None
    builder = getattr(module, name, None)
    if not callable(builder):
        raise MaskBuilderError(f"{FLAG} {spec}: module {module_name!r} has no function "
                               f"{name!r}" + ("" if builder is None else
                                              f" (it is a {type(builder).__name__})"))
    return builder


def build_mask(builder: Callable[..., Any], spec: str, tokens: torch.Tensor,
               position_ids: torch.Tensor) -> SliceMask:
    """The checked mask `builder` returns for a micro-batch of tokens / position_ids
    [b, s] (the whole sequence), a mask of s tokens (a list of slices too: RoPE reads the
    length); MaskBuilderError naming the builder and what it returned."""
    seq_len = tokens.shape[-1]
    what = f"{FLAG} {spec} returned"
    try:
        made = builder(tokens, position_ids)
    except Exception as error:  # noqa: BLE001 - the user's code
        raise MaskBuilderError(f"{FLAG} {spec} raised {type(error).__name__}: {error} (for a "
                               f"micro-batch of {tuple(tokens.shape)} tokens)") from None
    if made is None or isinstance(made, (str, bytes, int, float, torch.Tensor)):
        shown = (f"a tensor of shape {tuple(made.shape)}" if isinstance(made, torch.Tensor)
                 else repr(made)[:80])
        raise MaskBuilderError(f"{what} {shown}; it must return a SliceMask or a list of "
                               "slices (q_start, q_end, k_start, k_end, 'full' | 'causal') "
                               f"over the sequence's {seq_len} positions")
    try:
        return as_mask(made).with_length(seq_len)
    except (ValueError, TypeError) as error:
        raise MaskBuilderError(f"{what} no mask of the micro-batch's {seq_len} positions: "
                               f"{error}") from None


def agreed_mask(builder: Callable[..., Any], spec: str, tokens: torch.Tensor,
                position_ids: torch.Tensor, group: Any = None) -> SliceMask:
    """`build_mask` on every rank of `group` (a gloo group: the data- and context-parallel
    ranks of one pipeline stage and tensor rank, `agreement_group`; None: this rank alone),
    agreed before any rank goes on. A builder that fails on some ranks only (on the samples
    one data-parallel replica reads) would otherwise leave the others waiting in the
    model's collectives. One all_reduce (MIN) of the first failing rank, on the CPU; where
    a rank failed, its message travels to every rank, which raises it (MaskBuilderError
    naming the builder, the error and the global rank it happened on)."""
    try:
        mask, message = build_mask(builder, spec, tokens, position_ids), ""
    except MaskBuilderError as error:
        mask, message = None, str(error)
    if group is None or dist.get_world_size(group) == 1:
        if mask is None:
            raise MaskBuilderError(message)
        return mask
    size = dist.get_world_size(group)
    first = torch.tensor([dist.get_rank(group) if message else size], dtype=torch.int64)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    failed = int(first)
    if failed == size:
        return mask
    said = [message]
    dist.broadcast_object_list(said, src=dist.get_global_rank(group, failed), group=group)
    raise MaskBuilderError(f"{said[0]} (on rank {dist.get_global_rank(group, failed)})")


def agreement_group() -> Any:
    """The gloo group `agreed_mask` agrees over: megatron-core's data- and context-parallel
    ranks of this rank's pipeline stage and tensor rank (every rank of a replica reads the
    same samples, so a deterministic builder fails on all of its ranks alike); None where
    megatron-core made no gloo groups."""
    from megatron.core import parallel_state

    try:
        return parallel_state.get_data_parallel_group_gloo(with_context_parallel=True)
    except (AssertionError, AttributeError, TypeError):  # none made, or another signature
        return None


def layer_chunk(config: Any, layer_number: int, chunk: int | None) -> int | None:
    """The attention chunk of layer `layer_number` (1-based): `chunk` for a layer that
    applies RoPE, None (whole-sequence attention) for one that does not (megatron-core's
    `no_rope_freq`: a list with 1 for those layers, or every n-th layer for an int n)."""
    if chunk is None:
        return None
    no_rope = getattr(config, "no_rope_freq", None)
    if isinstance(no_rope, int) and not isinstance(no_rope, bool):
        skipped = no_rope > 0 and layer_number % no_rope == 0
    else:
        skipped = bool(no_rope) and bool(no_rope[layer_number - 1])
    return None if skipped else chunk


def _whole(share: torch.Tensor, group: Any) -> torch.Tensor:
    """[b, s] on the CPU from this rank's zigzag share [b, s / P] over `group` (P ranks)."""
    size = dist.get_world_size(group)
    if size == 1:
        return share.cpu()
    parts = [torch.empty_like(share) for _ in range(size)]
    dist.all_gather(parts, share.contiguous(), group=group)
    return zigzag_merge([p.cpu() for p in parts], dim=1)


def attach_mask_builder(model: torch.nn.Module, spec: str, cp_group: Any = None) -> Any:
    """Make `model` (a megatron-core GPTModel on the first pipeline stage, taking this CP
    rank's zigzag share of input_ids and position_ids) call the builder `spec` names on
    every forward with the whole micro-batch, and pass its mask to every layer as
    `MaskedSeqParams`. Collective over `cp_group` (default: megatron's CP group) per
    forward, then agreed over the data-parallel replicas (`agreed_mask`). Returns the
    hook's handle."""
    builder = load_mask_builder(spec)
    if not getattr(model, "pre_process", True) or not getattr(model, "post_process", True):
        raise MaskBuilderError(f"{FLAG} {spec}: with pipeline parallelism use the driver "
                               "(python -m megatron_mesh.pretrain_gpt), which gives every "
                               "stage the micro-batch's tokens")
    if cp_group is None:
        from megatron.core import parallel_state

        cp_group = parallel_state.get_context_parallel_group()
    agreeing = agreement_group()

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        names = ("input_ids", "position_ids")
        given = dict(zip(names, args))
        given.update({n: kwargs[n] for n in names if n in kwargs})
        if kwargs.get("packed_seq_params") is not None:
            raise MaskBuilderError(f"{FLAG} {spec}: the batch is packed (packed_seq_params); "
                                   "a mask is given over one unpacked sequence")
        tokens, positions = (_whole(given[n], cp_group) for n in names)
        mask = agreed_mask(builder, spec, tokens, positions, agreeing)
        return args, {**kwargs, "packed_seq_params": masked_seq_params(mask)}

    return model.register_forward_pre_hook(hook, with_kwargs=True)
