#!/usr/bin/env bash
# Steady-state decode at two commits, interleaved: usage
#   verify/decode_before_after.sh BEFORE AFTER OUT_DIR [REPEATS] [BATCHES...]
# Each commit runs from its own git worktree (under OUT_DIR/trees) with this checkout's python;
# every run is one `moeflow bench decode` process of configs/decode-host-syncs.yaml (this
# checkout's copy), and the side that goes first alternates by repeat so drift hits both alike.
# Summarise with: python docs/results/decode_syncs/summary.py OUT_DIR
set -euo pipefail
before=$1 after=$2 out=$3 repeats=${4:-3}
shift $(( $# < 4 ? $# : 4 ))
batches=("$@"); [ ${#batches[@]} -eq 0 ] && batches=(1 16 64)
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
cfg=$here/configs/decode-host-syncs.yaml
mkdir -p "$out/trees"
for side in before after; do
  rev=${!side}
  tree=$out/trees/$side
  [ -d "$tree" ] || git -C "$here" worktree add --detach "$tree" "$rev" >/dev/null
  git -C "$tree" rev-parse HEAD > "$out/$side.commit"
done
for r in $(seq 0 $((repeats - 1))); do
  order=(before after); [ $((r % 2)) -eq 1 ] && order=(after before)
  for b in "${batches[@]}"; do
    for side in "${order[@]}"; do
      echo "[repeat $r] batch $b: $side ($(cat "$out/$side.commit" | cut -c1-7))"
      (cd "$out/trees/$side" && PYTHONPATH="$out/trees/$side" "$py" -m moeflow bench decode "$cfg" \
        --batch "$b" --seed "$r" --json "$out/${side}_b${b}_r${r}.json" > "$out/${side}_b${b}_r${r}.log" 2>&1)
    done
  done
done
