#!/usr/bin/env bash
# Runs a GoogleTest binary as N processes at once, each its own shard of the tests
# (GTEST_TOTAL_SHARDS / GTEST_SHARD_INDEX), on the one GPU: most of a GPU test's time is its CPU
# reference, so shards on the GPU machine's cores cut the wall time (decode_cuda_test on an H100:
# 322 s as one process, 77 s as 4 shards).
#   gtest_shards.sh N TIMEOUT LOG BINARY [gtest args...]
# TIMEOUT: seconds per shard. Writes the shards' outputs one after another into LOG and exits
# non-zero when any shard failed or timed out.
set -uo pipefail
[ $# -ge 4 ] || { echo "usage: gtest_shards.sh N TIMEOUT LOG BINARY [gtest args...]" >&2; exit 2; }
n=$1 limit=$2 log=$3 bin=$4
shift 4
pids=()
for ((i = 0; i < n; ++i)); do
  GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i timeout "$limit" "$bin" "$@" >"$log.shard$i" 2>&1 &
  pids+=($!)
done
status=0
for ((i = 0; i < n; ++i)); do
  wait "${pids[$i]}"
  rc=$?
  [ "$rc" -eq 0 ] || status=$rc
done
: >"$log"
for ((i = 0; i < n; ++i)); do
  echo "== shard $i of $n" >>"$log"
  cat "$log.shard$i" >>"$log"
  rm -f "$log.shard$i"
done
exit "$status"
