#!/usr/bin/env bash
# Old build against new build on one GPU, in one call: decode_bench and store_bench of two bundles
# (tools/gpu_bundle.sh; the old one may hold only bin/tools/bench/{decode,store}_bench and lib/),
# run alternately (old, new, new, old) on the same shapes, then a table of the medians per shape
# and the new/old ratio. For changes that must not move speed (refactorings whose SASS differs).
#   ab_run.sh OLD_BUNDLE NEW_BUNDLE [decode_bench args...]
# Writes OUT (default /tmp/ab_out): decode_{old,new}_{1,2}.json, store_{old,new}/, ab.txt.
set -uo pipefail
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); shift 2
out=${OUT:-/tmp/ab_out}
mkdir -p "$out"
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--batches 1,16,64 --contexts 1024,4096,32768)
run_decode() {  # run_decode BUNDLE LABEL
  LD_LIBRARY_PATH="$1/lib:/usr/local/cuda/lib64" timeout 240 "$1/bin/tools/bench/decode_bench" \
    "${args[@]}" --json "$out/decode_$2.json" >"$out/decode_$2.txt" 2>&1
  echo "decode_bench $2 exit $?"
}
run_store() {  # run_store BUNDLE LABEL
  mkdir -p "$out/store_$2"
  LD_LIBRARY_PATH="$1/lib:/usr/local/cuda/lib64" timeout 240 "$1/bin/tools/bench/store_bench" \
    --quick --out "$out/store_$2" >"$out/store_$2.txt" 2>&1
  echo "store_bench $2 exit $?"
}
run_decode "$old" old_1
run_decode "$new" new_1
run_decode "$new" new_2
run_decode "$old" old_2
run_store "$old" old
run_store "$new" new
python3 - "$out" <<'PY' | tee "$out/ab.txt"
import json, os, statistics, sys
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else {}
rows = {}
for label in ("old_1", "old_2", "new_1", "new_2"):
    for r in load(f"decode_{label}.json").get("results", []):
        key = (r["kind"], r["batch"], r["context"])
        rows.setdefault(key, {}).setdefault(label[:3], []).append(r["graph_us"])
print("decode, graph us (two runs each, old new new old)")
print("| kind | B | L | old | new | new/old |")
print("|---|---|---|---|---|---|")
ratios = []
for key in sorted(rows):
    o, n = rows[key].get("old", []), rows[key].get("new", [])
    if not o or not n:
        continue
    mo, mn = statistics.median(o), statistics.median(n)
    ratios.append(mn / mo)
    print(f"| {key[0]} | {key[1]} | {key[2]} | {'/'.join(f'{x:.1f}' for x in o)} | "
          f"{'/'.join(f'{x:.1f}' for x in n)} | {mn / mo:.3f} |")
if ratios:
    print(f"decode new/old: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, "
          f"max {max(ratios):.3f} over {len(ratios)} shapes")
so, sn = load("store_old/store_bench.json"), load("store_new/store_bench.json")
old_rows = {(r["preset"], r["path"], r["n"]): r for r in so.get("store", [])}
print("\nstore, us per call (stream) and graph us")
print("| preset | path | N | old | new | new/old |")
print("|---|---|---|---|---|---|")
sratios = []
for r in sn.get("store", []):
    o = old_rows.get((r["preset"], r["path"], r["n"]))
    if not o:
        continue
    sratios.append(r["us"] / o["us"])
    print(f"| {r['preset']} | {r['path']} | {r['n']} | {o['us']:.1f} ({o['graph_us']:.1f}) | "
          f"{r['us']:.1f} ({r['graph_us']:.1f}) | {r['us'] / o['us']:.3f} |")
if sratios:
    print(f"store new/old: median {statistics.median(sratios):.3f}, min {min(sratios):.3f}, "
          f"max {max(sratios):.3f} over {len(sratios)} rows")
PY
