"""Text table and JSON form of a `Plan`."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_mesh.planner.cost import Estimate
from megatron_mesh.planner.reports.flags import PLACEMENT_FLAG
from megatron_mesh.planner.search import Plan

MIB = 2**20
COLUMNS = (
    ("method", "<"), ("fwd MiB", ">"), ("bwd MiB", ">"), ("total MiB", ">"),
    ("inter-node MiB", ">"), ("comm ms", ">"), ("fwd ms", ">"), ("bwd ms", ">"),
    ("total ms", ">"), ("vs ring", ">"),
)


def reference_name(plan: Plan) -> str:
    """The method speedups are measured against: ring, or all_gather under a window."""
    return plan.reference.method


def _row(plan: Plan, e: Estimate) -> list[str]:
    mark = (" *" if e is plan.best_mesh else "") + (" +" if e is plan.best_grid else "")
    calls = [] if plan.cluster.gpu is None else [_calls_text(e)]
    return calls + [
        e.label + mark,
        f"{e.bytes('forward') / MIB:.1f}",
        f"{e.bytes('backward') / MIB:.1f}",
        f"{e.total_bytes / MIB:.1f}",
        f"{e.inter_node_bytes / MIB:.1f}",
        f"{e.total_comm_s * 1e3:.3f}",
        f"{e.time_s['forward'] * 1e3:.3f}",
        f"{e.time_s['backward'] * 1e3:.3f}",
        f"{e.total_s * 1e3:.3f}",
        f"{plan.speedup(e):.2f}x",
    ]


def format_table(plan: Plan, tensor_parallel: int = 1) -> str:
    """The whole report: configuration, chosen mesh and placement, and the method table;
    with `tensor_parallel` > 1 the plan's GPUs are CP ranks of that many GPUs each."""
    w, c = plan.workload, plan.cluster
    compute = plan.reference.compute_s
    overlap = ("on: hidden transfers run under compute" if plan.overlap
               else "off: compute + all transfers")
    ref = reference_name(plan)
    heads = [name for name, _ in COLUMNS[:-1]] + [f"vs {ref}"]
    columns = COLUMNS
    if c.gpu is not None:  # the calls a GPU profile prices, first
        heads, columns = ["calls"] + heads, (("calls", ">"),) + COLUMNS
    rows = [heads] + [_row(plan, e) for e in plan.estimates]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = [
        _cp_line(c.gpus, c.nodes, c.gpus_per_node, tensor_parallel),
        f"attention: S={w.seq_length}, batch {w.batch}, {w.num_heads} q / {w.num_kv_heads} kv "
        f"heads x {w.head_dim}, {w.dtype}, {'causal' if w.causal else 'full'}"
        + ("" if w.doc_lengths is None else f", {len(w.doc_lengths)} packed documents "
           f"(longest {max(w.doc_lengths)}: compute counts in-document pairs only)")
        + _window_text(w),
        f"links per GPU: intra-node {c.intra_node_bw:g} GB/s, inter-node {c.inter_node_bw:g} "
        f"GB/s; {c.attention_text}",
        f"compute per GPU{_compute_of(plan)}: forward {compute['forward'] * 1e3:.3f} ms, backward "
        f"{compute['backward'] * 1e3:.3f} ms; overlap {overlap}",
        "",
        f"best mesh: {plan.best_mesh.mesh_shape[0]} x {plan.best_mesh.mesh_shape[1]} "
        f"(rows x cols), {plan.best_mesh.total_s * 1e3:.3f} ms per layer, "
        f"{plan.speedup(plan.best_mesh):.2f}x over {ref}, "
        f"{1 - plan.best_mesh.total_bytes / plan.reference.total_bytes:.1%} less traffic than "
        f"{ref}",
        *("  " + line for line in plan.placement.describe().splitlines()),
        *_grid_lines(plan, ref),
        f"fastest overall: {plan.best.label}",
        "",
    ]
    for r in rows:
        lines.append("  ".join(
            f"{cell:{align}{width}}" for cell, (_, align), width in zip(r, columns, widths)
        ).rstrip())
    for u in plan.unavailable:
        lines.append(f"{u.method}: not applicable: {u.reason}")
    lines.append(("MODEL (planner predictions); " if w.window is not None or c.gpu is not None
                  else "")
                 + "per layer, per GPU; traffic = bytes each GPU sends; * = best 2D mesh; "
                 "+ = best heads x rows x cols (the choice)"
                 + ("" if c.gpu is None else "; calls = kernel calls per pass (forward/"
                    "backward) x query rows x heads of each, priced by the GPU profile"))
    return "\n".join(lines)


