#!/usr/bin/env python3
"""Writes the seed corpora of the fuzzers in tools/fuzz/ (standard library only; deterministic).

  python3 tools/fuzz/make_corpus.py   # rewrites tools/fuzz/corpus/{safetensors,cli_inputs,gguf}/

safetensors/: valid files (every dtype, metadata, a scalar, empty tensors) and a few invalid ones.
cli_inputs/: an 8-byte flag prefix (see cli_inputs_fuzzer.cc) then the --in file of a small
`tqkv store` or `tqkv decode` (D 64, Hk 1, block 16; decode also with query_start_loc and with a
sliding window).
gguf/: GGUF files: GPT-2 tokenizers (every byte, merges, control tokens; one with an empty
control token), a one-layer Llama of F32 weights (also with RoPE scaling, and with a Q8_0 output
of the wrong shape), and a truncated file.
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


def prefix(decode, preset, block_index, rotation, bit7, num_blocks, seed=0, scale=0.0, window=0):
    mode = int(decode) | (preset << 1) | (block_index << 3) | (rotation << 5) | (int(bit7) << 7)
    return bytes([mode, num_blocks, seed, window]) + struct.pack("<f", scale)


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

    def cache_blocks(preset, rng=rng):
        per_block = block_bytes(preset, d, h, block)
        meta_offset = per_block - block * h * 2 * (2 if preset[1] else 3)
        blocks = bytearray()
        for _ in range(num_blocks):
            codes = bytes(rng.randrange(256) for _ in range(meta_offset))
            blocks += codes + struct.pack("<e", 0.25) * ((per_block - meta_offset) // 2)
        return ("U8", [num_blocks, per_block], bytes(blocks))

    for name, preset_index, bit7 in (("decode_4bit", 1, False), ("decode_k8v4_scale", 0, True)):
        cache = cache_blocks(PRESETS[preset_index])
        query = [rng.gauss(0, 1) for _ in range(hq * d)]
        seeds[name] = prefix(True, preset_index, 0, 0, bit7, 0, scale=0.125) + safetensors({
            "cache": cache,
            "query": ("F32", [1, hq, d], f32(query)),
            "block_tables": ("I32", [1, 2], struct.pack("<2i", 1, 0)),
            "seq_lens": ("I32", [1], struct.pack("<i", 20)),
        })
    # Several new tokens per sequence (AttentionCpu): 3 and 1 new tokens and a padding sequence
    # of none, BF16 query [4, Hq, D]; and one token each under a 7-token sliding window. (Their
    # own generator, so that the other seeds stay as they were.)
    own = random.Random(35)
    query = [own.gauss(0, 1) for _ in range(4 * hq * d)]
    seeds["attention_k3v4_verify"] = prefix(True, 2, 0, 0, False, 0) + safetensors({
        "cache": cache_blocks(PRESETS[2], own),
        "query": ("BF16", [4, hq, d], bf16(query)),
        "query_start_loc": ("I32", [4], struct.pack("<4i", 0, 3, 4, 4)),
        "block_tables": ("I32", [3, 2], struct.pack("<6i", 0, 1, 1, 0, 0, 0)),
        "seq_lens": ("I32", [3], struct.pack("<3i", 19, 32, 0)),
    })
    seeds["attention_3bit_window"] = prefix(True, 3, 0, 1, False, 0, window=7) + safetensors({
        "cache": cache_blocks(PRESETS[3], own),
        "query": ("F16", [2, hq, d], f16(query[:2 * hq * d])),
        "block_tables": ("I32", [2, 2], struct.pack("<4i", 1, 0, 0, 1)),
        "seq_lens": ("I32", [2], struct.pack("<2i", 30, 5)),
    })
    return seeds


def gguf(metadata, tensors=(), alignment=32):
    """metadata: (key, type, value) with type 4 u32, 6 f32, 7 bool, 8 string, or ("array", elem
    type, values); tensors: (name, dims, ggml type, raw bytes)."""
    def string(x):
        b = x.encode() if isinstance(x, str) else x
        return struct.pack("<Q", len(b)) + b

    def scalar(t, v):
        return {4: lambda: struct.pack("<I", v), 5: lambda: struct.pack("<i", v),
                6: lambda: struct.pack("<f", v), 7: lambda: struct.pack("<B", v),
                8: lambda: string(v)}[t]()

    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for key, t, v in metadata:
        out += string(key)
        if isinstance(t, tuple):
            out += struct.pack("<IIQ", 9, t[1], len(v)) + b"".join(scalar(t[1], x) for x in v)
        else:
            out += struct.pack("<I", t) + scalar(t, v)
    offset, blobs = 0, b""
    for name, dims, ggml_type, data in tensors:
        out += string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ggml_type, offset)
        pad = -len(data) % alignment
        blobs += data + b"\0" * pad
        offset += len(data) + pad
    out += b"\0" * (-len(out) % alignment)
    return out + blobs


def gpt2_byte_chars():
    """GPT-2's byte -> character map (printable bytes stand for themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def gguf_seeds(rng):
    arr = lambda t: ("array", t)
    byte_chars = gpt2_byte_chars()
    vocab = [byte_chars[b] for b in range(256)]
    merges = ["H e", "l l", "He ll", "o \u0120", "\u0120 w", "1 2"]
    vocab += [m.replace(" ", "") for m in merges] + ["<|im_start|>", "<|endoftext|>"]
    types = [1] * (len(vocab) - 2) + [3, 3]
    tokenizer = [
        ("tokenizer.ggml.model", 8, "gpt2"), ("tokenizer.ggml.pre", 8, "smollm"),
        ("tokenizer.ggml.tokens", ("array", 8), vocab), ("tokenizer.ggml.merges", ("array", 8), merges),
        ("tokenizer.ggml.token_type", ("array", 5), types),
        ("tokenizer.ggml.bos_token_id", 4, len(vocab) - 1), ("tokenizer.ggml.eos_token_id", 4, len(vocab) - 1),
    ]
    seeds = {"tokenizer_smollm": gguf(tokenizer)}
    seeds["tokenizer_empty_control"] = gguf([
        ("tokenizer.ggml.model", 8, "gpt2"), ("tokenizer.ggml.pre", 8, "gpt2"),
        ("tokenizer.ggml.tokens", ("array", 8), ["a", "b", "ab", "", "<s>"]),
        ("tokenizer.ggml.merges", ("array", 8), ["a b"]),
        ("tokenizer.ggml.token_type", ("array", 5), [1, 1, 1, 3, 3]),
    ])
    hidden, kv, ffn, vocab_size = 8, 4, 8, 5
    shapes = [("token_embd.weight", [hidden, vocab_size]), ("output_norm.weight", [hidden]),
              ("blk.0.attn_norm.weight", [hidden]), ("blk.0.attn_q.weight", [hidden, hidden]),
              ("blk.0.attn_k.weight", [hidden, kv]), ("blk.0.attn_v.weight", [hidden, kv]),
              ("blk.0.attn_output.weight", [hidden, hidden]), ("blk.0.ffn_norm.weight", [hidden]),
              ("blk.0.ffn_gate.weight", [hidden, ffn]), ("blk.0.ffn_up.weight", [hidden, ffn]),
              ("blk.0.ffn_down.weight", [ffn, hidden])]
    meta = [("general.architecture", 8, "llama"), ("llama.block_count", 4, 1),
            ("llama.embedding_length", 4, hidden), ("llama.feed_forward_length", 4, ffn),
            ("llama.attention.head_count", 4, 2), ("llama.attention.head_count_kv", 4, 1),
            ("llama.context_length", 4, 64), ("llama.attention.layer_norm_rms_epsilon", 6, 1e-5),
            ("llama.rope.freq_base", 6, 10000.0), ("llama.rope.dimension_count", 4, 4)]

    def weights():
        return [(name, dims, 0, f32([rng.gauss(0, 0.1) for _ in range(math.prod(dims))]))
                for name, dims in shapes]

    seeds["llama_f32"] = gguf(meta, weights())
    # An output projection of Q8_0 blocks (an fp16 scale, 32 int8s), shaped [32, 5] where the
    # model needs [8, 5]: the shape check's path, and Q8_0 for the fuzzer to mutate.
    q8 = struct.pack("<e", 0.01) + bytes(rng.randrange(256) for _ in range(32))
    seeds["llama_q8_output"] = gguf(meta, weights() + [("output.weight", [32, 5], 8, q8 * 5)])
    seeds["llama_rope_scaled"] = gguf(meta + [("llama.rope.scaling.type", 8, "linear")], weights())
    seeds["truncated"] = seeds["llama_f32"][: len(seeds["llama_f32"]) // 2]
    return seeds


def main():
    rng = random.Random(34)
    for target, seeds in (("safetensors", safetensors_seeds(rng)), ("cli_inputs", cli_seeds(rng)),
                          ("gguf", gguf_seeds(rng))):
        out = os.path.join(HERE, "corpus", target)
        os.makedirs(out, exist_ok=True)
        for old in os.listdir(out):
            os.remove(os.path.join(out, old))
        for name, data in seeds.items():
            with open(os.path.join(out, name), "wb") as f:
                f.write(data)


if __name__ == "__main__":
    main()
