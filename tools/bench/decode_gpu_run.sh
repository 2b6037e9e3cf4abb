#!/usr/bin/env bash
# One GPU-machine call for the decode kernel (issue 5): its GPU tests (checked against the CPU
# reference before anything is timed), PyTorch's bf16 SDPA decode (torch_decode_bench.py) and
# tools/bench/decode_bench in the same call, and optionally an ncu summary of one shape.
# Expects the bundle of tools/gpu_bundle.sh. Writes into $OUT (default /tmp/decode_out):
# all_logs.txt (decode_bench's lines annotated with the SM clock, power and power-cap samples
# taken while each shape ran), torch.json, decode_bench.json, decode_bench.txt (its raw output,
# timestamped) and clocks.txt (the samples).
#   decode_gpu_run.sh [--quick] [--skip-tests] [--ncu KIND:BATCH:CONTEXT]
# (--skip-tests: the benchmarks only, for a call whose tests ran in the call before on the same
# bundle; the decode_cuda_test, as 4 shards at once, ~80 s on an H100.)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/decode_out}
quick="" ncu_shape="" skip_tests=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=--quick ;;
    --skip-tests) skip_tests=1 ;;
    --ncu) ncu_shape=$2; shift ;;
  esac
  shift
done
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv
  if [ -z "$skip_tests" ]; then
    echo "== decode GPU tests"
    bash "$here/gtest_shards.sh" 4 400 "$out/decode_cuda_test.log" \
      "$here/bin/attention/decode_cuda_test"
    echo "decode_cuda_test exit $?"
    grep -E '^\[  (PASSED|FAILED)' "$out/decode_cuda_test.log"
  fi
  echo "== PyTorch SDPA"
  timeout 200 python3 "$here/torch_decode_bench.py" "$out/torch.json" $quick
  echo "torch exit $?"
  echo "== decode_bench"
  # The SM clock, power and throttle reasons sampled while it runs, so that each shape's line can
  # say what clock it ran at: sustained large shapes reach the board's power cap.
  ( while :; do
      echo "$(date +%s.%N) $(nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active \
        --format=csv,noheader,nounits 2>/dev/null)"
      sleep 0.1
    done ) >"$out/clocks.txt" &
  sampler=$!
  timeout 300 "$here/bin/tools/bench/decode_bench" $quick --torch-json "$out/torch.json" \
    --json "$out/decode_bench.json" | while IFS= read -r line; do echo "$(date +%s.%N) $line"; done \
    >"$out/decode_bench.txt"
  echo "decode_bench exit ${PIPESTATUS[0]}"
  kill "$sampler" 2>/dev/null
  python3 - "$out/decode_bench.txt" "$out/clocks.txt" <<'PY'
import sys
samples = []
for l in open(sys.argv[2]):
    f = l.replace(",", " ").split()
    if len(f) >= 4:
        try:
            samples.append((float(f[0]), float(f[1]), float(f[2]), int(f[3], 16)))
        except ValueError:
            pass
prev = None
for l in open(sys.argv[1]):
    ts, _, text = l.rstrip("\n").partition(" ")
    t = float(ts)
    if prev is not None and "B=" in text:
        s = [x for x in samples if prev <= x[0] <= t]
        if s:
            capped = sum(1 for x in s if x[3] & 0x4)
            text += "  [SM %d-%d MHz, <= %.0f W, power-capped %d of %d samples]" % (
                min(x[1] for x in s), max(x[1] for x in s), max(x[2] for x in s), capped, len(s))
    print(text)
    prev = t
PY
  if [ -n "$ncu_shape" ] && command -v ncu >/dev/null; then
    echo "== ncu $ncu_shape"
    timeout 150 ncu --clock-control none -k regex:"DecodeSplitKernel|QueryPrep|DecodeMerge" -c 3 \
      --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section SchedulerStats --section WarpStateStats \
      --metrics "smsp__inst_executed.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      "$here/bin/tools/bench/decode_bench" --only "$ncu_shape" 2>&1 | grep -v "^==PROF==" | head -n 120
  fi
} 2>&1 | tee "$out/all_logs.txt"
