"""A model of mixed layers: sliding-window layers and global (full attention) layers.

Megatron-Core's `window_attn_skip_freq` N makes layer n (1-indexed) global when n % N == 0
and windowed otherwise: N - 1 windowed layers, then one global
(`transformer.utils.is_layer_window_attention`); without it every layer is windowed. The
model's attention time is the sum over its layers of each kind's per-layer time. Megatron
takes `cp_comm_type` per layer, so Transformer Engine's best is the best method per layer
kind; the mesh's process groups are built once, so the mesh runs one grid (A, R, C) for
every layer, the one with the least summed time.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_mesh.layer_plan import check_positive_int
from megatron_mesh.planner.cost import Estimate
from megatron_mesh.planner.search import Plan, grid_key

TE_METHODS = ("ring", "all_gather", "a2a", "a2a+p2p")  # Transformer Engine's cp_comm_types


@dataclass(frozen=True)
class LayerMix:
    """`num_layers` layers; with `skip_freq` N every N-th layer (n % N == 0) is global."""

    num_layers: int
    skip_freq: int | None = None

    def __post_init__(self) -> None:
        check_positive_int("num_layers", self.num_layers)
        if self.skip_freq is not None:
            check_positive_int("window_attn_skip_freq", self.skip_freq)

    def is_windowed(self, layer_number: int) -> bool:
        """Megatron-Core's rule for 1-indexed `layer_number`."""
        return self.skip_freq is None or layer_number % self.skip_freq != 0

    @property
    def full(self) -> int:
        """Global (full attention) layers."""
        return 0 if self.skip_freq is None else self.num_layers // self.skip_freq

    @property
    def windowed(self) -> int:
        return self.num_layers - self.full


@dataclass(frozen=True)
class KindVerdict:
    """One layer kind: its fastest method and Transformer Engine's fastest (None: none)."""

    kind: str
    layers: int
    best: Estimate
    te_best: Estimate | None


@dataclass(frozen=True)
class ModelPlan:
    """The windowed layer's plan and, when the model has global layers, the global one's
    (the same workload without the window), weighted by their layer counts."""

    layers: LayerMix
    windowed: Plan
    full: Plan | None

    def kinds(self) -> list[tuple[str, int, Plan]]:
        """(kind, layers, plan) of each kind the model has."""
        out = [("windowed", self.layers.windowed, self.windowed)]
        if self.full is not None and self.layers.full:
            out.append(("global", self.layers.full, self.full))
        return [k for k in out if k[1] > 0]

    def method_s(self, name: str) -> float | None:
        """Seconds of all layers' attention with one method everywhere; None when some
        layer kind cannot run it."""
        total = 0.0
        for _, n, plan in self.kinds():
            e = plan.method(name)
            if e is None:
                return None
            total += n * e.total_s
        return total

    def te_best_s(self) -> float | None:
        """Transformer Engine's best method per layer kind (cp_comm_type per layer)."""
        verdicts = self.verdicts()
        if any(v.te_best is None for v in verdicts):
            return None
        return sum(v.layers * v.te_best.total_s for v in verdicts)

    def grid_s(self, grid_shape: tuple[int, int, int]) -> float:
        """Seconds of all layers' attention on one mesh grid (A, R, C)."""
        return sum(n * grid_estimate(plan, grid_shape).total_s for _, n, plan in self.kinds())

    @property
    def best_grid(self) -> tuple[int, int, int]:
        """The grid with the least summed time (ties as `search.grid_key`, by the windowed
        layer's estimate)."""
        shapes = [e.grid_shape for e in (*self.windowed.meshes, *self.windowed.grids)]
        return min(shapes, key=lambda g: (self.grid_s(g), *grid_key(grid_estimate(self.windowed, g))[1:]))

    def verdicts(self) -> list[KindVerdict]:
        """Per layer kind: the fastest of every method and Transformer Engine's fastest."""
        out = []
        for kind, n, plan in self.kinds():
            te = [e for e in (plan.method(m) for m in TE_METHODS) if e is not None]
            out.append(KindVerdict(kind, n, plan.best,
                                   min(te, key=lambda e: e.total_s) if te else None))
        return out


def grid_estimate(plan: Plan, grid_shape: tuple[int, int, int]) -> Estimate:
    """The estimate of the mesh grid (A, R, C) in `plan`."""
    return next(e for e in (*plan.meshes, *plan.grids) if e.grid_shape == grid_shape)


def model_plan(windowed: Plan, full: Plan | None, layers: LayerMix) -> ModelPlan:
    """Check that the two plans describe one model's layers and combine them."""
    if windowed.workload.window is None:
        raise ValueError("the windowed layers' plan has no window")
    if layers.full and full is None:
        raise ValueError(f"{layers.full} global layers need the global layers' plan")
    if full is not None and (full.workload.window is not None or full.cluster != windowed.cluster):
        raise ValueError("the global layers' plan must be the same cluster without a window")
    return ModelPlan(layers, windowed, full)
