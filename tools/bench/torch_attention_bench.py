#!/usr/bin/env python3
"""The peers of attention_bench, on its shapes, and the joint table.

1. PyTorch SDPA bf16 on the raw K/V with the lower-right causal mask
   (torch.nn.attention.bias.causal_lower_right), q [B, 32, q_len, 128], K/V [B, 8, L, 128]: the
   flash, cuDNN and efficient backends, the best kept (GQA by enable_gqa, or K/V expanded to 32
   heads where a backend refuses it; the expansion is outside the timing).
2. Dequantize-then-attend (turboquant_4bit_nc): the sequences' compressed K/V (random codes,
   valid norms and scales) dequantized to bf16 in PyTorch — centroid lookup times the norm, the
   inverse rotation as a GEMM, values as code · scale + zero — then the same SDPA; its time and
   its peak extra device memory (torch.cuda.max_memory_allocated above what the cache holds).
Timing: CUDA graph of the calls where capture works (events around 10 calls otherwise), median.
A mixed step (one chunk plus decode rows) is the sum of its two parts' calls.

  torch_attention_bench.py --ours attention_bench.json [--quick] [--out peers.json]
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

HQ, HK, D = 32, 8, 128
PEAK_TFLOPS = 790.0


def timed_us(fn, calls=8):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run = graph.replay
    except Exception:  # noqa: BLE001 - a backend that cannot be captured: plain calls
        torch.cuda.synchronize()
        graph = None

        def run():
            for _ in range(calls):
                fn()
    run()
    times = []
    for _ in range(5):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    times.sort()
    return times[len(times) // 2] * 1e3


BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def sdpa_call(q, k, v, backend):
    """A callable for one SDPA call (None where the backend refuses the shape)."""
    q_len, kv_len = q.shape[2], k.shape[2]
    mask = causal_lower_right(q_len, kv_len) if q_len > 1 else None
    for gqa in (True, False):
        kk, vv = (k, v) if gqa else (k.repeat_interleave(HQ // HK, 1), v.repeat_interleave(HQ // HK, 1))

        def call(kk=kk, vv=vv, gqa=gqa):
            with sdpa_kernel(BACKENDS[backend]):
                if mask is None:
                    return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa)
                return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=gqa)
        try:
            call()
            torch.cuda.synchronize()
            return call
        except Exception:  # noqa: BLE001
            continue
    return None


def best_sdpa(batch, kv_len, q_len):
    q = torch.randn(batch, HQ, q_len, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, HK, kv_len, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    best = (float("inf"), "none")
    for name in BACKENDS:
        call = sdpa_call(q, k, v, name)
        if call is not None:
            best = min(best, (timed_us(call), name))
    return best


def dequant_then_attend(batch, kv_len, q_len):
    """4bit_nc cache -> bf16 K/V -> SDPA: (µs, peak extra bytes)."""
    n = batch * kv_len * HK
    codes_k = torch.randint(0, 256, (n, D // 2), device="cuda", dtype=torch.uint8)
    codes_v = torch.randint(0, 256, (n, D // 2), device="cuda", dtype=torch.uint8)
    norm = torch.rand(n, 1, device="cuda", dtype=torch.float16) + 0.5
    scale = torch.rand(n, 1, device="cuda", dtype=torch.float16) * 0.1
    zero = torch.randn(n, 1, device="cuda", dtype=torch.float16)
    centroids = torch.linspace(-0.25, 0.25, 16, device="cuda", dtype=torch.float32)
    rot = torch.linalg.qr(torch.randn(D, D, device="cuda"))[0].to(torch.bfloat16)
    q = torch.randn(batch, HQ, q_len, D, device="cuda", dtype=torch.bfloat16)
    mask = causal_lower_right(q_len, kv_len) if q_len > 1 else None

    def unpack(c):
        return torch.stack((c & 15, c >> 4), dim=-1).reshape(n, D).long()

    def call():
        y = (centroids[unpack(codes_k)] * norm.float()).to(torch.bfloat16)
        k = (y @ rot).view(batch, kv_len, HK, D).transpose(1, 2)
        v = (unpack(codes_v).float() * scale.float() + zero.float()).to(torch.bfloat16)
        v = v.view(batch, kv_len, HK, D).transpose(1, 2)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return timed_us(call, calls=4), peak


def parse(shape):
    """attention_bench's shape names -> [(batch, kv_len, q_len), ...] (the calls of one step)."""
    parts = shape.split()
    if parts[0] == "verify":
        batch, context = (int(x[:-1]) * 1024 if x.endswith("k") else int(x)
                          for x in parts[1].split("x"))
        return [(batch, context, int(parts[2][1:]))]
    if parts[0] == "prefill":
        chunk, prefix = int(parts[1]), int(parts[2][1:-1]) * 1024
        return [(1, prefix + chunk, chunk)]
    if parts[0] == "mixed":
        return [(1, 2048, 2048), (63, 4096, 1)]
    if parts[0] == "decode":
        return [(63, 4096, 1)]
    if parts[0] == "window":  # SDPA over the tokens the window reads ("none": all of them)
        batch, context = (int(x[:-1]) * 1024 if x.endswith("k") else int(x)
                          for x in parts[1].split("x"))
        q = int(parts[3][1:]) if len(parts) > 3 and parts[3].startswith("q") else 1
        # (q new tokens: the first one's window through the last one.)
        return [(batch, context if parts[2] == "none" else min(context, int(parts[2][1:]) + q - 1),
                 q)]
    raise ValueError(shape)


