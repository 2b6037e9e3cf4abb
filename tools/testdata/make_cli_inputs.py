#!/usr/bin/env python3
"""Writes the inputs of a `tqkv store` + `tqkv decode` round trip, using only the standard library.

  make_cli_inputs.py STORE_IN.safetensors QUERY_IN.safetensors [--dtype F32|BF16] [--seed S]

Three sequences (1, 17 and 40 tokens) of Gaussian K/V [N, Hk=2, D=128] spread over shuffled
blocks of 16 tokens in a 10-block cache, a few padding slots (-1), and a query [3, Hq=8, D].
"""
import argparse
import json
import random
import struct


def write_safetensors(path, tensors):
    """tensors: name -> (dtype, shape, raw little-endian bytes)."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def pack_floats(values, dtype):
    if dtype == "F32":
        return struct.pack(f"<{len(values)}f", *values)
    # BF16: round-to-nearest-even of the fp32 bits.
    out = bytearray()
    for v in values:
        bits = struct.unpack("<I", struct.pack("<f", v))[0]
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out += struct.pack("<H", bits)
    return bytes(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("store_in")
    ap.add_argument("query_in")
    ap.add_argument("--varlen-out", help="also write several new tokens per sequence "
                    "(query_start_loc; each sequence's last row is its query in query_in)")
    ap.add_argument("--dtype", default="F32", choices=["F32", "BF16"])
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    hk, hq, d, block, num_blocks = 2, 8, 128, 16, 10
    lens = [1, 17, 40]
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    tables, slots = [], []
    for n in lens:
        row = [blocks.pop() for _ in range((n + block - 1) // block)]
        slots += [row[t // block] * block + t % block for t in range(n)]
        tables.append(row + [0] * (3 - len(row)))
    for i in (5, 30):  # padding tokens write nothing
        slots.insert(i, -1)
    n = len(slots)
    key = [rng.gauss(0, 1) * (6.0 if c % 37 == 0 else 1.0) for c in range(n * hk * d)]
    value = [rng.gauss(0, 1) for _ in range(n * hk * d)]
    write_safetensors(args.store_in, {
        "key": (args.dtype, [n, hk, d], pack_floats(key, args.dtype)),
        "value": (args.dtype, [n, hk, d], pack_floats(value, args.dtype)),
        "slot_mapping": ("I64", [n], struct.pack(f"<{n}q", *slots)),
    })
    query = [rng.gauss(0, 1) for _ in range(len(lens) * hq * d)]
    write_safetensors(args.query_in, {
        "query": ("F32", [len(lens), hq, d], pack_floats(query, "F32")),
        "block_tables": ("I32", [len(lens), 3], struct.pack("<9i", *sum(tables, []))),
        "seq_lens": ("I32", [len(lens)], struct.pack("<3i", *lens)),
    })
    if args.varlen_out:
        q_lens = [1, 5, 12]
        rows = []
        for b, q_len in enumerate(q_lens):
            rows += [rng.gauss(0, 1) for _ in range((q_len - 1) * hq * d)]
            rows += query[b * hq * d:(b + 1) * hq * d]
        loc = [0, q_lens[0], q_lens[0] + q_lens[1], sum(q_lens)]
        write_safetensors(args.varlen_out, {
            "query": ("F32", [sum(q_lens), hq, d], pack_floats(rows, "F32")),
            "query_start_loc": ("I32", [4], struct.pack("<4i", *loc)),
            "block_tables": ("I32", [len(lens), 3], struct.pack("<9i", *sum(tables, []))),
            "seq_lens": ("I32", [len(lens)], struct.pack("<3i", *lens)),
        })


if __name__ == "__main__":
    main()
