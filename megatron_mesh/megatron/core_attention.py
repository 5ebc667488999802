"""Megatron-Core's core-attention slot filled by the mesh (or handed to Transformer Engine).

`MeshDotProductAttention` has the constructor and forward of Megatron's
`DotProductAttention` / `TEDotProductAttention`: q [sq, b, np, hn], k / v [sk, b, ng, hn]
(this rank's zigzag share of the sequence, this TP rank's heads) -> [sq, b, np * hn].
"""
from __future__ import annotations

import logging
import math
import weakref
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mesh.attention import MeshAttention, as_sbhd, packed_documents
from megatron_mesh.calls.layout import AttentionMask
from megatron_mesh.checks import check_options
from megatron_mesh.layer_plan import DEFAULT_GRAD_DTYPE, DEFAULT_SCHEDULE, check_positive_int
from megatron_mesh.masks.chunked import chunked_mask
from megatron_mesh.masks.document_placement import DocumentPlacement
from megatron_mesh.masks.documents import Documents
from megatron_mesh.masks.mask import resolve_mask
from megatron_mesh.masks.placed_documents import mesh_placement
from megatron_mesh.masks.slices import SliceMask
from megatron_mesh.masks.window import window_of
from megatron_mesh.megatron.arguments import check_algorithm, is_mesh
from megatron_mesh.megatron.compat import have_transformer_engine
from megatron_mesh.megatron.groups import (
    get_mesh_grid,
    mesh_grid_is_initialized,
    single_rank_grid,
)
from megatron_mesh.megatron.mask_builder import MaskedSeqParams, layer_chunk, packed_mask
from megatron_mesh.megatron.placed_documents import placement_of
from megatron_mesh.megatron.shape import check_mesh_heads, local_head_counts
from megatron_mesh.megatron.sink import (
    SOFTMAX_TYPES,
    init_softmax_offset,
    mesh_offset,
    offset_sharded_state_dict,
)
from megatron_mesh.runtime import agreement
from megatron_mesh.runtime.grid import MeshGrid
from megatron_mesh.schedules.blocks import plan_blocks

_MASKS = {AttnMaskType.causal: True, AttnMaskType.no_mask: False}
# with packed documents Megatron may name the same masks "padding_*" (padding is in cu_seqlens)
_PACKED_MASKS = {**_MASKS, AttnMaskType.padding_causal: True, AttnMaskType.padding: False}

logger = logging.getLogger(__name__)
LAYER_CACHE_SIZE = 8  # input signatures whose MeshAttention a layer keeps (an LRU)
_logged_schedules: set[tuple] = set()


def _log_schedule(layer: MeshAttention, schedule: str) -> None:
    """Say once per process (on global rank 0) what runs on which grid (the layer's own
    plan: under a window or placed documents, the sparse exchange)."""
    ran = layer.plan.schedule.value
    seen = (layer.grid.shape_text, schedule, layer.plan.describe)
    if seen in _logged_schedules or (dist.is_initialized() and dist.get_rank() != 0):
        return
    _logged_schedules.add(seen)
    how = f" (chosen for less memory by '{schedule}')" if ran != schedule else ""
    logger.info("mesh attention: %s%s", layer.plan.describe, how)


_CU_FIELDS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
# the last PackedSeqParams resolved: (weak reference to it, its tensors' stamps, its Documents)
_resolved: list = [None, None, None]


def _stamps(params: PackedSeqParams) -> tuple:
    """What says the cumulative lengths of `params` are unchanged: per tensor attribute, the
    tensor itself (weakly), its version counter (bumped by every in-place write: a static
    buffer refilled with copy_, CUDA-graph style) and its storage address."""
    out = []
    for name in _CU_FIELDS:
        t = getattr(params, name, None)
        out.append(None if not isinstance(t, torch.Tensor)
                   else (weakref.ref(t), t._version, t.data_ptr()))
    return tuple(out)


def _same_stamps(params: PackedSeqParams, stamps: tuple) -> bool:
    for name, stamp in zip(_CU_FIELDS, stamps):
        t = getattr(params, name, None)
        if not isinstance(t, torch.Tensor) or stamp is None:
            if isinstance(t, torch.Tensor) or stamp is not None:
                return False  # a tensor now where none was, or the other way round
            continue
        ref, version, pointer = stamp
        if ref() is not t or t._version != version or t.data_ptr() != pointer:
            return False
    return True