def base_shape(shape):
    """The shape a variant runs (kernel choices after the shape: "chunk", "rows4", "exact")."""
    parts = shape.split()
    n = 3 if parts[0] in ("verify", "prefill", "window") else 2 if parts[0] == "decode" else 4
    if parts[0] == "window" and len(parts) > 3 and parts[3].startswith("q"):
        n = 4
    return " ".join(parts[:n])


def print_compact(ours, peers):
    """One line per shape: each kind's fastest-slowest µs, then SDPA and dequantize-then-SDPA."""
    by_shape = {}
    for r in ours:
        by_shape.setdefault(r["shape"], {}).setdefault(r["kind"].replace("turboquant_", ""), []).append(r["us"])
    for shape, kinds in by_shape.items():
        cells = "  ".join(f"{k} {min(v):.1f}-{max(v):.1f}" for k, v in kinds.items())
        p = peers.get(base_shape(shape))
        peer = (f"  | SDPA {p['sdpa_us']:.1f} ({p['backend']})" +
                (f", dequant+SDPA {p['dequant_us']:.1f}" if p["dequant_us"] > 0 else "")) if p else ""
        print(f"{shape:<30} {cells}{peer}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compact", action="store_true",
                    help="one line per shape (every kind's fastest-slowest µs over attention_bench's "
                         "--repeat runs, the peers) instead of the joint table")
    args = ap.parse_args()
    ours = json.load(open(args.ours))
    peers = {}
    for shape in dict.fromkeys(base_shape(r["shape"]) for r in ours):
        if shape.startswith("window mixed"):  # (no SDPA peer: a window's mask is not causal)
            continue
        calls = parse(shape)
        us, names, dq_us, dq_peak = 0.0, [], 0.0, 0
        for batch, kv_len, q_len in calls:
            t, name = best_sdpa(batch, kv_len, q_len)
            us += t
            names.append(name)
            if not shape.startswith(("decode", "window")):
                d_us, d_peak = dequant_then_attend(batch, kv_len, q_len)
                dq_us += d_us
                dq_peak = max(dq_peak, d_peak)
            torch.cuda.empty_cache()
        peers[shape] = {"sdpa_us": us, "backend": "+".join(names), "dequant_us": dq_us,
                        "dequant_peak_bytes": dq_peak}
        print(f"peer {shape:<24} sdpa {us:9.1f} us ({'+'.join(names)})  dequant+sdpa {dq_us:9.1f} us "
              f"peak extra {dq_peak / 1e6:8.1f} MB", flush=True)
    if args.out:
        json.dump(peers, open(args.out, "w"), indent=1)
    print()
    if args.compact:
        print_compact(ours, peers)
        return
    print("| shape | kind | tqkv µs | TFLOP/s (% of 790) | GB/s (% of read) | extra MB | SDPA bf16 µs "
          "| vs SDPA | dequant+SDPA µs (extra MB) | vs dequant |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in ours:
        p = peers.get(base_shape(r["shape"]))
        tflops = r["flops"] / (r["us"] * 1e-6) / 1e12
        gbs = r["bytes"] / (r["us"] * 1e-6) / 1e9
        cols = [r["shape"], r["kind"], f"{r['us']:.1f}", f"{tflops:.0f} ({100 * tflops / PEAK_TFLOPS:.0f} %)",
                f"{gbs:.0f} ({100 * gbs / r['read_gbs']:.0f} %)", f"{r['workspace'] / 1e6:.1f}"]
        if p:
            cols += [f"{p['sdpa_us']:.1f} ({p['backend']})", f"{p['sdpa_us'] / r['us']:.2f}x"]
            if p["dequant_us"] > 0:
                cols += [f"{p['dequant_us']:.1f} ({p['dequant_peak_bytes'] / 1e6:.0f})",
                         f"{p['dequant_us'] / r['us']:.2f}x"]
            else:
                cols += ["", ""]
        else:
            cols += ["", "", "", ""]
        print("| " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
