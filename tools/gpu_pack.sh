#!/usr/bin/env bash
# A small bundle for one device call (the device tool carries at most 64 MiB; the full bundle of
# tools/gpu_bundle.sh is larger): builds the given targets (default: the attention GPU tests,
# attention_bench and model_bench; name fewer in TARGETS where the pack nears the limit), strips
# them, copies their non-system shared libraries and the attention run scripts,
# and packs everything as .gpu_bundle_pack/b.tar.xz with a runner. On the GPU machine (carry .gpu_bundle_pack):
#   bash .gpu_bundle_pack/run.sh 'bash attention_gpu_run.sh --only verify'
#   bash .gpu_bundle_pack/run.sh 'bin/attention/attention_cuda_test --gtest_filter=*Shared*'
#   bash .gpu_bundle_pack/run.sh 'bin/tools/bench/model_bench --spec-tokens 4'
# (run.sh unpacks into /tmp/b, sets LD_LIBRARY_PATH and runs its arguments there.)
# Usage: [TARGETS="//a:b //c:d"] tools/gpu_pack.sh [EXTRA_FILE ...]   (extra files go to bin/)
set -euo pipefail
cd "$(dirname "$0")/.."
targets=${TARGETS:-"//attention:attention_cuda_test //attention:query_prep_cuda_test \
//attention:decode_cuda_test //tools:sim_cuda_test //model:cuda_engine_test \
//tools/bench:attention_bench //tools/bench:model_bench"}
bazel build -c opt $targets
stage=$(mktemp -d)
mkdir -p "$stage/b/bin" "$stage/b/lib"
for t in $targets; do
  rel=$(sed -e 's|^//||' -e 's|:|/|' <<<"$t")
  mkdir -p "$stage/b/bin/$(dirname "$rel")"
  cp -f "bazel-bin/$rel" "$stage/b/bin/$rel"
  chmod u+w "$stage/b/bin/$rel"
  strip "$stage/b/bin/$rel"
  # As tools/gpu_bundle.sh: glibc, libstdc++ and the CUDA libraries exist on the GPU machine.
  ldd "bazel-bin/$rel" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*) ;;
      libcublas*|libcudart*|libcuda.so*) ;;
      *) cp -fL "$lib" "$stage/b/lib/" ;;
    esac
  done
done
for x in "$@"; do cp -f "$x" "$stage/b/bin/"; done
cp tools/bench/torch_attention_bench.py tools/bench/attention_gpu_run.sh tools/bench/ab_attention.sh \
  tools/bench/gtest_shards.sh \
  "$stage/b/"
rm -rf .gpu_bundle_pack
mkdir -p .gpu_bundle_pack
# xz -9: a 64 MiB window holds a whole binary, so the binaries' shared code (the kernels every test
# and bench links) packs once (attention_cuda_test, sim_cuda_test, cuda_engine_test and two
# model_bench builds: 64.4 MB at xz's default -6, 40.2 MB at -9e).
XZ_OPT="-9 -T2" tar -C "$stage" -cJf .gpu_bundle_pack/b.tar.xz b
rm -rf "$stage"
cat >.gpu_bundle_pack/run.sh <<'EOF'
#!/usr/bin/env bash
set -uo pipefail
rm -rf /tmp/b
tar -C /tmp -xJf "$(dirname "$0")/b.tar.xz"
export LD_LIBRARY_PATH=/tmp/b/lib:/usr/local/cuda/lib64
cd /tmp/b
eval "$@"
EOF
echo "packed: $(du -h .gpu_bundle_pack/b.tar.xz | cut -f1) in .gpu_bundle_pack/"
