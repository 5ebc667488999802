"""The mesh under a sliding window: the sparse exchange of `megatron_mesh.schedules.sparse`.

Whatever schedule was asked for, each rank receives only the rows its blocks use, point to
point, while its own block computes, and sends partial outputs and gradients back for those
rows after the blocks: those are exposed. Bytes per rank come from the closed form of
`planner.windows` (equal to `cost_models.sparse.window_traffic`). Each byte goes straight to its peer,
so, as for an all-to-all, a rank's bytes for other nodes leave through its NIC while those
for its own node cross the intra-node links at the same time. Each exchange (Q rows, K,V
rows, partial outputs back, ...) ends when its slowest sender is done, since its receivers
wait for it, so each is priced at the rank whose part takes longest, and the bytes shown are
those ranks' (measured on the emulated cluster, pricing instead the one rank slowest over all
exchanges predicted 2D meshes up to 1.3x too fast). The inbound rows travel while the rank's
own block computes (`cost.price`'s `own_block_flops`; priced so for placed documents, whose
own block `planner.placed` counts; a window's is not counted yet). A heads dimension adds
the all-to-all of `mesh.py` first.
"""
from __future__ import annotations

import numpy as np

from megatron_mesh.layer_plan import BACKWARD_FLOPS_RATIO, dim_groups
from megatron_mesh.masks.mask import Mask
from megatron_mesh.planner.cost import Estimate, PricedTransfer, price
from megatron_mesh.planner.hardware import Cluster
from megatron_mesh.planner.methods.ulysses import all_to_all_pair
from megatron_mesh.planner.pricing.masked import counts_of, mesh_totals, pair_flops, pairs_of
from megatron_mesh.planner.pricing.tiles import mesh_calls
from megatron_mesh.planner.pricing.windows import (
    COL_PARTS,
    PARTS,
    ROW_PARTS,
    RowCounts,
    RowSizes,
    heads_bytes,
    inner_shape,
    peer_bytes,
)
from megatron_mesh.planner.pricing.workload import Workload

INBOUND = ("Q", "K,V", "Q,dO, lse,D")  # `PARTS` received while the own block computes


def _split(parts: np.ndarray, peers: np.ndarray, node: np.ndarray) -> tuple[np.ndarray, ...]:
    """(on-node, off-node) bytes [parts, mesh] of per-peer `parts` [parts, mesh, peers]."""
    same = node[peers] == node[:, None]
    total = parts.sum(-1)
    on = (parts * same).sum(-1)
    return on, total - on


def sparse_transfers(workload: Workload, cluster: Cluster, rows: int, cols: int,
                     heads: int = 1) -> list[PricedTransfer]:
    """The masked layer's transfers on a heads x rows x cols grid (a window's in closed
    form, any other mask's from its slices, `counts_of`): for each exchange, the bytes of
    the rank whose part takes longest (the first of them on a tie)."""
    assert workload.sparse
    mask = workload.mask_on(cluster.gpus)
    seq = workload.seq_length if mask.documents is None else mask.documents.total
    return exchange_transfers(workload, cluster, counts_of(mask, seq, rows, cols, heads), heads)


def exchange_transfers(workload: Workload, cluster: Cluster, counts: RowCounts,
                       heads: int = 1) -> list[PricedTransfer]:
    """The sparse exchange of `counts` (rows each mesh rank uses of each peer's chunk:
    a window's, or placed documents' `planner.placed`) on a heads x rows x cols grid."""
    rows, cols = counts.rows, counts.cols
    plan = workload.mesh_plan(rows, cols, heads)
    shape, e = workload.attention_shape(), workload.dtype_bytes
    inner = inner_shape(shape, heads)
    sizes = RowSizes.of(inner, plan.dq_bytes(e), plan.dkv_bytes(e))
    row_parts, col_parts, row_peer, col_peer = peer_bytes(counts, sizes)
    nic, link = cluster.bandwidth(True), cluster.bandwidth(False)
    worst = [(-1.0, 0, 0)] * len(PARTS)  # per part: (seconds, on-node, off-node bytes)
    for t in range(heads):  # head slice t: mesh rank m is CP rank m * heads + t
        node = (np.arange(rows * cols) * heads + t) // cluster.gpus_per_node
        on = np.zeros((len(PARTS), rows * cols), dtype=np.int64)
        off = np.zeros_like(on)
        on[list(ROW_PARTS)], off[list(ROW_PARTS)] = _split(row_parts, row_peer, node)
        on[list(COL_PARTS)], off[list(COL_PARTS)] = _split(col_parts, col_peer, node)
        seconds = np.maximum(off / nic, on / link)
        for k, m in enumerate(seconds.argmax(1)):
            if seconds[k, m] > worst[k][0]:
                worst[k] = (float(seconds[k, m]), int(on[k, m]), int(off[k, m]))
    d, g_q = workload.dtype, "fp32" if plan.grad_reduce_dtype.dq_in_fp32 else workload.dtype
    g_kv = "fp32" if plan.grad_reduce_dtype.dkv_in_fp32 else workload.dtype
    names = {"Q": f"Q rows ({d})", "partial O, lse": f"partial O ({d}), lse (fp32) rows",
             "K,V": f"K,V rows ({d})", "Q,dO, lse,D": f"Q,dO ({d}), lse,D (fp32) rows",
             "dQ": f"dQ rows ({g_q})", "dK,dV": f"dK,dV rows ({g_kv})"}
    out = []
    if heads > 1:
        a2a = heads_bytes(shape, heads, cluster.gpus)
        heads_groups = dim_groups(range(cluster.gpus), rows, cols, heads)[2]
        out += all_to_all_pair(a2a, a2a, d, heads_groups, cluster)
    for (phase, group, tensors), (_, on_n, off_n) in zip(PARTS, worst):
        n = on_n + off_n
        out.append(PricedTransfer(phase, group, names[tensors], n, off_n > 0, False,
                                  off_node_share=off_n / n if n else 0.0,
                                  under_own_block=tensors in INBOUND))
    return out


def mask_estimate(workload: Workload, cluster: Cluster, mask: Mask, rows: int, cols: int,
                  heads: int = 1, overlap: bool = True) -> Estimate:
    """`mask` on a heads x rows x cols grid: the sparse exchange of its rows (the inbound
    ones under the least own block) plus the busiest mesh rank's pairs (`workload` gives
    the shape; the mask covers its seq_length, or its THD documents' padded total)."""
    seq = workload.seq_length if mask.documents is None else mask.documents.total
    counts = counts_of(mask, seq, rows, cols, heads)
    transfers = exchange_transfers(workload, cluster, counts, heads)
    block = pairs_of(mask, seq, rows, cols, heads)  # walked once for both
    busiest = max(mesh_totals(block, rows, cols))
    own = min(block[m, m] for m in range(rows * cols)) * pair_flops(workload, heads)
    fwd = busiest * pair_flops(workload, heads)
    label = f"mesh {rows}x{cols}" if heads == 1 else f"mesh {heads}x{rows}x{cols}"
    calls = None if cluster.gpu is None else mesh_calls(  # what a GPU profile prices
        workload, cluster.gpus, rows, cols, heads, blocks=max(
            mesh_totals({k: 1 for k, n in block.items() if n}, rows, cols)),
        backend=cluster.gpu.calls_backend)
    return price("mesh", label, transfers, workload, cluster, overlap, (rows, cols), heads,
                 flops={"forward": fwd, "backward": BACKWARD_FLOPS_RATIO * fwd},
                 own_block_flops={"forward": own, "backward": BACKWARD_FLOPS_RATIO * own},
                 calls=calls)
