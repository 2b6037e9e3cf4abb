#!/usr/bin/env python3
"""PyTorch bf16 decode on the decode_bench shapes, for the side-by-side table.

q [B, 32, 1, 128], K/V [B, 8, L, 128] contiguous bf16,
torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True).
Small shapes rotate among K/V sets that hold >= 256 MiB together (five times the H200's L2; at
least 8 sets), so that HBM, not L2, is measured, as decode_bench's RotatingSets.
µs per call: 10 calls back to back on the stream, and one call per set (at least 16) captured into
one CUDA graph and replayed (as engines run decode steps); median of 7.
Writes {"results": [{"batch", "context", "us", "graph_us"}]} to the path given.
  torch_decode_bench.py OUT.json [--quick] [--hq 32] [--head-dim 128]   (as decode_bench's)
"""
import json
import sys

import torch
import torch.nn.functional as F

ROTATE_BYTES = 256 << 20  # the K/V sets of a shape together (decode_bench's kRotateBytes)


def graph_time_us(q, kvs, sets, calls=16):
    """µs per call of `calls` SDPA calls captured into one CUDA graph (median of 7 replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream, as torch recommends
        for i in range(3):
            F.scaled_dot_product_attention(q, *kvs[i % sets], enable_gqa=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            F.scaled_dot_product_attention(q, *kvs[i % sets], enable_gqa=True)
    graph.replay()
    times = []
    for _ in range(7):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    times.sort()
    del graph
    return times[len(times) // 2] * 1e3


def main():
    out_path = sys.argv[1]
    quick = "--quick" in sys.argv
    batches = [1, 64] if quick else [1, 16, 64, 256]
    contexts = [4096, 32768] if quick else [1024, 4096, 16384, 32768]
    hq, hk, d = 32, 8, 128
    if "--hq" in sys.argv:  # query heads (GQA group hq / 8), as decode_bench --hq
        hq = int(sys.argv[sys.argv.index("--hq") + 1])
    if "--head-dim" in sys.argv:  # as decode_bench --head-dim
        d = int(sys.argv[sys.argv.index("--head-dim") + 1])
    results = []
    for b in batches:
        for ctx in contexts:
            kv_bytes = 2 * b * hk * ctx * d * 2
            want = max(8, -(-ROTATE_BYTES // kv_bytes))
            sets = max(1, min(want, (1 << 30) // kv_bytes))
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
            graph_us = graph_time_us(q, kvs, sets, calls=max(16, sets))
            results.append({"batch": b, "context": ctx, "us": us, "graph_us": graph_us})
            print(f"torch bf16 SDPA B={b} L={ctx}: {us:.1f} us ({kv_bytes / us / 1e3:.0f} GB/s), "
                  f"graph {graph_us:.1f} us ({kv_bytes / graph_us / 1e3:.0f} GB/s)", flush=True)
            del kvs
            torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump({"results": results}, f)


if __name__ == "__main__":
    main()
