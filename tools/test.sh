#!/usr/bin/env bash
# Sets up the build (tools/setup.sh) and runs every test target, then prints one line per target
# and a final "N passed, N failed". GPU-tagged targets whose tests all skipped (no device here) are
# listed as SKIP and counted apart, never as passed. Exits non-zero if anything failed.
# Extra arguments go to `bazel test` (e.g. --config=asan).
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh || { echo "setup failed"; echo "0 passed, 1 failed"; exit 1; }

log=$(mktemp)
bazel test //... --keep_going --test_summary=short "$@" 2>&1 | tee "$log"
bazel_rc=${PIPESTATUS[0]}
testlogs=$(bazel info bazel-testlogs "$@" 2>/dev/null)

passed=0; failed=0; skipped=0
echo
echo "== tqkv test summary =="
while read -r target status; do
  xml="$testlogs/$(sed -e 's|^//||' -e 's|:|/|' <<<"$target")/test.xml"
  if [ "$status" = PASSED ] && [ -f "$xml" ] && grep -q 'result="skipped"' "$xml" &&
     ! grep -q 'result="completed"' "$xml"; then
    echo "SKIP  $target (every test skipped: no CUDA device here)"
    skipped=$((skipped + 1))
  elif [ "$status" = PASSED ]; then
    echo "PASS  $target"
    passed=$((passed + 1))
  else
    echo "FAIL  $target ($status)"
    failed=$((failed + 1))
  fi
done < <(grep -E '^//[^ ]+ +(\(cached\) )?(PASSED|FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD|FLAKY|INCOMPLETE|REMOTE FAILURE)' "$log" |
         sed -E 's/^(\/\/[^ ]+) +(\(cached\) )?(PASSED|FAILED TO BUILD|FAILED|TIMEOUT|NO STATUS|FLAKY|INCOMPLETE|REMOTE FAILURE).*/\1 \3/' |
         sed -E 's/ (FAILED TO BUILD|NO STATUS|REMOTE FAILURE)$/ FAILED/')
rm -f "$log"
if [ $((passed + failed + skipped)) -eq 0 ] || { [ "$bazel_rc" -ne 0 ] && [ "$failed" -eq 0 ]; }; then
  echo "FAIL  bazel test exited $bazel_rc without a per-target failure (build or analysis error)"
  failed=$((failed + 1))
fi
echo "$skipped skipped (GPU tests without a device; they run on the H200 via tools/gpu_bundle.sh)"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
