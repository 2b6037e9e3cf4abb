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

# Several new tokens per sequence (query_start_loc): each sequence's last token attends to its
# whole context, so its row is that sequence's decode output (same query, same cache).
python3 $MAKE "$tmp/in.safetensors" "$tmp/q.safetensors" --varlen-out "$tmp/v.safetensors" --seed 5
$TQKV store --preset turboquant_k3v4_nc --block-size 16 --num-blocks 10 \
  --in "$tmp/in.safetensors" --out "$tmp/cache.safetensors" &&
$TQKV decode --preset turboquant_k3v4_nc --cache "$tmp/cache.safetensors" \
  --in "$tmp/q.safetensors" --out "$tmp/out.safetensors" &&
$TQKV decode --preset turboquant_k3v4_nc --cache "$tmp/cache.safetensors" \
  --in "$tmp/v.safetensors" --out "$tmp/vout.safetensors"
check "query_start_loc: decode ran" test $? -eq 0
python3 - "$tmp/out.safetensors" "$tmp/vout.safetensors" <<'PY'
import json, struct, sys
def read(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        data = raw[8 + n + a:8 + n + b]
        out[name] = (t["shape"], struct.unpack(f"<{len(data) // 4}f", data))
    return out
dec, var = read(sys.argv[1]), read(sys.argv[2])
(tq, hq, d), vo = var["output"]
assert tq == 18, tq
last = [0, 5, 17]  # the last row of each sequence (query_start_loc 0, 1, 6, 18)
worst = 0.0
for b, row in enumerate(last):
    for i in range(hq * d):
        x, y = vo[row * hq * d + i], dec["output"][1][b * hq * d + i]
        worst = max(worst, abs(x - y) / (1 + abs(y)))
assert worst < 1e-5, worst
PY
check "query_start_loc: each sequence's last row equals its decode" test $? -eq 0

# --sliding-window 20: the rows at positions < 20 (sequence 0, and sequence 1 at 12..16) read
# their whole context and equal the rows without a window; the rows of sequence 2 (positions
# 28..39) read only (p - 20, p] and differ. Decode with the window (no query_start_loc) equals
# each sequence's last row.
$TQKV decode --preset turboquant_k3v4_nc --cache "$tmp/cache.safetensors" --sliding-window 20 \
  --in "$tmp/v.safetensors" --out "$tmp/wout.safetensors" &&
$TQKV decode --preset turboquant_k3v4_nc --cache "$tmp/cache.safetensors" --sliding-window 20 \
  --in "$tmp/q.safetensors" --out "$tmp/wdec.safetensors"
check "--sliding-window: decode ran" test $? -eq 0
python3 - "$tmp/vout.safetensors" "$tmp/wout.safetensors" "$tmp/wdec.safetensors" <<'PY'
import json, struct, sys
def read(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    a, b = header["output"]["data_offsets"]
    data = raw[8 + n + a:8 + n + b]
    return header["output"]["shape"], struct.unpack(f"<{len(data) // 4}f", data)
(tq, hq, d), full = read(sys.argv[1])
_, win = read(sys.argv[2])
_, dec = read(sys.argv[3])
row = hq * d
def diff(x, i, y, j):
    return max(abs(x[i * row + k] - y[j * row + k]) for k in range(row))
for r in range(6):  # positions 0 and 12..16
    assert diff(full, r, win, r) == 0.0, r
for r in range(6, 18):  # positions 28..39
    assert diff(full, r, win, r) > 1e-3, r
for b, r in enumerate([0, 5, 17]):
    assert diff(win, r, dec, b) < 1e-5, (b, diff(win, r, dec, b))
PY
check "--sliding-window: rows inside the window unchanged, rows past it differ, decode matches" \
  test $? -eq 0

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
expect_error "unknown --rotation, for FP8 keys too" 'bogus' \
  $TQKV store --preset turboquant_k8v4 --block-size 16 --num-blocks 10 --rotation bogus --in "$tmp/in.safetensors" --out "$tmp/err.safetensors"
expect_error "bad block size" 'block_size = 24' \
  $TQKV store --preset turboquant_4bit_nc --block-size 24 --num-blocks 10 --in "$tmp/in.safetensors" --out "$tmp/err.safetensors"
# An empty sequence (seq_lens 0) has no query position for a windowed decode.
python3 - "$tmp/q.safetensors" "$tmp/q0.safetensors" <<'PY'
import json, struct, sys
raw = bytearray(open(sys.argv[1], "rb").read())
n = struct.unpack("<Q", raw[:8])[0]
a, _ = json.loads(raw[8:8 + n])["seq_lens"]["data_offsets"]
raw[8 + n + a:8 + n + a + 4] = struct.pack("<i", 0)
open(sys.argv[2], "wb").write(raw)
PY
$TQKV decode --preset turboquant_k3v4_nc --cache "$tmp/cache.safetensors" --in "$tmp/q0.safetensors" --out "$tmp/q0out.safetensors"
check "an empty sequence decodes without a window" test $? -eq 0
expect_error "an empty sequence with --sliding-window" 'seq_lens\[0\] = 0.*--sliding-window' \
  $TQKV decode --preset turboquant_k3v4_nc --cache "$tmp/cache.safetensors" --sliding-window 8 --in "$tmp/q0.safetensors" --out "$tmp/err.safetensors"
# Empty tensors are named: a cache of no blocks, block tables of no columns.
python3 - "$tmp/q.safetensors" "$tmp/empty_cache.safetensors" "$tmp/q_w0.safetensors" <<'PY'
import json, struct, sys
def write(path, tensors, metadata=None):
    header, blob = {}, b""
    if metadata: header["__metadata__"] = metadata
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    text = json.dumps(header).encode(); text += b" " * (-len(text) % 8)
    open(path, "wb").write(struct.pack("<Q", len(text)) + text + blob)
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
tensors = {k: (v["dtype"], v["shape"], raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
           for k, v in header.items() if k != "__metadata__"}
write(sys.argv[2], {"cache": ("U8", [0, 34816], b"")})
b = tensors["seq_lens"][1][0]
tensors["block_tables"] = ("I32", [b, 0], b"")
tensors["seq_lens"] = ("I32", [b], struct.pack(f"<{b}i", *([0] * b)))
write(sys.argv[3], tensors)
PY
expect_error "a cache of no blocks" "tensor 'cache' has shape \[0, 34816\]; dim 0 (NB" \
  $TQKV decode --preset turboquant_k3v4_nc --cache "$tmp/empty_cache.safetensors" --in "$tmp/q.safetensors" --out "$tmp/err.safetensors"
expect_error "block tables of no columns" "tensor 'block_tables' has shape \[3, 0\]" \
  $TQKV decode --preset turboquant_k3v4_nc --cache "$tmp/cache.safetensors" --in "$tmp/q_w0.safetensors" --out "$tmp/err.safetensors"
expect_error "negative --sliding-window" 'sliding-window' \
  $TQKV decode --preset turboquant_k3v4_nc --cache "$tmp/cache.safetensors" --sliding-window -3 --in "$tmp/q.safetensors" --out "$tmp/err.safetensors"
# A cache file records the format and rotation it was stored with; other flags are an error.
$TQKV store --preset turboquant_4bit_nc --block-size 16 --num-blocks 10 --rotation haar --seed 5 \
  --in "$tmp/in.safetensors" --out "$tmp/haar.safetensors"
expect_error "decode with another rotation" 'written with rotation haar' \
  $TQKV decode --preset turboquant_4bit_nc --cache "$tmp/haar.safetensors" --in "$tmp/q.safetensors" --out "$tmp/err.safetensors"
expect_error "decode with another seed" 'rotation_id' \
  $TQKV decode --preset turboquant_4bit_nc --rotation haar --seed 6 --cache "$tmp/haar.safetensors" --in "$tmp/q.safetensors" --out "$tmp/err.safetensors"
expect_error "decode with another block size" 'block_size 16.*--block-size' \
  $TQKV decode --preset turboquant_4bit_nc --block-size 32 --rotation haar --seed 5 --cache "$tmp/haar.safetensors" --in "$tmp/q.safetensors" --out "$tmp/err.safetensors"
expect_error "store --cache-in with another preset" 'preset turboquant_4bit_nc' \
  $TQKV store --preset turboquant_3bit_nc --block-size 16 --num-blocks 10 --cache-in "$tmp/haar.safetensors" --in "$tmp/in.safetensors" --out "$tmp/err.safetensors"
expect_error "store --num-blocks past int32 ids" '1 to 2147483648' \
  $TQKV store --preset turboquant_4bit_nc --block-size 16 --num-blocks 2147483649 --in "$tmp/in.safetensors" --out "$tmp/err.safetensors"
expect_error "unknown --device" 'cpu, cuda' \
  $TQKV store --preset turboquant_4bit_nc --block-size 16 --num-blocks 10 --device tpu --in "$tmp/in.safetensors" --out "$tmp/err.safetensors"
if ! $TQKV info | grep -q '^CUDA devices: [1-9]'; then
  # Without a device (CI) the CUDA store says so; with one, tools/bench/store_gpu_run.sh compares
  # --device cuda with --device cpu.
  expect_error "--device cuda without a device" 'CUDA' \
    $TQKV store --preset turboquant_4bit_nc --block-size 16 --num-blocks 10 --device cuda --in "$tmp/in.safetensors" --out "$tmp/err.safetensors"
fi
expect_error "bad --rotation-path" '--rotation-path: tensor not in {auto,fwht,mma,gemm}' \
  $TQKV store --preset turboquant_4bit_nc --block-size 16 --num-blocks 10 --device cuda --rotation-path tensor --in "$tmp/in.safetensors" --out "$tmp/err.safetensors"
expect_error "bad --gemm-precision, on the CPU too" '--gemm-precision: fp16 not in' \
  $TQKV store --preset turboquant_4bit_nc --block-size 16 --num-blocks 10 --gemm-precision fp16 --in "$tmp/in.safetensors" --out "$tmp/err.safetensors"
expect_error "missing input file" 'nope.safetensors' \
  $TQKV decode --preset turboquant_4bit_nc --cache "$tmp/nope.safetensors" --in "$tmp/q.safetensors" --out "$tmp/err.safetensors"
expect_error "cache of another preset" 'not a multiple' \
  $TQKV decode --preset turboquant_k8v4 --cache "$tmp/c1.safetensors" --in "$tmp/q.safetensors" --out "$tmp/err.safetensors"
expect_error "query given as cache" "no tensor named 'cache'" \
  $TQKV decode --preset turboquant_4bit_nc --cache "$tmp/q.safetensors" --in "$tmp/q.safetensors" --out "$tmp/err.safetensors"

echo "$failures failure(s)"
exit $((failures > 0))
