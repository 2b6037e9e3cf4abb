#!/usr/bin/env python3
"""Compares the attention outputs of two `tqkv sim --json` reports (e.g. --device cpu vs cuda).

Each output row's checksum is Σ_i out[i]·(i mod 97 + 1) over the Hq·D outputs of one query row
(prefill and decode);
rows are matched by (request, branch, position, layer). Prints the worst relative difference and
exits non-zero above the tolerance (default 2e-3: the decode kernels' row-relative tolerance).
"""
import json
import sys


def main():
    a, b = (json.load(open(p)) for p in sys.argv[1:3])
    tol = float(sys.argv[3]) if len(sys.argv) > 3 else 2e-3
    ra = {tuple(e[:4]): e[4] for e in a["output_checksums"]}
    rb = {tuple(e[:4]): e[4] for e in b["output_checksums"]}
    if ra.keys() != rb.keys():
        print(f"different rows: {len(ra)} vs {len(rb)}")
        return 1
    scale = max(abs(v) for v in ra.values()) or 1.0
    worst = max(abs(ra[k] - rb[k]) for k in ra) / scale
    print(f"{len(ra)} decode rows compared; worst |difference| / max |checksum| = {worst:.2e} "
          f"(tolerance {tol:.0e}); cosine mean {a['cosine_mean']:.5f} vs {b['cosine_mean']:.5f}")
    return 0 if worst <= tol else 1


if __name__ == "__main__":
    sys.exit(main())
