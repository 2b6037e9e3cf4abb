#!/usr/bin/env python3
"""PyTorch bf16 decode on the decode_bench shapes, for the side-by-side table.

q [B, 32, 1, 128], K/V [B, 8, L, 128] contiguous bf16,
torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True).
Small shapes rotate among several K/V sets (> 1 GiB in all) so that HBM, not L2, is measured.
Writes {"results": [{"batch", "context", "us"}]} to the path given.
"""
import json
import sys

import torch
import torch.nn.functional as F


def main():
    out_path = sys.argv[1]
    quick = "--quick" in sys.argv
    batches = [1, 64] if quick else [1, 16, 64, 256]
    contexts = [4096, 32768] if quick else [1024, 4096, 16384, 32768]
    hq, hk, d = 32, 8, 128
    results = []
    for b in batches:
        for ctx in contexts:
            kv_bytes = 2 * b * hk * ctx * d * 2
            sets = max(1, min(8, (1 << 30) // kv_bytes))
            q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
            kvs = [(torch.randn(b, hk, ctx, d, device="cuda", dtype=torch.bfloat16),
                    torch.randn(b, hk, ctx, d, device="cuda", dtype=torch.bfloat16))
                   for _ in range(sets)]
            for i in range(3):
                F.scaled_dot_product_attention(q, *kvs[i % sets], enable_gqa=True)
            times = []
            reps = 10
            for r in range(7):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for i in range(reps):
                    F.scaled_dot_product_attention(q, *kvs[(r * reps + i) % sets], enable_gqa=True)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / reps)
            times.sort()
            us = times[len(times) // 2] * 1e3
            results.append({"batch": b, "context": ctx, "us": us})
            print(f"torch bf16 SDPA B={b} L={ctx}: {us:.1f} us ({kv_bytes / us / 1e3:.0f} GB/s)",
                  flush=True)
            del kvs
            torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump({"results": results}, f)


if __name__ == "__main__":
    main()
