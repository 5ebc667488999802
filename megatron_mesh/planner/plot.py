"""Predicted speedup against GPU count (strong scaling: fixed sequence), over ring, or over
all_gather for a sliding-window layer (Transformer Engine's ring refuses windows)."""
from __future__ import annotations

from megatron_mesh.planner.search import Plan

SERIES = ("best mesh", "all_gather", "a2a", "a2a+p2p")
INSTALL_HINT = "pip install 'megatron-mesh[plot]'  (or: pip install matplotlib)"


def gpu_counts(max_gpus: int, seq_length: int) -> list[int]:
    """Powers of two from 2 up to max_gpus, plus max_gpus, that the zigzag layout allows."""
    counts = {max_gpus}
    n = 2
    while n < max_gpus:
        counts.add(n)
        n *= 2
    return sorted(n for n in counts if n >= 2 and seq_length % (2 * n) == 0)


def speedup_series(plans: list[Plan]) -> dict[str, list[tuple[int, float]]]:
    """(GPUs, speedup over the plans' reference) points per series, the reference itself
    left out; a2a points only where heads divide, none for a method that does not run."""
    reference = plans[-1].reference.method
    series: dict[str, list[tuple[int, float]]] = {name: [] for name in SERIES
                                                  if name != reference}
    for p in plans:
        n = p.cluster.gpus
        series["best mesh"].append((n, p.speedup(p.best_mesh)))
        for name in series.keys() - {"best mesh"}:
            e = p.method(name)
            if e is not None:
                series[name].append((n, p.speedup(e)))
    return series


def draw(plans: list[Plan], path: str) -> None:
    """Write the speedup plot of `plans` to `path` (PNG, or whatever the suffix names)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(f"--plot needs matplotlib: {INSTALL_HINT}") from exc
    series = speedup_series(plans)
    last = plans[-1]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=name)
    reference = last.reference.label
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--", label=reference)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"GPUs ({last.cluster.gpus_per_node} per node)")
    ax.set_ylabel(f"predicted attention speedup over {reference} (MODEL)")
    w = last.workload
    window = "" if w.window is None else f", window ({w.window.left}, {w.window.right})"
    ax.set_title(
        f"S={w.seq_length}, {w.num_heads}/{w.num_kv_heads} heads x {w.head_dim}, {w.dtype}"
        f"{window}, {last.cluster.intra_node_bw:g}/{last.cluster.inter_node_bw:g} GB/s",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
