"""One attention layer's problem and plan, and the terms they are written in, each decided
here once: the shapes (`AttentionShape`, the grid's `GridShape`), the schedule, exchange and
gradient-dtype choices, and the plan (`MeshPlan`). A leaf: it imports nothing of the project
(nor torch), so the models (`traffic.py`, `memory.py`), the runtime and the planner all build
on it without a cycle.

- sizes: `FP32_BYTES`, `DTYPE_BYTES` (input dtypes by their flag names)
- axis names of the grid: `ROW` (the C ranks that pass Q), `COLUMN` (the R ranks that pass
  K/V), `HEADS` (the A ranks of an all-to-all)
- the grid shape A x R x C (`GridShape`, its one check against the CP size) and its
  factorizations (`mesh_shapes`, `grid_shapes`, `shape_text`, `shapes_text`)
- the heads dimension's rules (`check_heads`: A divides the query heads; `kv_repeats`;
  `heads_shape`: the problem the R x C mesh solves after the all-to-all)
- one attention layer's problem (`AttentionShape`) and its FLOPs (`attention_flops`)
- the schedule and gradient-dtype enums, their user spellings and checks, and the plan of
  a layer (`MeshPlan`), frozen; `plan.resolve_plan` decides it from user spellings
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

FP32_BYTES = 4  # lse, D, fp32 accumulators and fp32 gradient exchanges
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}  # input dtypes by their flag names
BACKWARD_FLOPS_RATIO = 2.5  # five S x S matmuls (QK^T recomputed, dV, dP, dQ, dK) against two

ROW = "row"  # the C ranks of a row: they pass Q, dO, lse, D, partial O and dQ
COLUMN = "column"  # the R ranks of a column: they pass K/V and dK, dV
HEADS = "heads"  # the A ranks of an all-to-all (heads dimension)
AXES = (COLUMN, ROW, HEADS)  # the grid's dims in layout order: rank = ((i * C) + j) * A + a


def check_positive_int(name: str, value: object) -> int:
    """`value` as an int, or ValueError naming it unless it is an int >= 1 (not a bool).
    A flag's name ('--mesh-heads') reads as the command line does: '--mesh-heads 0: ...'."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        if name.startswith("--"):
            raise ValueError(f"{name} {value!r}: must be a positive integer")
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


# ----------------------------------------------------------------------- the grid shape


def shape_text(heads: int, rows: int, cols: int) -> str:
    """'AxRxC', or 'RxC' when A = 1, as the flags write a shape."""
    return f"{heads}x{rows}x{cols}" if heads > 1 else f"{rows}x{cols}"


