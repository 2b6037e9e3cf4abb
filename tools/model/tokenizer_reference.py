#!/usr/bin/env python3
"""Token ids of model/testdata/tokenizer_cases.txt from an independent implementation, Hugging
Face's `tokenizers` (Rust), built from the GGUF file's own vocabulary and merges with SmolLM2's
pre-tokenizer (Digits(individual_digits) then ByteLevel), for model/tokenizer_test.cc.

  pip install tokenizers gguf
  python3 tools/model/tokenizer_reference.py .models/SmolLM2-135M-Instruct.Q4_1.gguf \
      model/testdata/tokenizer_cases.txt > model/testdata/smollm2_tokenizer_reference.json

Cases are separated by lines holding only "----"; "\\n", "\\t", "\\r" in a case stand for a newline,
a tab and a carriage return.
"""
import json
import sys

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers


def strings(reader, key):
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def main(gguf_path, cases_path):
    r = GGUFReader(gguf_path)
    tokens = strings(r, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in strings(r, "tokenizer.ggml.merges")]
    types = r.fields["tokenizer.ggml.token_type"]
    control = [tokens[k] for k, i in enumerate(types.data) if int(types.parts[i][0]) == 3]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    text = open(cases_path, encoding="utf-8").read()
    cases = [c.strip("\n").replace("\\n", "\n").replace("\\t", "\t").replace("\\r", "\r")
             for c in text.split("\n----\n")]
    out = [{"text": c, "ids": tok.encode(c, add_special_tokens=False).ids} for c in cases]
    json.dump({"cases": out}, sys.stdout, ensure_ascii=False, indent=0)
    print()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
