"""Text and JSON of a `ModelPlan`: each method per layer kind and summed over the model."""
from __future__ import annotations

from typing import Any

from megatron_mesh.planner.pricing.layers import TE_METHODS, ModelPlan, grid_estimate
from megatron_mesh.planner.reports.report import plan_to_dict


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3f}"


def _rows(mp: ModelPlan) -> list[tuple[str, list[float | None], float | None]]:
    """(label, per-kind seconds per layer, model seconds) of each TE method, TE's best per
    layer kind and the mesh on its one grid."""
    kinds = mp.kinds()
    rows = []
    for name in TE_METHODS:
        found = [plan.method(name) for _, _, plan in kinds]
        label = next((e.label for e in found if e is not None), name)
        rows.append((label, [None if e is None else e.total_s for e in found],
                     mp.method_s(name)))
    te = mp.verdicts()
    rows.append(("TE best per layer kind",
                 [None if v.te_best is None else v.te_best.total_s for v in te], mp.te_best_s()))
    g = mp.best_grid
    rows.append((f"{grid_estimate(mp.windowed, g).label} (one grid) +",
                 [grid_estimate(plan, g).total_s for _, _, plan in kinds], mp.grid_s(g)))
    return rows


def format_model(mp: ModelPlan) -> str:
    """The whole model's table and the verdict per layer kind and for the model."""
    w = mp.windowed.workload.window
    mix = mp.layers
    kinds = mp.kinds()
    te_total = mp.te_best_s()
    head = [f"{kind} ms/layer" for kind, _, _ in kinds]
    table = [["method", *head, "model ms", "vs TE best"]]
    for label, per_kind, total in _rows(mp):
        vs = "-" if total is None or te_total is None else f"{te_total / total:.2f}x"
        table.append([label, *map(_ms, per_kind), _ms(total), vs])
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    freq = ("" if mix.skip_freq is None else
            f" (window_attn_skip_freq {mix.skip_freq}: layer n is global when n % "
            f"{mix.skip_freq} == 0)")
    lines = [
        f"whole model (MODEL): {mix.num_layers} layers = {mix.windowed} windowed, window "
        f"({w.left}, {w.right}) + {mix.full} global{freq}",
        "attention forward + backward per GPU; model ms = sum over the layers",
    ]
    for r in table:
        lines.append("  ".join(cell.ljust(n) if i == 0 else cell.rjust(n)
                               for i, (cell, n) in enumerate(zip(r, widths))).rstrip())
    lines.append(verdict_line(mp))
    lines.append("MODEL: planner predictions; + = the mesh's grid for every layer (its groups "
                 "are built once); TE best per layer kind = Megatron's cp_comm_type per layer")
    return "\n".join(lines)


def verdict_line(mp: ModelPlan) -> str:
    """'verdict (MODEL): <kind>: fastest ...; whole model: ...'."""
    parts = []
    for v in mp.verdicts():
        if v.te_best is None:
            parts.append(f"{v.kind} layers: fastest {v.best.label} (no Transformer Engine "
                         "method runs them)")
        else:
            parts.append(f"{v.kind} layers: fastest {v.best.label}, "
                         f"{v.te_best.total_s / v.best.total_s:.2f}x over TE's best "
                         f"({v.te_best.label})")
    g, te = mp.best_grid, mp.te_best_s()
    grid_s = mp.grid_s(g)
    mesh = f"{grid_estimate(mp.windowed, g).label} on every layer {grid_s * 1e3:.3f} ms"
    if te is None:
        parts.append(f"whole model: {mesh}")
    else:
        winner = "the mesh" if grid_s < te else "TE's best per layer kind"
        parts.append(f"whole model: {mesh}, TE's best per layer kind {te * 1e3:.3f} ms "
                     f"({te / grid_s:.2f}x): {winner} is faster")
    return "verdict (MODEL): " + "; ".join(parts)


def model_to_dict(mp: ModelPlan) -> dict[str, Any]:
    """Everything in the model's table, machine-readable, with both layer plans."""
    kinds = mp.kinds()
    return {
        "layers": {"num_layers": mp.layers.num_layers, "window_attn_skip_freq":
                   mp.layers.skip_freq, "windowed": mp.layers.windowed,
                   "global": mp.layers.full},
        "windowed": plan_to_dict(mp.windowed),
        "global": None if mp.full is None else plan_to_dict(mp.full),
        "model": [{"method": label,
                   "seconds_per_layer": {k: s for (k, _, _), s in zip(kinds, per_kind)},
                   "model_s": total} for label, per_kind, total in _rows(mp)],
        "best_grid": list(mp.best_grid),
        "verdict": verdict_line(mp),
    }