def _compute_of(plan: Plan) -> str:
    """Whose compute the table's compute line shows: the same for every method at a flat
    rate; the reference's (its kernel calls) under a GPU profile."""
    if plan.cluster.gpu is None:
        return ""
    return f" ({plan.reference.label}, calls {_calls_text(plan.reference)}; by method below)"


def _calls_text(e: Estimate) -> str:
    """'16/16 x 2048r x 8h': a rank's kernel calls per pass and the size of each."""
    k = e.calls
    if k is None:
        return "-"
    counts = f"{k.forward}" if k.forward == k.backward else f"{k.forward}/{k.backward}"
    return f"{counts} x {k.rows}r x {k.heads}h"


def _cp_line(cp: int, nodes: int, per_node: int, tp: int) -> str:
    """The table's first line: GPUs, or CP ranks of TP GPUs each."""
    if tp == 1:
        return f"context parallelism over {cp} GPUs ({nodes} node(s) x {per_node} GPUs)"
    return (f"context parallelism over {cp} CP ranks of {tp} GPUs each ({nodes} node(s) x "
            f"{per_node} CP ranks)")


def _window_text(w) -> str:
    """The sliding window and the share of the unwindowed layer's pairs it keeps."""
    if w.window is None:
        return ""
    full = w.seq_length * w.seq_length / (2 if w.causal else 1)
    if w.doc_lengths is not None:  # of the documents' pairs
        full = replace(w, window=None).pairs()
    kept = w.pairs()
    within = " in-document" if w.doc_lengths is not None else ""
    return (f", sliding window ({w.window.left}, {w.window.right}): {kept / full:.2%} of the "
            f"{'causal' if w.causal else 'full'}{within} pairs")


def _grid_lines(plan: Plan, ref: str) -> list[str]:
    """The heads x rows x cols choice and its placement, when it is not the 2D mesh."""
    g = plan.best_grid
    if g is None or g is plan.best_mesh or plan.grid_placement is None:
        return []
    a, r, c = g.grid_shape
    return [
        f"best heads x rows x cols: {a} x {r} x {c}, {g.total_s * 1e3:.3f} ms per layer, "
        f"{plan.speedup(g):.2f}x over {ref} (the choice)",
        *("  " + line for line in plan.grid_placement.describe().splitlines()),
    ]


def _estimate_dict(plan: Plan, e: Estimate) -> dict[str, Any]:
    return {
        "method": e.method,
        "label": e.label,
        "mesh_shape": list(e.mesh_shape) if e.mesh_shape else None,
        "grid_shape": list(e.grid_shape) if e.grid_shape else None,
        "bytes": {"forward": e.bytes("forward"), "backward": e.bytes("backward"),
                  "total": e.total_bytes, "inter_node": e.inter_node_bytes},
        "transfers": [
            {"phase": t.phase, "group": t.group, "tensors": t.tensors, "bytes": t.nbytes,
             "crosses_nodes": t.crosses_nodes, "off_node_share": t.off_node_share,
             "hidden": t.hidden}
            for t in e.transfers
        ],
        "calls": None if e.calls is None else vars(e.calls).copy(),
        "compute_s": dict(e.compute_s),
        "comm_s": dict(e.comm_s),
        "time_s": {**e.time_s, "total": e.total_s},
        f"speedup_over_{plan.reference.method}": plan.speedup(e),
    }


def _workload_dict(plan: Plan) -> dict[str, Any]:
    out = vars(plan.workload).copy()
    w = plan.workload.window
    out["window"] = None if w is None else [w.left, w.right]
    out["slices"] = None if plan.workload.slices is None else plan.workload.slices.text()
    return out


