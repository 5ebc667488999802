"""How one attention layer runs on its CP group: the plan, resolved once and passed on.

A `MeshPlan` fixes the group's factorization P = heads x rows x cols (heads: the head-parallel
all-to-all width, 1 for the plain 2D mesh), the `Schedule` that runs and the dtype of the
gradient exchange. It is frozen: every later step (the attention call, the byte and memory
models, the planner, the driver's banner) reads it and never re-derives it.

The input spelling "streamed" is not a schedule: `resolve_plan` turns it into the ring that
holds less extra memory for the layer's shape (`memory.streamed_schedule`), once.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .dtypes import FP32_BYTES

if TYPE_CHECKING:
    from .traffic import AttentionShape, Traffic

STREAMED = "streamed"  # input spelling: the ring with less memory for the shape


class Schedule(str, enum.Enum):
    """The order a rank moves its tile's chunks in (see attention.py); equal to its name."""

    STREAMED_KV = "streamed_kv"  # K/V travel around the column ring, overlapped
    STREAMED_Q = "streamed_q"  # Q travel around the row ring, overlapped
    GATHERED = "gathered"  # all-gather the tile's Q and K/V, then compute

    def __str__(self) -> str:
        return self.value

    @property
    def hidden_direction(self) -> str | None:
        """The grid direction whose traffic overlaps compute: 'column', 'row' or None."""
        return {"streamed_kv": "column", "streamed_q": "row"}.get(self.value)

    def partial_out_bytes(self, dtype_bytes: int) -> int:
        """Bytes per element of the partial outputs sent over the row: fp32 for streamed_q
        (merged hop by hop, so kept exact), the input dtype otherwise (each sent once)."""
        return FP32_BYTES if self is Schedule.STREAMED_Q else dtype_bytes


class GradDtype(str, enum.Enum):
    """The dtypes the gradient partials travel in: dQ over the row, dK / dV over the column.

    Every rank sums its own blocks in fp32 either way; this is only the exchange. "mixed"
    sends dK / dV in the input dtype, as Transformer Engine's ring does over its P - 1 hops,
    and keeps dQ (summed over the C members of a row, which a ring never exchanges) in fp32.
    """

    FP32 = "fp32"
    INPUT = "input"
    MIXED = "mixed"

    def __str__(self) -> str:
        return self.value

    @property
    def dq_in_fp32(self) -> bool:
        return self is not GradDtype.INPUT

    @property
    def dkv_in_fp32(self) -> bool:
        return self is GradDtype.FP32

    def dq_bytes(self, dtype_bytes: int) -> int:
        """Bytes per element of the dQ exchange for inputs of dtype_bytes."""
        return FP32_BYTES if self.dq_in_fp32 else dtype_bytes

    def dkv_bytes(self, dtype_bytes: int) -> int:
        """Bytes per element of the dK, dV exchange for inputs of dtype_bytes."""
        return FP32_BYTES if self.dkv_in_fp32 else dtype_bytes


SCHEDULE_NAMES = (STREAMED,) + tuple(s.value for s in Schedule)  # what users may write
DEFAULT_SCHEDULE = STREAMED
GRAD_DTYPE_NAMES = tuple(g.value for g in GradDtype)
DEFAULT_GRAD_DTYPE = GradDtype.MIXED.value


def shape_text(heads: int, rows: int, cols: int) -> str:
    """'AxRxC', or 'RxC' when A = 1, as the flags write a shape."""
    return f"{heads}x{rows}x{cols}" if heads > 1 else f"{rows}x{cols}"


def _one_of(name: str, value: object, valid: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in valid:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(valid)}")
    return str(value)


def check_schedule_name(schedule: object) -> str:
    """The schedule name as given, or ValueError naming it and the valid spellings."""
    return _one_of("schedule", schedule, SCHEDULE_NAMES)


def check_grad_dtype_name(grad_reduce_dtype: object) -> str:
    """The gradient dtype name as given, or ValueError naming it and the valid ones."""
    return _one_of("grad_reduce_dtype", grad_reduce_dtype, GRAD_DTYPE_NAMES)


