"""The R x C mesh: bytes straight from `megatron_mesh.traffic.mesh_traffic`, the contract.

Rows are C consecutive CP ranks (Q, dO, lse, D gathers, partial O / lse exchange, dQ
reduce-scatter in fp32, or the input dtype with mesh_grad_reduce_dtype "input"); columns
are R ranks C apart (K,V gathers, dK,dV reduce-scatter, likewise). The streamed_kv
schedule passes K/V around the column ring while blocks compute, dK/dV partials travelling
behind, so column traffic counts as hidden and row traffic as exposed (the forward Q gather
overlaps only the local diagonal block, which the model ignores); streamed_q hides the row
the same way and exposes the column (and sends its partial O in fp32); "streamed" is
whichever of the two the plan resolved it to (`Workload.mesh_plan`); gathered hides
nothing.
"""
from __future__ import annotations

from megatron_mesh.plan import GradDtype, Schedule
from megatron_mesh.planner.cost import Transfer
from megatron_mesh.planner.hardware import Cluster
from megatron_mesh.planner.topology import consecutive_groups, crosses_nodes, strided_groups
from megatron_mesh.planner.workload import Workload
from megatron_mesh.traffic import mesh_traffic


def schedule_run(workload: Workload, rows: int, cols: int) -> str:
    """The schedule that runs on this shape: "streamed" resolved to its ring."""
    return workload.mesh_plan(rows, cols).schedule.value


def mesh_transfers(workload: Workload, cluster: Cluster, rows: int, cols: int) -> list[Transfer]:
    p = cluster.gpus
    if rows < 1 or cols < 1 or rows * cols != p:
        raise ValueError(f"mesh shape {rows}x{cols} does not multiply to {p} GPUs")
    plan = workload.mesh_plan(rows, cols)
    traffic = mesh_traffic(workload.attention_shape(), plan)
    row_cross = crosses_nodes(consecutive_groups(p, cols), cluster)
    col_cross = crosses_nodes(strided_groups(p, rows), cluster)
    e = workload.dtype
    g = "fp32" if plan.grad_dtype is GradDtype.FP32 else e
    hidden = plan.schedule.hidden_direction
    o = "fp32" if plan.schedule is Schedule.STREAMED_Q else e
    return [
        Transfer("forward", "row", f"Q ({e}); partial O ({o}), lse (fp32)",
                 traffic.forward_row, row_cross, hidden=hidden == "row"),
        Transfer("forward", "column", f"K,V ({e})",
                 traffic.forward_col, col_cross, hidden=hidden == "column"),
        Transfer("backward", "row", f"Q,dO ({e}), lse,D (fp32); dQ ({g})",
                 traffic.backward_row, row_cross, hidden=hidden == "row"),
        Transfer("backward", "column", f"K,V ({e}); dK,dV ({g})",
                 traffic.backward_col, col_cross, hidden=hidden == "column"),
    ]
