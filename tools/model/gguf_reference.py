#!/usr/bin/env python3
"""Reference values of a GGUF file from an independent reader, llama.cpp's gguf-py (PyPI `gguf`),
for model/gguf_test.cc: the Llama metadata, and for a few tensors their dims, type, first and
last elements and sums of the dequantized values.

  pip install gguf numpy
  python3 tools/model/gguf_reference.py .models/SmolLM2-135M-Instruct.Q4_1.gguf \
      > model/testdata/smollm2_gguf_reference.json
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

TENSORS = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
           "blk.0.attn_norm.weight", "blk.17.ffn_down.weight", "blk.29.ffn_gate.weight",
           "output_norm.weight"]
KEYS = ["general.architecture", "llama.block_count", "llama.context_length",
        "llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count",
        "llama.attention.head_count_kv", "llama.rope.freq_base",
        "llama.attention.layer_norm_rms_epsilon", "tokenizer.ggml.model", "tokenizer.ggml.pre",
        "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"]


def scalar(field):
    v = field.parts[field.data[0]]
    if field.types[0].name == "STRING":
        return bytes(v).decode()
    return v.tolist()[0]


def main(path):
    r = GGUFReader(path)
    out = {"metadata": {k: scalar(r.fields[k]) for k in KEYS if k in r.fields},
           "num_tensors": len(r.tensors), "tensors": {}}
    out["metadata"]["num_tokens"] = len(r.fields["tokenizer.ggml.tokens"].data)
    out["metadata"]["num_merges"] = len(r.fields["tokenizer.ggml.merges"].data)
    by_name = {t.name: t for t in r.tensors}
    for name in TENSORS:
        t = by_name[name]
        x = dequantize(t.data, t.tensor_type).astype(np.float64).ravel()
        out["tensors"][name] = {
            "dims": [int(d) for d in t.shape], "type": t.tensor_type.name,
            "head": x[:8].tolist(), "tail": x[-8:].tolist(),
            "sum": float(x.sum()), "sum_sq": float((x * x).sum())}
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main(sys.argv[1])