def documents_of(params: PackedSeqParams) -> Documents:
    """The packed documents of Megatron's PackedSeqParams (qkv_format "thd"), read from its
    tensors once per params object and contents: every layer of a micro-batch gets the same
    object, and one whose tensors are replaced or written in place (their version counters
    move) is read again. Writes that bypass the version counter (through .data or numpy)
    are not seen: refill a static buffer with copy_."""
    if (_resolved[0] is not None and _resolved[0]() is params
            and _same_stamps(params, _resolved[1])):
        return _resolved[2]
    if getattr(params, "qkv_format", None) != "thd":
        raise ValueError(f"packed_seq_params.qkv_format="
                         f"{getattr(params, 'qkv_format', None)!r}: the mesh takes packed "
                         "sequences in 'thd' format")
    for suffix in ("", "_padded"):
        q, kv = (getattr(params, f"cu_seqlens_{side}{suffix}") for side in ("q", "kv"))
        if (q is None) != (kv is None) or (q is not None and not torch.equal(q, kv)):
            raise ValueError(f"packed_seq_params.cu_seqlens_q{suffix} and cu_seqlens_kv{suffix} "
                             "differ; self-attention over packed documents needs the same "
                             "documents for both")
    stamps = _stamps(params)  # before reading: a write meanwhile is seen next time
    documents = packed_documents(params.cu_seqlens_q, params.cu_seqlens_q_padded)
    _resolved[:] = [weakref.ref(params), stamps, documents]
    return documents


def resolve_algorithm(
    context_parallel_algo: str | None, cp_comm_type: str | None, config: TransformerConfig
) -> str:
    """The spec's algorithm, else cp_comm_type (argument, then config), else 'mesh'."""
    configured = getattr(config, "cp_comm_type", None)
    for algo in (context_parallel_algo, cp_comm_type, configured):
        if algo is None or isinstance(algo, list):
            continue
        return check_algorithm(algo)
    return "mesh"


def plan_micro_batch(model: torch.nn.Module, params: PackedSeqParams | None,
                     device: torch.device | str) -> bool:
    """Make this rank's blocks of a micro-batch of packed documents (`params`) ahead of its
    first attention layer (`MeshDotProductAttention.plan_blocks`), once per micro-batch:
    every layer of the same mask then finds them in the caches. False where nothing was
    planned (no mesh attention layer, no packed documents)."""
    for module in model.modules():
        if isinstance(module, MeshDotProductAttention):
            return module.plan_blocks(params, device)
    return False


def transformer_engine_attention() -> type | None:
    """Megatron's TEDotProductAttention, or None when Transformer Engine is missing."""
    if not have_transformer_engine():
        return None
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE, TEDotProductAttention
    except ImportError:
        return None
    return TEDotProductAttention if HAVE_TE else None


