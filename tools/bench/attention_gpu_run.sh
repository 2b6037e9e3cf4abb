#!/usr/bin/env bash
# One GPU-machine call for attention over several new tokens per sequence (issue 35): its GPU
# tests (query_prep_cuda_test, decode_cuda_test (the split kernels verify passes run on),
# attention_cuda_test, sim_cuda_test, cuda_engine_test: every kernel against a CPU reference
# before anything is timed), then attention_bench and its peers (torch_attention_bench.py: PyTorch SDPA
# bf16 and dequantize-then-SDPA) on the same shapes in the same call, and the joint table last.
# Expects the bundle of tools/gpu_bundle.sh. Writes into $OUT (default /tmp/attention_out): the
# test logs, attention_bench.json / .txt, peers.json and peers.txt (the joint table).
#   attention_gpu_run.sh [--skip-tests] [--kind KIND] [--only TEXT] [--ncu TEXT]
# (--kind / --only: attention_bench's; the peers run on the shapes it measured.) --ncu TEXT: last,
# ncu of the first attention kernel (split, prefill or chunk kernel) of the shape whose name
# contains TEXT, on --kind (default turboquant_4bit_nc): the summary sections and the warp stall
# reasons printed, the whole report (ncu.ncu-rep) and its per-instruction SASS table with stall
# samples (ncu_sass.csv) in $OUT.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/attention_out}
skip_tests="" bench_args=() ncu_shape="" ncu_kind=turboquant_4bit_nc
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-tests) skip_tests=1 ;;
    --kind | --only)
      bench_args+=("$1" "$2")
      [ "$1" = --kind ] && ncu_kind=$2
      shift
      ;;
    --ncu) ncu_shape=$2; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
if [ -z "$skip_tests" ]; then
  for t in attention/query_prep_cuda_test attention/decode_cuda_test attention/attention_cuda_test \
    tools/sim_cuda_test model/cuda_engine_test; do
    name=$(basename "$t")
    # The two long ones as 4 shards at once (gtest_shards.sh; H100: decode_cuda_test 322 s in one
    # process, 77 s in four; attention_cuda_test 112 s, 47 s).
    case "$name" in
      decode_cuda_test | attention_cuda_test)
        bash "$here/gtest_shards.sh" 4 400 "$out/$name.log" "$here/bin/$t" --gtest_brief=1 ;;
      *) timeout 300 "$here/bin/$t" --gtest_brief=1 >"$out/$name.log" 2>&1 ;;
    esac
    rc=$?
    echo "$name exit $rc: $(grep -E '^\[  (PASSED|FAILED)' "$out/$name.log" | tr '\n' ' ')"
    grep -E "worst" "$out/$name.log"
    [ "$rc" -eq 0 ] || status=1
  done
fi
timeout 400 "$here/bin/tools/bench/attention_bench" --json "$out/attention_bench.json" \
  "${bench_args[@]}" >"$out/attention_bench.txt" 2>&1
echo "attention_bench exit $?"
timeout 300 python3 "$here/torch_attention_bench.py" --ours "$out/attention_bench.json" \
  --out "$out/peers.json" >"$out/peers.txt" 2>&1
echo "torch_attention_bench exit $?"
grep -E '^\| ' "$out/peers.txt"
if [ -n "$ncu_shape" ]; then
  if command -v ncu >/dev/null; then
    echo "== ncu $ncu_kind: $ncu_shape"
    timeout 300 ncu --set full --import-source no --clock-control none -c 1 -f \
      -k regex:"DecodeSplitKernel|PrefillWgmmaKernel|PrefillAttentionKernel|ChunkAttentionKernel" \
      -o "$out/ncu" "$here/bin/tools/bench/attention_bench" --kind "$ncu_kind" --only "$ncu_shape" \
      >"$out/ncu_run.txt" 2>&1
    echo "ncu exit $?"
    ncu -i "$out/ncu.ncu-rep" --page details --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section SchedulerStats --section WarpStateStats 2>&1 | head -n 150
    ncu -i "$out/ncu.ncu-rep" --page raw --csv \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      >"$out/ncu_stalls.csv" 2>&1
    ncu -i "$out/ncu.ncu-rep" --page source --csv --print-source sass >"$out/ncu_sass.csv" 2>&1
    echo "ncu source page exit $? ($(wc -l <"$out/ncu_sass.csv") lines in ncu_sass.csv)"
  else
    echo "ncu: not found"
    status=1
  fi
fi
exit $status
