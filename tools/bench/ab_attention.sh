#!/usr/bin/env bash
# Old build against new build of attention_bench on one GPU, in one call: the two binaries run
# alternately (old, new, new, old) on the same shapes, then a table of both builds' µs per shape
# and the new/old ratio of their medians. For a kernel change that must be timed against the
# build before it on the same board (timings move ±5 % between H200s).
#   ab_attention.sh OLD_BIN NEW_BIN [attention_bench args...]
# e.g. (tools/gpu_pack.sh /tmp/attention_bench_old packs the old binary into bin/):
#   bash ab_attention.sh bin/attention_bench_old bin/tools/bench/attention_bench \
#     --kind turboquant_4bit_nc --only "verify 64x4k q"
# Both binaries need the same shared libraries (LD_LIBRARY_PATH as run.sh sets it). Writes OUT
# (default /tmp/ab_attention): {old,new}_{1,2}.json and .txt, ab.txt.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: ab_attention.sh OLD_BIN NEW_BIN [attention_bench args...]" >&2; exit 2; }
old=$1 new=$2
shift 2
out=${OUT:-/tmp/ab_attention}
mkdir -p "$out"
run_one() {  # run_one BIN LABEL, with the caller's attention_bench arguments
  local bin=$1 label=$2
  timeout 280 "$bin" "${args[@]}" --json "$out/$label.json" >"$out/$label.txt" 2>&1
  echo "attention_bench $label exit $?"
}
args=("$@")
run_one "$old" old_1
run_one "$new" new_1
run_one "$new" new_2
run_one "$old" old_2
python3 - "$out" <<'PY' | tee "$out/ab.txt"
import json, os, statistics, sys
out = sys.argv[1]
rows = {}
for label in ("old_1", "new_1", "new_2", "old_2"):
    path = os.path.join(out, f"{label}.json")
    if not os.path.exists(path):
        continue
    for r in json.load(open(path)):
        rows.setdefault((r["kind"], r["shape"]), {}).setdefault(label[:3], []).append(r["us"])
print("attention_bench, graph us (old new new old)")
print("| kind | shape | old | new | new/old |")
print("|---|---|---|---|---|")
for key in rows:
    o, n = rows[key].get("old", []), rows[key].get("new", [])
    if not o or not n:
        continue
    ratio = statistics.median(n) / statistics.median(o)
    print(f"| {key[0]} | {key[1]} | {' / '.join(f'{x:.1f}' for x in o)} | "
          f"{' / '.join(f'{x:.1f}' for x in n)} | {ratio:.3f} |")
PY
