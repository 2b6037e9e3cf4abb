#!/usr/bin/env bash
# Builds every test tagged "gpu", every binary tagged "benchmark" and the tqkv program, and copies
# them with their non-system shared libraries and a runner into a git-ignored folder (default
# .gpu_bundle/). A GPU machine with the CUDA runtime but no Bazel then runs them all with
#   bash .gpu_bundle/run_all.sh            (tests, then benchmarks)
#   bash .gpu_bundle/run_all.sh tests      (tests only)
# Usage: tools/gpu_bundle.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.gpu_bundle}

tests=$(bazel query 'attr(tags, "\bgpu\b", tests(//...))' 2>/dev/null | sort)
benches=$(bazel query 'attr(tags, "\bbenchmark\b", kind("cc_binary", //...))' 2>/dev/null | sort)
bazel build $tests $benches //tools:tqkv //tools/bench:initcheck_cublas_probe

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
label_to_path() { sed -e 's|^//||' -e 's|:|/|' <<<"$1"; }
copy_binary() {  # copy_binary LABEL -> prints the bundle-relative path
  local rel; rel=$(label_to_path "$1")
  mkdir -p "$out/bin/$(dirname "$rel")"
  cp -f "bazel-bin/$rel" "$out/bin/$rel"
  chmod u+w "$out/bin/$rel"
  # Shared libraries from Debian packages (fmt, spdlog, benchmark) do not exist on the GPU
  # machine; glibc, libstdc++ and the CUDA libraries do.
  ldd "bazel-bin/$rel" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*) ;;
      libcublas*|libcudart*|libcuda.so*) ;;
      *) cp -fL "$lib" "$out/lib/" ;;
    esac
  done
  echo "bin/$rel"
}

: >"$out/tests.txt"
for t in $tests; do copy_binary "$t" >>"$out/tests.txt"; done
: >"$out/benchmarks.txt"
for b in $benches; do copy_binary "$b" >>"$out/benchmarks.txt"; done
copy_binary //tools:tqkv >/dev/null
copy_binary //tools/bench:initcheck_cublas_probe >/dev/null
cp tools/gpu_bundle_run_all.sh "$out/run_all.sh"
cp tools/gpu_check.sh tools/sim_compare.py tools/testdata/make_cli_inputs.py \
  tools/bench/torch_decode_bench.py tools/bench/decode_gpu_run.sh tools/bench/store_gpu_run.sh \
  tools/bench/store_seed_bench.py tools/bench/ab_run.sh tools/bench/torch_attention_bench.py \
  tools/bench/attention_gpu_run.sh tools/bench/ab_attention.sh tools/bench/gtest_shards.sh "$out/"
chmod +x "$out/run_all.sh" "$out/gpu_check.sh"
echo "bundle in $out: $(wc -l <"$out/tests.txt") tests, $(wc -l <"$out/benchmarks.txt") benchmarks"
