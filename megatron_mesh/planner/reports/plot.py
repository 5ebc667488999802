"""Predicted speedup against GPU count (strong scaling: fixed sequence), over ring, or over
all_gather for a sliding-window layer (Transformer Engine's ring refuses windows): the
planner's choice (its heads x rows x cols grid), the best 2D mesh and the other methods."""
from __future__ import annotations

from typing import Any

from megatron_mesh.layer_plan import shape_text
from megatron_mesh.planner.search import Plan

CHOICE = "planner's choice"
SERIES = (CHOICE, "best 2D mesh", "all_gather", "a2a", "a2a+p2p")
INSTALL_HINT = "pip install 'megatron-mesh[plot]'  (or: pip install matplotlib)"
WHY_MISSING = {  # why a method has no point at some GPU counts
    "a2a": "needs the heads (per TP rank) divisible by the CP size",
    "a2a+p2p": "needs an A, 1 < A < CP size, dividing the CP size and the heads",
}


def gpu_counts(max_gpus: int, seq_length: int) -> list[int]:
    """Powers of two from 2 up to max_gpus, plus max_gpus, that the zigzag layout allows."""
    counts = {max_gpus}
    n = 2
    while n < max_gpus:
        counts.add(n)
        n *= 2
    return sorted(n for n in counts if n >= 2 and seq_length % (2 * n) == 0)


def speedup_series(plans: list[Plan]) -> dict[str, list[tuple[int, float]]]:
    """(CP size, speedup over the plans' reference) points per series, the reference itself
    left out; a2a points only where heads divide, none for a method that does not run."""
    reference = plans[-1].reference.method
    series: dict[str, list[tuple[int, float]]] = {name: [] for name in SERIES
                                                  if name != reference}
    for p in plans:
        n = p.cluster.gpus
        assert p.best_grid is not None
        series[CHOICE].append((n, p.speedup(p.best_grid)))
        series["best 2D mesh"].append((n, p.speedup(p.best_mesh)))
        for name in series.keys() - {CHOICE, "best 2D mesh"}:
            e = p.method(name)
            if e is not None:
                series[name].append((n, p.speedup(e)))
    return series


def legend_label(name: str, points: list[tuple[int, float]], plans: list[Plan],
                 tensor_parallel: int = 1) -> str:
    """The series' name, and where it has no point, at which GPU counts and why."""
    drawn = {n for n, _ in points}
    missing = [p.cluster.gpus * tensor_parallel for p in plans if p.cluster.gpus not in drawn]
    if not missing:
        return name
    if not drawn:
        reason = next((u.reason for u in plans[-1].unavailable if u.method == name), "")
        return f"{name}: not drawn" + (f" ({_short(reason)})" if reason else "")
    where = ", ".join(map(str, missing))
    return f"{name} (none at {where} GPUs: {WHY_MISSING.get(name, 'not applicable')})"


def _short(reason: str) -> str:
    """A refusal's first clause, for a legend."""
    return reason.split(";")[0]


def figure(plans: list[Plan], tensor_parallel: int = 1) -> Any:
    """The speedup plot of `plans` (one per CP size) as a matplotlib Figure; the x axis is
    GPUs (TP x CP), labelled with plain counts."""
    plt = _pyplot()
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    series = speedup_series(plans)
    last = plans[-1]
    tp = tensor_parallel
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, points in series.items():
        label = legend_label(name, points, plans, tp)
        xs, ys = zip(*points) if points else ((), ())
        style = dict(linewidth=2.4, zorder=3) if name == CHOICE else {}
        ax.plot([x * tp for x in xs], ys, marker="o", label=label, **style)
    for p in plans:
        g = p.best_grid
        assert g is not None and g.grid_shape is not None
        ax.annotate(shape_text(*g.grid_shape), (p.cluster.gpus * tp, p.speedup(g)),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    reference = last.reference.label
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--", label=reference)
    ax.set_xscale("log", base=2)
    ticks = [p.cluster.gpus * tp for p in plans]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FixedFormatter([str(n) for n in ticks]))
    ax.xaxis.set_minor_locator(NullLocator())
    per_node = f"{last.cluster.gpus_per_node * tp} per node"
    ax.set_xlabel(f"GPUs ({per_node})" if tp == 1 else f"GPUs (TP {tp} x CP, {per_node})")
    ax.set_ylabel(f"predicted attention speedup over {reference} (MODEL)")
    w = last.workload
    window = "" if w.window is None else f", window ({w.window.left}, {w.window.right})"
    heads = f"{w.num_heads}/{w.num_kv_heads} heads" + ("" if tp == 1 else " per TP rank")
    ax.set_title(
        f"S={w.seq_length}, {heads} x {w.head_dim}, {w.dtype}{window}, "
        f"{last.cluster.intra_node_bw:g}/{last.cluster.inter_node_bw:g} GB/s; labels: the "
        "choice's grid (AxRxC)", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def draw(plans: list[Plan], path: str, tensor_parallel: int = 1) -> None:
    """Write the speedup plot of `plans` to `path` (PNG, or whatever the suffix names)."""
    fig = figure(plans, tensor_parallel)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display), or RuntimeError saying what to
    install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(f"--plot needs matplotlib: {INSTALL_HINT}") from exc
    return plt
