"""The attention problem the planner sizes: one layer, one sequence split over P ranks."""
from __future__ import annotations

from dataclasses import dataclass

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
from megatron_mesh.masks.window import Window, window_of
from megatron_mesh.masks.zigzag import check_zigzag_divisible
from megatron_mesh.models.plan import resolve_plan
from megatron_mesh.planner.windows import kept_pairs


@dataclass(frozen=True)
class Workload:
    """Sequence length S, heads, head size, batch, input dtype and causal mask of one layer,
    the dtype the mesh's gradient exchange uses and the mesh schedule (mesh_attention's
    grad_reduce_dtype and schedule). `doc_lengths`: packed documents (their lengths sum to
    S); attention stays inside each, so compute counts only in-document FLOPs, while the
    bytes are those of the whole sequence (every rank holds a share of every document).
    `window`: a sliding window (`window.window_of`, decided once): compute counts only the
    (query, key) pairs it keeps, and each method moves what it moves under a window
    (`planner.methods`)."""

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
            self._check_window()

    def _check_window(self) -> None:
        w = self.window
        if not isinstance(w, Window) or window_of((w.left, w.right), self.causal) != w:
            raise ValueError(f"window {w!r} is not a checked window for causal={self.causal} "
                             "(one that limits something): pass window_of((left, right), causal)")
        if self.doc_lengths is not None:
            raise ValueError("a sliding window inside packed documents is not priced: give "
                             "the window or the document lengths, not both")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def mesh_plan(self, rows: int, cols: int, heads: int = 1) -> MeshPlan:
        """The plan the mesh runs on a heads x rows x cols group for this layer."""
        return resolve_plan(self.attention_shape(), rows, cols, self.mesh_schedule,
                            self.mesh_grad_reduce_dtype, heads=heads)

    def attention_shape(self) -> AttentionShape:
        """The shape `megatron_mesh.models.traffic` counts bytes for."""
        return AttentionShape(
            seq_len=self.seq_length,
            batch=self.batch,
            q_heads=self.num_heads,
            kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype_bytes=self.dtype_bytes,
        )

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

    def forward_flops(self) -> float:
        """4 * S^2 * heads * head_dim * batch (QK^T and PV); half of it when causal. With
        packed documents, the sum of that over the documents (each its own S). Under a
        sliding window: 4 * (pairs the window keeps) * heads * head_dim * batch."""
        if self.window is not None:
            pairs = kept_pairs(self.seq_length, self.window, self.causal)
            return 4.0 * pairs * self.batch * self.num_heads * self.head_dim
        if self.doc_lengths is None:
            return attention_flops(self.seq_length, self.seq_length, self.batch,
                                   self.num_heads, self.head_dim, self.causal)
        return sum(attention_flops(n, n, self.batch, self.num_heads, self.head_dim, self.causal)
                   for n in self.doc_lengths)

    def backward_flops(self) -> float:
        """2.5 x forward: five S x S matmuls (QK^T recomputed, dV, dP, dQ, dK) against two."""
        return BACKWARD_FLOPS_RATIO * self.forward_flops()
