#!/usr/bin/env bash
# The offload engine's GPU check, in one command, on a CUDA machine with its own torch and no internet.
#
#   bash benchmarks/gpu_check.sh           # CUDA: install, checks, CUDA tests, benchmark; ends within 8 minutes
#   bash benchmarks/gpu_check.sh --tiny    # the same script on the CPU in seconds (tests/test_gpu_check.py runs it)
#
# Install: torch is never touched. Wheels in .whl/ (optree for the machine's Python: see docs/offloading.md,
# "The GPU check") go to /tmp/site with pip --no-index --no-deps --target; remat itself is imported from this
# checkout through PYTHONPATH. Then, each stage with a time limit inside one overall budget:
#   1. benchmarks/gpu_check.py: environment; exactness under delayed copies; waits under the cap; pinned pool; prefetch;
#      in-place writes
#   2. the CUDA tests: pytest -k "gpu or cuda" over tests/test_offload_gpu.py and tests/test_transforms.py
#   3. benchmarks/budget_gpu.py: the device model probed; the transformer stack under keep/recompute and
#      keep/offload/recompute budgets at 10% and 25%, and compiled with offload_to_cpu per block: held and peak
#      device MiB, step time against no remat, bytes copied
#   4. benchmarks/offload_gpu.py: leak check, per row peak allocated / reserved, retries, syncs, bytes moved,
#      times, copy bandwidth and how much of the copy time shows in the step time
# and a summary in markdown at the end (the last lines of the output hold every result).
#
# Environment: PYTHON (default python3); BENCH_ARGS (arguments of offload_gpu.py, default "--rounds 3");
# GPU_CHECK_LOGDIR (each stage's full log is kept there, default a new temporary folder);
# GPU_CHECK_BUDGET_S (overall limit in seconds, default 540).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
TINY=0
case "${1:-}" in
  --tiny) TINY=1 ;;
  "") ;;
  *) echo "usage: bash benchmarks/gpu_check.sh [--tiny]" >&2; exit 2 ;;
esac
LOGDIR=${GPU_CHECK_LOGDIR:-$(mktemp -d)}
mkdir -p "$LOGDIR"
BUDGET=${GPU_CHECK_BUDGET_S:-540}
export PYTHONUNBUFFERED=1
START=$SECONDS
SUMMARY=()
FAILED=0

# stage NAME LIMIT_S LOG COMMAND...: run with a time limit (at most what is left of the budget), log kept
stage() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  echo
  echo "### $name"
  echo
  if [ "$limit" -le 5 ]; then
    echo "not run: the ${BUDGET} s budget is spent"
    SUMMARY+=("| $name | NOT RUN (budget spent) | 0 s |")
    FAILED=1
    return
  fi
  local t0=$SECONDS rc status
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$LOGDIR/$log"
  rc=${PIPESTATUS[0]}
  status="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status="TIMED OUT after ${limit} s"
    FAILED=1
  elif [ "$rc" -ne 0 ]; then
    status="FAILED (exit $rc)"
    FAILED=1
  fi
  SUMMARY+=("| $name | $status | $((SECONDS - t0)) s |")
}

echo "## remat GPU check$([ $TINY -eq 1 ] && echo ' (--tiny)')"
echo
if [ $TINY -eq 0 ] && compgen -G ".whl/*.whl" >/dev/null; then
  echo "installing $(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ')into /tmp/site (no index, no dependencies)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "**FAIL** pip could not install the wheels in .whl/"; exit 2; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import optree, remat" 2>"$LOGDIR/import.log"; then
  cat "$LOGDIR/import.log"
  echo "**FAIL** remat does not import with $PY: bring an optree wheel for this Python in .whl/ (docs/offloading.md)"
  exit 2
fi
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [ $TINY -eq 0 ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fi

if [ $TINY -eq 1 ]; then
  stage "checks (benchmarks/gpu_check.py --tiny)" 120 checks.log "$PY" benchmarks/gpu_check.py --tiny
  echo
  echo "### CUDA tests"
  echo
  echo "skipped with --tiny: they skip without CUDA, and the test suite runs the rest"
  SUMMARY+=("| CUDA tests | skipped (--tiny) | 0 s |")
  stage "budgets (benchmarks/budget_gpu.py --tiny)" 120 budget.log "$PY" benchmarks/budget_gpu.py --tiny
  stage "benchmark (benchmarks/offload_gpu.py --tiny)" 120 bench.log "$PY" benchmarks/offload_gpu.py --tiny
else
  stage "checks (benchmarks/gpu_check.py)" 120 checks.log "$PY" benchmarks/gpu_check.py
  stage "CUDA tests (pytest -k 'gpu or cuda')" 120 tests.log \
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_offload_gpu.py tests/test_transforms.py -k "gpu or cuda"
  stage "budgets (benchmarks/budget_gpu.py)" 90 budget.log "$PY" benchmarks/budget_gpu.py
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
  stage "benchmark (benchmarks/offload_gpu.py ${BENCH_ARGS:---rounds 3})" 400 bench.log \
    "$PY" benchmarks/offload_gpu.py ${BENCH_ARGS:---rounds 3}
fi

echo
echo "## Summary"
echo
echo "| stage | result | time |"
echo "|---|---|---|"
printf '%s\n' "${SUMMARY[@]}"
echo
grep -h -E '^- (\*\*PASS\*\*|\*\*FAIL\*\*|SKIP) |^  - |^gpu_check: ' "$LOGDIR/checks.log" 2>/dev/null
if [ -f "$LOGDIR/tests.log" ]; then
  echo
  echo "CUDA tests: $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$LOGDIR/tests.log" | tail -1)"
fi
echo
grep -E '^(budget_gpu: |\|)' "$LOGDIR/budget.log" 2>/dev/null
echo
grep -E '^(transformer |leak check|\||copy bandwidth|offload-to-cpu|torchtune-style)' "$LOGDIR/bench.log" 2>/dev/null
echo
RESULT=$([ $FAILED -eq 0 ] && echo 'all stages passed' || echo 'SOME STAGES FAILED')
echo "gpu_check.sh: $RESULT in $((SECONDS - START)) s; logs in $LOGDIR"
exit $FAILED
