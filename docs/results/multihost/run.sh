#!/usr/bin/env bash
# NOTE: prepared, not yet run: a benchmark held this machine when it was written; docs/results/multihost.md
# does not exist until it has run (report.py writes it).
# Two "hosts" (this namespace = node 0, a network namespace on a veth pair = node 1) against one:
# `moeflow bench serve --base-url` on the same workload, asap D1 E2. Needs root.
# Usage: docs/results/multihost/run.sh  (writes docs/results/multihost/{one_host,two_hosts,link}.{json,txt})
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-python}
OUT=docs/results/multihost
NS=mfbench$$; A=mfbA$$; B=mfbB$$; ADDR_A=10.214.7.1; ADDR_B=10.214.7.2; MPORT=29611; HPORT=8611
SERVE=(--model tiny --mode asap --moe-workers 2 --max-restarts 0 --log-level warning)
BENCH=(--workload fixed --fixed-len 64 --max-tokens 16 --request-rate 4 --num-prompts 24 --no-progress)
pids=()
cleanup() { for p in "${pids[@]:-}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true
            ip netns del "$NS" 2>/dev/null || true; ip link del "$A" 2>/dev/null || true; }
trap cleanup EXIT
wait_up() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$HPORT/health" >/dev/null && return 0; sleep 0.1; done; return 1; }

# one host
$PY -m moeflow serve "${SERVE[@]}" --port $HPORT & pids+=($!)
wait_up
$PY -m moeflow bench serve --base-url "http://127.0.0.1:$HPORT" "${BENCH[@]}" --json $OUT/one_host.json | tee $OUT/one_host.txt
kill "${pids[-1]}"; wait "${pids[-1]}" || true

# two hosts
ip netns add "$NS"; ip link add "$A" type veth peer name "$B"; ip link set "$B" netns "$NS"
ip addr add $ADDR_A/24 dev "$A"; ip link set "$A" up
ip -n "$NS" addr add $ADDR_B/24 dev "$B"; ip -n "$NS" link set "$B" up; ip -n "$NS" link set lo up
# the link itself: a dispatch -> combine round trip over gloo between the namespaces
ip netns exec "$NS" env GLOO_SOCKET_IFNAME="$B" PYTHONPATH=. $PY $OUT/link.py 1 tcp://$ADDR_A:29612 /dev/null & lp=$!
GLOO_SOCKET_IFNAME="$A" PYTHONPATH=. $PY $OUT/link.py 0 tcp://$ADDR_A:29612 $OUT/link.json | tee $OUT/link.txt
wait $lp
ip netns exec "$NS" env GLOO_SOCKET_IFNAME="$B" $PY -m moeflow worker-node --nnodes 2 --node-rank 1 \
  --master-addr $ADDR_A --master-port $MPORT & pids+=($!)
GLOO_SOCKET_IFNAME="$A" $PY -m moeflow serve "${SERVE[@]}" --port $HPORT --nnodes 2 --node-rank 0 \
  --master-addr $ADDR_A --master-port $MPORT & pids+=($!)
wait_up
$PY -m moeflow bench serve --base-url "http://127.0.0.1:$HPORT" "${BENCH[@]}" --json $OUT/two_hosts.json | tee $OUT/two_hosts.txt
git rev-parse HEAD > $OUT/commit.txt
