#!/usr/bin/env bash
# The GPU run's dry run (docs/gpu.md): on any machine, without a GPU, is everything verify/gpu_run.sh
# needs in place (its files, the GPU tests collecting without the server's packages, through pytest
# or verify/mini_pytest.py, the lazy imports, the bench command line)?
#
#   bash verify/gpu_check.sh --dry-run
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
OUT=${OUT:-./gpu-check-out}
DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: [PYTHON=python3] bash verify/gpu_check.sh --dry-run" >&2; exit 2 ;;
esac

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # no `pip install -e .` there: the tree itself
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
export MOEFLOW_CACHE_DIR=${MOEFLOW_CACHE_DIR:-${TMPDIR:-/tmp}/moeflow-gpu-check-cache}  # the embedded model, written once

# the one bench command: the embedded model, dtype auto (bf16 on a GPU with native bf16)
BENCH=(bench decode --model tiny --device cuda --context 512 --batch 16 --steps 32 --repeats 2)
TESTS=(tests/gpu/cuda_support.py tests/gpu/test_hf_parity_cuda.py tests/gpu/test_paged_decode_cuda.py
       tests/gpu/test_experts_cuda.py tests/gpu/test_sampling_cuda.py tests/gpu/test_speed_vs_transformers_cuda.py
       tests/gpu/test_transport_cuda.py tests/integration/comm_harness.py tests/integration/comm_deploy.py
       tests/conftest.py verify/mini_pytest.py verify/gpu_check.py verify/gpu_probe.py verify/gpu_run.sh
       configs/gpu-decode.yaml docs/gpu.md)

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

echo "the GPU run is verify/gpu_run.sh a, then b (docs/gpu.md); this script checks what it needs: --dry-run" >&2
exit 2
