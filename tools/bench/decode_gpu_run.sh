#!/usr/bin/env bash
# One GPU-machine call for the decode kernel (issue 5): its GPU tests (checked against the CPU
# reference before anything is timed), PyTorch's bf16 SDPA decode (torch_decode_bench.py) and
# tools/bench/decode_bench in the same call, and optionally an ncu summary of one shape.
# Expects the bundle of tools/gpu_bundle.sh. Writes into $OUT (default /tmp/decode_out):
# all_logs.txt, torch.json, decode_bench.json.
#   decode_gpu_run.sh [--quick] [--ncu KIND:BATCH:CONTEXT]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/decode_out}
quick="" ncu_shape=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=--quick ;;
    --ncu) ncu_shape=$2; shift ;;
  esac
  shift
done
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv
  echo "== decode GPU tests"
  timeout 420 "$here/bin/attention/decode_cuda_test" 2>&1 | tail -n 40
  echo "decode_cuda_test exit ${PIPESTATUS[0]}"
  echo "== PyTorch SDPA"
  timeout 200 python3 "$here/torch_decode_bench.py" "$out/torch.json" $quick
  echo "torch exit $?"
  echo "== decode_bench"
  timeout 300 "$here/bin/tools/bench/decode_bench" $quick --torch-json "$out/torch.json" \
    --json "$out/decode_bench.json"
  echo "decode_bench exit $?"
  if [ -n "$ncu_shape" ] && command -v ncu >/dev/null; then
    echo "== ncu $ncu_shape"
    timeout 150 ncu --clock-control none -k regex:"DecodeSplitKernel|QueryPrep|DecodeMerge" -c 3 \
      --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section SchedulerStats --section WarpStateStats \
      --metrics "smsp__inst_executed.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      "$here/bin/tools/bench/decode_bench" --only "$ncu_shape" 2>&1 | grep -v "^==PROF==" | head -n 120
  fi
} 2>&1 | tee "$out/all_logs.txt"
