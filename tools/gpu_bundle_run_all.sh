#!/usr/bin/env bash
# Runner inside the GPU bundle (copied there by tools/gpu_bundle.sh as run_all.sh).
#   run_all.sh [all]      every test binary, then every benchmark
#   run_all.sh tests      the tests only
#   run_all.sh sanitize   the tests under compute-sanitizer's memcheck, racecheck, synccheck and
#                         initcheck (SANITIZE_TOOLS to pick; SANITIZE_TIMEOUT seconds per run, 900),
#                         each on the test subset below that
#                         covers every kernel family at sizes the tools finish in minutes
# Prints one line per run and a final "N passed, N failed". On the GPU machine a skipped test
# counts as a failure: there is a device, so nothing may skip; under a sanitizer any reported error
# fails the run. Logs go to $LOG_DIR (default: logs/ beside this script); benchmark arguments and
# outputs: $BENCH_ARGS, and benchmarks may write into $LOG_DIR.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
export LD_LIBRARY_PATH="$here/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
what=${1:-all}
log_dir=${LOG_DIR:-$here/logs}
mkdir -p "$log_dir"

passed=0; failed=0
run_one() {  # run_one KIND PATH [ARGS...]; KIND test, bench or sanitize:TOOL
  local kind=$1 bin=$2; shift 2
  local name; name=$(sed -e 's|^bin/||' -e 's|/|_|g' <<<"$bin")
  local log="$log_dir/$name.log" start end rc
  local prefix=() label=$bin
  if [[ $kind == sanitize:* ]]; then
    label="$bin (${kind#sanitize:})"
    # Tests provoke API errors on purpose (bad launches, bad arguments): only device-side errors
    # count. --error-exitcode makes any report fail the run.
    prefix=(timeout "${SANITIZE_TIMEOUT:-900}" "$sanitizer" --tool "${kind#sanitize:}" --error-exitcode 86
            --report-api-errors no --print-limit 20)
    log="$log_dir/$name.${kind#sanitize:}.log"
    kind=test
  elif [ "$kind" = test ]; then
    case "$bin" in
      # The two long ones as 4 shards at once (gtest_shards.sh: their time is mostly the CPU
      # reference; on an H100 decode_cuda_test 322 -> 77 s). It writes the shards' logs into $log.
      *decode_cuda_test | *attention_cuda_test) prefix=(bash "$here/gtest_shards.sh" 4 900 "$log") ;;
    esac
  fi
  start=$(date +%s.%N)
  if [[ ${prefix[0]:-} == bash ]]; then
    "${prefix[@]}" "./$bin" "$@" >/dev/null 2>&1; rc=$?
  else
    "${prefix[@]}" "./$bin" "$@" >"$log" 2>&1; rc=$?
  fi
  end=$(date +%s.%N)
  local secs; secs=$(awk -v a="$start" -v b="$end" 'BEGIN {printf "%.1f", b - a}')
  local detail=""
  if [ "$kind" = test ]; then
    local ran skipped
    # (Summed over the shards where a binary ran as several.)
    ran=$(grep -Eo '^\[==========\] [0-9]+ tests? from .* ran' "$log" |
      awk '{s += $2; n++} END {if (n) print s}')
    skipped=$(grep -Eo '^\[  SKIPPED \] [0-9]+ test' "$log" | awk '{s += $4} END {print s + 0}')
    detail="${ran:-?} tests"
    if [ -n "${skipped:-}" ] && [ "$skipped" -gt 0 ]; then
      detail="$detail, $skipped SKIPPED on a GPU machine"
      rc=1
    fi
  fi
  if [ $rc -eq 0 ]; then
    passed=$((passed + 1)); printf 'PASS  %-50s %s %ss\n' "$label" "$detail" "$secs"
  else
    failed=$((failed + 1)); printf 'FAIL  %-50s %s %ss (exit %s, log %s)\n' "$label" "$detail" "$secs" "$rc" "$log"
    tail -n 30 "$log" | sed 's/^/      /'
  fi
}

# The sanitize mode's subset of each test binary (gtest filters), chosen so that each tool finishes
# in minutes: decode's 4bit_nc staged and k8v4 kernels with the merge (ChainedCalls), k3v4_nc's
# hi-only, exact and narrow kernels (K3v4Codebook), the launcher's checks; the store's graph,
# slot-validation, non-finite, MMA-path and binary-search tests and the GEMM path's precisions;
# attention's mixed step (decode rows on the decode kernels, chunk kernel, splits and merge),
# sliding windows and the prefill kernel; every test of the others.
sanitize_filter() {
  case "$1" in
    *decode_cuda_test) echo 'CudaDecodeTest.ChainedCalls*:CudaDecodeTest.K3v4Codebook*:CudaDecodeTest.BadArguments*' ;;
    *attention_cuda_test) echo 'CudaAttentionTest.SplitsMerge*:CudaAttentionTest.SlidingWindow*:CudaAttentionTest.PrefillKernel*:CudaAttentionTest.PlanAndRun*' ;;
    *store_cuda_test) echo 'StoreCudaTest.GraphCapture*:StoreCudaTest.OutOfRange*:StoreCudaTest.NonFinite*:StoreCudaTest.SmallWorkspace*:StoreCudaTest.MmaPath*:StoreCudaTest.CloseMidpoints*:StoreCudaTest.Fp32AccurateGemm*' ;;
    # Timing assertions do not hold under a sanitizer; the sim test runs 3 sims (racecheck: >100 s).
    *cuda_runtime_test) echo '*:-CudaRuntimeTest.EventsMeasureTime' ;;
    *sim_cuda_test) echo 'SimCudaTest.FourBit*' ;;
    *) echo '*' ;;
  esac
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /'
if [ "$what" = sanitize ]; then
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
    while read -r t; do
      [ -n "$t" ] && run_one "sanitize:$tool" "$t" --gtest_filter="$(sanitize_filter "$t")"
    done <tests.txt
    if [ "$tool" = initcheck ] && [ -x bin/tools/bench/initcheck_cublas_probe ]; then
      # Why the store marks cuBLAS's output initialized (quant/store_cuda.cc): reports on a bare
      # GEMM's output without the mark, none with it. Information, not a pass or fail.
      for c in bf16 bf16-marked; do
        "$sanitizer" --tool initcheck --print-limit 0 bin/tools/bench/initcheck_cublas_probe "$c" \
          >"$log_dir/initcheck_cublas_probe.$c.log" 2>&1
        printf 'INFO  initcheck on a cuBLAS bf16 GEMM output, case %-12s %s reports\n' "$c" \
          "$(grep -Eo 'ERROR SUMMARY: [0-9]+' "$log_dir/initcheck_cublas_probe.$c.log" | grep -Eo '[0-9]+' || echo '?')"
      done
    fi
  done
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ]
  exit
fi
while read -r t; do [ -n "$t" ] && run_one test "$t"; done <tests.txt
if [ "$what" != tests ]; then
  while read -r b; do [ -n "$b" ] && run_one bench "$b" ${BENCH_ARGS:-}; done <benchmarks.txt
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
