"""The R x C mesh: bytes straight from `megatron_mesh.cost_models.traffic.mesh_traffic`, the contract.

Rows are C consecutive CP ranks (Q, dO, lse, D gathers, partial O / lse exchange, dQ
reduce-scatter); columns are R ranks C apart (K,V gathers, dK,dV reduce-scatter), the
gradients in the dtypes of mesh_grad_reduce_dtype (`layer_plan.GradDtype`). The streamed_kv
schedule passes K/V around the column ring while blocks compute, dK/dV partials travelling
behind, so column traffic counts as hidden and row traffic as exposed (the forward Q gather
overlaps only the local diagonal block, which the model ignores); streamed_q hides the row
the same way and exposes the column (and sends its partial O in fp32); "streamed" is
whichever of the two the plan resolved it to (`Workload.mesh_plan`); gathered hides
nothing.

With a heads dimension A (A x R x C = P), the all-to-all over A consecutive CP ranks comes
first (exposed, like Ulysses'), and the R x C mesh runs over the P/A ranks that share a head
slice (stride A in CP rank) on 1/A of the heads (`traffic.grid_traffic`).

Under a sliding window or a mask given as slices every schedule runs the sparse exchange
(`sparse.py`).
"""
from __future__ import annotations

from megatron_mesh.cost_models.traffic import mesh_traffic
from megatron_mesh.layer_plan import COLUMN, FP32_BYTES, ROW, GridShape, dim_groups
from megatron_mesh.planner.cost import PricedTransfer
from megatron_mesh.planner.hardware import Cluster
from megatron_mesh.planner.methods.sparse import sparse_transfers
from megatron_mesh.planner.methods.ulysses import all_to_all_pair
from megatron_mesh.planner.pricing.workload import Workload
from megatron_mesh.planner.topology import crosses_nodes


def mesh_transfers(workload: Workload, cluster: Cluster, rows: int, cols: int,
                   heads: int = 1) -> list[PricedTransfer]:
    p = cluster.gpus
    GridShape(heads, rows, cols).check_cp_size(p)
    if workload.sparse:
        return sparse_transfers(workload, cluster, rows, cols, heads)
    plan = workload.mesh_plan(rows, cols, heads)
    traffic = mesh_traffic(workload.attention_shape(), plan)
    col_groups, row_groups, heads_groups = dim_groups(range(p), rows, cols, heads)
    row_cross = crosses_nodes(row_groups, cluster)
    col_cross = crosses_nodes(col_groups, cluster)
    e = workload.dtype
    g_q = "fp32" if plan.grad_reduce_dtype.dq_in_fp32 else e
    g_kv = "fp32" if plan.grad_reduce_dtype.dkv_in_fp32 else e
    hidden = plan.schedule.hidden_direction
    o = "fp32" if plan.partial_out_bytes(workload.dtype_bytes) == FP32_BYTES else e
    # the partials (outputs, gradients) reduced over a group: on a streamed ring they trail
    # their chunks; the rest of each direction's bytes are the chunks themselves
    out_part = traffic.forward_row_partials
    dq_part = traffic.backward_row_partials
    dkv_part = traffic.backward_col_partials

    def row(phase: str, tensors: str, nbytes: int, trailing: bool = False) -> PricedTransfer:
        return PricedTransfer(phase, ROW, tensors, nbytes, row_cross, hidden == ROW, cols, trailing)

    def column(phase: str, tensors: str, nbytes: int, trailing: bool = False) -> PricedTransfer:
        return PricedTransfer(phase, COLUMN, tensors, nbytes, col_cross, hidden == COLUMN, rows,
                        trailing)

    a2a = [] if heads == 1 else all_to_all_pair(traffic.forward_heads, traffic.backward_heads,
                                                 e, heads_groups, cluster)
    return a2a + [
        row("forward", f"Q ({e})", traffic.forward_row - out_part),
        row("forward", f"partial O ({o}), lse (fp32)", out_part, trailing=True),
        column("forward", f"K,V ({e})", traffic.forward_col),
        row("backward", f"Q,dO ({e}), lse,D (fp32)", traffic.backward_row - dq_part),
        row("backward", f"dQ ({g_q})", dq_part, trailing=True),
        column("backward", f"K,V ({e})", traffic.backward_col - dkv_part),
        column("backward", f"dK,dV ({g_kv})", dkv_part, trailing=True),
    ]
