#!/usr/bin/env bash
# Checks megatron-mesh on a machine with one CUDA GPU, in one command, unattended:
#   scripts/gpu_check.sh [--dry-run] [OUT_DIR]        (default gpu_check_out/)
# Needs only Python with a CUDA torch. What else it needs (pytest and its dependencies,
# megatron-core) it installs, without a package index, from wheels carried beside the
# checkout in .whl/ (GPU_CHECK_WHEELS=DIR for another folder; scripts/gpu_wheels.sh fetches
# them on a machine with an index), into OUT_DIR/.site. Transformer Engine and transformers
# are used when installed. Steps, each under 10 minutes, each reported and none stopping the
# others: the `gpu` tests (Transformer Engine's kernel tests among them when TE imports, with
# the memory table), the tile efficiency bench (2K / 4K / 8K tokens per chunk, bf16, every
# backend; at 2K also with the torch merge, an A/B against the Triton one), the driver
# against Hugging Face GPT-2. Writes OUT_DIR/steps.jsonl (one line a step: rc, seconds, or
# why it was skipped), OUT_DIR/gpu_check.json and OUT_DIR/summary.txt.
# Without a CUDA GPU it says so and exits 0. --dry-run (or GPU_CHECK_DRY_RUN=1) goes through
# every step without a GPU, installing the wheels and checking the imports but printing the
# step commands instead of running them.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=${GPU_CHECK_DRY_RUN:-0}
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:-gpu_check_out}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DRY" != 1 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing to check"
    exit 0
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/*.jsonl "$OUT"/*.json "$OUT"/*.log "$OUT/summary.txt"

record() {  # record NAME RC SECONDS NOTE: one line of OUT/steps.jsonl
    "$PY" -c 'import json, sys
name, rc, sec, note = sys.argv[1:5]
print(json.dumps({"step": name, "rc": None if rc == "" else int(rc),
                  "seconds": int(sec), "note": note}))' "$@" >> "$OUT/steps.jsonl"
}

skip() {  # skip NAME WHY
    echo "gpu_check: $1: skipped: $2"
    record "$1" "" 0 "skipped: $2"
}

step() {  # step NAME COMMAND...: runs it (10 minutes at most), logs to OUT/NAME.log
    local name=$1; shift
    if [ "$DRY" = 1 ]; then
        echo "gpu_check: $name: would run: $*"
        record "$name" "" 0 "dry run: $*"
        return
    fi
    echo "gpu_check: $name: $*"
    local start=$SECONDS
    timeout 600 "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    record "$name" "$rc" $((SECONDS - start)) "log: $name.log"
    tail -n 25 "$OUT/$name.log"
}

has() {  # has MODULE: whether python imports it
    "$PY" -c "import $1" > /dev/null 2>&1
}

# 1. wheels carried beside the checkout (no package index needed)
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    skip wheels "no wheels in $WHEELS/ (scripts/gpu_wheels.sh fetches them; see docs/performance.md)"
else
    start=$SECONDS
    failed=()
    for w in "${wheels[@]}"; do  # one at a time: a bad wheel keeps no other out
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$OUT/.site" "$w" >> "$OUT/wheels.log" 2>&1 || failed+=("$(basename "$w")")
    done
    rc=${#failed[@]}
    note="$(( ${#wheels[@]} - rc )) of ${#wheels[@]} wheels from $WHEELS installed into $OUT/.site"
    [ "$rc" -eq 0 ] || note="$note; failed: ${failed[*]} (wheels.log)"
    record wheels "$rc" $((SECONDS - start)) "$note"
    echo "gpu_check: wheels: $note"
    export PYTHONPATH="$PYTHONPATH:$OUT/.site"  # after what is installed: theirs win
fi

# 2. the machine and what is there
"$PY" - > "$OUT/machine.json" 2> "$OUT/machine.log" <<'PYEOF'
import importlib, importlib.metadata as md, json, platform, torch
def version(*names):
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            pass
    return None
def imports(name):
    try:
        importlib.import_module(name)
        return True
    except Exception:
        return False
cuda = torch.cuda.is_available()
print(json.dumps({
    "gpu": torch.cuda.get_device_name(0) if cuda else None,
    "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
    "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
    "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    "triton": version("triton") if imports("triton") else None,
    "transformer_engine": version("transformer_engine", "transformer-engine")
    if imports("transformer_engine") else None,
    "megatron_core": version("megatron-core", "megatron_core") if imports("megatron.core") else None,
    "transformers": version("transformers") if imports("transformers") else None,
    "pytest": version("pytest") if imports("pytest") else None}))
PYEOF
cat "$OUT/machine.json"
has transformer_engine \
    || echo "gpu_check: Transformer Engine does not import: its kernel tests skip and its bench rows say why"

# 3. the steps
if has pytest; then
    MESH_GPU_MEMORY_REPORT="$OUT/memory.jsonl" step gpu_tests "$PY" -m pytest -q -p no:cacheprovider \
        -m gpu tests/unit/test_kernels.py tests/unit/test_kernels_te.py tests/unit/test_kernels_documents.py \
        tests/unit/test_merge_triton.py tests/distributed/test_host_staging.py \
        tests/distributed/test_placed_documents.py tests/distributed/test_sinks.py \
        tests/distributed/test_decode.py
else
    skip gpu_tests "pytest does not import (carry its wheels in $WHEELS/: scripts/gpu_wheels.sh)"
fi
step tiles_mha "$PY" scripts/bench_tiles.py --chunk 2048,4096,8192 --cp-size 8 --heads 16 \
    --head-dim 128 --dtype bf16 --json "$OUT/tiles.jsonl"
MESH_TRITON_MERGE=0 step tiles_torch_merge "$PY" scripts/bench_tiles.py --chunk 2048 --cp-size 8 \
    --heads 16 --head-dim 128 --dtype bf16 --backends torch --json "$OUT/tiles.jsonl"
step tiles_gqa "$PY" scripts/bench_tiles.py --chunk 8192 --cp-size 8 --heads 32 --kv-heads 8 \
    --head-dim 128 --dtype bf16 --json "$OUT/tiles.jsonl"
if ! has transformers; then
    skip driver_vs_hf "transformers does not import"
elif ! has megatron.core; then
    skip driver_vs_hf "megatron-core does not import (carry its wheel in $WHEELS/: scripts/gpu_wheels.sh)"
else
    step driver_vs_hf "$PY" scripts/compare_hf_gpt2.py --json "$OUT/driver_vs_hf.json"
fi

# 4. the summary, from whatever the steps left
"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def lines(name):
    path = out / name
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None
report = {"machine": load("machine.json"), "steps": lines("steps.jsonl"),
          "tiles": lines("tiles.jsonl"), "memory": lines("memory.jsonl"),
          "driver_vs_hf": load("driver_vs_hf.json"),
          "cp_on_one_gpu": "not run: the driver does not yet run several ranks on one GPU"}
(out / "gpu_check.json").write_text(json.dumps(report, indent=1))
print("\nsteps:")
for s in report["steps"]:
    status = "ok" if s["rc"] == 0 else (f"rc={s['rc']}" if s["rc"] is not None else "-")
    print(f"  {s['step']:>14}: {status:>6} ({s['seconds']} s) {s['note']}")
failed = [s["step"] for s in report["steps"] if s["rc"] not in (0, None)]
print("failed steps:", ", ".join(failed) or "none")
tiles = [r for r in report["tiles"] if r.get("pass") == "fwd+bwd"]
if tiles:
    print("tile efficiency (fwd+bwd, single fused call time / tile time):")
for r in tiles:
    print(f"  {r['backend']:>6} merge {r.get('merge', '?'):>6} heads {r['heads']}/{r['kv_heads']} "
          f"chunk {r['chunk']:>5}: "
          f"{100 * r['efficiency']:5.1f}%  tile peak {r.get('tile_peak_bytes', 0) / 2**20:.0f} MiB")
worst = {}
for r in report["memory"]:
    key = (r["shape"], r["schedule"])
    worst[key] = (max(worst.get(key, (0,))[0], r["measured_bytes"]), r["model_bytes"])
if worst:
    print("extra memory per rank, S=8192 bf16 16x128 heads (measured CUDA peak / model MiB):")
    for (shape, sch), (m, mod) in sorted(worst.items()):
        print(f"  {shape} {sch:>12}: {m / 2**20:8.1f} / {mod / 2**20:8.1f}")
if report["driver_vs_hf"]:
    for name, r in report["driver_vs_hf"].get("results", {}).items():
        print(f"  {name:>32}: {r['tokens_per_s']:10.1f} tokens/s, {r['peak_memory_mib']:9.1f} MiB")
print(f"written: {out / 'gpu_check.json'}, {out / 'summary.txt'}")
PYEOF
