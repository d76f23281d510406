#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on a machine with one CUDA device and its own python (torch,
# transformers; no make, no pip, no pytest needed), in a copy of this working tree:
#
#   OUT=gpu-check-out PYTHON=python3 bash verify/gpu_check.sh     # about 5 minutes at most
#   bash verify/gpu_check.sh --dry-run                            # any machine, no GPU: is it all in place?
#
# Steps, each under a time limit: the versions and the device; `pytest -m gpu tests/gpu -x` (or
# verify/mini_pytest.py where pytest is missing); one `moeflow bench decode --device cuda`; then
# OUT/summary.{md,json}. Everything goes under OUT; the exit status is non-zero if a step failed,
# and the summary is written either way.
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
OUT=${OUT:-./gpu-check-out}
DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: [OUT=DIR] [PYTHON=python3] bash verify/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # no `pip install -e .` there: the tree itself
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
export MOEFLOW_CACHE_DIR=${MOEFLOW_CACHE_DIR:-${TMPDIR:-/tmp}/moeflow-gpu-check-cache}  # the embedded model, written once

# the one bench command: the embedded model, dtype auto (bf16 on a GPU with native bf16)
BENCH=(bench decode --model tiny --device cuda --context 512 --batch 16 --steps 32 --repeats 2)
TESTS=(tests/gpu/cuda_support.py tests/gpu/test_hf_parity_cuda.py tests/gpu/test_paged_decode_cuda.py
       tests/gpu/test_experts_cuda.py tests/gpu/test_sampling_cuda.py tests/gpu/test_speed_vs_transformers_cuda.py
       tests/gpu/test_transport_cuda.py tests/integration/comm_harness.py tests/integration/comm_deploy.py
       tests/conftest.py verify/mini_pytest.py verify/gpu_check.py docs/gpu.md)

cd "$ROOT" || exit 2
if [ "$DRY_RUN" = 1 ]; then
  rc=0
  for f in "${TESTS[@]}"; do
    [ -f "$f" ] || { echo "FAIL missing: $f"; rc=1; }
  done
  [ "$rc" = 0 ] && echo "PASS files: the script's ${#TESTS[@]} pieces are in place"
  command -v timeout >/dev/null || echo "NOTE timeout(1) is missing here: a real run would have no step limits"
  "$PYTHON" verify/gpu_check.py dry-run -- "${BENCH[@]}" || rc=1
  if "$PYTHON" -c "import pytest" 2>/dev/null; then
    n=$("$PYTHON" -m pytest -m gpu --collect-only -q -p no:cacheprovider tests/gpu 2>&1 | grep -c '::')
    if [ "$n" -gt 0 ]; then echo "PASS pytest collects $n gpu tests"; else echo "FAIL pytest collects no gpu tests"; rc=1; fi
  else
    echo "NOTE pytest is not installed for $PYTHON: a real run would use verify/mini_pytest.py"
  fi
  echo "dry run of verify/gpu_check.sh: $([ "$rc" = 0 ] && echo ok || echo FAILED)"
  exit "$rc"
fi

mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
export MOEFLOW_GPU_CHECK_OUT="$OUT/results"  # tests/gpu record() writes its numbers here
: > "$OUT/steps.tsv"
failed=0

# step NAME LIMIT_S CMD...: run CMD under a time limit, its output to OUT/NAME.log (and the terminal)
step() {
  local name=$1 limit=$2 t0 rc
  shift 2
  echo "== $name (limit ${limit} s): $*"
  t0=$(date +%s)
  if command -v timeout >/dev/null; then
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  else
    "$@" 2>&1 | tee "$OUT/$name.log"
  fi
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$limit" >> "$OUT/steps.tsv"
  [ "$rc" = 0 ] || { failed=1; echo "== $name failed (exit $rc$([ "$rc" = 124 ] && echo ', timed out'))"; }
}

# limits: 20 + 190 + 80 = 290 s, inside the 5 minutes with the summary
step env 20 "$PYTHON" verify/gpu_check.py env "$OUT/env.json"
if "$PYTHON" -c "import pytest" 2>/dev/null; then
  step tests 190 "$PYTHON" -m pytest -m gpu tests/gpu -x -q -rA -s -p no:cacheprovider --junitxml="$OUT/pytest.xml"
else
  echo "pytest is not installed for $PYTHON: running the gpu tests with verify/mini_pytest.py"
  step tests 190 "$PYTHON" verify/mini_pytest.py -m gpu tests/gpu -x --json "$OUT/tests.json"
fi
step bench_decode 80 "$PYTHON" -m moeflow "${BENCH[@]}" --json "$OUT/bench_decode.json" --md "$OUT/bench_decode.md"
"$PYTHON" verify/gpu_check.py summary "$OUT" || failed=1
echo "results under $OUT (summary.md, summary.json, one log per step)"
exit "$failed"
