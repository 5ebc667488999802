"""How one attention layer runs on its CP group: the plan, resolved once and passed on.

A `layer_plan.MeshPlan` fixes the group's factorization P = heads x rows x cols (heads: the
head-parallel all-to-all width, 1 for the plain 2D mesh), the `Schedule` that runs and the
dtype of the gradient exchange. It is frozen: every later step (the attention call, the byte
and memory models, the planner, the driver's banner) reads it and never re-derives it.

The input spelling "streamed" is not a schedule: `resolve_plan` turns it into the ring that
holds less extra memory for the layer's shape (`memory.streamed_schedule`), once. This module
sits above the memory model, which only reads plans.
"""
from __future__ import annotations

from dataclasses import replace

from ..layer_plan import (
    DEFAULT_GRAD_DTYPE,
    DEFAULT_SCHEDULE,
    STREAMED,
    AttentionShape,
    Exchange,
    GradDtype,
    MeshPlan,
    Schedule,
    check_grad_reduce_dtype,
    check_schedule_name,
    heads_shape,
)
from .memory import streamed_schedule


def resolve_schedule_name(schedule: str | Schedule, shape: AttentionShape, rows: int,
                          cols: int) -> Schedule:
    """The `Schedule` a name runs on this shape and grid: "streamed" becomes the ring with
    less extra memory (`memory.streamed_schedule`); other names map to themselves."""
    if isinstance(schedule, Schedule):
        return schedule
    check_schedule_name(schedule)
    if schedule == STREAMED:
        return streamed_schedule(shape, rows, cols)
    return Schedule(schedule)


def resolve_plan(shape: AttentionShape, rows: int, cols: int,
                 schedule: str | Schedule = DEFAULT_SCHEDULE,
                 grad_reduce_dtype: str | GradDtype = DEFAULT_GRAD_DTYPE, heads: int = 1,
                 cp_size: int | None = None, exchange: str | Exchange = Exchange.DENSE
                 ) -> MeshPlan:
    """The one place a layer's plan is decided, from user spellings: validates the names,
    resolves "streamed" for `shape` (the layer as one rank's attention sees it: its heads,
    the whole sequence S; with heads > 1, for the mesh's 1/A of them) and checks
    heads * rows * cols against cp_size when given. `exchange`: sparse where the mask kind
    leaves most rows unused and only used rows should travel (`layer_plan.Exchange`)."""
    if not isinstance(grad_reduce_dtype, GradDtype):
        check_grad_reduce_dtype(grad_reduce_dtype)
    if not isinstance(schedule, Schedule):
        check_schedule_name(schedule)
    plan = MeshPlan(rows=rows, cols=cols, heads=heads, exchange=Exchange(exchange),
                    grad_reduce_dtype=GradDtype(grad_reduce_dtype))
    if cp_size is not None:
        plan.check_cp_size(cp_size)
    if heads > 1:  # the mesh runs on 1/A of the heads over the whole sequence
        shape = heads_shape(shape, heads)
    return replace(plan, schedule=resolve_schedule_name(schedule, shape, rows, cols))
