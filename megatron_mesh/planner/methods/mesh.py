"""The R x C mesh: bytes straight from `megatron_mesh.traffic.mesh_traffic`, the contract.

Rows are C consecutive CP ranks (Q, dO, lse, D gathers, partial O / lse exchange, dQ
reduce-scatter in fp32, or the input dtype with mesh_grad_reduce_dtype "input"); columns
are R ranks C apart (K,V gathers, dK,dV reduce-scatter, likewise). The streamed_kv
schedule passes K/V around the column ring while blocks compute, dK/dV partials travelling
behind, so column traffic counts as hidden and row traffic as exposed (the forward Q gather
overlaps only the local diagonal block, which the model ignores); streamed_q hides the row
the same way and exposes the column (and sends its partial O in fp32); "streamed" is
whichever of the two it picks for the shape (`memory.streamed_schedule`); gathered hides
nothing.
"""
from __future__ import annotations

from megatron_mesh.memory import streamed_schedule
from megatron_mesh.planner.cost import Transfer
from megatron_mesh.planner.hardware import Cluster
from megatron_mesh.planner.topology import consecutive_groups, crosses_nodes, strided_groups
from megatron_mesh.planner.workload import Workload
from megatron_mesh.traffic import mesh_traffic, partial_out_bytes


def schedule_run(workload: Workload, rows: int, cols: int) -> str:
    """The schedule that runs on this shape: "streamed" resolved to its ring."""
    if workload.mesh_schedule == "streamed":
        return streamed_schedule(workload.attention_shape(), rows, cols)
    return workload.mesh_schedule


HIDDEN_DIRECTION = {"streamed_kv": "column", "streamed_q": "row"}  # gathered: none


def mesh_transfers(workload: Workload, cluster: Cluster, rows: int, cols: int) -> list[Transfer]:
    p = cluster.gpus
    if rows < 1 or cols < 1 or rows * cols != p:
        raise ValueError(f"mesh shape {rows}x{cols} does not multiply to {p} GPUs")
    schedule = schedule_run(workload, rows, cols)
    traffic = mesh_traffic(workload.attention_shape(), rows, cols, workload.mesh_grad_bytes,
                           partial_out_bytes(schedule, workload.dtype_bytes))
    row_cross = crosses_nodes(consecutive_groups(p, cols), cluster)
    col_cross = crosses_nodes(strided_groups(p, rows), cluster)
    e = workload.dtype
    g = "fp32" if workload.mesh_grad_bytes == 4 else e
    hidden = HIDDEN_DIRECTION.get(schedule)
    o = "fp32" if schedule == "streamed_q" else e
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