class MeshDotProductAttention(MegatronModule):
    """Exact context-parallel attention over this rank's mesh grid.

    The spec chooses this class for the 'mesh' algorithm (`spec.mesh_core_attention_spec`;
    Transformer Engine's attention for the others). With CP = 1 every algorithm is plain
    attention, so this class also runs any algorithm there; with CP > 1 it runs only 'mesh'
    and names the fix otherwise. config.softmax_type "off-by-one" / "learnable" adds
    attention sinks: `softmax_offset` held as megatron-core's DotProductAttention holds it
    (`megatron/sink.py`).

    `grid` is the mesh grid of this layer's CP group, passed in as `pg_collection` is (the
    spec's params: `get_gpt_layer_spec(..., grid=grid)`); without one the layer takes the
    grid `initialize_mesh_grids` built for its CP group (for model builders that cannot pass
    it, as megatron-core's `use_mpu_process_groups` stands in for `pg_collection`).

    `attention_chunk_size` (spec params): Llama 4's chunked attention in the layers that
    apply RoPE (`mask_builder.layer_chunk`); a `MaskedSeqParams` brings a micro-batch's mask.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        context_parallel_algo: str | None = None,
        backend: str = "auto",
        schedule: str = DEFAULT_SCHEDULE,
        grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE,
        k_channels: int | None = None,
        v_channels: int | None = None,
        grid: MeshGrid | None = None,
        attention_chunk_size: int | None = None,
    ) -> None:
        super().__init__(config=config)
        self.context_parallel_algo = resolve_algorithm(context_parallel_algo, cp_comm_type, config)
        _check_algorithm(self.context_parallel_algo, config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        check_options(backend, schedule, grad_reduce_dtype)
        self.backend = backend
        self.schedule = schedule
        self.grad_reduce_dtype = grad_reduce_dtype
        _check_supported(config, attn_mask_type, attention_type, attention_dropout)
        self.window_size = layer_window(config, self.layer_number)
        window_of(self.window_size, _MASKS.get(attn_mask_type, True))  # ValueError if bad
        if attention_chunk_size is not None:
            check_positive_int("attention_chunk_size", attention_chunk_size)
        self.chunk = layer_chunk(config, self.layer_number, attention_chunk_size)
        if self.chunk is not None and self.window_size is not None:
            raise ValueError(f"layer {self.layer_number} has a sliding window "
                             f"{self.window_size} and chunked attention (attention_chunk_size="
                             f"{self.chunk}); give one of the two")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        cp_ranks = tuple(dist.get_process_group_ranks(pg_collection.cp))
        if grid is not None:
            if not isinstance(grid, MeshGrid):
                raise ValueError(f"grid must be a MeshGrid (initialize_mesh_grids returns it), "
                                 f"got {type(grid).__name__}")
            self.grid = grid  # passed in, as pg_collection is
        elif len(cp_ranks) == 1 and not mesh_grid_is_initialized():
            self.grid = single_rank_grid(pg_collection.cp)  # CP = 1 needs no setup
        else:
            self.grid = get_mesh_grid(pg_collection.cp)  # the one built for the group handed in
        if config.context_parallel_size != len(cp_ranks) or self.grid.cp_ranks != cp_ranks:
            fix = ("pass the grid initialize_mesh_grids() returned for this context-parallel "
                   "layout" if grid is not None else "call initialize_mesh_grids() after "
                   "initialize_model_parallel() with the same context-parallel size")
            raise ValueError(
                f"the mesh grid covers CP ranks {list(self.grid.cp_ranks)} but this layer's "
                f"CP group is {list(cp_ranks)} (config.context_parallel_size="
                f"{config.context_parallel_size}); {fix}"
            )
        tp_size = dist.get_world_size(pg_collection.tp)
        check_mesh_heads(self.grid.heads, self.grid.cp_size,
                         *local_head_counts(config.num_attention_heads, config.num_query_groups,
                                            tp_size), tp_size)
        # multi-latent attention passes its Q / K head dim and V's own (the mesh reads both
        # from the tensors; only the default softmax scale needs K's)
        head_dim = config.kv_channels if k_channels is None else k_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        )
        self.current_max_attn_logits = None
        init_softmax_offset(self, config, config.num_attention_heads // tp_size)
        # one per input signature and mask, the LAYER_CACHE_SIZE most recently used (packed
        # documents change the local length from micro-batch to micro-batch; a rebuilt layer
        # is the same value)
        self._layers: OrderedDict[tuple, MeshAttention] = OrderedDict()

    def _layer(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               causal: bool, packed: bool, placed: bool = False,
               mask: SliceMask | None = None) -> MeshAttention:
        """The layer's MeshAttention for these inputs, decided at their first forward
        (`placed`: for placed documents, `PlacedSeqParams`; `mask`: a mask given as slices,
        which alone says what each query sees)."""
        signature = (tuple(query.shape), tuple(key.shape), tuple(value.shape), query.dtype,
                     query.device, causal, packed, placed, mask)
        layer = self._layers.get(signature)
        if layer is not None:
            self._layers.move_to_end(signature)
        else:
            layer = MeshAttention.build(
                query, key, value, self.grid, causal=None if mask is not None else causal,
                softmax_scale=self.softmax_scale, backend=self.backend, schedule=self.schedule,
                grad_reduce_dtype=self.grad_reduce_dtype, packed=packed,
                window_size=self.window_size, placed=placed, mask=mask)
            self._layers[signature] = layer
            while len(self._layers) > LAYER_CACHE_SIZE:
                self._layers.popitem(last=False)
            if self.grid.cp_size > 1:
                _log_schedule(layer, self.schedule)
        return layer

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """q [sq, b, np, hn], k / v [sk, b, ng, hn] -> [sq, b, np * hn]; with
        `packed_seq_params` (qkv_format "thd": packed documents) q [t, np, hn], k / v
        [t, ng, hn] hold this rank's THD share (`documents.py`) -> [t, np * hn]; a
        `PlacedSeqParams` (`placement.py`) instead: this rank's rows of the placed documents.

        `attention_mask` is not read: the mask is the causal (or no) mask of
        `attn_mask_type`, applied to the whole sequence across the CP group, inside each
        document when packed, and this layer's sliding window (`layer_window`); or this
        layer's chunks (`attention_chunk_size`, restarting at each packed document); or the
        mask a `MaskedSeqParams` (or a packed batch, `mask_builder.with_packed_mask`) carries.
        """
        try:  # local checks; a rejection is told to every rank of the grid (`agreement.py`)
            if attention_bias is not None:
                raise ValueError("MeshDotProductAttention does not support attention_bias")
            mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
            mask = self._mask(query, packed_seq_params)
            if isinstance(packed_seq_params, MaskedSeqParams):
                packed_seq_params = None  # an unpacked batch
            masks = _MASKS if packed_seq_params is None else _PACKED_MASKS
            if mask_type not in masks:
                raise ValueError(
                    f"MeshDotProductAttention supports attn_mask_type "
                    f"{' or '.join(m.name for m in masks)}, got {mask_type}"
                )
            placement = placement_of(packed_seq_params, self.config)  # PlacedSeqParams
            documents = (None if packed_seq_params is None or placement is not None
                         else documents_of(packed_seq_params))
            packed = documents if placement is None else placement
            query, key, value = as_sbhd(packed, query, key, value)
            if query.shape[0] != key.shape[0]:
                raise ValueError(
                    f"MeshDotProductAttention needs as many queries as keys per rank (got "
                    f"{query.shape[0]} and {key.shape[0]}); inference with a KV cache is not "
                    "supported")
            if packed is not None:
                mask = self._packed_mask(packed, packed_seq_params)
            layer = self._layer(query, key, value, masks[mask_type], packed is not None,
                                placement is not None, mask)
        except Exception as error:  # noqa: BLE001 - every rank must hear of it
            agreement.refuse(self.grid, error)
        out = layer(query, key, value, documents, placement,  # agrees with the others first
                    softmax_offset=mesh_offset(self.softmax_offset))
        if packed is not None:
            return out.reshape(out.shape[0], -1)
        return out.reshape(out.shape[0], out.shape[1], -1)

    def plan_blocks(self, params: PackedSeqParams, device: torch.device | str) -> bool:
        """Make this rank's blocks of the micro-batch of packed documents `params` brings
        under this layer's mask, ahead of its forward (`schedules.blocks.plan_blocks`): the
        layer then finds them in the caches. False where there is nothing to plan ahead
        (no packed documents) or `params` is refused (the forward says why, to every
        rank)."""
        if params is None or isinstance(params, MaskedSeqParams):
            return False
        try:
            placement = placement_of(params, self.config)
            documents = None if placement is not None else documents_of(params)
            packed = documents if placement is None else placement
            value = resolve_mask(self._packed_mask(packed, params),
                                 _PACKED_MASKS.get(self.attn_mask_type, True), None, None,
                                 self.window_size)
        except ValueError:
            return False
        grid = self.grid
        mask = AttentionMask(value.causal, documents, grid.rows * grid.cols, value.window,
                             None if placement is None else mesh_placement(placement, grid.heads),
                             value.slices)
        local = packed.total // grid.cp_size if placement is None else placement.local_tokens
        plan_blocks(mask, grid, grid.heads * local, device)
        return True

    def _mask(self, query: torch.Tensor, params: PackedSeqParams | None) -> SliceMask | None:
        """The mask of this call given as slices: the micro-batch's (`MaskedSeqParams`), or
        this layer's chunks over the whole sequence; None: the causal (or no) mask."""
        if isinstance(params, MaskedSeqParams):
            if self.chunk is not None:
                raise ValueError(f"layer {self.layer_number} is chunked (attention_chunk_size="
                                 f"{self.chunk}) and the micro-batch brings a mask "
                                 f"({params.mask.text(2)}); give one of the two")
            return params.mask
        if self.chunk is None or params is not None:  # packed: `_packed_mask`
            return None
        return chunked_mask(query.shape[0] * self.grid.cp_size, self.chunk)

    def _packed_mask(self, packed: Documents | DocumentPlacement,
                     params: PackedSeqParams) -> SliceMask | None:
        """The mask of a call over packed documents, over the packed sequence's positions
        (padded for THD): this layer's chunks restarting at each document's first token, or
        the builder's mask laid on the documents (`mask_builder.with_packed_mask`); None:
        the documents' own. Either is intersected with the documents' mask."""
        given = packed_mask(params)
        if given is not None and self.chunk is not None:
            raise ValueError(f"layer {self.layer_number} is chunked (attention_chunk_size="
                             f"{self.chunk}) and the micro-batch brings a mask "
                             f"({given.text(2)}); give one of the two")
        if self.chunk is None:
            return given
        if isinstance(packed, Documents):
            return chunked_mask(packed.total, self.chunk, packed.cu_padded)
        return chunked_mask(packed.total, self.chunk, packed.cu_seqlens)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """megatron-core's: a learnable `softmax_offset` sharded over TP heads (`sink.py`)."""
        return offset_sharded_state_dict(self, self.config, self.pg_collection.tp, prefix,
                                         sharded_offsets, metadata)


