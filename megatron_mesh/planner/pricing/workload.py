"""The attention problem the planner sizes: one layer, one sequence split over P ranks."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_mesh.cost_models.plan import resolve_plan
from megatron_mesh.layer_plan import (
    BACKWARD_FLOPS_RATIO,
    DEFAULT_GRAD_DTYPE,
    DEFAULT_SCHEDULE,
    DTYPE_BYTES,
    GRAD_DTYPE_NAMES,
    SCHEDULE_NAMES,
    AttentionShape,
    MeshPlan,
    attention_flops,
    check_positive_int,
    one_of,
)
from megatron_mesh.masks.documents import Documents
from megatron_mesh.masks.mask import Mask, as_attention_mask
from megatron_mesh.masks.slices import SliceMask, as_mask
from megatron_mesh.masks.window import Window, window_of
from megatron_mesh.masks.zigzag import check_zigzag_divisible
from megatron_mesh.planner.pricing.windows import kept_pairs


@dataclass(frozen=True)
class Workload:
    """Sequence length S, heads, head size, batch, input dtype and causal mask of one layer,
    the dtype the mesh's gradient exchange uses and the mesh schedule (mesh_attention's
    grad_reduce_dtype and schedule). `doc_lengths`: packed documents (their lengths sum to
    S); attention stays inside each, so compute counts only in-document FLOPs, while the
    bytes are those of the whole sequence (every rank holds a share of every document).
    `window`: a sliding window (`window.window_of`, decided once), inside each document
    with `doc_lengths`; `slices`: a user's mask over the sequence's positions (`SliceMask`).
    They compose into one `mask`: compute counts only the (query, key) pairs it keeps, and
    each method moves what it moves under it (`planner.methods`). `from_shape` builds one
    from an `AttentionShape` and a `Mask`."""

    seq_length: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int = 1
    dtype: str = "bf16"
    causal: bool = True
    mesh_grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE
    mesh_schedule: str = DEFAULT_SCHEDULE
    doc_lengths: tuple[int, ...] | None = None
    window: Window | None = None
    slices: SliceMask | None = None

    @classmethod
    def from_shape(cls, shape: AttentionShape, mask: Mask | SliceMask | None = None,
                   doc_lengths: tuple[int, ...] | None = None, dtype: str = "bf16",
                   mesh_schedule: str = DEFAULT_SCHEDULE,
                   mesh_grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE) -> Workload:
        """The workload of `shape` (its dtype named by `dtype`) under `mask` (None: causal;
        a `Mask` of documents given as cu_seqlens, a window, slices, composed; its
        documents, or `doc_lengths`, are packed THD over the whole sequence)."""
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if DTYPE_BYTES[dtype] != shape.dtype_bytes:
            fits = sorted(n for n, b in DTYPE_BYTES.items() if b == shape.dtype_bytes)
            raise ValueError(f"dtype {dtype!r} has {DTYPE_BYTES[dtype]} bytes a value, the "
                             f"shape's dtype_bytes {shape.dtype_bytes}: name one of {fits}")
        mask = Mask() if mask is None else as_attention_mask(mask)
        if mask.placement is not None:
            raise ValueError("the planner prices a placement of its own (price_placement); "
                             "give the documents as cu_seqlens (documents_mask) or doc_lengths")
        if mask.documents is not None:
            docs = mask.documents
            if docs.padded_lengths != docs.lengths or (doc_lengths is not None
                                                       and tuple(doc_lengths) != docs.lengths):
                raise ValueError(f"the mask's documents {docs.lengths} (padded "
                                 f"{docs.padded_lengths}) and doc_lengths {doc_lengths}: give "
                                 "unpadded documents once")
            doc_lengths = docs.lengths
        return cls(shape.seq_len, shape.q_heads, shape.kv_heads, shape.head_dim, shape.batch,
                   dtype, mask.causal, mesh_grad_reduce_dtype, mesh_schedule, doc_lengths,
                   mask.window, mask.slices)

    def __post_init__(self) -> None:
        for name in ("seq_length", "num_heads", "num_kv_heads", "head_dim", "batch"):
            check_positive_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads "
                f"{self.num_kv_heads}"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        one_of("mesh_grad_reduce_dtype", self.mesh_grad_reduce_dtype, GRAD_DTYPE_NAMES)
        one_of("mesh_schedule", self.mesh_schedule, SCHEDULE_NAMES)
        if self.doc_lengths is not None:
            object.__setattr__(self, "doc_lengths", tuple(self.doc_lengths))
            if not self.doc_lengths or any(
                    not isinstance(n, int) or n < 1 for n in self.doc_lengths):
                raise ValueError(f"doc_lengths {self.doc_lengths!r} must be positive integers")
            if sum(self.doc_lengths) != self.seq_length:
                raise ValueError(f"doc_lengths sum to {sum(self.doc_lengths)}, but seq_length "
                                 f"is {self.seq_length}; packed documents fill the sequence")
        if self.window is not None:
            w = self.window
            if not isinstance(w, Window) or window_of((w.left, w.right), self.causal) != w:
                raise ValueError(f"window {w!r} is not a checked window for causal="
                                 f"{self.causal} (one that limits something): pass "
                                 "window_of((left, right), causal)")
        if self.slices is not None:
            object.__setattr__(self, "slices", as_mask(self.slices))
            if self.slices.seq_len != self.seq_length:
                raise ValueError(f"the mask's slices cover {self.slices.seq_len} positions, "
                                 f"but seq_length is {self.seq_length}; give slices over "
                                 "the whole (packed) sequence")

    @property
    def mask(self) -> Mask:
        """The one mask of the layer: causal, the THD documents, the window, the slices."""
        docs = None if self.doc_lengths is None else Documents.from_cu_seqlens(self._cu())
        return Mask(self.causal, docs, window=self.window, slices=self.slices)

    def _cu(self, unit: int = 1) -> list[int]:
        """Cumulative document lengths, each rounded up to a multiple of `unit`."""
        cu = [0]
        for n in self.doc_lengths:
            cu.append(cu[-1] + -(-n // unit) * unit)
        return cu

    def mask_on(self, cp_size: int) -> Mask:
        """`mask` as it runs on `cp_size` ranks: THD documents padded to multiples of 2P
        (Transformer Engine's cu_seqlens_padded; with slices, which name positions of the
        unpadded sequence, the documents must be multiples of 2P already)."""
        mask = self.mask
        if mask.documents is None or cp_size == 1:
            return mask
        unit = 2 * cp_size
        if self.slices is not None:
            odd = [n for n in self.doc_lengths if n % unit]
            if odd:
                raise ValueError(f"documents of lengths {odd[:4]} are not multiples of 2P = "
                                 f"{unit}: THD pads them, which moves the positions the "
                                 "slices name; give documents of multiples of 2P with slices")
            return mask
        return Mask(self.causal, Documents.from_cu_seqlens(self._cu(), self._cu(unit)),
                    window=self.window)

    @property
    def sparse(self) -> bool:
        """Whether the mesh runs the sparse exchange (a window or a user's slices)."""
        return self.window is not None or self.slices is not None

    @property
    def generic(self) -> bool:
        """Whether the mesh is priced from the mask's slices (`planner.masked`): no closed
        form stands in for it (slices, or a window inside documents)."""
        return self.slices is not None or (self.window is not None
                                           and self.doc_lengths is not None)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def mesh_plan(self, rows: int, cols: int, heads: int = 1) -> MeshPlan:
        """The plan the mesh runs on a heads x rows x cols group for this layer."""
        return resolve_plan(self.attention_shape(), rows, cols, self.mesh_schedule,
                            self.mesh_grad_reduce_dtype, heads=heads)

    def attention_shape(self) -> AttentionShape:
        """The shape `megatron_mesh.cost_models.traffic` counts bytes for."""
        return AttentionShape(self.seq_length, self.batch, self.num_heads, self.num_kv_heads,
                              self.head_dim, self.dtype_bytes)

    def kv_chunk_bytes(self, cp_size: int) -> int:
        """Bytes of one rank's K,V (its S / cp_size tokens) in the input dtype."""
        _, kv, _ = self.attention_shape().local_elements(cp_size)
        return kv * self.dtype_bytes

    def check_cp_size(self, cp_size: int) -> None:
        """Megatron's zigzag layout cuts the sequence into 2 * cp_size equal chunks."""
        if cp_size < 1:
            raise ValueError(f"the number of GPUs must be positive, got {cp_size}")
        check_zigzag_divisible(self.seq_length, cp_size, "seq_length", "GPUs",
                               single_rank=True)

    def pairs(self) -> int | None:
        """(query, key) pairs the mask keeps (None: the dense mask, whose FLOPs keep the
        kernels' convention): the slices' count where there are slices, else the closed
        form per document (each its own sequence; tested equal to the slices' count)."""
        if self.slices is not None:
            return self.mask.sequence_slices(self.seq_length).pairs
        if self.doc_lengths is not None:
            return sum(kept_pairs(n, self.window or Window(-1, -1), self.causal)
                       for n in self.doc_lengths)
        if self.window is not None:
            return kept_pairs(self.seq_length, self.window, self.causal)
        return None

    def forward_flops(self) -> float:
        """4 * S^2 * heads * head_dim * batch (QK^T and PV), half of it when causal; under
        any other mask (documents, a window, slices) 4 * `pairs` * heads * head_dim * batch."""
        pairs = self.pairs()
        if pairs is None:
            return attention_flops(self.seq_length, self.seq_length, self.batch,
                                   self.num_heads, self.head_dim, self.causal)
        return 4.0 * pairs * self.batch * self.num_heads * self.head_dim

    def backward_flops(self) -> float:
        """2.5 x forward: five S x S matmuls (QK^T recomputed, dV, dP, dQ, dK) against two."""
        return BACKWARD_FLOPS_RATIO * self.forward_flops()