def _cluster_dict(plan: Plan) -> dict[str, Any]:
    """The cluster, its GPU profile as the name, whether measured and its line."""
    out = vars(plan.cluster).copy()
    g = plan.cluster.gpu
    out["gpu"] = None if g is None else {"name": g.name, "measured": g.measured,
                                         "backend": g.backend, "kernel": g.calls_backend,
                                         "describe": g.describe()}
    return out


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """Everything in the table, machine-readable."""
    pl = plan.placement
    return {
        "workload": _workload_dict(plan),
        "reference": plan.reference.method,
        "cluster": _cluster_dict(plan),
        "overlap": plan.overlap,
        "best_mesh": {
            "shape": list(plan.best_mesh.mesh_shape),
            "row_nodes": pl.row_nodes,
            "col_nodes": pl.col_nodes,
            "rows_inside_node": pl.rows_inside_node,
            "cols_inside_node": pl.cols_inside_node,
        },
        "best_grid": list(plan.best_grid.grid_shape) if plan.best_grid else None,
        "fastest": plan.best.label,
        "estimates": [_estimate_dict(plan, e) for e in plan.estimates],
        "unavailable": [{"method": u.method, "reason": u.reason} for u in plan.unavailable],
    }


def format_placed(plan: Plan, placed) -> str:
    """THD beside the document placement (`planner.placed.PlacedPlan`), per mesh shape and
    grid, with the compute floor; the placement is what the driver runs by default."""
    thd = {e.grid_shape: e for e in (*plan.meshes, *plan.grids)}
    best_thd = plan.best_grid
    best = placed.best
    floor = placed.floor_total_s
    heads = ("method", "THD MiB", "placed MiB", "THD inter MiB", "placed inter MiB",
             "THD ms", "placed ms", "THD/placed", "placed/floor")
    rows = [heads]
    for e in placed.estimates:
        t = thd[e.grid_shape]
        mark = (" +" if e is best else "") + (" t" if t is best_thd else "")
        rows.append((e.label + mark, f"{t.total_bytes / MIB:.1f}", f"{e.total_bytes / MIB:.1f}",
                     f"{t.inter_node_bytes / MIB:.1f}", f"{e.inter_node_bytes / MIB:.1f}",
                     f"{t.total_s * 1e3:.3f}", f"{e.total_s * 1e3:.3f}",
                     f"{t.total_s / e.total_s:.2f}x", f"{e.total_s / floor:.2f}x"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(heads))]
    lines = [
        "",
        "packed documents, THD layout (every document cut over all ranks: the bytes of one "
        "sequence) vs placed whole (place_documents, the sparse exchange of the documents "
        f"that span ranks); the driver runs the placement with --reset-attention-mask "
        f"({PLACEMENT_FLAG} by default)",
        "  " + placed.placement.summary(),
        f"compute floor (MODEL: busiest rank's in-document FLOPs): forward "
        f"{placed.floor_s['forward'] * 1e3:.3f} ms, backward "
        f"{placed.floor_s['backward'] * 1e3:.3f} ms, total {floor * 1e3:.3f} ms",
        f"best placed (MODEL): {best.label}, {best.total_s * 1e3:.3f} ms per layer, "
        f"{best_thd.total_s / best.total_s:.2f}x faster than THD's best ({best_thd.label}, "
        f"{best_thd.total_s * 1e3:.3f} ms), {best.total_s / floor:.2f}x the floor",
        "",
    ]
    for r in rows:
        lines.append("  ".join(f"{cell:{'<' if i == 0 else '>'}{w}}"
                               for i, (cell, w) in enumerate(zip(r, widths))).rstrip())
    lines.append("MODEL (planner predictions), per layer, per GPU; MiB = bytes each GPU sends "
                 "(the rank slowest at each exchange); placed: the rows received run under the "
                 "least own block, the rest exposed, compute of the busiest rank; + = best "
                 "placed (the choice), t = THD's best")
    return "\n".join(lines)


def placed_to_dict(plan: Plan, placed) -> dict[str, Any]:
    """The placement's rows of `format_placed`, machine-readable."""
    return {
        "summary": placed.placement.summary(),
        "floor_s": {**placed.floor_s, "total": placed.floor_total_s},
        "best": placed.best.label,
        "best_grid": list(placed.best.grid_shape),
        "thd_best": plan.best_grid.label,
        "estimates": [_estimate_dict(plan, e) for e in placed.estimates],
    }
