#!/usr/bin/env bash
# End-to-end checks on a GPU machine, from the bundle (copied there by tools/gpu_bundle.sh):
#  1. tqkv sim --device cuda against --device cpu on the same workload (decode outputs compared
#     row by row with tools/sim_compare.py);
#  2. tqkv store / decode --device cuda against --device cpu on files written by
#     make_cli_inputs.py (cache bytes compared; decode outputs within the kernel tolerance).
# Usage (on the GPU machine): bash .gpu_bundle/gpu_check.sh [OUT_DIR]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-/tmp/gpu_check}
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
tqkv="$here/bin/tools/tqkv"
failed=0
step() { echo "== $*"; }

step "tqkv sim, cpu vs cuda (same workload)"
args=(sim --requests 16 --json)
"$tqkv" "${args[@]}" "$out/sim_cpu.json" > "$out/sim_cpu.txt" 2>/dev/null || failed=$((failed + 1))
"$tqkv" "${args[@]}" "$out/sim_cuda.json" --device cuda > "$out/sim_cuda.txt" 2>&1 || failed=$((failed + 1))
cat "$out/sim_cuda.txt"
python3 "$here/sim_compare.py" "$out/sim_cpu.json" "$out/sim_cuda.json" 2e-3 || failed=$((failed + 1))

step "tqkv store / decode, cuda vs cpu"
python3 "$here/make_cli_inputs.py" "$out/in.safetensors" "$out/q.safetensors" --dtype BF16 --seed 5
for preset in turboquant_k8v4 turboquant_4bit_nc turboquant_k3v4_nc turboquant_3bit_nc; do
  "$tqkv" store --preset $preset --block-size 16 --num-blocks 10 --in "$out/in.safetensors" \
    --out "$out/c_cpu.safetensors" &&
  "$tqkv" store --preset $preset --block-size 16 --num-blocks 10 --in "$out/in.safetensors" \
    --out "$out/c_cuda.safetensors" --device cuda || failed=$((failed + 1))
  echo "$preset store: $(cmp -l "$out/c_cpu.safetensors" "$out/c_cuda.safetensors" 2>/dev/null | wc -l) bytes differ (cuda vs cpu)"
  for dev in cpu cuda; do
    "$tqkv" decode --preset $preset --cache "$out/c_cpu.safetensors" --in "$out/q.safetensors" \
      --out "$out/o_$dev.safetensors" --device $dev || failed=$((failed + 1))
  done
  python3 - "$out/o_cpu.safetensors" "$out/o_cuda.safetensors" <<'PY' || failed=$((failed + 1))
import sys
from safetensors.numpy import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
scale = abs(a["output"]).max(axis=-1, keepdims=True) + 1e-30
out_err = float((abs(a["output"] - b["output"]) / scale).max())
lse_err = float((abs(a["lse"] - b["lse"]) / abs(a["lse"]).clip(min=1)).max())
ok = out_err <= 2.5e-3 and lse_err <= 1e-3
print(f"  decode cuda vs cpu: output err {out_err:.2e}, lse err {lse_err:.2e} {'ok' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
done
echo "gpu_check: $failed failure(s)"
exit $((failed > 0))
