#!/usr/bin/env python3
"""Logits of an independent implementation, llama.cpp (PyPI llama-cpp-python, built from its
source on the CPU), for model/llama_test.cc: for each prompt of model/testdata/llama_prompts.txt
(one per line), llama.cpp's token ids and, at every position, its top-5 tokens and logits.

  CMAKE_ARGS="-DGGML_OPENMP=OFF" pip install llama-cpp-python
  python3 tools/model/llama_cpp_reference.py .models/SmolLM2-135M-Instruct.Q4_1.gguf \
      model/testdata/llama_prompts.txt > model/testdata/smollm2_llama_cpp_logits.json
"""
import json
import sys

import numpy as np
from llama_cpp import Llama


def main(model_path, prompts_path):
    llm = Llama(model_path=model_path, logits_all=True, n_ctx=512, n_threads=2, verbose=False)
    out = []
    for line in open(prompts_path, encoding="utf-8"):
        prompt = line.rstrip("\n")
        if not prompt:
            continue
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=False)
        llm.reset()
        llm.eval(ids)
        logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
        top = np.argsort(-logits, axis=1)[:, :5]
        out.append({"prompt": prompt, "ids": ids,
                    "top_ids": top.tolist(),
                    "top_logits": np.take_along_axis(logits, top, axis=1).tolist()})
    json.dump({"llama_cpp": __import__("llama_cpp").__version__, "prompts": out}, sys.stdout)
    print()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
