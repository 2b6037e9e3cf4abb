#!/usr/bin/env python3
"""Static size of the decode split kernels' chunk loops, from their SASS (no GPU needed).

The staged decode kernels are bound by the instructions a warp executes per 16-token chunk
(tools/bench/README.md), so a kernel change can be judged here before a device call:

  nvcc -std=c++20 -arch=sm_90a -O3 --expt-relaxed-constexpr -I. -c attention/decode_split_mse4.cu -o /tmp/dk.o
  python3 tools/bench/sass_loops.py /tmp/dk.o [NAME_SUBSTRING ...] [--histogram] [--dump DIR]

For every kernel whose mangled name contains all substrings (default: the D = 128 staged compressed
kernels), it prints the kernel's instruction count and its chunk loop: the largest backward branch
whose body holds exactly one chunk's HMMAs (24 for the packed staged kernels), with its instruction
count, HMMA and LDGSTS counts. Template arguments in the names: DecodeSplitKernel<KeyKind (0 4-bit,
1 3-bit, 2 FP8, 3 bf16, 4 fp16), value bits, D, N tiles, packed, staged, warps per CTA>.

cuobjdump is not in every CUDA toolkit image: the script looks in PATH, CUDA_HOME/bin,
/usr/local/cuda/bin, then in a pip-installed nvidia-cuda-cuobjdump
(`pip install --target /tmp/cuobj nvidia-cuda-cuobjdump`, then CUOBJDUMP=/tmp/cuobj/nvidia/cu13/bin/cuobjdump).
"""
import collections
import glob
import os
import re
import shutil
import subprocess
import sys

DEFAULT_FILTER = ["ELi128ELi1ELb1ELb1E"]  # D = 128, one N tile, packed, staged
CHUNK_HMMAS = int(os.environ.get("CHUNK_HMMAS", "24"))  # 16: the hi-only score path


def find_cuobjdump():
    candidates = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            candidates.append(os.path.join(root, "bin", "cuobjdump"))
    candidates += sorted(glob.glob("/tmp/cuobj/nvidia/*/bin/cuobjdump"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    sys.exit("sass_loops.py: no cuobjdump found (see the docstring for the pip package)")


def kernels(obj):
    out = subprocess.run([find_cuobjdump(), "-sass", obj], capture_output=True, text=True,
                         check=True).stdout
    for block in re.split(r"\n\s+Function : ", out)[1:]:
        name = block.split("\n", 1)[0].strip()
        code = []
        for line in block.split("\n"):
            m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
            if m:
                code.append((int(m.group(1), 16), m.group(2)))
        yield name, code


def chunk_loop(code):
    index = {addr: i for i, (addr, _) in enumerate(code)}
    best = None
    for i, (addr, text) in enumerate(code):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= addr or target not in index:
            continue
        body = [t for _, t in code[index[target]:i + 1]]
        if sum("HMMA" in t for t in body) == CHUNK_HMMAS and (best is None or len(body) > len(best)):
            best = body
    return best


def opcode(text):
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    obj, rest = argv[0], argv[1:]
    histogram = "--histogram" in rest
    dump = None
    if "--dump" in rest:
        dump = rest[rest.index("--dump") + 1]
        os.makedirs(dump, exist_ok=True)
    filters = [a for a in rest if not a.startswith("--") and a != dump] or DEFAULT_FILTER
    for name, code in kernels(obj):
        if not all(f in name for f in filters):
            continue
        loop = chunk_loop(code)
        short = re.sub(r"^.*DecodeSplitKernel", "DecodeSplitKernel", name)
        if loop is None:
            print(f"{short}: {len(code)} instructions, no {CHUNK_HMMAS}-HMMA chunk loop")
            continue
        ldgsts = sum("LDGSTS" in t for t in loop)
        print(f"{short}: {len(code)} instructions, chunk loop {len(loop)} "
              f"(HMMA {CHUNK_HMMAS}, LDGSTS {ldgsts})")
        if histogram:
            counts = collections.Counter(opcode(t) for t in loop)
            print("   " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
        if dump:
            path = os.path.join(dump, re.sub(r"[^A-Za-z0-9_]", "_", short)[:120] + ".sass")
            with open(path, "w") as f:
                f.write("\n".join(loop) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
