#!/usr/bin/env bash
# Builds the libFuzzer targets of tools/fuzz/ with clang (outside Bazel, whose toolchain is gcc)
# under AddressSanitizer + UndefinedBehaviorSanitizer, then runs each over its seed corpus
# (tools/fuzz/corpus/<target>/, never modified) for a bounded time, all fuzzers at once.
#
#   tools/fuzz/run.sh [SECONDS_PER_FUZZER (default 30)] [TARGET...]   # safetensors cli_inputs gguf
#
# Prints one line per fuzzer, "PASS  fuzz:<target> (...)" or "FAIL  fuzz:<target> (...)"; a
# failing input is kept under the printed work directory (crashes/<target>/). Exits non-zero if
# the build or any fuzzer failed; TQKV_FUZZ_KEEP=1 keeps the work directory (fuzzers, logs) even
# then. Needs clang and libclang-rt-14-dev (tools/setup.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-30}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(safetensors cli_inputs gguf)

CXX=${CXX_FUZZ:-clang++}
work=$(mktemp -d "${TMPDIR:-/tmp}/tqkv-fuzz.XXXXXX")
echo "tools/fuzz/run.sh: building in $work"
sanitize=(-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
cxxflags=(-std=c++20 -g -O1 -Wall -Wextra -I. -DSPDLOG_SHARED_LIB -DSPDLOG_COMPILED_LIB
          -DSPDLOG_FMT_EXTERNAL "${sanitize[@]}")
libs=(-lspdlog -lfmt -lxxhash -pthread)

# The library sources each target needs (the closure of what it calls; no CUDA).
runtime_srcs=(runtime/safetensors.cc runtime/error.cc runtime/logging.cc runtime/device.cc)
declare -A srcs=(
  [safetensors]="${runtime_srcs[*]}"
  [cli_inputs]="${runtime_srcs[*]} tools/cli_util.cc quant/block_format.cc quant/preset.cc
                quant/codebook.cc quant/quantizer.cc quant/rotation.cc attention/decode_cpu.cc
                attention/attention.cc attention/attention_cpu.cc"
  [gguf]="${runtime_srcs[*]} model/gguf.cc model/tokenizer.cc model/llama.cc"
)

# Compile every library source once (coverage-instrumented, no fuzzer main), in parallel.
all_srcs=$(for t in "${targets[@]}"; do echo ${srcs[$t]}; done | tr ' ' '\n' | sort -u)
obj() { echo "$work/obj/${1//\//_}.o"; }
mkdir -p "$work/obj"
export CXX work
export CXXFLAGS_STR="${cxxflags[*]}"
if ! xargs -P "$(nproc)" -I{} bash -c \
    'o="$work/obj/$(echo {} | tr / _).o"; $CXX $CXXFLAGS_STR -fsanitize=fuzzer-no-link -c {} -o "$o" ||
     { echo "tools/fuzz/run.sh: compiling {} failed"; exit 255; }' <<<"$all_srcs"; then
  for t in "${targets[@]}"; do echo "FAIL  fuzz:$t (build failed)"; done
  exit 1
fi

status=0
pids=()
for t in "${targets[@]}"; do
  objs=()
  for s in ${srcs[$t]}; do objs+=("$(obj "$s")"); done
  if ! $CXX "${cxxflags[@]}" -fsanitize=fuzzer "tools/fuzz/${t}_fuzzer.cc" "${objs[@]}" "${libs[@]}" \
      -o "$work/${t}_fuzzer"; then
    echo "FAIL  fuzz:$t (build failed)"
    status=1
    continue
  fi
  mkdir -p "$work/corpus/$t" "$work/crashes/$t"
  dict=tools/fuzz/safetensors.dict
  [ -f "tools/fuzz/$t.dict" ] && dict=tools/fuzz/$t.dict
  # New inputs go to the first directory (the work copy); the checked-in seeds are only read.
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$work/${t}_fuzzer" -max_total_time="$seconds" -max_len=8192 -timeout=20 -rss_limit_mb=2048 \
    -print_final_stats=1 -dict="$dict" -artifact_prefix="$work/crashes/$t/" \
    "$work/corpus/$t" "tools/fuzz/corpus/$t" >"$work/$t.log" 2>&1 &
  pids+=("$t:$!")
done

for entry in "${pids[@]}"; do
  t=${entry%%:*}
  pid=${entry#*:}
  wait "$pid"
  rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$t.log" | tail -1)
  crashes=$(find "$work/crashes/$t" -type f | wc -l)
  if [ "$rc" -eq 0 ] && [ "$crashes" -eq 0 ]; then
    echo "PASS  fuzz:$t (${runs:-?} runs in ${seconds}s)"
  else
    echo "---- fuzz:$t log (last 60 lines) ----"
    tail -60 "$work/$t.log"
    echo "FAIL  fuzz:$t (exit $rc; $crashes failing input(s) in $work/crashes/$t/)"
    status=1
  fi
done
[ "$status" -eq 0 ] && [ -z "${TQKV_FUZZ_KEEP:-}" ] && rm -rf "$work"
exit "$status"
