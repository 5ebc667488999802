"""The layer's plan: validated once, "streamed" resolved once, and the byte and memory models
reading it give the numbers of their keyword forms."""
from __future__ import annotations

import pytest

import megatron_mesh as mm
from megatron_mesh.cost_models.memory import extra_memory, streamed_schedule
from megatron_mesh.cost_models.plan import resolve_plan
from megatron_mesh.layer_plan import GradDtype, MeshPlan, Schedule

SHAPES = [mm.AttentionShape(4096, 1, 8, 8, 64), mm.AttentionShape(2048, 2, 32, 8, 128, 4),
          mm.AttentionShape(8192, 1, 16, 1, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("schedule", ["streamed", *(str(s) for s in Schedule)])
@pytest.mark.parametrize("grads", ["fp32", "input", "mixed"])
def test_plan_models_equal_keyword_forms(shape, schedule, grads) -> None:
    for rows, cols in mm.mesh_shapes(8):
        plan = resolve_plan(shape, rows, cols, schedule, grads, cp_size=8)
        ran = streamed_schedule(shape, rows, cols) if schedule == "streamed" else schedule
        assert plan.schedule == ran and isinstance(plan.schedule, Schedule)
        assert plan.grad_reduce_dtype is GradDtype(grads)
        e = shape.dtype_bytes
        keyword = mm.mesh_traffic(shape, rows, cols, GradDtype(grads).dq_bytes(e),
                                  Schedule(ran).partial_out_bytes(e), GradDtype(grads).dkv_bytes(e))
        assert mm.mesh_traffic(shape, plan) == keyword
        assert extra_memory(shape, plan) == extra_memory(shape, rows, cols, ran, grads)


def test_plan_is_frozen_and_names_its_shape() -> None:
    plan = MeshPlan(rows=2, cols=4, schedule="streamed_q", grad_reduce_dtype="input")
    assert plan.cp_size == 8 and plan.heads == 1 and plan.shape_label == "2x4"
    with pytest.raises(AttributeError):
        plan.rows = 4  # type: ignore[misc]
    assert MeshPlan(rows=2, cols=2, heads=4).shape_label == "4x2x2"


@pytest.mark.parametrize("kwargs, message", [
    (dict(rows=0, cols=4), "rows must be a positive integer, got 0"),
    (dict(rows=2, cols=2.0), "cols must be a positive integer, got 2.0"),
    (dict(rows=2, cols=2, heads=0), "heads must be a positive integer, got 0"),
    (dict(rows=2, cols=2, schedule="streamed"), "'streamed' is not a valid Schedule"),
    (dict(rows=2, cols=2, grad_reduce_dtype="bf16"), "'bf16' is not a valid GradDtype"),
])
def test_bad_plan_names_the_value(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        MeshPlan(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(schedule="ring"), "schedule='ring' is not one of streamed, streamed_kv, streamed_q, "
     "gathered"),
    (dict(grad_reduce_dtype="bf16"), "grad_reduce_dtype='bf16' is not one of fp32, input, mixed"),
    (dict(cp_size=16), "mesh shape 2x4 has 8 ranks but the context-parallel size is 16"),
    (dict(heads=2, cp_size=8), "mesh shape 2x2x4 has 16 ranks but the context-parallel size is 8"),
])
def test_resolve_plan_rejects_bad_input(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_plan(SHAPES[0], 2, 4, **kwargs)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_plan_says_what_runs(schedule: Schedule) -> None:
    """`MeshPlan.runner` is the one place that folds the one-rank ring into the gathered code
    and routes the sparse exchange; the layer dispatches on it."""
    from megatron_mesh.attention import RUNNERS, sparse_plan
    from megatron_mesh.layer_plan import Exchange, Runner

    for rows, cols in mm.mesh_shapes(4):
        plan = MeshPlan(rows=rows, cols=cols, schedule=schedule)
        one_rank_ring = ((schedule is Schedule.STREAMED_KV and rows == 1)
                         or (schedule is Schedule.STREAMED_Q and cols == 1))
        expected = (Runner.GATHERED if schedule is Schedule.GATHERED or one_rank_ring
                    else Runner(schedule.value))
        assert plan.runner is expected and RUNNERS[plan.runner].__name__.endswith(expected.value)
        assert MeshPlan(rows=rows, cols=cols, schedule=schedule,
                        exchange="sparse").runner is Runner.SPARSE
    assert sparse_plan(schedule, "sparse", True) == (schedule, Exchange.SPARSE)
    assert sparse_plan(schedule, "gathered", True) == (Schedule.GATHERED, Exchange.DENSE)
    assert sparse_plan(schedule, "gathered", False) == (schedule, Exchange.DENSE)
    assert set(RUNNERS) == set(Runner)
