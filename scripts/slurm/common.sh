# shellcheck shell=bash
# Shared by the sbatch scripts in this directory (sourced, not run).
#
# Every setting is an environment variable with a default; set it on the sbatch line:
#   CONFIG=configs/gpt3-2.7b.yaml CP_SIZE=8 MESH_SHAPE=2x4 sbatch scripts/slurm/<script>
# Arguments after the script name go to the driver unchanged (they win over the defaults).

set -euo pipefail

# Repository root: sbatch runs a copy of the script, so take the submit directory.
MESH_HOME=${MESH_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$MESH_HOME"
PYTHON=${PYTHON:-python3}

JOB_ID=${SLURM_JOB_ID:-local-$$}
JOB_NAME=${SLURM_JOB_NAME:-megatron-mesh}
NNODES=${SLURM_JOB_NUM_NODES:-1}

# Parallel layout. CP_SIZE defaults to every rank not used by TP (DP = 1); MESH_SHAPE
# empty lets the driver pick R x C near sqrt(CP) (taller for GQA) and log it.
TP_SIZE=${TP_SIZE:-1}
CP_SIZE=${CP_SIZE:-$(( NNODES * PROCS_PER_NODE / TP_SIZE ))}
CP_ALGO=${CP_ALGO:-mesh}
MESH_SHAPE=${MESH_SHAPE:-}

# Training length and batch; empty means "as in the config". A SEQ_LENGTH also sets
# --max-position-embeddings (learned position tables must cover it) unless given.
SEQ_LENGTH=${SEQ_LENGTH:-}
MAX_POSITION_EMBEDDINGS=${MAX_POSITION_EMBEDDINGS:-$SEQ_LENGTH}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-}
TRAIN_ITERS=${TRAIN_ITERS:-}
LOG_INTERVAL=${LOG_INTERVAL:-10}
SAVE_INTERVAL=${SAVE_INTERVAL:-}

# Data: Megatron indexed dataset prefix (path/to/name_text_document, without .bin/.idx),
# or a blend "0.7 PREFIX_A 0.3 PREFIX_B"; empty trains on mock data. TOKENIZER_ARGS is passed as is, e.g.
#   TOKENIZER_ARGS="--tokenizer-type GPT2BPETokenizer --vocab-file v.json --merge-file m.txt"
DATA_PATH=${DATA_PATH:-}
TOKENIZER_ARGS=${TOKENIZER_ARGS:-}

# Per-job outputs: <OUTPUT_DIR>/<job name>-<job id>/{train.log,checkpoints,wandb}.
# Point CHECKPOINT_DIR at a fixed path to resume across jobs: it is loaded when not empty.
OUTPUT_DIR=${OUTPUT_DIR:-$MESH_HOME/runs}
RUN_DIR=${RUN_DIR:-$OUTPUT_DIR/$JOB_NAME-$JOB_ID}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-$RUN_DIR/checkpoints}
WANDB_PROJECT=${WANDB_PROJECT:-}
WANDB_EXP_NAME=${WANDB_EXP_NAME:-$JOB_NAME-$JOB_ID}
WANDB_DIR=${WANDB_DIR:-$RUN_DIR/wandb}
mkdir -p "$RUN_DIR" "$CHECKPOINT_DIR"
TRAIN_LOG=$RUN_DIR/train.log

# torchrun rendezvous: the first node of the allocation hosts the c10d store.
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname)}" 2>/dev/null | head -n 1 || hostname)}
# The port follows from the job id, so every node computes the same one; when this script
# runs on the rendezvous host and another job there holds that port, take the next free one.
if [[ -z ${MASTER_PORT:-} ]]; then
    MASTER_PORT=$(( 20000 + ${SLURM_JOB_ID:-$$} % 20000 ))
    if [[ $MASTER_ADDR == "$(hostname -s)" || $MASTER_ADDR == "$(hostname)" ]]; then
        while (exec 3<>"/dev/tcp/127.0.0.1/$MASTER_PORT") 2>/dev/null; do
            MASTER_PORT=$(( MASTER_PORT + 1 ))
        done
    fi
fi
export MASTER_ADDR MASTER_PORT

# Extra srun options, e.g. a container: SRUN_ARGS="--container-image=<image> --container-mounts=<dirs>"
SRUN_ARGS=${SRUN_ARGS:-}

