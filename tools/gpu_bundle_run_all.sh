#!/usr/bin/env bash
# Runner inside the GPU bundle (copied there by tools/gpu_bundle.sh as run_all.sh).
# Runs every test binary (and, unless told "tests", every benchmark), prints one line per binary
# and a final "N passed, N failed". On the GPU machine a skipped test counts as a failure: there
# is a device, so nothing may skip. Logs go to $LOG_DIR (default: logs/ beside this script);
# benchmark arguments and outputs: $BENCH_ARGS, and benchmarks may write into $LOG_DIR.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
export LD_LIBRARY_PATH="$here/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
what=${1:-all}
log_dir=${LOG_DIR:-$here/logs}
mkdir -p "$log_dir"

passed=0; failed=0
run_one() {  # run_one KIND PATH [ARGS...]
  local kind=$1 bin=$2; shift 2
  local name; name=$(sed -e 's|^bin/||' -e 's|/|_|g' <<<"$bin")
  local log="$log_dir/$name.log" start end rc
  start=$(date +%s.%N)
  "./$bin" "$@" >"$log" 2>&1; rc=$?
  end=$(date +%s.%N)
  local secs; secs=$(awk -v a="$start" -v b="$end" 'BEGIN {printf "%.1f", b - a}')
  local detail=""
  if [ "$kind" = test ]; then
    local ran skipped
    ran=$(grep -Eo '^\[==========\] [0-9]+ tests? from .* ran' "$log" | grep -Eo '[0-9]+' | head -1)
    skipped=$(grep -Eo '^\[  SKIPPED \] [0-9]+ test' "$log" | grep -Eo '[0-9]+' | head -1)
    detail="${ran:-?} tests"
    if [ -n "${skipped:-}" ] && [ "$skipped" -gt 0 ]; then
      detail="$detail, $skipped SKIPPED on a GPU machine"
      rc=1
    fi
  fi
  if [ $rc -eq 0 ]; then
    passed=$((passed + 1)); printf 'PASS  %-50s %s %ss\n' "$bin" "$detail" "$secs"
  else
    failed=$((failed + 1)); printf 'FAIL  %-50s %s %ss (exit %s, log %s)\n' "$bin" "$detail" "$secs" "$rc" "$log"
    tail -n 30 "$log" | sed 's/^/      /'
  fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /'
while read -r t; do [ -n "$t" ] && run_one test "$t"; done <tests.txt
if [ "$what" != tests ]; then
  while read -r b; do [ -n "$b" ] && run_one bench "$b" ${BENCH_ARGS:-}; done <benchmarks.txt
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
