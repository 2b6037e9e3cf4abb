#!/usr/bin/env python3
"""Static size of the decode split kernels' chunk loops, from their SASS (no GPU needed).

The staged decode kernels are bound by the instructions a warp executes per 16-token chunk
(tools/bench/README.md), so a kernel change can be judged here before a device call:

  nvcc -std=c++20 -arch=sm_90a -O3 --expt-relaxed-constexpr -I. -c attention/decode_split_mse4.cu -o /tmp/dk.o
  python3 tools/bench/sass_loops.py /tmp/dk.o [NAME_SUBSTRING ...] [--histogram] [--dump DIR]

For every kernel whose description contains all the given words (default: the D = 128 packed
staged compressed kernels), it prints the kernel's instruction count and its chunk loop: the
backward branch whose body holds exactly one chunk's MMAs (HMMA or HGMMA; CHUNK_HMMAS: 24 for the
packed staged kernels, 32 / 64 for the half-precision ones with 2 / 4 N tiles, 32 / 16 for the
shared-output ones, whose 4 N tiles are 16 warpgroup MMAs on sm_90a) and issues copies (LDGSTS:
the staged main loop, not the masked last chunks' loop), else the largest such, with its
instruction count, MMA and LDGSTS counts. The count is static; the common path leaves out what
conditional forward branches of 24 instructions or more skip (the lazy rescale, which rarely
runs). --histogram: the common path's opcodes; --dump DIR: each loop's SASS, its rare branches
marked "rare". A kernel DecodeSplitKernel<code> is described by its SplitVariant
(attention/decode_variant.h, SplitVariant::Code), e.g. "mse4 v4 D128 nt1 packed staged": key kind
(mse4, mse3, fp8, bf16, f16), value bits, head_dim, N tiles, packed or unpacked, pipeline
(registers, staged, narrow, paired), hi_only, one_cta, half, shared_o (whose loop is one step:
its warp's chunk scored, then P·V over four chunks for a quarter of head_dim; the same HMMAs),
window (the shared-output kernel's sliding-window twin).

cuobjdump is not in every CUDA toolkit image: the script looks in PATH, CUDA_HOME/bin,
/usr/local/cuda/bin, then in a pip-installed nvidia-cuda-cuobjdump
(`pip install --target /tmp/cuobj nvidia-cuda-cuobjdump`, then CUOBJDUMP=/tmp/cuobj/nvidia/cu13/bin/cuobjdump);
that cuobjdump needs nvdisasm in PATH (`pip download --no-deps nvidia-cuda-nvdisasm`, unzip the
wheel: nvidia/cu13/bin/nvdisasm).
"""
import collections
import glob
import os
import re
import shutil
import subprocess
import sys

DEFAULT_FILTER = ["D128", "nt1", "packed", "staged"]
KINDS = ["mse4", "mse3", "fp8", "bf16", "f16"]
PIPELINES = ["registers", "staged", "narrow", "paired"]


def describe(name):
    """SplitVariant of a DecodeSplitKernel<code> name, as words (SplitVariant::FromCode)."""
    m = re.search(r"DecodeSplitKernelILj(\d+)E", name)
    if not m:
        return name
    c = int(m.group(1))
    words = [KINDS[c & 7], f"v{(c >> 3) & 31}", f"D{(c >> 8) & 511}", f"nt{(c >> 17) & 7}",
             "packed" if (c >> 20) & 1 else "unpacked", PIPELINES[(c >> 21) & 3]]
    if (c >> 23) & 1:
        words.append("hi_only")
    if (c >> 24) & 1:
        words.append("one_cta")
    if (c >> 25) & 1:
        words.append("half")
    if (c >> 26) & 1:
        words.append("shared_o")
    if (c >> 27) & 1:
        words.append("window")
    return " ".join(words)
# 16: the hi-only score path; the half-precision kernels 32 (nt2) or 64 (nt4); the shared-output
# kernels 32 (nt2) or, with warpgroup MMAs, 16 (nt4).
CHUNK_HMMAS = int(os.environ.get("CHUNK_HMMAS", "24"))
# The fewest instructions a conditional forward branch must skip to count as a rare branch.
RARE_LEAST = 24


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


def is_mma(text):
    """A tensor-core MMA: HMMA (mma.sync) or HGMMA (a warpgroup MMA)."""
    return re.search(r"\bHG?MMA\.", text) is not None


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
        body = code[index[target]:i + 1]
        if sum(is_mma(t) for _, t in body) != CHUNK_HMMAS:
            continue
        # The staged kernels' main loop issues the next chunks' copies; the masked last chunks'
        # loop (longer: its column masks) does not, but in the shared-output kernels, where
        # both do, the shorter one is the main loop.
        staged = any("LDGSTS" in t for _, t in body)
        key = (staged, -len(body) if staged else len(body))
        if best is None or key > best[0]:
            best = (key, body)
    return best[1] if best else None


def rare_instructions(loop, least=RARE_LEAST):
    """The indices of the loop's instructions that lie inside a region that a conditional forward
    branch of the loop skips, counting only regions of at least `least` instructions: the rare
    branches (the lazy softmax's rescale) that a chunk mostly does not run. The rest is the common
    path, as far as static code tells (short skips, such as a short-circuit test, are counted
    in)."""
    index = {addr: i for i, (addr, _) in enumerate(loop)}
    skipped = set()
    for i, (addr, text) in enumerate(loop):
        m = re.match(r"@!?P\w+\s+BRA\b.*?0x([0-9a-f]+)", text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target <= addr or target not in index or index[target] - i - 1 < least:
            continue
        skipped.update(range(i + 1, index[target]))
    return skipped


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
        short = describe(name)
        if short == name or not all(f in short.split() for f in filters):
            continue
        loop = chunk_loop(code)
        if loop is None:
            print(f"{short}: {len(code)} instructions, no {CHUNK_HMMAS}-HMMA chunk loop")
            continue
        ldgsts = sum("LDGSTS" in t for _, t in loop)
        rare = rare_instructions(loop)
        print(f"{short}: {len(code)} instructions, chunk loop {len(loop)} "
              f"(MMA {CHUNK_HMMAS}, LDGSTS {ldgsts}; common path {len(loop) - len(rare)}, "
              f"{len(rare)} in rare branches)")
        if histogram:
            counts = collections.Counter(opcode(t) for i, (_, t) in enumerate(loop)
                                         if i not in rare)
            print("   common path: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
        if dump:
            path = os.path.join(dump, re.sub(r"[^A-Za-z0-9_]", "_", short)[:120] + ".sass")
            with open(path, "w") as f:
                f.write("\n".join(("rare " if i in rare else "     ") + t
                                  for i, (_, t) in enumerate(loop)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