class MeshDotProductAttentionInTEState(MeshDotProductAttention):
    """The mesh in place of Transformer Engine's attention, keeping TE's state-dict shape.

    TE's attention saves an `_extra_state` (its FP8 metadata: an empty uint8 tensor without
    FP8, else pickled bytes); this class keeps whatever was loaded there and saves it back
    unchanged, so a TE checkpoint loads strictly into a mesh run and back without losing or
    inventing state. In the dist-checkpoint format neither contributes anything with a
    vanilla softmax (TE's attention returns no sharded state then; with a learnable one both
    save the offset and the extra state, `sink.offset_sharded_state_dict`); loading a
    checkpoint without it leaves the extra state at "no FP8 metadata" instead of reporting a
    missing key.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._te_extra_state: Any = torch.empty(0, dtype=torch.uint8)

    def get_extra_state(self) -> Any:
        return self._te_extra_state

    def set_extra_state(self, state: Any) -> None:
        self._te_extra_state = state

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list, unexpected_keys: list,
                              error_msgs: list) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        key = prefix + "_extra_state"
        if key not in state_dict and key in missing_keys:  # a dist checkpoint: none stored
            missing_keys.remove(key)
            self._te_extra_state = torch.empty(0, dtype=torch.uint8)


def layer_window(config: TransformerConfig, layer_number: int) -> tuple[int, int] | None:
    """The sliding window of layer `layer_number` (1-based): config.window_size, unless
    config.window_attn_skip_freq makes it a global layer (megatron-core's rule,
    `is_layer_window_attention`: every n-th layer global for an int n, or per layer for a
    list); None for a global layer."""
    from megatron.core.transformer.utils import is_layer_window_attention

    window = getattr(config, "window_size", None)
    skip = getattr(config, "window_attn_skip_freq", None)
    if not window or not is_layer_window_attention(window, skip, layer_number):
        return None
    return tuple(window)


def _check_algorithm(algo: str, config: TransformerConfig) -> None:
    """ValueError unless this class can run `algo`: 'mesh', or any algorithm at CP = 1."""
    if is_mesh(algo) or config.context_parallel_size == 1:
        return
    if transformer_engine_attention() is None:
        raise ValueError(
            f"context-parallel algorithm {algo!r} runs in Transformer Engine, which is not "
            "installed: install transformer-engine[pytorch] (GPU only), or use "
            "--context-parallel-algo mesh, which needs no Transformer Engine"
        )
    raise ValueError(
        f"MeshDotProductAttention runs the 'mesh' algorithm, but {algo!r} was asked for "
        "(spec params or TransformerConfig.cp_comm_type); build the layer spec with "
        f"get_gpt_layer_spec({algo!r}) or mesh_core_attention_spec({algo!r}), which choose "
        "Transformer Engine's attention for it"
    )


def _check_supported(
    config: TransformerConfig,
    attn_mask_type: AttnMaskType,
    attention_type: str,
    attention_dropout: float | None,
) -> None:
    """ValueError for features the mesh does not implement, before any communication."""
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    problems = []
    if dropout:
        problems.append(f"attention dropout {dropout} (set attention_dropout=0.0)")
    if attention_type != "self":
        problems.append(f"attention_type {attention_type!r} (only 'self')")
    if attn_mask_type not in _MASKS:
        problems.append(f"attn_mask_type {attn_mask_type} (only causal or no_mask)")
    if getattr(config, "softmax_type", "vanilla") not in SOFTMAX_TYPES:
        problems.append(f"softmax_type {config.softmax_type!r} (valid: "
                        f"{', '.join(SOFTMAX_TYPES)})")
    if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
        problems.append("qk_clip / log_max_attention_logit")
    if problems:
        raise ValueError("MeshDotProductAttention does not support: " + "; ".join(problems))
