#!/usr/bin/env bash
# Two "hosts" (this namespace = node 0, a network namespace on a veth pair = node 1) against one:
# `moeflow bench serve --base-url` on the same workload, asap D1 E2. Needs root.
# Both deployments stay up together and the bench runs alternate between them (REPEATS each), so the
# machine's drift hits both alike. Usage: docs/results/multihost/run.sh, then report.py
# (writes docs/results/multihost/{one_host,two_hosts}_r<k>.{json,txt} and link.{json,txt}).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-python}
OUT=docs/results/multihost
NS=mfbench$$; A=mfbA$$; B=mfbB$$; ADDR_A=10.214.7.1; ADDR_B=10.214.7.2; MPORT=29611; HPORT1=8611; HPORT2=8612
REPEATS=${REPEATS:-5}
SERVE=(--model tiny --mode asap --moe-workers 2 --max-restarts 0 --log-level warning)
BENCH=(--workload fixed --fixed-len 64 --max-tokens 16 --request-rate 4 --num-prompts 24 --no-progress)
pids=()
cleanup() { for p in "${pids[@]:-}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true
            ip netns del "$NS" 2>/dev/null || true; ip link del "$A" 2>/dev/null || true; }
trap cleanup EXIT
wait_up() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 0.1; done; return 1; }
git rev-parse HEAD > $OUT/commit.txt
git diff --quiet HEAD -- moeflow || echo "dirty" >> $OUT/commit.txt

# one host
$PY -m moeflow serve "${SERVE[@]}" --port $HPORT1 & pids+=($!)
wait_up $HPORT1

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
GLOO_SOCKET_IFNAME="$A" $PY -m moeflow serve "${SERVE[@]}" --port $HPORT2 --nnodes 2 --node-rank 0 \
  --master-addr $ADDR_A --master-port $MPORT & pids+=($!)
wait_up $HPORT2

# alternate, the order flipped every repeat; seeds s, s+1, ... shared by both
for k in $(seq "$REPEATS"); do
  order=(one_host:$HPORT1 two_hosts:$HPORT2); ((k % 2)) || order=(two_hosts:$HPORT2 one_host:$HPORT1)
  for o in "${order[@]}"; do
    name=${o%%:*}; port=${o##*:}
    $PY -m moeflow bench serve --base-url "http://127.0.0.1:$port" "${BENCH[@]}" --seed $((k - 1)) \
      --json $OUT/${name}_r$k.json | tee $OUT/${name}_r$k.txt
  done
done
