#!/usr/bin/env bash
# Checks megatron-mesh on a machine with one CUDA GPU, in one command, unattended, in at most
# 6 minutes (GPU_CHECK_BUDGET_S, 360):
#   scripts/gpu_check.sh [--dry-run] [OUT_DIR]        (default gpu_check_out/)
# Needs only Python with a CUDA torch. What else it needs (pytest and its dependencies,
# megatron-core) it installs, without a package index, from wheels carried beside the
# checkout in .whl/ (GPU_CHECK_WHEELS=DIR for another folder; scripts/gpu_wheels.sh fetches
# them on a machine with an index), into OUT_DIR/.site. Transformer Engine and transformers
# are used when installed. Steps, each under its own time limit (LIMITS below; they add up
# to the budget less a reserve for the installs and the summary, and no step runs past the
# budget), each reported and none stopping the others: the `gpu` tests (Transformer
# Engine's kernel tests among them when TE imports, with the memory table), the tile
# efficiency bench for MHA 16 x 128 and GQA 32 / 8 (2K / 4K / 8K tokens per chunk, bf16,
# every backend; at 2K also with the torch merge, an A/B against the Triton one), the
# FlexAttention tile (its gpu tests, then its tile at 2K / 4K / 8K), the
# driver against Hugging Face GPT-2 at 4K and 16K tokens, CP = 4 trained on the one GPU
# against CP = 1 (scripts/cp_on_one_gpu.py), and the GPU profile fitted to the tile rows
# (scripts/fit_gpu_profile.py, when there). Writes OUT_DIR/steps.jsonl (one line a step:
# rc, seconds, limit, or why it was skipped), OUT_DIR/gpu_check.json and OUT_DIR/summary.txt.
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

# Seconds each step may take; with RESERVE_S (wheels, machine facts, summary) they add up
# to at most BUDGET_S, so that a rerun fits a 15-minute device lease beside the first run.
BUDGET_S=${GPU_CHECK_BUDGET_S:-360}
RESERVE_S=30
declare -A LIMITS=([gpu_tests]=80 [tiles_mha]=35 [tiles_torch_merge]=10 [tiles_gqa]=35
                   [tiles_documents]=10 [tiles_flex]=30 [driver_vs_hf_4k]=35
                   [driver_vs_hf_16k]=35 [cp_on_one_gpu]=50 [profile_fit]=10)
total=$RESERVE_S
for name in "${!LIMITS[@]}"; do total=$((total + LIMITS[$name])); done
if [ "$total" -gt "$BUDGET_S" ]; then
    echo "gpu_check: the step limits and the reserve add up to $total s, over the budget $BUDGET_S s" >&2
    exit 2
fi
DEADLINE=$((SECONDS + BUDGET_S))

record() {  # record NAME RC SECONDS NOTE [LIMIT]: one line of OUT/steps.jsonl
    "$PY" -c 'import json, sys
name, rc, sec, note, limit = (sys.argv[1:6] + [""])[:5]
print(json.dumps({"step": name, "rc": None if rc == "" else int(rc),
                  "seconds": int(sec), "limit_s": None if limit == "" else int(limit),
                  "note": note}))' "$@" >> "$OUT/steps.jsonl"
}

skip() {  # skip NAME WHY
    echo "gpu_check: $1: skipped: $2"
    record "$1" "" 0 "skipped: $2"
}

step() {  # step NAME COMMAND...: runs it under LIMITS[NAME] (and the budget), logs to OUT/NAME.log
    local name=$1; shift
    local limit=${LIMITS[$name]}
    if [ "$DRY" = 1 ]; then
        echo "gpu_check: $name: would run (limit ${limit} s): $*"
        record "$name" "" 0 "dry run: $*" "$limit"
        return
    fi
    local left=$((DEADLINE - SECONDS - RESERVE_S / 3))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -le 0 ]; then
        skip "$name" "no time left in the ${BUDGET_S} s budget"
        return
    fi
    echo "gpu_check: $name (limit ${limit} s): $*"
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local note="log: $name.log"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && note="killed at its limit of ${limit} s; $note"
    record "$name" "$rc" $((SECONDS - start)) "$note" "$limit"
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
        --durations=15 -m gpu tests/unit/test_kernels.py tests/unit/test_kernels_te.py \
        tests/unit/test_kernels_te_runs.py \
        tests/unit/test_kernels_documents.py tests/unit/test_merge_triton.py \
        tests/distributed/test_host_staging.py tests/distributed/test_placed_documents.py \
        tests/distributed/test_sinks.py tests/distributed/test_decode.py
