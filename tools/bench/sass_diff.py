#!/usr/bin/env python3
"""Are two builds' kernels the same machine code? Compares the SASS of every kernel (no GPU needed).

  python3 tools/bench/sass_diff.py OLD.o [OLD2.o ...] -- NEW.o [NEW2.o ...]

A refactoring that renames kernels, moves them between files or replaces template parameters
changes the kernels' names but must not change their code. So each kernel's SASS body is
normalized (addresses, the function's own name and relocated symbol names dropped) and hashed,
and the two builds are compared as multisets of bodies: every old body must have an identical
new one. Prints the kernels of each side without a twin and exits 1 if there is any; with
--allow-removed, old kernels without a twin are listed but do not fail (kernels deleted on
purpose).

cuobjdump and nvdisasm are not in every CUDA toolkit image: set CUOBJDUMP, or
`pip install --target /tmp/cuobj nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` and put
/tmp/cuobj/nvidia/cu13/bin on PATH.
"""
import collections
import hashlib
import os
import re
import shutil
import subprocess
import sys


def cuobjdump():
    for c in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump",
              "/tmp/cuobj/nvidia/cu13/bin/cuobjdump"):
        if c and os.path.exists(c):
            return c
    sys.exit("sass_diff.py: no cuobjdump (see the docstring)")


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    return out.splitlines()


def kernels(obj):
    """{mangled name: normalized SASS body} of every function in obj's sm_90a code."""
    text = subprocess.run([cuobjdump(), "-sass", obj], capture_output=True, text=True, check=True).stdout
    bodies, name, lines = {}, None, []
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if name:
                bodies[name] = lines
            name, lines = m.group(1), []
            continue
        if name is None:
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;?\s*(/\*.*\*/)?\s*$", line)
        if m:
            lines.append(m.group(1))
        else:
            m = re.match(r"\s*/\* (0x[0-9a-f]{16}) \*/\s*$", line)
            if m:
                lines.append(m.group(1))
    if name:
        bodies[name] = lines
    result = {}
    for n, ls in bodies.items():
        body = "\n".join(re.sub(r"_Z\w+|\$\S+", "SYM", l) for l in ls)
        result[n] = body
    return result


def main(argv):
    allow_removed = "--allow-removed" in argv
    argv = [a for a in argv if a != "--allow-removed"]
    if "--" not in argv:
        sys.exit(__doc__)
    i = argv.index("--")
    old, new = argv[:i], argv[i + 1:]
    def collect(objs):
        d = {}
        for o in objs:
            d.update(kernels(o))
        return d
    a, b = collect(old), collect(new)
    by_hash = lambda d: collections.Counter(hashlib.sha1(v.encode()).hexdigest() for v in d.values())
    ha, hb = by_hash(a), by_hash(b)
    names = lambda d, missing: sorted(
        n for n, v in d.items() if hashlib.sha1(v.encode()).hexdigest() in missing)
    only_a = ha - hb
    only_b = hb - ha
    print(f"old: {len(a)} kernels, new: {len(b)} kernels, identical bodies: {sum((ha & hb).values())}")
    for title, d, missing in (("old only", a, only_a), ("new only", b, only_b)):
        ns = names(d, missing)
        if ns:
            print(f"{title} ({len(ns)}):")
            for n in demangle(ns):
                print("  " + n)
    failed = bool(only_b) or (bool(only_a) and not allow_removed)
    print("DIFFERENT" if failed else "IDENTICAL (every new kernel has an old twin)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
