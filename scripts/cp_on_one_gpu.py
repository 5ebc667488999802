"""The mesh trained on one GPU: CP = 4 (a 2x2 mesh and a 2x1x2 heads x rows x cols grid)
against CP = 1, in bf16, with every rank on the one GPU (--mesh-host-staged-collectives).

Four driver jobs started together (torchrun each): CP = 1 in the dtype and in fp32, and the
two CP = 4 grids in the dtype; the same model, data (arithmetic token sequences written
here as a Megatron indexed dataset), seed and iterations. The bound, at every iteration i:

    |L_cp4(i) - L_cp1(i)| <= 2 * max_{j <= i} |L_cp1(j) - L_cp1_fp32(j)| + 2^-8 * L_cp1(i)

CP = 4 sums the attention in another order than CP = 1, as bf16 rounds it differently than
fp32: it may move the loss from CP = 1 by twice what bf16 itself has moved it from fp32 so
far, plus one bf16 ulp of the loss. Prints the losses and the verdict; --json writes them.
Exits 0 within the bound, 1 beyond it or when a job fails, 2 on bad flags.

    python scripts/cp_on_one_gpu.py --json cp.json          # on a GPU: bf16, 20 iterations
    python scripts/cp_on_one_gpu.py --dtype fp32 --layers 2 --hidden 64 --heads 4 --seq 64 \\
        --iters 3                                            # smoke run on a CPU (gloo)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.]+E[+-]\d+) \|")
BF16_ULP = 2.0 ** -8
GRIDS = {"cp4 2x2": "2x2", "cp4 2x1x2": "2x1x2"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2, help="micro-batch = global batch")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="of CP = 1 and CP = 4 (fp32 for a CPU smoke run)")
    p.add_argument("--timeout", type=float, default=240, help="seconds for all four jobs")
    p.add_argument("--json", default=None, help="write the losses and the verdict here")
    args = p.parse_args(argv)
    for name in ("layers", "hidden", "heads", "seq", "batch", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)} must be a positive integer")
    if args.heads % 2 or args.hidden % args.heads:
        p.error(f"--heads {args.heads} must be even (the 2x1x2 grid splits them in two) and "
                f"divide --hidden {args.hidden}")
    if args.seq % 8:
        p.error(f"--seq {args.seq} must be a multiple of 8 (2 zigzag halves on each of 4 ranks)")
    return args


def write_data(prefix: str, tokens: int, vocab: int) -> None:
    """Arithmetic sequences (learnable), about `tokens` tokens, as a Megatron indexed dataset."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    rng = np.random.default_rng(0)
    written = 0
    while written < tokens:
        start, step, n = rng.integers(0, vocab), rng.integers(1, 4), rng.integers(40, 400)
        builder.add_document((start + step * np.arange(n)) % vocab, [int(n)])
        written += int(n)
    builder.finalize(prefix + ".idx")


def job_commands(args: argparse.Namespace, data: str, cache: str) -> dict[str, list[str]]:
    """The four jobs' command lines (torchrun on this machine), by name."""
    common = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
              "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
              "--max-position-embeddings", str(args.seq), "--micro-batch-size", str(args.batch),
              "--global-batch-size", str(args.batch), "--train-iters", str(args.iters),
              "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "2", "--log-interval", "1",
              "--eval-iters", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
              "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
              "--data-path", data, "--data-cache-path", cache, "--split", "100,0,0"]
    low = ["--bf16"] if args.dtype == "bf16" else []

    def torchrun(nproc: int, *flags: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(nproc), "-m", "megatron_mesh.pretrain_gpt", *common,
                *flags]

    jobs = {"cp1": torchrun(1, *low), "cp1 fp32": torchrun(1)}
    for name, shape in GRIDS.items():
        jobs[name] = torchrun(4, *low, "--context-parallel-size", "4", "--context-parallel-algo",
                              "mesh", "--mesh-shape", shape, "--mesh-host-staged-collectives")
    return jobs


def losses(output: str) -> dict[int, float]:
    """Iteration -> lm loss, from the driver's log lines."""
    return {int(m[1]): float(m[2]) for m in LOSS.finditer(output)}


