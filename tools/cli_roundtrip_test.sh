#!/usr/bin/env bash
# `tqkv store` then `tqkv decode` on files written by a short Python script (standard library
# only), checked against the library's own reference; then the CLI's error behaviour.
set -u
TQKV=tools/tqkv
CHECK=tools/cli_roundtrip_check
MAKE=tools/testdata/make_cli_inputs.py
tmp=${TEST_TMPDIR:-$(mktemp -d)}
failures=0
check() {
  local what=$1; shift
  if "$@"; then echo "ok   $what"; else echo "FAIL $what"; failures=$((failures + 1)); fi
}

for dtype in F32 BF16; do
  python3 $MAKE "$tmp/in.safetensors" "$tmp/q.safetensors" --dtype $dtype --seed $RANDOM
  for preset in turboquant_k8v4 turboquant_4bit_nc turboquant_k3v4_nc turboquant_3bit_nc; do
    for rotation in hadamard haar; do
      rm -f "$tmp/cache.safetensors" "$tmp/out.safetensors"
      $TQKV store --preset $preset --block-size 16 --num-blocks 10 --rotation $rotation --seed 3 \
        --in "$tmp/in.safetensors" --out "$tmp/cache.safetensors" &&
      $TQKV decode --preset $preset --rotation $rotation --seed 3 --cache "$tmp/cache.safetensors" \
        --in "$tmp/q.safetensors" --out "$tmp/out.safetensors"
      check "$preset $rotation $dtype: store + decode ran" test $? -eq 0
      check "$preset $rotation $dtype: matches the library reference" \
        $CHECK $preset 16 10 $rotation 3 "$tmp/in.safetensors" "$tmp/cache.safetensors" \
        "$tmp/q.safetensors" "$tmp/out.safetensors"
    done
  done
done

# --cache-in updates a cache in place: storing the same tokens again changes nothing.
$TQKV store --preset turboquant_4bit_nc --block-size 16 --num-blocks 10 \
  --in "$tmp/in.safetensors" --out "$tmp/c1.safetensors"
$TQKV store --preset turboquant_4bit_nc --block-size 16 --num-blocks 10 \
  --in "$tmp/in.safetensors" --cache-in "$tmp/c1.safetensors" --out "$tmp/c2.safetensors"
check "--cache-in round trip is stable" cmp -s "$tmp/c1.safetensors" "$tmp/c2.safetensors"

# Errors: one line, non-zero exit, no output file.
expect_error() {  # expect_error DESCRIPTION PATTERN ARGS...
  local what=$1 pattern=$2; shift 2
  rm -f "$tmp/err.safetensors"
  local out; out=$("$@" 2>&1); local rc=$?
  check "$what: non-zero exit" test $rc -ne 0
  check "$what: one line" test "$(printf '%s\n' "$out" | wc -l)" -eq 1
  check "$what: message names it ($pattern)" grep -q -- "$pattern" <<<"$out"
  check "$what: no output file" test ! -e "$tmp/err.safetensors"
}
expect_error "unknown preset" 'turboquant_k3v4_nc' \
  $TQKV store --preset tq9 --block-size 16 --num-blocks 10 --in "$tmp/in.safetensors" --out "$tmp/err.safetensors"
expect_error "slot out of range" 'slot_mapping\[' \
  $TQKV store --preset turboquant_4bit_nc --block-size 16 --num-blocks 2 --in "$tmp/in.safetensors" --out "$tmp/err.safetensors"
expect_error "missing tensor" "no tensor named 'key'" \
  $TQKV store --preset turboquant_4bit_nc --block-size 16 --num-blocks 10 --in "$tmp/q.safetensors" --out "$tmp/err.safetensors"
expect_error "bad block size" 'block_size = 24' \
  $TQKV store --preset turboquant_4bit_nc --block-size 24 --num-blocks 10 --in "$tmp/in.safetensors" --out "$tmp/err.safetensors"
expect_error "unknown --device" 'cpu, cuda' \
  $TQKV store --preset turboquant_4bit_nc --block-size 16 --num-blocks 10 --device tpu --in "$tmp/in.safetensors" --out "$tmp/err.safetensors"
if ! $TQKV info | grep -q '^CUDA devices: [1-9]'; then
  # Without a device (CI) the CUDA store says so; with one, tools/bench/store_gpu_run.sh compares
  # --device cuda with --device cpu.
  expect_error "--device cuda without a device" 'CUDA' \
    $TQKV store --preset turboquant_4bit_nc --block-size 16 --num-blocks 10 --device cuda --in "$tmp/in.safetensors" --out "$tmp/err.safetensors"
fi
expect_error "bad --rotation-path" 'auto, fwht, mma, gemm' \
  $TQKV store --preset turboquant_4bit_nc --block-size 16 --num-blocks 10 --device cuda --rotation-path tensor --in "$tmp/in.safetensors" --out "$tmp/err.safetensors"
expect_error "missing input file" 'nope.safetensors' \
  $TQKV decode --preset turboquant_4bit_nc --cache "$tmp/nope.safetensors" --in "$tmp/q.safetensors" --out "$tmp/err.safetensors"
expect_error "cache of another preset" 'not a multiple' \
  $TQKV decode --preset turboquant_k8v4 --cache "$tmp/c1.safetensors" --in "$tmp/q.safetensors" --out "$tmp/err.safetensors"
expect_error "query given as cache" "no tensor named 'cache'" \
  $TQKV decode --preset turboquant_4bit_nc --cache "$tmp/q.safetensors" --in "$tmp/q.safetensors" --out "$tmp/err.safetensors"

echo "$failures failure(s)"
exit $((failures > 0))
