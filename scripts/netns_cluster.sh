#!/usr/bin/env bash
# A second clock the project does not write: run bench_cluster.py's documents mode with the
# ranks of each node in their own network namespace, nodes joined by veth pairs through a
# bridge, and every node's link out shaped by the kernel (tc tbf). Compute stays emulated
# (the sleeping kernel); links inside a node are the namespace's own (loopback, unshaped);
# the project's link emulation only counts bytes (--real-links).
#
#   sudo scripts/netns_cluster.sh NODES RATE_MBIT -- [bench_cluster.py arguments]
#
# RATE_MBIT: each node's link to the others, e.g. the modelled inter-node rate per GPU x
# GPUs per node / slowdown (45 GB/s x 8 / 20000 = 18 MB/s = 144 Mbit/s). The bench
# arguments must name one --cp-sizes P (P / NODES ranks per node) and --doc-length-dist or
# --doc-lengths; --nodes, --rank, --master and --real-links are added here. Rank 0 prints
# the report. Namespaces, veths and the bridge are removed on exit, whatever happens.
set -euo pipefail

if [[ $# -lt 3 || $3 != "--" ]]; then
    echo "usage: $0 NODES RATE_MBIT -- bench_cluster.py arguments (one --cp-sizes P)" >&2
    exit 2
fi
NODES=$1
RATE=$2
shift 3
BENCH_ARGS=("$@")
[[ $NODES =~ ^[1-9][0-9]*$ ]] || { echo "NODES must be a positive integer, got $NODES" >&2; exit 2; }
[[ $RATE =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "RATE_MBIT must be a number, got $RATE" >&2; exit 2; }

P=""
for ((i = 0; i < ${#BENCH_ARGS[@]}; i++)); do
    if [[ ${BENCH_ARGS[$i]} == --cp-sizes ]]; then P=${BENCH_ARGS[$((i + 1))]}; fi
done
[[ $P =~ ^[1-9][0-9]*$ ]] || { echo "give one --cp-sizes P in the bench arguments" >&2; exit 2; }
(( P % NODES == 0 )) || { echo "NODES $NODES does not divide P $P" >&2; exit 2; }
PER_NODE=$((P / NODES))

TAG=mm$$  # names unique to this run
BRIDGE=${TAG}br
SUBNET=10.77.$(($$ % 200 + 20))
PORT=$((20000 + $$ % 20000))
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PIDS=()

cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for ((n = 0; n < NODES; n++)); do
        ip netns del "${TAG}n$n" 2>/dev/null || true
        ip link del "${TAG}v$n" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
}
trap cleanup EXIT INT TERM

ip link add "$BRIDGE" type bridge
ip addr add "$SUBNET.254/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
for ((n = 0; n < NODES; n++)); do
    ns=${TAG}n$n
    ip netns add "$ns"
    ip link add "${TAG}v$n" type veth peer name "${TAG}e$n"
    ip link set "${TAG}e$n" netns "$ns"
    ip link set "${TAG}v$n" master "$BRIDGE"
    ip link set "${TAG}v$n" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$SUBNET.$((n + 1))/24" dev "${TAG}e$n"
    ip -n "$ns" link set "${TAG}e$n" up
    # the node's link out: a token bucket at RATE (burst: 5 ms of it, at least 64 KB)
    burst=$(python3 -c "print(max(65536, int($RATE * 1e6 / 8 * 0.005)))")
    ip netns exec "$ns" tc qdisc add dev "${TAG}e$n" root tbf rate "${RATE}mbit" \
        burst "$burst" latency 2s
done
echo "netns cluster: $NODES node(s) x $PER_NODE ranks, node links ${RATE} Mbit/s (tbf)," \
     "in-node links unshaped" >&2

for ((r = P - 1; r >= 0; r--)); do
    n=$((r / PER_NODE))
    ip netns exec "${TAG}n$n" env GLOO_SOCKET_IFNAME="${TAG}e$n" OMP_NUM_THREADS=1 \
        PYTHONPATH="${PYTHONPATH:-$ROOT}" python3 "$ROOT/scripts/bench_cluster.py" \
        "${BENCH_ARGS[@]}" --nodes "$NODES" --rank "$r" --master "$SUBNET.1:$PORT" \
        --real-links &
    PIDS+=($!)
done
status=0
for ((i = 0; i < P; i++)); do  # a rank that fails ends the run (the trap stops the others)
    wait -n || { status=$?; echo "a rank exited with status $status; stopping" >&2; break; }
done
[[ $status != 0 ]] || PIDS=()
exit $status