@dataclass(frozen=True)
class MeshPlan:
    """One layer's CP group as heads x rows x cols, its schedule and gradient dtype."""

    rows: int
    cols: int
    schedule: Schedule = Schedule.GATHERED
    grad_dtype: GradDtype = GradDtype.MIXED
    heads: int = 1

    def __post_init__(self) -> None:
        for name in ("heads", "rows", "cols"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        object.__setattr__(self, "grad_dtype", GradDtype(self.grad_dtype))

    @property
    def cp_size(self) -> int:
        """P = heads * rows * cols."""
        return self.heads * self.rows * self.cols

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols) of the mesh each head group runs."""
        return self.rows, self.cols

    @property
    def shape_label(self) -> str:
        """'RxC', or 'AxRxC' with a heads dimension."""
        return shape_text(self.heads, self.rows, self.cols)

    def check_cp_size(self, cp_size: int) -> None:
        """ValueError unless heads * rows * cols == cp_size."""
        if self.cp_size != cp_size:
            raise ValueError(
                f"mesh shape {self.shape_label} has {self.cp_size} ranks, but the CP group has "
                f"{cp_size}; heads x rows x cols must equal the CP size")

    def dq_bytes(self, dtype_bytes: int) -> int:
        """Bytes per element of the dQ exchange over the row."""
        return self.grad_dtype.dq_bytes(dtype_bytes)

    def dkv_bytes(self, dtype_bytes: int) -> int:
        """Bytes per element of the dK, dV exchange over the column."""
        return self.grad_dtype.dkv_bytes(dtype_bytes)

    def partial_out_bytes(self, dtype_bytes: int) -> int:
        """Bytes per element of the partial outputs sent over the row."""
        return self.schedule.partial_out_bytes(dtype_bytes)

    def traffic(self, shape: AttentionShape) -> Traffic:
        """Bytes one rank sends for one layer of `shape` under this plan (`mesh_traffic`)."""
        from .traffic import mesh_traffic
        return mesh_traffic(shape, self)

    def describe(self) -> str:
        """'RxC, schedule S, grads G' for logs and banners."""
        return f"{self.shape_label}, schedule {self.schedule}, grads {self.grad_dtype}"


def resolve_schedule_name(schedule: str | Schedule, shape: AttentionShape, rows: int,
                          cols: int) -> Schedule:
    """The `Schedule` a name runs on this shape and grid: "streamed" becomes the ring with
    less extra memory (`memory.streamed_schedule`); other names map to themselves."""
    if isinstance(schedule, Schedule):
        return schedule
    check_schedule_name(schedule)
    if schedule == STREAMED:
        from .memory import streamed_schedule  # memory imports this module's names
        return Schedule(streamed_schedule(shape, rows, cols))
    return Schedule(schedule)


def resolve_plan(
    shape: AttentionShape,
    rows: int,
    cols: int,
    schedule: str | Schedule = DEFAULT_SCHEDULE,
    grad_reduce_dtype: str | GradDtype = DEFAULT_GRAD_DTYPE,
    heads: int = 1,
    cp_size: int | None = None,
) -> MeshPlan:
    """The one place a layer's plan is decided, from user spellings: validates the names,
    resolves "streamed" for `shape` (the layer as one rank's attention sees it: its heads,
    the whole sequence S; with heads > 1, for the mesh's 1/A of them) and checks
    heads * rows * cols against cp_size when given."""
    if not isinstance(grad_reduce_dtype, GradDtype):
        check_grad_dtype_name(grad_reduce_dtype)
    if not isinstance(schedule, Schedule):
        check_schedule_name(schedule)
    plan = MeshPlan(rows=rows, cols=cols, heads=heads, grad_dtype=GradDtype(grad_reduce_dtype))
    if cp_size is not None:
        plan.check_cp_size(cp_size)
    if heads > 1:  # the mesh runs on 1/A of the heads over the whole sequence
        from .traffic import heads_shape
        shape = heads_shape(shape, heads)
    return replace(plan, schedule=resolve_schedule_name(schedule, shape, rows, cols))
