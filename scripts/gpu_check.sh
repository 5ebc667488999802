#!/usr/bin/env bash
# Checks megatron-mesh on a machine with one CUDA GPU, in one command:
#   scripts/gpu_check.sh [OUT_DIR]        (default gpu_check_out/)
# Uses what is installed (CUDA torch, megatron-core, maybe Transformer Engine, maybe
# transformers), says what is missing, and installs transformers only when a package index
# answers. Steps, each under 10 minutes: the `gpu` tests (with the memory table), the tile
# efficiency bench (2K / 4K / 8K tokens per chunk, bf16, every backend), the driver against
# Hugging Face GPT-2. Writes OUT_DIR/gpu_check.json and prints a short table.
# Without a CUDA GPU it says so and exits 0.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-gpu_check_out}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing to check"
    exit 0
fi
mkdir -p "$OUT"
rm -f "$OUT"/*.jsonl "$OUT"/*.json "$OUT"/*.log

"$PY" - > "$OUT/machine.json" <<'PYEOF'
import importlib.metadata as md, json, torch
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
print(json.dumps({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                  "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                  "transformer_engine": version("transformer_engine") or version("transformer-engine"),
                  "megatron_core": version("megatron-core"), "transformers": version("transformers")}))
PYEOF
cat "$OUT/machine.json"

if ! "$PY" -c 'import transformers' 2>/dev/null; then
    if timeout 30 "$PY" -m pip download --no-deps -q -d "$OUT/.probe" transformers >/dev/null 2>&1; then
        echo "gpu_check: installing transformers (the GPT-2 comparison needs it)"
        timeout 300 "$PY" -m pip install -q transformers || echo "gpu_check: installing transformers failed"
    else
        echo "gpu_check: transformers is missing and no package index answers: the GPT-2 comparison is skipped"
    fi
    rm -rf "$OUT/.probe"
fi
"$PY" -c 'import transformer_engine' 2>/dev/null \
    || echo "gpu_check: Transformer Engine is missing: its kernel tests and bench rows are skipped"

step() {  # step NAME COMMAND...: runs it (10 minutes at most), logs to OUT/NAME.log
    local name=$1; shift
    echo "gpu_check: $name: $*"
    local start=$SECONDS
    timeout 600 "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start))}" >> "$OUT/steps.jsonl"
    tail -n 25 "$OUT/$name.log"
}

MESH_GPU_MEMORY_REPORT="$OUT/memory.jsonl" step gpu_tests "$PY" -m pytest -q -m gpu \
    tests/test_kernels.py tests/test_kernels_te.py tests/test_host_staging.py
step tiles_mha "$PY" scripts/bench_tiles.py --chunk 2048,4096,8192 --cp-size 8 --heads 16 \
    --head-dim 128 --dtype bf16 --json "$OUT/tiles.jsonl"
step tiles_gqa "$PY" scripts/bench_tiles.py --chunk 8192 --cp-size 8 --heads 32 --kv-heads 8 \
    --head-dim 128 --dtype bf16 --json "$OUT/tiles.jsonl"
if "$PY" -c 'import transformers' 2>/dev/null; then
    step driver_vs_hf "$PY" scripts/compare_hf_gpt2.py --json "$OUT/driver_vs_hf.json"
fi

"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
lines = lambda name: [json.loads(l) for l in (out / name).read_text().splitlines()] \
    if (out / name).exists() else []
report = {"machine": json.loads((out / "machine.json").read_text()), "steps": lines("steps.jsonl"),
          "tiles": lines("tiles.jsonl"), "memory": lines("memory.jsonl"),
          "driver_vs_hf": json.loads((out / "driver_vs_hf.json").read_text())
          if (out / "driver_vs_hf.json").exists() else None,
          "cp_on_one_gpu": "not run: the driver does not yet run several ranks on one GPU"}
(out / "gpu_check.json").write_text(json.dumps(report, indent=1))
print("\nsteps:", ", ".join(f"{s['step']} rc={s['rc']} ({s['seconds']} s)" for s in report["steps"]))
print("tile efficiency (fwd+bwd, single fused call time / tile time):")
for r in report["tiles"]:
    if r["pass"] == "fwd+bwd":
        print(f"  {r['backend']:>6} heads {r['heads']}/{r['kv_heads']} chunk {r['chunk']:>5}: "
              f"{100 * r['efficiency']:5.1f}%  tile peak {r['tile_peak_bytes'] / 2**20:.0f} MiB")
worst = {}
for r in report["memory"]:
    key = (r["shape"], r["schedule"])
    worst[key] = (max(worst.get(key, (0,))[0], r["measured_bytes"]), r["model_bytes"])
if worst:
    print("extra memory per rank, S=8192 bf16 16x128 heads (measured CUDA peak / model MiB):")
    for (shape, sch), (m, mod) in sorted(worst.items()):
        print(f"  {shape} {sch:>12}: {m / 2**20:8.1f} / {mod / 2**20:8.1f}")
if report["driver_vs_hf"]:
    for name, r in report["driver_vs_hf"]["results"].items():
        print(f"  {name:>32}: {r['tokens_per_s']:10.1f} tokens/s, {r['peak_memory_mib']:9.1f} MiB")
print(f"written: {out / 'gpu_check.json'}")
PYEOF
