"""The planner's verdict over the table of cases in docs/planner.md (model numbers).

    python scripts/planner_verdict.py [--grad-reduce-dtype fp32|input]

GPT-3 sizes from configs/, Llama-style GQA 64/8 and MQA 32/1; CP 8 ... 256; S = 32K, 128K,
1M tokens; 1 and 8 GPUs per node. Prints, per model and node size, how much faster the
planner's heads x rows x cols choice is predicted than ring, all_gather, a2a, a2a+p2p and
the best 2D mesh (least and geometric mean over the cases), and what kind of shape it picks.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from megatron_mesh.layer_plan import DEFAULT_GRAD_DTYPE, GRAD_DTYPE_NAMES
from megatron_mesh.planner.reports.verdict import LLAMA_GQA, MQA, gpt3_models, summary_table, verdicts

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grad-reduce-dtype", choices=GRAD_DTYPE_NAMES, default=DEFAULT_GRAD_DTYPE,
                   help="dtypes of the mesh's dQ and dK, dV exchanges (default %(default)s)")
    args = p.parse_args()
    rows = verdicts(gpt3_models(CONFIGS) + [LLAMA_GQA, MQA], args.grad_reduce_dtype)
    print(f"planner model, bf16, causal, batch 1, mesh gradients in {args.grad_reduce_dtype}: "
          "time of each method / time of the heads x rows x cols choice")
    print(summary_table(rows))
    slower = [v for v in rows if any((v.speedup_over(m) or 2.0) < 1 - 1e-9
                                     for m in ("ring", "all_gather", "a2a", "a2a+p2p", "mesh"))]
    print(f"{len(rows)} cases; the choice is predicted slower than some method in {len(slower)}")


if __name__ == "__main__":
    main()
