"""The planner's verdict over a table of cases: heads x rows x cols against every method.

For each model (GPT-3 sizes, Llama-style GQA, MQA), CP size, sequence length and node size
it plans one attention layer and compares the chosen grid (`Plan.best_grid`) with ring,
all_gather, a2a, a2a+p2p and the best 2D mesh. All numbers come from the planner's model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from megatron_mesh.layer_plan import DEFAULT_GRAD_DTYPE
from megatron_mesh.planner.search import Plan, plan


@dataclass(frozen=True)
class Model:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


LLAMA_GQA = Model("Llama-style GQA 64/8", 64, 8, 128)
MQA = Model("MQA 32/1", 32, 1, 128)
CP_SIZES = (8, 16, 32, 64, 128, 256)
SEQ_LENGTHS = (32 * 1024, 128 * 1024, 1024 * 1024)
GPUS_PER_NODE = (1, 8)


def gpt3_models(config_dir: Path) -> list[Model]:
    """The GPT-3 sizes of `config_dir`/gpt3-*.yaml (heads and kv-channels), smallest first."""
    models = []
    for path in config_dir.glob("gpt3-*.yaml"):
        keys = dict(line.split(":", 1) for line in path.read_text().splitlines()
                    if ":" in line and not line.startswith("#"))
        heads = int(keys["num-attention-heads"])
        models.append(Model(path.stem, heads, heads, int(keys["kv-channels"])))
    return sorted(models, key=lambda m: m.num_heads * m.head_dim)


@dataclass(frozen=True)
class Verdict:
    """One case: the chosen grid against each other method (time over the choice's time)."""

    model: Model
    cp_size: int
    seq_length: int
    gpus_per_node: int
    plan: Plan

    @property
    def choice(self) -> tuple[int, int, int]:
        assert self.plan.best_grid is not None and self.plan.best_grid.grid_shape is not None
        return self.plan.best_grid.grid_shape

    def speedup_over(self, method: str) -> float | None:
        """Time of `method` ('ring', 'all_gather', 'a2a', 'a2a+p2p', 'mesh': the best 2D
        mesh) over the choice's; None when the method does not apply."""
        other = self.plan.best_mesh if method == "mesh" else self.plan.method(method)
        if other is None:
            return None
        assert self.plan.best_grid is not None
        return other.total_s / self.plan.best_grid.total_s


METHODS = ("ring", "all_gather", "a2a", "a2a+p2p", "mesh")


def verdicts(models: list[Model], grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE) -> list[Verdict]:
    """Plan every case of the table for `models` with the mesh's gradient dtype."""
    out = []
    for model in models:
        for p in CP_SIZES:
            for s in SEQ_LENGTHS:
                for node in GPUS_PER_NODE:
                    out.append(Verdict(model, p, s, node, plan(
                        p, seq_length=s, num_heads=model.num_heads,
                        num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                        gpus_per_node=node, mesh_grad_reduce_dtype=grad_reduce_dtype)))
    return out


def summary_table(rows: list[Verdict]) -> str:
    """Markdown: per model and node size, the choice's speedup over each method (least and
    geometric mean over CP sizes and sequence lengths) and how often the choice is a corner."""
    lines = ["| model | GPUs/node | " + " | ".join(f"vs {m} (min / geomean)" for m in METHODS)
             + " | choice: A=1 / R=P/A,C=1 / other |",
             "|---|---|" + "---|" * len(METHODS) + "---|"]
    keys = sorted({(v.model, v.gpus_per_node) for v in rows},
                  key=lambda k: (k[0].num_heads * k[0].head_dim, k[0].num_kv_heads, k[1]))
    for model, node in keys:
        mine = [v for v in rows if (v.model, v.gpus_per_node) == (model, node)]
        cells = []
        for m in METHODS:
            xs = [x for x in (v.speedup_over(m) for v in mine) if x is not None]
            cells.append(f"{min(xs):.2f}x / {math.exp(sum(map(math.log, xs)) / len(xs)):.2f}x"
                         if xs else "n/a")
        two_d = sum(v.choice[0] == 1 for v in mine)
        corner = sum(v.choice[0] > 1 and v.choice[2] == 1 for v in mine)
        cells.append(f"{two_d} / {corner} / {len(mine) - two_d - corner}")
        heads = f"{model.num_heads}/{model.num_kv_heads}x{model.head_dim}"
        lines.append(f"| {model.name} ({heads}) | {node} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