def compare(runs: dict[str, dict[int, float]], iters: int) -> dict:
    """The verdict on the losses of each run (by name: 'cp1', 'cp1 fp32' and the CP = 4
    grids): per grid, the largest |L_cp4 - L_cp1| over the bound (module doc) and the
    iterations beyond it; a run missing an iteration fails."""
    want = list(range(1, iters + 1))
    missing = {name: [i for i in want if i not in got] for name, got in runs.items()}
    verdict: dict = {"pass": not any(missing.values()),
                     "missing": {n: m for n, m in missing.items() if m}, "grids": {}}
    if verdict["missing"]:
        return verdict
    ref, wide = runs["cp1"], runs["cp1 fp32"]
    drift, bound = 0.0, {}
    for i in want:
        drift = max(drift, abs(ref[i] - wide[i]))
        bound[i] = 2 * drift + BF16_ULP * abs(ref[i])
    for name in GRIDS:
        diff = {i: abs(runs[name][i] - ref[i]) for i in want}
        beyond = [i for i in want if diff[i] > bound[i]]
        verdict["grids"][name] = {"max_diff": max(diff.values()),
                                  "max_ratio": max(diff[i] / bound[i] for i in want),
                                  "beyond": beyond}
        verdict["pass"] = verdict["pass"] and not beyond
    verdict["bound"] = [bound[i] for i in want]
    return verdict


def run_jobs(jobs: dict[str, list[str]], timeout: float, folder: Path) -> dict[str, dict]:
    """Start every job at once, wait for all (killing what is left after `timeout`); each
    job's exit status, seconds and output."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    started, procs = time.monotonic(), {}
    for name, cmd in jobs.items():
        log = open(folder / f"{name.replace(' ', '_')}.log", "w")
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                        stderr=subprocess.STDOUT), log)
    results = {}
    for name, (proc, log) in procs.items():
        try:
            rc = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log.close()
        results[name] = {"rc": rc, "seconds": round(time.monotonic() - started, 1),
                         "output": Path(log.name).read_text()}
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    where = (f"{torch.cuda.get_device_name(0)}, every rank on it" if torch.cuda.is_available()
             else "CPU (gloo; not a GPU check)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_data(str(folder / "arith"), 4 * args.iters * args.batch * args.seq, 255)
        jobs = job_commands(args, str(folder / "arith"), str(folder / "cache"))
        results = run_jobs(jobs, args.timeout, folder)
    runs = {name: losses(r["output"]) for name, r in results.items()}
    verdict = compare(runs, args.iters)
    failed = {name: r for name, r in results.items() if r["rc"] != 0}
    verdict["pass"] = verdict["pass"] and not failed
    print(f"CP = 4 on one device ({where}) against CP = 1, {args.dtype}, {args.iters} "
          f"iterations: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
          f"seq {args.seq}, micro-batch {args.batch}")
    print(f"{'iter':>5} " + " ".join(f"{name:>12}" for name in jobs) + f" {'bound':>10}")
    for i in range(1, args.iters + 1):
        row = " ".join(f"{runs[n][i]:12.6f}" if i in runs[n] else f"{'-':>12}" for n in jobs)
        bound = verdict.get("bound")
        print(f"{i:>5} {row} {bound[i - 1] if bound else float('nan'):10.2e}")
    for name, g in verdict["grids"].items():
        print(f"{name}: max |L - L_cp1| {g['max_diff']:.3e}, at most {g['max_ratio']:.2f} of the "
              f"bound" + (f"; beyond it at iterations {g['beyond']}" if g["beyond"] else ""))
    for name, r in failed.items():
        print(f"{name}: exit {r['rc']} after {r['seconds']} s:\n{r['output'][-2000:]}")
    if verdict["missing"]:
        print(f"iterations missing from the logs: {verdict['missing']}")
    print("CP on one device:", "pass" if verdict["pass"] else "FAIL")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": where, "config": vars(args), "losses": runs, "verdict": verdict,
            "jobs": {n: {"rc": r["rc"], "seconds": r["seconds"]} for n, r in results.items()}},
            indent=1))
    return 0 if verdict["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
