#!/usr/bin/env bash
# The prepared GPU run (docs/gpu.md): two calls sized for a lent GPU's 15 minutes in all, run back to
# back in a copy of this working tree on the GPU machine (its own python: torch + CUDA, triton,
# transformers, pytest with pytest-timeout; no make, no pip, no fastapi, no .git):
#
#   OUT=$OUT bash verify/gpu_run.sh a    # <= 5 min: facts, the CUDA-IPC probe, the device's ceilings,
#                                        #   every GPU test (per-test timeouts, no -x)
#   OUT=$OUT bash verify/gpu_run.sh b    # <= 7 min: bench roofline on a Qwen3-30B-A3B shape, bench
#                                        #   decode of colocated and every mode over cuda-ipc
#   bash verify/gpu_run.sh a --rehearse  # any machine, no GPU: the same steps on the CPU, smaller
#
# Each call writes at most 8 files to OUT (default ./gpu-out), as it goes (unbuffered, tee'd into
# OUT/<call>.log), and OUT/<call>-summary.md last. The commit: git where the tree has it, else
# .gpu-commit at the tree's root (`git rev-parse HEAD > .gpu-commit` where git is, carried with the
# copy: the GPU machine's copy has no .git), else unknown.
# Exit status: non-zero when a step failed; the summary is written either way.
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
OUT=${OUT:-./gpu-out}
PART=${1:-}
REHEARSE=0
case "${2:-}" in --rehearse) REHEARSE=1 ;; "") ;; *) PART=usage ;; esac
case "$PART" in
  a|b) ;;
  *) echo "usage: [OUT=DIR] [PYTHON=python3] bash verify/gpu_run.sh a|b [--rehearse]" >&2; exit 2 ;;
esac

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
export MOEFLOW_CACHE_DIR=${MOEFLOW_CACHE_DIR:-${TMPDIR:-/tmp}/moeflow-gpu-run-cache}  # the embedded model
DEVICE=cuda
if [ "$REHEARSE" = 1 ]; then
  export MOEFLOW_GPU_REHEARSAL=1  # tests/gpu: device cpu, deferred for cuda-ipc
  DEVICE=cpu
fi
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/$PART.log"
STEPS="$OUT/$PART-steps.tsv"
: > "$LOG"
: > "$STEPS"
cd "$ROOT" || exit 2
failed=0

# step NAME LIMIT_S CMD...: CMD under a time limit, its output into the call's log as it comes
step() {
  local name=$1 limit=$2 t0 rc
  shift 2
  echo "== $name (limit ${limit} s): $*" | tee -a "$LOG"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$limit" >> "$STEPS"
  [ "$rc" = 0 ] || { failed=1; echo "== $name failed (exit $rc$([ "$rc" = 124 ] && echo ', timed out'))" | tee -a "$LOG"; }
}

if [ "$PART" = a ]; then
  # limits: 15 + 30 + 30 + 220 = 295 s, inside the 5 minutes with the summary
  step facts 15 "$PYTHON" verify/gpu_probe.py facts "$OUT/a-facts.json"
  step ipc 30 "$PYTHON" verify/gpu_probe.py ipc "$OUT/a-ipc.json"
  step ceilings 30 "$PYTHON" -m moeflow bench roofline --ceilings-only --device "$DEVICE" --json "$OUT/a-ceilings.json"
  PER_TEST=()
  "$PYTHON" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout=60)
  export MOEFLOW_GPU_CHECK_OUT="$OUT/a-results.jsonl"  # tests/gpu record(): one line per result
  MARK="gpu"
  [ "$REHEARSE" = 1 ] && MARK="gpu and not slow"
  step tests 220 "$PYTHON" -m pytest -m "$MARK" tests/gpu -q -rfEs -p no:cacheprovider "${PER_TEST[@]}" \
    --junitxml="$OUT/a-tests.xml"
else
  # limits: 270 + 150 = 420 s, inside the 7 minutes with the summary
  if [ "$REHEARSE" = 1 ]; then
    ROOF=(--shape tiny --layers 2 --prefill-batch 2 --prefill-len 128 --decode-batches 2 4 --context 128)
    DEC=(--context 128 --batch 4 --steps 4 --repeats 1)
    sed -e 's/device: cuda/device: cpu/g' -e 's/cuda-ipc/deferred/g' configs/gpu-decode.yaml > "${TMPDIR:-/tmp}/gpu-decode-rehearsal.yaml"
    CONFIG="${TMPDIR:-/tmp}/gpu-decode-rehearsal.yaml"
  else
    ROOF=(--shape qwen3-30b-a3b --layers 48)
    DEC=()
    CONFIG=configs/gpu-decode.yaml
  fi
  step roofline 270 "$PYTHON" -m moeflow bench roofline "${ROOF[@]}" --device "$DEVICE" \
    --json "$OUT/b-roofline.json" --md "$OUT/b-roofline.md"
  step decode 150 "$PYTHON" -m moeflow bench decode "$CONFIG" "${DEC[@]}" --json "$OUT/b-decode.json" \
    --md "$OUT/b-decode.md"
fi
"$PYTHON" verify/gpu_probe.py summary "$OUT" "$PART" | tee -a "$LOG" || failed=1
echo "$(ls "$OUT" | grep -c "^$PART") files under $OUT" | tee -a "$LOG"
exit "$failed"
