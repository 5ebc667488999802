#!/usr/bin/env bash
# Transformer Engine on a GPU machine that has no package index and takes at most 64 MiB of
# files a call: its wheel travels in parts, call after call, into a stage outside the
# checkout, and is installed there once whole.
#
#   scripts/te_device.sh prepare            here, with an index: the wheels into .te/, the
#                                           TE wheel cut into .te/parts/part-NN, .te/SHA256SUMS
#   scripts/te_device.sh receive            there: every .te/parts/part-NN carried this call
#                                           copied into the stage; says which are missing
#   scripts/te_device.sh install [LIMIT_S]  there: the parts joined and checked, the
#                                           dependencies and the wheel installed (no index),
#                                           TE's torch extension built from its sdist under
#                                           LIMIT_S seconds (default 420), then imported
#   scripts/te_device.sh check              there: TE's kernel tests (`-m gpu`) and the tile
#                                           bench with --backends te
#
# What to carry, one call each (`.te/` is ignored by git): .te/SHA256SUMS with part-00, then
# part-01, ..., then .te/deps and the sdist with `install`. Each step appends one JSON line
# (step, rc, seconds, note) to $OUT/te_steps.jsonl (OUT: the device's output folder, else
# .te/out). TE_VERSION (2.20.2), TE_CUDA (cu13), TE_PART_MIB (56), TE_STAGE
# (/tmp/te_stage) and TE_DIR (.te) change the defaults.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TE_VERSION=${TE_VERSION:-2.20.2}
TE_CUDA=${TE_CUDA:-cu13}
TE_DIR=${TE_DIR:-.te}
TE_STAGE=${TE_STAGE:-/tmp/te_stage}
TE_PART_MIB=${TE_PART_MIB:-56}
OUT=${OUT:-$TE_DIR/out}
WHEEL="transformer_engine_${TE_CUDA}-${TE_VERSION}-py3-none-manylinux_2_28_x86_64.whl"
SDIST="transformer_engine_torch-${TE_VERSION}.tar.gz"
# TE's and its torch package's requirements, less torch and the CUDA libraries the GPU
# machine's torch brings
DEPS=(pydantic "importlib-metadata>=1.0" packaging einops onnxscript onnx nvdlfw-inspect
      "nvidia-cudnn-frontend>=1.29.0" setuptools pybind11)

usage() {
    echo "usage: scripts/te_device.sh prepare | receive | install [LIMIT_S] | check" >&2
    exit 2
}

record() {  # record STEP RC SECONDS NOTE
    mkdir -p "$OUT"
    "$PY" -c 'import json, sys
step, rc, seconds, note = sys.argv[1:]
print(json.dumps({"step": step, "rc": int(rc), "seconds": int(seconds), "note": note}))' \
        "$@" | tee -a "$OUT/te_steps.jsonl"
}

timed() {  # timed STEP LIMIT_S COMMAND...: runs it, logs to OUT/STEP.log, records it
    local step=$1 limit=$2 start rc
    shift 2
    mkdir -p "$OUT"
    start=$(date +%s)
    timeout -k 5 "$limit" "$@" > "$OUT/$step.log" 2>&1
    rc=$?
    record "$step" "$rc" $(($(date +%s) - start)) "$(tail -n 1 "$OUT/$step.log" | cut -c1-300)"
    return $rc
}

split_wheel() {  # split_wheel FILE: FILE cut into TE_DIR/parts/part-NN, sums in TE_DIR/SHA256SUMS
    local file=$1
    rm -rf "$TE_DIR/parts"
    mkdir -p "$TE_DIR/parts"
    split -b "${TE_PART_MIB}M" -d -a 2 "$file" "$TE_DIR/parts/part-"
    (cd "$(dirname "$file")" && sha256sum "$(basename "$file")") > "$TE_DIR/SHA256SUMS"
    (cd "$TE_DIR/parts" && sha256sum part-*) >> "$TE_DIR/SHA256SUMS"
}

