#!/usr/bin/env bash
# End-to-end checks of the tqkv command line: outputs and exit codes.
set -u
TQKV=tools/tqkv
failures=0
check() {  # check DESCRIPTION CONDITION...
  local what=$1; shift
  if "$@"; then echo "ok   $what"; else echo "FAIL $what"; failures=$((failures + 1)); fi
}

out=$($TQKV info 2>&1); rc=$?
check "info exits 0" test $rc -eq 0
check "info prints the version" grep -q '^tqkv [0-9]' <<<"$out"
check "info says whether CUDA is compiled in" grep -q '^CUDA compiled in: \(yes\|no\)$' <<<"$out"
# TURBOQUANT.md: 196 / 134 / 118 / 102 bytes per token-head at D=128; 2.61x .. 5.02x.
check "k8v4 row"    grep -Eq '^turboquant_k8v4 +fp8 +4 .* 196  2\.61x' <<<"$out"
check "4bit_nc row" grep -Eq '^turboquant_4bit_nc +4 +4 .* 134  3\.82x' <<<"$out"
check "k3v4_nc row" grep -Eq '^turboquant_k3v4_nc +3 +4 .* 118  4\.34x' <<<"$out"
check "3bit_nc row" grep -Eq '^turboquant_3bit_nc +3 +3 .* 102  5\.02x' <<<"$out"
check "bf16 row" grep -Eq '^bf16 +16 +16 +256  1\.00x +512  1\.00x +1024  1\.00x' <<<"$out"

out=$($TQKV info --memory 40 --preset turboquant_k3v4_nc --layers 32 --kv-heads 8 --head-dim 128 2>&1); rc=$?
check "info --memory exits 0" test $rc -eq 0
# 40 GiB / (32 layers * 8 heads * 118 B * 16 tokens per block) = 88,862 blocks; bf16: 20,480.
check "info --memory: k3v4 blocks" grep -Eq '^turboquant_k3v4_nc +30,208 +483,328 +88,862 +1,421,776 +4.34x' <<<"$out"
check "info --memory: bf16 blocks" grep -Eq '^bf16 +131,072 +2,097,152 +20,480 ' <<<"$out"
out=$($TQKV info --memory 40 --preset nope 2>&1); rc=$?
check "info --memory with a bad preset exits non-zero" test $rc -ne 0
check "... with one line naming it" test "$(wc -l <<<"$out")" -eq 1

for bad in nan -1 0 inf 1e10; do
  out=$($TQKV info --memory $bad 2>&1); rc=$?
  check "info --memory $bad: one line naming it, non-zero exit" \
    test $rc -ne 0 -a "$(wc -l <<<"$out")" -eq 1 -a -n "$(grep -- '--memory' <<<"$out")"
done

out=$($TQKV info --preset turboquant_4bit_nc 2>&1); rc=$?
check "info --preset without --memory: one line naming --memory, non-zero exit" \
  test $rc -ne 0 -a "$(wc -l <<<"$out")" -eq 1 -a -n "$(grep -- '--memory' <<<"$out")"

# tqkv sim: invalid flags give one clear line and a non-zero exit.
sim_error() {  # sim_error DESCRIPTION PATTERN ARGS...
  local what=$1 pattern=$2; shift 2
  local out; out=$($TQKV sim "$@" 2>&1); local rc=$?
  check "sim $what: non-zero exit" test $rc -ne 0
  check "sim $what: one line" test "$(wc -l <<<"$out")" -eq 1
  check "sim $what: names it" grep -q -- "$pattern" <<<"$out"
}
sim_error "unknown preset" "--preset turboquant_9bit" --preset turboquant_9bit
sim_error "kv heads not dividing q heads" "--q-heads = 32" --kv-heads 5
sim_error "memory too small for one sequence" "cannot hold one sequence" --num-blocks 4
sim_error "unknown device" "--device = tpu" --device tpu
# CLI11 alone read a seed past 2^64 - 1 as 2^64 - 1.
sim_error "seed past uint64" "18446744073709551616 is not a whole number from 0 to 18446744073709551615" \
  --seed 18446744073709551616
sim_error "negative seed" "--seed: -1 is not a whole number" --seed -1

$TQKV >/dev/null 2>&1; rc=$?
check "no subcommand is an error" test $rc -ne 0
out=$($TQKV frobnicate 2>&1); rc=$?
check "unknown subcommand is an error" test $rc -ne 0
out=$($TQKV --log-level loud info 2>&1); rc=$?
check "bad --log-level exits non-zero" test $rc -ne 0
check "bad --log-level names the value" grep -q '"loud"' <<<"$out"
check "bad --log-level is one line" test "$(wc -l <<<"$out")" -eq 1

echo "$failures failure(s)"
exit $((failures > 0))