else
    skip gpu_tests "pytest does not import (carry its wheels in $WHEELS/: scripts/gpu_wheels.sh)"
fi
step tiles_mha "$PY" scripts/bench_tiles.py --chunk 2048,4096,8192 --cp-size 8 --heads 16 \
    --head-dim 128 --dtype bf16 --json "$OUT/tiles.jsonl"
# the torch merge's rows apart: the profile is fitted to one merge (the Triton one)
MESH_TRITON_MERGE=0 step tiles_torch_merge "$PY" scripts/bench_tiles.py --chunk 2048 --cp-size 8 \
    --heads 16 --head-dim 128 --dtype bf16 --backends torch --json "$OUT/tiles_torch_merge.jsonl"
step tiles_gqa "$PY" scripts/bench_tiles.py --chunk 2048,4096,8192 --cp-size 8 --heads 32 \
    --kv-heads 8 --head-dim 128 --dtype bf16 --json "$OUT/tiles.jsonl"
step tiles_documents "$PY" scripts/bench_tiles.py --chunk 2048 --cp-size 8 --heads 16 \
    --head-dim 128 --dtype bf16 --backends torch --documents 16 --calls grouped,blocks \
    --json "$OUT/tiles_documents.jsonl"
# FlexAttention's tile (compiled; its first calls of a shape compile): its gpu tests, then
# its tile at 2K / 4K / 8K (torch's and cuDNN's of the same shapes are in tiles.jsonl): the
# rows of a flex fit, which the profile fit takes when all three chunks were timed
step tiles_flex bash -c '"$0" -m pytest -q -x -p no:cacheprovider -m gpu tests/unit/test_kernels_flex.py \
    && "$0" scripts/bench_tiles.py --chunk 2048,4096,8192 --cp-size 8 --heads 16 --head-dim 128 \
    --dtype bf16 --backends flex --iters 3 --json "$1"' "$PY" "$OUT/tiles_flex.jsonl"
if ! has megatron.core; then
    why="megatron-core does not import (carry its wheel in $WHEELS/: scripts/gpu_wheels.sh)"
    skip driver_vs_hf_4k "$why"; skip driver_vs_hf_16k "$why"; skip cp_on_one_gpu "$why"
else
    if ! has transformers; then
        skip driver_vs_hf_4k "transformers does not import"
        skip driver_vs_hf_16k "transformers does not import"
    else
        step driver_vs_hf_4k "$PY" scripts/compare_hf_gpt2.py --seq 4096 --batch 4 --iters 12 \
            --warmup 4 --json "$OUT/driver_vs_hf_4k.json"
        step driver_vs_hf_16k "$PY" scripts/compare_hf_gpt2.py --seq 16384 --batch 1 --iters 12 \
            --warmup 4 --json "$OUT/driver_vs_hf_16k.json"
    fi
    step cp_on_one_gpu "$PY" scripts/cp_on_one_gpu.py --timeout $((LIMITS[cp_on_one_gpu] - 5)) \
        --json "$OUT/cp_on_one_gpu.json"
fi
if [ -f scripts/fit_gpu_profile.py ]; then
    fit_rows=("$OUT/tiles.jsonl")
    if "$PY" -c 'import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
sys.exit(len({r["chunk"] for r in rows if r["pass"] == "backward"}) < 3)' "$OUT/tiles_flex.jsonl" 2>/dev/null; then
        fit_rows+=("$OUT/tiles_flex.jsonl")
    fi
    step profile_fit "$PY" scripts/fit_gpu_profile.py "${fit_rows[@]}"
else
    skip profile_fit "scripts/fit_gpu_profile.py is not there (nothing fits the GPU profile yet)"
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
def tail(name, n=15):
    path = out / name
    return path.read_text().splitlines()[-n:] if path.exists() else []
report = {"machine": load("machine.json"), "steps": lines("steps.jsonl"),
          "tiles": lines("tiles.jsonl") + lines("tiles_torch_merge.jsonl")
          + lines("tiles_flex.jsonl"), "tiles_documents": lines("tiles_documents.jsonl"),
          "memory": lines("memory.jsonl"),
          "driver_vs_hf": {seq: load(f"driver_vs_hf_{seq}.json") for seq in ("4k", "16k")},
          "cp_on_one_gpu": load("cp_on_one_gpu.json"), "profile_fit": tail("profile_fit.log")}
