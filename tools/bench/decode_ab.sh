#!/usr/bin/env bash
# Side-by-side graph timings of decode builds on the GPU machine (in the bundle of
# tools/gpu_bundle.sh, with variants from tools/bench/decode_variants.sh), in rounds, so that
# each shape's builds run next to each other and run-to-run drift shows as the spread.
#   decode_ab.sh [-r ROUNDS] "LABEL=BUILD[:ENV=V[,ENV=V]] ..." KIND:BATCH:CONTEXT[:TPS] ...
# BUILD is "bundle" (the bundle's own decode_bench) or a variant name (var/NAME/decode_bench);
# ENV settings apply to that run only, e.g. TQKV_DECODE_NARROW=0. TPS forces the split length
# (decode_bench --tps; the plan's choice without it). Prints one line per run.
#   decode_ab.sh "base=bundle copy=copy base8w=bundle:TQKV_DECODE_NARROW=0" \
#     turboquant_k3v4_nc:64:4096 turboquant_4bit_nc:1:32768
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH="$here/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
rounds=2
if [ "${1:-}" = "-r" ]; then rounds=$2; shift 2; fi
builds=$1
shift
for ((round = 1; round <= rounds; ++round)); do
  for shape in "$@"; do
    for b in $builds; do
      label=${b%%=*} rest=${b#*=}
      build=${rest%%:*} envs=""
      [ "$build" != "$rest" ] && envs=${rest#*:}
      if [ "$build" = bundle ]; then bin="$here/bin/tools/bench/decode_bench"; else bin="$here/var/$build/decode_bench"; fi
      only=$(echo "$shape" | cut -d: -f1-3) tps=$(echo "$shape" | cut -s -d: -f4)
      line=$(env ${envs//,/ } timeout 120 "$bin" --only "$only" ${tps:+--tps "$tps"} 2>&1 |
        grep "B=" | head -n 1 |
        sed -e 's/  */ /g' -e 's/ read floor.*//')
      echo "r$round $label $shape |${line:- (no result)}"
    done
  done
done