# Time limit: `#SBATCH --signal=B:USR1@SECONDS` warns this batch shell; run_driver passes
# EXIT_SIGNAL on to every rank through srun (again every 2 s until they stop, since a rank
# still starting up ignores it), the driver saves after its current iteration and exits 0,
# and the job requeues itself (`#SBATCH --requeue`): the next start loads that checkpoint.
# torchrun ignores EXIT_SIGNAL (inherited SIG_IGN), so only the ranks act on it.
TIME_LIMIT_SIGNAL=${TIME_LIMIT_SIGNAL:-USR1}
EXIT_SIGNAL=${EXIT_SIGNAL:-SIGUSR1}
IGNORE_EXIT_SIGNAL=(bash -c "trap '' ${EXIT_SIGNAL#SIG}; exec \"\$@\"" launcher)

LAUNCH=(
    "${IGNORE_EXIT_SIGNAL[@]}" "$PYTHON" -m torch.distributed.run
    --nnodes "$NNODES" --nproc-per-node "$PROCS_PER_NODE"
    --rdzv-id "$JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
)

DRIVER_ARGS=(
    --config "$CONFIG"
    --tensor-model-parallel-size "$TP_SIZE"
    --context-parallel-size "$CP_SIZE"
    --context-parallel-algo "$CP_ALGO"
    --log-interval "$LOG_INTERVAL"
    --save "$CHECKPOINT_DIR"
    --exit-signal-handler --exit-signal "$EXIT_SIGNAL"
)
[[ -n $MESH_SHAPE ]] && DRIVER_ARGS+=(--mesh-shape "$MESH_SHAPE")
[[ -n $SEQ_LENGTH ]] && DRIVER_ARGS+=(--seq-length "$SEQ_LENGTH")
[[ -n $MAX_POSITION_EMBEDDINGS ]] && DRIVER_ARGS+=(--max-position-embeddings "$MAX_POSITION_EMBEDDINGS")
[[ -n $MICRO_BATCH_SIZE ]] && DRIVER_ARGS+=(--micro-batch-size "$MICRO_BATCH_SIZE")
[[ -n $GLOBAL_BATCH_SIZE ]] && DRIVER_ARGS+=(--global-batch-size "$GLOBAL_BATCH_SIZE")
[[ -n $TRAIN_ITERS ]] && DRIVER_ARGS+=(--train-iters "$TRAIN_ITERS")
[[ -n $SAVE_INTERVAL ]] && DRIVER_ARGS+=(--save-interval "$SAVE_INTERVAL")
# shellcheck disable=SC2206  # a blend is several words
[[ -n $DATA_PATH ]] && DRIVER_ARGS+=(--data-path $DATA_PATH)
[[ -n $WANDB_PROJECT ]] && DRIVER_ARGS+=(--wandb-project "$WANDB_PROJECT"
    --wandb-exp-name "$WANDB_EXP_NAME" --wandb-save-dir "$WANDB_DIR")
[[ -n $(ls -A "$CHECKPOINT_DIR" 2>/dev/null) ]] && DRIVER_ARGS+=(--load "$CHECKPOINT_DIR")
# shellcheck disable=SC2206  # word splitting of TOKENIZER_ARGS is intended
[[ -n $TOKENIZER_ARGS ]] && DRIVER_ARGS+=($TOKENIZER_ARGS)

# Run the given launcher + driver (an srun), keep a copy of its output in the run directory,
# record what ran, and requeue the job when the time limit stopped it (see EXIT_SIGNAL).
TIME_UP=0
run_driver() {
    {
        echo "# job $JOB_ID on $NNODES node(s): ${SLURM_JOB_NODELIST:-$(hostname)}" \
            "(start ${SLURM_RESTART_COUNT:-0})"
        echo "# rendezvous $MASTER_ADDR:$MASTER_PORT"
        printf '%q ' "$@"
        echo
    } | tee "$RUN_DIR/command.txt"
    local log_start pid status=0
    log_start=$(stat -c %s "$TRAIN_LOG" 2>/dev/null || echo 0)
    trap 'TIME_UP=1' "$TIME_LIMIT_SIGNAL"
    "$@" > >(tee -a "$TRAIN_LOG") 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        if (( TIME_UP )); then
            kill -s "$EXIT_SIGNAL" "$pid" 2>/dev/null || true
        fi
        sleep 2 & wait $! || true  # a trapped signal ends the wait at once
    done
    wait "$pid" || status=$?
    if (( TIME_UP && status == 0 )) && [[ -n ${SLURM_JOB_ID:-} ]] \
        && grep -q "$EXIT_SIGNAL received: saving" <(tail -c +$(( log_start + 1 )) "$TRAIN_LOG"); then
        echo "# time limit near: saved; requeued to go on from the checkpoint" | tee -a "$TRAIN_LOG"
        scontrol requeue "$SLURM_JOB_ID"
    fi
    return "$status"
}