prepare() {
    mkdir -p "$TE_DIR/deps"
    local simple=https://pypi.org/simple base=https://files.pythonhosted.org
    for name in "$WHEEL" "$SDIST"; do
        [ -f "$TE_DIR/$name" ] && continue
        local project=${name%%-"$TE_VERSION"*}
        project=${project//_/-}
        local path
        path=$(curl -sS "$simple/$project/" | grep -o "packages/[^\"#]*/$name" | head -n 1)
        if [ -z "$path" ]; then
            echo "te_device: $name is not on $simple/$project/" >&2
            exit 1
        fi
        curl -sS -L -o "$TE_DIR/$name" "$base/$path" || exit 1
    done
    "$PY" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
        --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 --platform any \
        -d "$TE_DIR/deps" "${DEPS[@]}" pydantic-core annotated-types typing-inspection \
        typing-extensions zipp onnx-ir ml-dtypes protobuf pyyaml || exit 1
    split_wheel "$TE_DIR/$WHEEL"
    echo "te_device: $(ls "$TE_DIR/parts" | wc -l) parts of at most $TE_PART_MIB MiB in $TE_DIR/parts;" \
         "deps $(du -sh "$TE_DIR/deps" | cut -f1)"
}

receive() {
    mkdir -p "$TE_STAGE"
    [ -f "$TE_DIR/SHA256SUMS" ] && cp "$TE_DIR/SHA256SUMS" "$TE_STAGE/"
    if [ ! -f "$TE_STAGE/SHA256SUMS" ]; then
        echo "te_device: carry $TE_DIR/SHA256SUMS with the first part" >&2
        exit 2
    fi
    local part got=() missing=()
    for part in "$TE_DIR"/parts/part-*; do
        [ -f "$part" ] || continue
        cp "$part" "$TE_STAGE/"
        got+=("$(basename "$part")")
    done
    for part in $(grep -o 'part-[0-9]*' "$TE_STAGE/SHA256SUMS"); do
        if [ ! -f "$TE_STAGE/$part" ] \
            || ! (cd "$TE_STAGE" && grep " $part\$" SHA256SUMS | sha256sum -c --status); then
            missing+=("$part")
        fi
    done
    record receive 0 0 "received ${got[*]:-nothing}; missing ${missing[*]:-none}"
}

join_parts() {
    (cd "$TE_STAGE" && for part in $(grep -o 'part-[0-9]*' SHA256SUMS); do
         grep " $part\$" SHA256SUMS | sha256sum -c --status \
             || { echo "te_device: $part is missing or damaged in $TE_STAGE" >&2; exit 1; }
     done
     cat $(grep -o 'part-[0-9]*' SHA256SUMS) > "$WHEEL"
     grep " $WHEEL\$" SHA256SUMS | sha256sum -c --status \
         || { echo "te_device: the joined $WHEEL does not match its sum" >&2; exit 1; })
}

install() {
    local limit=${1:-420}
    timed join 60 join_parts || exit 1
    timed deps 120 "$PY" -m pip install --no-index --no-deps -q "$TE_DIR"/deps/*.whl || exit 1
    timed wheel 120 "$PY" -m pip install --no-index --no-deps -q "$TE_STAGE/$WHEEL" || exit 1
    # the torch extension, compiled against the torch there (its build needs torch imported)
    MAX_JOBS=${MAX_JOBS:-$(nproc)} NVTE_FRAMEWORK=pytorch timed build "$limit" \
        "$PY" -m pip install --no-index --no-deps --no-build-isolation -v "$TE_DIR/$SDIST" \
        || exit 1
    timed import 60 "$PY" -c 'import transformer_engine, transformer_engine.pytorch as te
print("transformer_engine", transformer_engine.__version__)'
}

check() {
    timed te_tests 240 "$PY" -m pytest -q -p no:cacheprovider -m gpu \
        tests/unit/test_kernels_te.py tests/unit/test_kernels_te_runs.py
    timed te_tiles 120 "$PY" scripts/bench_tiles.py --chunk 2048,4096,8192 --cp-size 8 \
        --heads 16 --head-dim 128 --dtype bf16 --backends te,cudnn --json "$OUT/tiles_te.jsonl"
}

case "${1:-}" in
    prepare) prepare ;;
    receive) receive ;;
    install) shift; install "$@" ;;
    check) check ;;
    split) split_wheel "$2" ;;  # split FILE: cut FILE into parts (prepare does it for TE)
    join) join_parts ;;  # the received parts joined and checked (install does it first)
    *) usage ;;
esac
