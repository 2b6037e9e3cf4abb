#!/usr/bin/env bash
# Sets up the build (tools/setup.sh) and runs every test target, then prints one line per target
# and a final "N passed, N failed". GPU-tagged targets whose tests all skipped (no device here) are
# listed as SKIP and counted apart, never as passed. Then runs //kvcache/... again under
# AddressSanitizer (--config=asan); those targets are listed and counted as "... (asan)".
# Exits non-zero if anything failed. Extra arguments go to both `bazel test` runs.
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh || { echo "setup failed"; echo "0 passed, 1 failed"; exit 1; }

passed=0; failed=0; skipped=0

# summarize LOG TESTLOGS SUFFIX BAZEL_RC: one line per target of a `bazel test` log, counted into
# passed / failed / skipped.
summarize() {
  local log=$1 testlogs=$2 suffix=$3 rc=$4 seen=0 failed_before=$failed target status xml
  while read -r target status; do
    seen=$((seen + 1))
    xml="$testlogs/$(sed -e 's|^//||' -e 's|:|/|' <<<"$target")/test.xml"
    if [ "$status" = PASSED ] && [ -f "$xml" ] && grep -q 'result="skipped"' "$xml" &&
       ! grep -q 'result="completed"' "$xml"; then
      echo "SKIP  $target$suffix (every test skipped: no CUDA device here)"
      skipped=$((skipped + 1))
    elif [ "$status" = PASSED ]; then
      echo "PASS  $target$suffix"
      passed=$((passed + 1))
    else
      echo "FAIL  $target$suffix ($status)"
      failed=$((failed + 1))
    fi
  done < <(grep -E '^//[^ ]+ +(\(cached\) )?(PASSED|FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD|FLAKY|INCOMPLETE|REMOTE FAILURE)' "$log" |
           sed -E 's/^(\/\/[^ ]+) +(\(cached\) )?(PASSED|FAILED TO BUILD|FAILED|TIMEOUT|NO STATUS|FLAKY|INCOMPLETE|REMOTE FAILURE).*/\1 \3/' |
           sed -E 's/ (FAILED TO BUILD|NO STATUS|REMOTE FAILURE)$/ FAILED/')
  if [ "$seen" -eq 0 ] || { [ "$rc" -ne 0 ] && [ "$failed" -eq "$failed_before" ]; }; then
    echo "FAIL  bazel test${suffix} exited $rc without a per-target failure (build or analysis error)"
    failed=$((failed + 1))
  fi
}

log=$(mktemp)
bazel test //... --keep_going --test_summary=short "$@" 2>&1 | tee "$log"
bazel_rc=${PIPESTATUS[0]}
testlogs=$(bazel info bazel-testlogs "$@" 2>/dev/null)

# Second pass: the block manager under AddressSanitizer + LeakSanitizer (.bazelrc --config=asan,
# a dbg build). Fewer rapidcheck cases there: each runs ~15x slower than in the opt build.
asan_log=$(mktemp)
bazel test //kvcache/... --config=asan --test_env=RC_PARAMS=max_success=80 --keep_going \
  --test_summary=short "$@" 2>&1 | tee "$asan_log"
asan_rc=${PIPESTATUS[0]}
asan_testlogs=$(bazel info bazel-testlogs --config=asan "$@" 2>/dev/null)

echo
echo "== tqkv test summary =="
summarize "$log" "$testlogs" "" "$bazel_rc"
summarize "$asan_log" "$asan_testlogs" " (asan)" "$asan_rc"
rm -f "$log" "$asan_log"
echo "$skipped skipped (GPU tests without a device; they run on the H200 via tools/gpu_bundle.sh)"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
