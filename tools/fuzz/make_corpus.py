#!/usr/bin/env python3
"""Writes the seed corpora of the fuzzers in tools/fuzz/ (standard library only; deterministic).

  python3 tools/fuzz/make_corpus.py   # rewrites tools/fuzz/corpus/{safetensors,cli_inputs}/

safetensors/: valid files (every dtype, metadata, a scalar, empty tensors) and a few invalid ones.
cli_inputs/: an 8-byte flag prefix (see cli_inputs_fuzzer.cc) then the --in file of a small
`tqkv store` or `tqkv decode` (D 64, Hk 1, block 16).
"""
import json
import math
import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
PRESETS = [  # AllPresets() order: name, fp8 keys, key bits, value bits
    ("turboquant_k8v4", True, 8, 4),
    ("turboquant_4bit_nc", False, 4, 4),
    ("turboquant_k3v4_nc", False, 3, 4),
    ("turboquant_3bit_nc", False, 3, 3),
]


def safetensors(tensors, metadata=None, header_extra=None):
    """tensors: name -> (dtype, shape, raw little-endian bytes), laid out in name order."""
    header, offset, blobs = {}, 0, []
    if metadata:
        header["__metadata__"] = metadata
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    if header_extra:
        header.update(header_extra)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def f32(values):
    return struct.pack(f"<{len(values)}f", *values)


def bf16(values):
    out = bytearray()
    for v in values:
        bits = struct.unpack("<I", struct.pack("<f", v))[0]
        out += struct.pack("<H", (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
    return bytes(out)


def f16(values):
    return struct.pack(f"<{len(values)}e", *values)


def block_bytes(preset, d, h, block):
    _, fp8, kb, vb = preset
    key = d if fp8 else (d * kb + 7) // 8
    val = (d * vb + 7) // 8
    meta = 2 if fp8 else 3
    return block * h * (key + val + 2 * meta)


def prefix(decode, preset, block_index, rotation, bit7, num_blocks, seed=0, scale=0.0):
    mode = int(decode) | (preset << 1) | (block_index << 3) | (rotation << 5) | (int(bit7) << 7)
    return bytes([mode, num_blocks, seed, 0]) + struct.pack("<f", scale)


def safetensors_seeds(rng):
    seeds = {}
    seeds["all_dtypes"] = safetensors({
        "a_f32": ("F32", [2, 3], f32([rng.gauss(0, 1) for _ in range(6)])),
        "b_f16": ("F16", [4], f16([0.5, -1.0, 2.0, 0.0])),
        "c_bf16": ("BF16", [2, 2], bf16([1.0, 2.0, 3.0, 4.0])),
        "d_i32": ("I32", [], struct.pack("<i", -7)),
        "e_i64": ("I64", [3], struct.pack("<3q", 1, -1, 2**40)),
        "f_u8": ("U8", [0, 5], b""),
        "g_u8": ("U8", [5], bytes(range(5))),
    }, metadata={"format": "pt", "note": "caf\u00e9"})
    seeds["empty"] = safetensors({})
    seeds["metadata_only"] = safetensors({}, metadata={"k": "v"})
    valid = safetensors({"x": ("F32", [2], f32([1.0, 2.0])), "y": ("I64", [1], struct.pack("<q", 3))})
    seeds["truncated"] = valid[:-3]
    header = b'{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'
    seeds["overlap"] = struct.pack("<Q", len(header)) + header + bytes(8)
    header = b'{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"x":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}'
    seeds["duplicate_key"] = struct.pack("<Q", len(header)) + header + bytes(4)
    header = b'{"x":{"dtype":"F64","shape":[1, -2],"data_offsets":[0,18446744073709551615]}}'
    seeds["bad_fields"] = struct.pack("<Q", len(header)) + header
    seeds["huge_header_length"] = struct.pack("<Q", 2**63) + b"{}"
    return seeds


def cli_seeds(rng):
    seeds = {}
    d, h, block = 64, 1, 16
    n = 3
    key = [rng.gauss(0, 1) for _ in range(n * h * d)]
    value = [rng.gauss(0, 1) for _ in range(n * h * d)]
    slots = [0, 17, -1]
    store_in = {
        "key": ("F32", [n, h, d], f32(key)),
        "value": ("F32", [n, h, d], f32(value)),
        "slot_mapping": ("I64", [n], struct.pack(f"<{n}q", *slots)),
    }
    seeds["store_4bit_f32"] = prefix(False, 1, 0, 0, False, 2) + safetensors(store_in)
    seeds["store_k8v4_bf16_haar"] = prefix(False, 0, 0, 2, False, 2, seed=5) + safetensors({
        "key": ("BF16", [n, h, d], bf16(key)),
        "value": ("BF16", [n, h, d], bf16(value)),
        "slot_mapping": ("I32", [n], struct.pack(f"<{n}i", *slots)),
    })
    cache = bytes(block_bytes(PRESETS[3], d, h, block) * 2)
    seeds["store_3bit_f16_cache_in"] = prefix(False, 3, 0, 1, True, 2, seed=1) + safetensors({
        "key": ("F16", [n, h, d], f16(key)),
        "value": ("F16", [n, h, d], f16(value)),
        "slot_mapping": ("I64", [n], struct.pack(f"<{n}q", 31, 0, 5)),
        "cache": ("U8", [2, len(cache) // 2], cache),
    })
    centroids = [math.tanh((i - 7.5) / 4) * 0.3 for i in range(16)]
    seeds["store_4bit_centroids"] = prefix(False, 1, 0, 0, False, 1) + safetensors(
        dict(store_in, centroids=("F32", [16], f32(centroids)),
             slot_mapping=("I64", [n], struct.pack(f"<{n}q", 3, 2, 1))))

    hq, num_blocks = 2, 2
    for name, preset_index, bit7 in (("decode_4bit", 1, False), ("decode_k8v4_scale", 0, True)):
        preset = PRESETS[preset_index]
        per_block = block_bytes(preset, d, h, block)
        meta_offset = per_block - block * h * 2 * (2 if preset[1] else 3)
        blocks = bytearray()
        for _ in range(num_blocks):
            codes = bytes(rng.randrange(256) for _ in range(meta_offset))
            blocks += codes + struct.pack("<e", 0.25) * ((per_block - meta_offset) // 2)
        query = [rng.gauss(0, 1) for _ in range(hq * d)]
        seeds[name] = prefix(True, preset_index, 0, 0, bit7, 0, scale=0.125) + safetensors({
            "cache": ("U8", [num_blocks, per_block], bytes(blocks)),
            "query": ("F32", [1, hq, d], f32(query)),
            "block_tables": ("I32", [1, 2], struct.pack("<2i", 1, 0)),
            "seq_lens": ("I32", [1], struct.pack("<i", 20)),
        })
    return seeds


def main():
    rng = random.Random(34)
    for target, seeds in (("safetensors", safetensors_seeds(rng)), ("cli_inputs", cli_seeds(rng))):
        out = os.path.join(HERE, "corpus", target)
        os.makedirs(out, exist_ok=True)
        for old in os.listdir(out):
            os.remove(os.path.join(out, old))
        for name, data in seeds.items():
            with open(os.path.join(out, name), "wb") as f:
                f.write(data)


if __name__ == "__main__":
    main()