(out / "gpu_check.json").write_text(json.dumps(report, indent=1))
print(f"\nmachine: {json.dumps(report['machine'])}")
print("steps:")
for s in report["steps"]:
    status = "ok" if s["rc"] == 0 else (f"rc={s['rc']}" if s["rc"] is not None else "-")
    limit = f" of {s['limit_s']} s" if s.get("limit_s") is not None else ""
    print(f"  {s['step']:>17}: {status:>6} ({s['seconds']} s{limit}) {s['note']}")
print(f"total: {sum(s['seconds'] for s in report['steps'])} s in the steps")
failed = [s["step"] for s in report["steps"] if s["rc"] not in (0, None)]
print("failed steps:", ", ".join(failed) or "none")
tiles = [r for r in report["tiles"] if r.get("pass") == "fwd+bwd"]
if tiles:
    print("tile efficiency (fwd+bwd, single fused call time / tile time):")
for r in tiles:
    print(f"  {r['backend']:>6} merge {r.get('merge', '?'):>6} heads {r['heads']}/{r['kv_heads']} "
          f"chunk {r['chunk']:>5}, {r.get('calls', '?'):>3} calls: "
          f"{100 * r['efficiency']:5.1f}%  tile peak {r.get('tile_peak_bytes', 0) / 2**20:.0f} MiB")
documents = [r for r in report["tiles_documents"] if r.get("pass") == "fwd+bwd"]
if documents:
    print("tile of packed documents (fwd+bwd, one varlen call of the same FLOPs / tile time):")
for r in documents:
    how = "joined by document" if r["grouped"] else "one call a block"
    print(f"  {r['backend']:>6} {r['documents']} documents, chunk {r['chunk']:>5}, {how:>18}: "
          f"{r['calls']:>3} calls, {r['tile_ms']:.3f} ms, {100 * r['efficiency']:5.1f}%")
worst = {}
for r in report["memory"]:
    key = (r["shape"], r["schedule"])
    worst[key] = (max(worst.get(key, (0,))[0], r["measured_bytes"]), r["model_bytes"])
if worst:
    print("extra memory per rank, S=8192 bf16 16x128 heads (measured CUDA peak / model MiB):")
    for (shape, sch), (m, mod) in sorted(worst.items()):
        print(f"  {shape} {sch:>12}: {m / 2**20:8.1f} / {mod / 2**20:8.1f}")
for seq, hf in report["driver_vs_hf"].items():
    if not hf:
        continue
    c = hf["config"]
    print(f"driver vs GPT-2, S = {c['seq']}, micro-batch {c['batch']} ({hf['device']}):")
    rows = list(hf.get("results", {}).items())
    for name, r in rows:
        print(f"  {name:>32}: {r['tokens_per_s']:10.1f} tokens/s, {r['peak_memory_mib']:9.1f} MiB")
    if len(rows) == 2:
        (_, ours), (_, theirs) = rows
        print(f"  {'ours / GPT-2':>32}: {ours['tokens_per_s'] / theirs['tokens_per_s']:10.2f}x "
              f"tokens/s, {ours['peak_memory_mib'] / theirs['peak_memory_mib']:9.2f}x memory")
cp = report["cp_on_one_gpu"]
if cp:
    v = cp["verdict"]
    print(f"CP = 4 on one GPU against CP = 1 ({cp['config']['dtype']}, "
          f"{cp['config']['iters']} iterations): {'pass' if v['pass'] else 'FAIL'}")
    for name, g in v.get("grids", {}).items():
        print(f"  {name:>10}: max |L - L_cp1| {g['max_diff']:.3e}, {g['max_ratio']:.2f} of the bound"
              + (f", beyond it at {g['beyond']}" if g["beyond"] else ""))
    if v.get("missing"):
        print(f"  iterations missing: {v['missing']}")
else:
    print("CP = 4 on one GPU: not run (see its step)")
if report["profile_fit"]:
    print("GPU profile fit (profile_fit.log, last lines):")
    for line in report["profile_fit"]:
        print(f"  {line}")
print(f"written: {out / 'gpu_check.json'}, {out / 'summary.txt'}")
PYEOF
