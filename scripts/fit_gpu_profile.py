"""Fit a GPU's kernel-time profile to `bench_tiles.py --json` rows and print its residuals.

    python scripts/fit_gpu_profile.py megatron_mesh/planner/profiles/h200-tiles.jsonl \\
        --out megatron_mesh/planner/profiles/h200.json \\
        --versions torch=2.11.0+cu130,cudnn=9.19,triton=3.6 --date 2026-11-27

The model and the fit: `megatron_mesh.planner.gpu_profile`, `megatron_mesh.planner.profile_fit`.
Prints, per row, the fitted against the measured single-call and tile times (relative error,
fit / measured - 1), then the worst; writes the profile (JSON) to --out, with the machine (the
rows' device), the versions (--versions, else those the rows carry, else this machine's torch
when it has CUDA, else "unknown"), the date (--date, else one in the file's name, else today)
and the source. The stored bound `max_rel_error` is the worst residual rounded up to 5%.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import sys

from megatron_mesh.planner.gpu_profile import GpuProfile, profile_to_dict
from megatron_mesh.planner.profile_fit import fit_rows, residuals

# fp16 runs at bf16's tensor rate; fp32 (torch's memory-efficient op, no tensor cores) at
# the data-sheet ratio of dense FP32 to dense BF16 tensor FLOP/s on H100 / H200 SXM: 67 / 989
DTYPE_RATE = {"bf16": 1.0, "fp16": 1.0, "fp32": round(67 / 989, 4)}
VERSION_KEYS = ("torch", "cudnn", "triton")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tiles", metavar="TILES_JSONL", nargs="+",
                   help="bench_tiles.py --json rows (several files: their rows together)")
    p.add_argument("--out", help="write the profile (JSON) here")
    p.add_argument("--name", help="profile name (default: from the device, e.g. h200)")
    p.add_argument("--backend", help="backend the planner prices (default: cudnn if measured, "
                   "else the first)")
    p.add_argument("--versions", help="k=v,... (e.g. torch=2.11.0+cu130,cudnn=9.19,triton=3.6)")
    p.add_argument("--date", help="YYYY-MM-DD of the measurement")
    p.add_argument("--source", help="where the rows come from (default: the file's name)")
    p.add_argument("--note", default="", help="a line printed with the profile")
    return p.parse_args(argv)


def read_rows(parser_error, path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError as exc:
        parser_error(f"TILES_JSONL {path}: {exc.strerror}")
    except json.JSONDecodeError as exc:
        parser_error(f"TILES_JSONL {path}: not one JSON object a line ({exc.msg}, line {exc.lineno})")
    return []


def versions(args: argparse.Namespace, rows: list[dict], error) -> dict[str, str]:
    if args.versions:
        pairs = [kv.split("=", 1) for kv in args.versions.split(",")]
        if any(len(kv) != 2 or not kv[0] for kv in pairs):
            error(f"--versions {args.versions!r}: give k=v,... (e.g. torch=2.11.0,cudnn=9.19)")
        return dict(pairs)
    if all(k in rows[0] for k in VERSION_KEYS):
        return {k: str(rows[0][k]) for k in VERSION_KEYS}
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        import importlib.metadata as md
        try:
            triton = md.version("triton")
        except md.PackageNotFoundError:
            triton = "none"
        return {"torch": torch.__version__, "cudnn": str(torch.backends.cudnn.version()),
                "triton": triton}
    return {k: "unknown" for k in VERSION_KEYS}


def default_name(device: str) -> str:
    found = re.search(r"\b([ABHL]\d{2,3}|GB?\d{3})\b", device)
    return (found.group(1) if found else re.sub(r"\W+", "-", device)).lower()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prog = os.path.basename(sys.argv[0])

    def error(message: str) -> None:
        print(f"{prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

    rows = [row for path in args.tiles for row in read_rows(error, path)]
    named = " + ".join(os.path.basename(path) for path in args.tiles)
    try:
        fits = fit_rows(rows)
    except ValueError as exc:
        error(f"TILES_JSONL {named}: {exc}")
    backends = list(dict.fromkeys(b for b, _, _ in fits))
    backend = args.backend or ("cudnn" if "cudnn" in backends else backends[0])
    if backend not in backends:
        error(f"--backend {backend}: the rows measure {', '.join(backends)}")
    date = args.date or (re.search(r"\d{4}-\d{2}-\d{2}", os.path.basename(args.tiles[0])) or
                         [datetime.date.today().isoformat()])[0]
    res = residuals(fits, rows)
    worst = max(r.worst for r in res)
    device = rows[0]["device"]
    profile = GpuProfile(
        name=args.name or default_name(device), machine=device,
        versions=tuple(versions(args, rows, error).items()), date=date,
        source=args.source or named, measured=True, note=args.note,
        backend=backend, dtype_rate=tuple(DTYPE_RATE.items()), fits=fits,
        max_rel_error=math.ceil(worst * 20 - 1e-9) / 20)
    print(profile.describe())
    print(f"{'backend':>7} {'pass':>8} {'heads':>5} {'chunk':>6} {'single':>8} {'tile':>8}")
    for r in res:
        print(f"{r.backend:>7} {r.phase:>8} {f'{r.heads}/{r.kv_heads}':>5} {r.chunk:>6} "
              f"{100 * r.single:+7.1f}% {100 * r.tile:+7.1f}%")
    print("fit / measured - 1 per row (single call, tile); rms "
          f"{100 * (sum(r.single ** 2 + r.tile ** 2 for r in res) / (2 * len(res))) ** 0.5:.1f}%, "
          f"worst {100 * worst:.1f}%: stored bound {100 * profile.max_rel_error:.0f}%")
    for b, phase, fit in fits:
        print(f"{b:>7} {phase:>8}: latency {fit.latency_s * 1e6:.1f} us, {fit.tflops:.0f} TFLOP/s, "
              f"fill {fit.fill_units:.0f} units, host {fit.host_s * 1e6:.1f} us, merge "
              f"{fit.merge_s * 1e6:.1f} us per call")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(profile_to_dict(profile), f, indent=2)
            f.write("\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
