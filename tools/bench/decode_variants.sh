#!/usr/bin/env bash
# Builds decode_bench and decode_cuda_test for measurement or experiment builds of the decode
# kernels, each with its own extra nvcc flags (bazel/cuda.bzl's TQKV_NVCC_EXTRA), into
# .gpu_bundle/var/NAME/ beside the bundle of tools/gpu_bundle.sh (run that first: it replaces the
# whole folder). On the GPU machine tools/bench/decode_ab.sh times them side by side.
#   tools/bench/decode_variants.sh NAME="FLAGS" ...
#   e.g. tools/bench/decode_variants.sh copy="-DTQKV_DECODE_COPY_ONLY" compute="-DTQKV_DECODE_COMPUTE_ONLY"
# Ends with a default build again, so that bazel-bin holds the committed kernels.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -d .gpu_bundle ] || { echo "no .gpu_bundle: run tools/gpu_bundle.sh first" >&2; exit 1; }
targets="//tools/bench:decode_bench //attention:decode_cuda_test"
for spec in "$@"; do
  name=${spec%%=*}
  flags=${spec#*=}
  [ -n "$name" ] && [ "$name" != "$spec" ] || { echo "bad variant '$spec' (NAME=FLAGS)" >&2; exit 1; }
  bazel build --define="TQKV_NVCC_EXTRA=$flags" $targets
  mkdir -p ".gpu_bundle/var/$name"
  cp -f bazel-bin/tools/bench/decode_bench bazel-bin/attention/decode_cuda_test ".gpu_bundle/var/$name/"
  chmod u+w ".gpu_bundle/var/$name/"*
  echo "$flags" >".gpu_bundle/var/$name/flags.txt"
  echo "variant $name: $flags"
done
bazel build $targets >/dev/null 2>&1
