#!/usr/bin/env bash
# One GPU-machine call for the CUDA store (issue 7): GPU tests, tools/bench/store_bench, the vLLM
# seed beside it (store_seed_bench.py), and `tqkv store --device cuda` against --device cpu.
# Expects the bundle of tools/gpu_bundle.sh with this script, store_seed_bench.py and
# make_cli_inputs.py copied beside run_all.sh, and the seed module in $SEED_DIR (default .seed).
# Writes three files to $OUT (default /tmp/store_out): all_logs.txt, store_bench.json,
# seed_report.json.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/store_out}
seed_dir=$(cd "${SEED_DIR:-.seed}" && pwd)
logs=/tmp/store_logs
rm -rf "$logs" /tmp/store_bench
mkdir -p "$out" "$logs"
export LOG_DIR="$logs"
start=$(date +%s)
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv
  echo "== GPU tests (run_all.sh tests)"
  timeout 230 bash "$here/run_all.sh" tests
  echo "== store_bench"
  export LD_LIBRARY_PATH="$here/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  timeout 150 "$here/bin/tools/bench/store_bench" --out "$logs" --seed-dir /tmp/store_bench
  echo "store_bench exit $?"
  echo "== seed side by side"
  PYTHONUNBUFFERED=1 timeout 170 python3 "$here/store_seed_bench.py" --seed-module "$seed_dir" \
    --inputs /tmp/store_bench --ours "$logs/store_bench.json" --out "$out/seed_report.json"
  echo "seed exit $?"
  echo "== tqkv store --device cuda vs --device cpu"
  tqkv="$here/bin/tools/tqkv"
  for dtype in F32 BF16; do
    python3 "$here/make_cli_inputs.py" /tmp/cli_in.safetensors /tmp/cli_q.safetensors \
      --dtype $dtype --seed 7
    for preset in turboquant_k8v4 turboquant_4bit_nc turboquant_k3v4_nc turboquant_3bit_nc; do
      for rotation in hadamard hadamard_signs haar; do
        args=(store --preset $preset --block-size 16 --num-blocks 10 --rotation $rotation --seed 3
              --in /tmp/cli_in.safetensors)
        "$tqkv" "${args[@]}" --out /tmp/cli_cpu.safetensors
        "$tqkv" "${args[@]}" --device cuda --out /tmp/cli_cuda.safetensors; rc=$?
        ndiff=$(cmp -l /tmp/cli_cpu.safetensors /tmp/cli_cuda.safetensors 2>/dev/null | wc -l)
        echo "cli $dtype $preset $rotation: exit $rc, $ndiff bytes differ from --device cpu"
      done
    done
  done
  "$tqkv" store --preset turboquant_4bit_nc --block-size 16 --num-blocks 2 --device cuda \
    --in /tmp/cli_in.safetensors --out /tmp/cli_bad.safetensors; echo "bad slots: exit $?"
  echo "== ncu: every kernel of store_bench --profile (N = 65,536), full report in ncu.txt"
  ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -n "$ncu_bin" ]; then
    timeout 150 "$ncu_bin" --clock-control none \
      --section SpeedOfLight --section Occupancy --section LaunchStats \
      --metrics smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__bytes.sum \
      "$here/bin/tools/bench/store_bench" --profile > "$out/ncu.txt" 2>&1
    echo "ncu exit $?"
    grep -E "^  [a-zA-Z_].*\(|Duration|smsp__inst_executed|issue_active|dram__bytes|Registers Per|Achieved Occupancy|Grid Size" "$out/ncu.txt"
  else
    echo "no ncu on this machine"
  fi
  echo "elapsed $(( $(date +%s) - start )) s"
} > "$logs/driver.log" 2>&1
{
  cat "$logs/driver.log"
  for f in "$logs"/*.log; do
    [ "$(basename "$f")" = driver.log ] && continue
    echo "===== $f"
    cat "$f"
  done
} > "$out/all_logs.txt" 2>/dev/null
cp "$logs/store_bench.json" "$out/" 2>/dev/null
tail -n 150 "$logs/driver.log"