def dim_groups(ranks: range | list[int] | tuple[int, ...], rows: int, cols: int,
               heads: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """The groups of each dim of the R x C x A grid over `ranks` (CP order, rank = ((i * C)
    + j) * A + a): (columns: R ranks each, rows: C ranks each, heads: A ranks each)."""
    at = lambda i, j, a: ranks[(i * cols + j) * heads + a]  # noqa: E731
    columns = [[at(i, j, a) for i in range(rows)] for j in range(cols) for a in range(heads)]
    row_groups = [[at(i, j, a) for j in range(cols)] for i in range(rows) for a in range(heads)]
    heads_groups = [[at(i, j, a) for a in range(heads)] for i in range(rows) for j in range(cols)]
    return columns, row_groups, heads_groups


def mesh_shapes(cp_size: int) -> list[tuple[int, int]]:
    """Every rows x cols factorization of cp_size, from cp_size x 1 down to 1 x cp_size."""
    return [(cp_size // c, c) for c in range(1, cp_size + 1) if cp_size % c == 0]


def grid_shapes(cp_size: int) -> list[tuple[int, int, int]]:
    """Every heads x rows x cols factorization of cp_size: A ascending, then as
    `mesh_shapes` (P/A x 1 down to 1 x P/A)."""
    return [(a, r, c) for a in range(1, cp_size + 1) if cp_size % a == 0
            for r, c in mesh_shapes(cp_size // a)]


def shapes_text(cp_size: int, heads: int | bool = False) -> str:
    """The valid shapes of a CP group, in one order everywhere: '4x1, 2x2, 1x4' for 4
    (`mesh_shapes`); heads=True: every 'AxRxC' of `grid_shapes` ('RxC' when A = 1); an
    int A > 1 dividing cp_size: the 'AxRxC' of that A."""
    if heads is True:
        return ", ".join(shape_text(a, r, c) for a, r, c in grid_shapes(cp_size))
    if not heads or heads == 1:
        return ", ".join(f"{r}x{c}" for r, c in mesh_shapes(cp_size))
    return ", ".join(shape_text(heads, r, c) for r, c in mesh_shapes(cp_size // heads))


@dataclass(frozen=True)
class GridShape:
    """A x R x C: `heads` ranks of an all-to-all, then a `rows` x `cols` mesh."""

    heads: int
    rows: int
    cols: int

    def __post_init__(self) -> None:
        for name in ("heads", "rows", "cols"):
            check_positive_int(name, getattr(self, name))

    @property
    def cp_size(self) -> int:
        """P = A x R x C."""
        return self.heads * self.rows * self.cols

    @property
    def text(self) -> str:
        """'AxRxC' ('RxC' when A = 1)."""
        return shape_text(self.heads, self.rows, self.cols)

    def check_cp_size(self, cp_size: int) -> "GridShape":
        """The one check of P = A x R x C: ValueError naming the valid shapes unless this
        grid has exactly cp_size ranks; returns the shape."""
        if self.cp_size != cp_size:
            a = self.heads if self.heads > 1 and cp_size % self.heads == 0 else True
            raise ValueError(
                f"mesh shape {self.text} has {self.cp_size} ranks but the context-parallel "
                f"size is {cp_size}; valid shapes: {shapes_text(cp_size, a)}")
        return self


# ----------------------------------------------------------------- the heads dimension


def heads_sizes(cp_size: int, q_heads: int | None = None) -> list[int]:
    """Every all-to-all size A of a grid over cp_size ranks: A divides P and the query
    heads (when known; K/V heads are repeated where A exceeds them), 1 included."""
    return [a for a in range(1, cp_size + 1)
            if cp_size % a == 0 and (q_heads is None or q_heads % a == 0)]


def check_heads(heads: int, q_heads: int, kv_heads: int) -> None:
    """ValueError unless A divides the query heads (then lcm(A, hkv) divides them too)."""
    if q_heads % heads != 0:
        valid = heads_sizes(q_heads, q_heads)
        raise ValueError(
            f"heads={heads} (the all-to-all size) must divide the {q_heads} query heads "
            f"({kv_heads} K/V heads); valid sizes: {', '.join(map(str, valid))}"
        )


def kv_repeats(heads: int, kv_heads: int) -> int:
    """How many times each K/V head is repeated so that A slices get whole heads:
    A / gcd(A, hkv) (1 when A divides hkv)."""
    return heads // math.gcd(heads, kv_heads)


# ------------------------------------------------------------------ one layer's problem


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer's problem on a CP group; `seq_len` is the whole sequence S."""

    seq_len: int
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    v_head_dim: int | None = None  # V's own head dim (multi-latent attention); None: head_dim

    @property
    def dv(self) -> int:
        """V's head dim (that of O, dO and dV too)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def local_elements(self, cp_size: int) -> tuple[int, int, int]:
        """(q, kv, l) element counts of one rank's share (`traffic.py`'s module docstring):
        kv = |K| + |V|, each with its own head dim."""
        s = self.seq_len // cp_size
        q = s * self.batch * self.q_heads * self.head_dim
        kv = s * self.batch * self.kv_heads * (self.head_dim + self.dv)
        lse = s * self.batch * self.q_heads
        return q, kv, lse

    def out_elements(self, cp_size: int) -> int:
        """o: elements of one rank's O (or dO) chunk, q with V's head dim."""
        return self.seq_len // cp_size * self.batch * self.q_heads * self.dv


def heads_shape(shape: AttentionShape, heads: int) -> AttentionShape:
    """The problem the R x C mesh solves after the all-to-all: 1/A of the query heads and
    lcm(A, hkv)/A K/V heads (repeated when A does not divide hkv), the whole sequence."""
    kv_heads = shape.kv_heads * kv_repeats(heads, shape.kv_heads)
    return AttentionShape(shape.seq_len, shape.batch, shape.q_heads // heads, kv_heads // heads,
                          shape.head_dim, shape.dtype_bytes, shape.v_head_dim)


def attention_flops(q_len: int, kv_len: int, batch: int, q_heads: int, head_dim: int,
                    causal: bool) -> float:
    """Forward FLOPs of q_len queries against kv_len keys: 4 sq sk hq d b (QK^T and PV),
    half of it when causal; backward is `BACKWARD_FLOPS_RATIO` times this."""
    flops = 4.0 * q_len * kv_len * q_heads * head_dim * batch
    return flops / 2 if causal else flops


# ------------------------------------------------------------- schedules and grad dtypes

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
        """The grid axis whose traffic overlaps compute: `COLUMN`, `ROW` or None."""
        return {"streamed_kv": COLUMN, "streamed_q": ROW}.get(self.value)

    def runs_gathered(self, rows: int, cols: int) -> bool:
        """Whether the gathered code runs on a rows x cols mesh: a ring of one rank has
        nothing to stream (streamed_kv on one row, streamed_q on one column)."""
        return (self is Schedule.GATHERED or (self is Schedule.STREAMED_KV and rows == 1)
                or (self is Schedule.STREAMED_Q and cols == 1))

    def partial_out_bytes(self, dtype_bytes: int) -> int:
        """Bytes per element of the partial outputs sent over the row: fp32 for streamed_q
        (merged hop by hop, so kept exact), the input dtype otherwise (each sent once)."""
        return FP32_BYTES if self is Schedule.STREAMED_Q else dtype_bytes


class Exchange(str, enum.Enum):
    """What travels between ranks: whole chunks (the schedule's gathers and rings) or, where
    a mask kind leaves most rows unused (sliding windows, placed documents), only the rows
    each rank's blocks use, point to point (`schedules/sparse.py`)."""

    DENSE = "dense"
    SPARSE = "sparse"

    def __str__(self) -> str:
        return self.value


class Runner(str, enum.Enum):
    """The code that runs a plan, one module each (`attention.RUNNERS`)."""

    GATHERED = "gathered"
    STREAMED_KV = "streamed_kv"
    STREAMED_Q = "streamed_q"
    SPARSE = "sparse"

    def __str__(self) -> str:
        return self.value


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
# the tile kernels by name (`kernels.BACKEND_KERNELS`; 'auto': `kernels.choice`)
BACKEND_NAMES = ("auto", "torch", "cudnn", "te", "flex")
DEFAULT_BACKEND = "auto"


def one_of(name: str, value: object, valid: tuple[str, ...]) -> str:
    """`value` as given, or ValueError naming it and the valid spellings."""
    if not isinstance(value, str) or value not in valid:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(valid)}")
    return str(value)


def check_schedule_name(schedule: object) -> str:
    """The schedule name as given, or ValueError naming it and the valid spellings."""
    return one_of("schedule", schedule, SCHEDULE_NAMES)


def check_grad_reduce_dtype(grad_reduce_dtype: object) -> str:
    """The gradient dtype name as given, or ValueError naming it and the valid ones."""
    return one_of("grad_reduce_dtype", grad_reduce_dtype, GRAD_DTYPE_NAMES)


@dataclass(frozen=True)
class MeshPlan:
    """One layer's CP group as heads x rows x cols, its schedule and gradient dtype."""

    rows: int
    cols: int
    schedule: Schedule = Schedule.GATHERED
    grad_reduce_dtype: GradDtype = GradDtype.MIXED
    heads: int = 1
    exchange: Exchange = Exchange.DENSE

    def __post_init__(self) -> None:
        GridShape(self.heads, self.rows, self.cols)  # positive integers
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        object.__setattr__(self, "grad_reduce_dtype", GradDtype(self.grad_reduce_dtype))
        object.__setattr__(self, "exchange", Exchange(self.exchange))

    @property
    def runner(self) -> Runner:
        """The code that runs: the sparse exchange where it is asked for, the gathered code
        for the gathered schedule and for a ring of one rank (streamed_kv on one row,
        streamed_q on one column: nothing to stream), else the schedule's ring."""
        if self.exchange is Exchange.SPARSE:
            return Runner.SPARSE
        if self.schedule.runs_gathered(self.rows, self.cols):
            return Runner.GATHERED
        return Runner(self.schedule.value)

    @property
    def describe(self) -> str:
        """'2x2, schedule streamed_kv, sparse exchange, gradients mixed': what runs, for logs."""
        ran = {Runner.SPARSE: "sparse exchange (only the rows blocks use)",
               Runner.GATHERED: "gathered"}.get(self.runner, f"ring {self.runner}")
        return (f"{self.shape_label}, schedule {self.schedule} (runs {ran}), gradients "
                f"{self.grad_reduce_dtype}")

    @property
    def grid(self) -> GridShape:
        """A x R x C."""
        return GridShape(self.heads, self.rows, self.cols)

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
        """ValueError unless heads * rows * cols == cp_size (`GridShape.check_cp_size`)."""
        self.grid.check_cp_size(cp_size)

    def dq_bytes(self, dtype_bytes: int) -> int:
        """Bytes per element of the dQ exchange over the row."""
        return self.grad_reduce_dtype.dq_bytes(dtype_bytes)

    def dkv_bytes(self, dtype_bytes: int) -> int:
        """Bytes per element of the dK, dV exchange over the column."""
        return self.grad_reduce_dtype.dkv_bytes(dtype_bytes)

    def partial_out_bytes(self, dtype_bytes: int) -> int:
        """Bytes per element of the partial outputs sent over the row."""
        return self.schedule.partial_out_bytes(dtype_bytes)
