#!/usr/bin/env python3
"""The vLLM Triton seed store (../shared/seed/seed_store.py) beside tqkv's CUDA store, on the GPU.

Run after store_bench (same device call):
  store_seed_bench.py --seed-module DIR --inputs /tmp/store_bench --ours LOG_DIR/store_bench.json
                      --out LOG_DIR/seed_report.json

1. Times the seed on store_bench's shapes (Hk = 8, D = 128, bf16, block 16; N = 16 .. 65,536;
   every preset), per call from Python (as vLLM calls it) and per call inside a CUDA graph for
   N <= 2048, with inputs rotated over more than 4x the L2 and the same slot patterns.
2. Feeds the seed the exact inputs, Πᵀ, centroids and midpoints store_bench used (N = 2048,
   inputs_<preset>.safetensors), into the same poisoned cache, and reports how many bytes differ
   from tqkv's caches (fwht, gemm) and from the CPU reference, sorted into classes, each checked
   against its explanation (index flips at a midpoint, ties of the approximate division, fp32
   norms).
3. Prints the side-by-side table (seed / tqkv ratios) using store_bench.json.
"""
import argparse
import json
import math
import os
import sys

import torch
from safetensors import safe_open

H, D, BLOCK = 8, 128, 16
PRESETS = {  # name: (key_fp8, key_bits, value_bits, norm_correction)
    "turboquant_k8v4": (True, 8, 4, False),
    "turboquant_4bit_nc": (False, 4, 4, True),
    "turboquant_k3v4_nc": (False, 3, 4, True),
    "turboquant_3bit_nc": (False, 3, 3, True),
}


def fmt_sizes(preset):
    key_fp8, kb, vb, _ = PRESETS[preset]
    key_bytes = D if key_fp8 else math.ceil(D * kb / 8)
    val_bytes = math.ceil(D * vb / 8)
    num_meta = 2 if key_fp8 else 3
    dps = key_bytes + val_bytes
    slot_bytes = dps + 2 * num_meta
    return key_bytes, val_bytes, num_meta, dps, slot_bytes


def median_us(fn, per_batch, batches=15):
    times = []
    i = 0
    for _ in range(batches):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_batch):
            fn(i)
            i += 1
        end.record()
        end.synchronize()
        times.append(1000.0 * start.elapsed_time(end) / per_batch)
    times.sort()
    return times[len(times) // 2]


def time_us(fn):
    for w in range(3):
        fn(w)
    torch.cuda.synchronize()
    one = median_us(fn, 1, 5)
    per_batch = int(min(max(2000.0 / max(one, 1.0), 1), 200))
    return median_us(fn, per_batch)


def graph_us(fn, calls):
    for w in range(3):
        fn(w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    return median_us(lambda i: g.replay(), 1, 21) / calls


def slot_mapping(n, gen):
    """store_bench's patterns: scattered decode slots for n <= 256, runs of positions above."""
    if n <= 256:
        num_blocks = n * 4
        blocks = torch.randperm(num_blocks, generator=gen)[:n]
        pos = torch.randint(0, BLOCK, (n,), generator=gen)
        return blocks * BLOCK + pos, num_blocks
    num_blocks = (n + BLOCK - 1) // BLOCK + 8
    blocks = torch.randperm(num_blocks, generator=gen)
    t = torch.arange(n)
    return blocks[t // BLOCK] * BLOCK + t % BLOCK, num_blocks


def seed_call(seed, preset, key, value, cache, slots, tables):
    key_fp8, kb, vb, nc = PRESETS[preset]
    key_bytes, _, _, _, slot_bytes = fmt_sizes(preset)
    seed.triton_turboquant_store(
        key, value, cache.view(cache.shape[0], BLOCK, H, slot_bytes), slots,
        tables["pit"], tables["midpoints"], mse_bits=kb, key_packed_size=key_bytes,
        value_quant_bits=vb, key_fp8=key_fp8, centroids=tables["centroids"], norm_correction=nc)


def load_inputs(path):
    out = {}
    with safe_open(path, framework="pt", device="cuda") as f:
        for name in f.keys():
            out[name] = f.get_tensor(name)
        out["__meta__"] = f.metadata()
    return out


# ------------------------------------------------------------------------------------------------
# Byte comparison


def unpack(codes_bytes, bits, d):
    """[rows, nbytes] uint8 -> [rows, d] int64 codes (TURBOQUANT.md bit packing)."""
    b = codes_bytes.long()
    if bits == 8:
        return b
    if bits == 4:
        return torch.stack((b & 15, b >> 4), dim=-1).reshape(b.shape[0], d)
    g = b.reshape(b.shape[0], -1, 3)
    w = g[..., 0] | (g[..., 1] << 8) | (g[..., 2] << 16)
    shifts = torch.arange(8, device=b.device) * 3
    return ((w[..., None] >> shifts) & 7).reshape(b.shape[0], d)


def ulp32(x):
    """ulp of fp32 values (as fp64)."""
    x = x.abs().double().clamp_min(2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(x)) - 23)


def compare(preset, inputs, seed_cache, other, other_name):
    """Byte differences between the seed's cache and `other`, by class."""
    key_fp8, kb, vb, nc = PRESETS[preset]
    key_bytes, val_bytes, num_meta, dps, slot_bytes = fmt_sizes(preset)
    nb, block_bytes = seed_cache.shape
    meta_offset = BLOCK * H * dps
    slots = inputs["slot_mapping"].long()
    n = slots.shape[0]
    dev = seed_cache.device
    a = seed_cache.reshape(-1)
    b = other.reshape(-1)
    blk, pos = slots // BLOCK, slots % BLOCK
    heads = torch.arange(H, device=dev)
    row_base = (blk[:, None] * block_bytes + pos[:, None] * (H * dps) + heads[None, :] * dps)
    row_base = row_base.reshape(-1)  # [n * H], token-major like key.reshape(-1, D)
    key_addr = row_base[:, None] + torch.arange(key_bytes, device=dev)[None, :]
    val_addr = row_base[:, None] + key_bytes + torch.arange(val_bytes, device=dev)[None, :]
    meta_base = (blk[:, None] * block_bytes + meta_offset
                 + 2 * (heads[None, :] * num_meta * BLOCK + pos[:, None])).reshape(-1)
    owned = torch.zeros_like(a, dtype=torch.bool)
    owned[key_addr.reshape(-1)] = True
    owned[val_addr.reshape(-1)] = True
    for f in range(num_meta):
        owned[meta_base + 2 * f * BLOCK] = True
        owned[meta_base + 2 * f * BLOCK + 1] = True
    total_diff = int((a != b).sum())
    classes = {}

    def add(name, nbytes, nfields, explained):
        c = classes.setdefault(name, {"bytes": 0, "fields": 0, "explained": True})
        c["bytes"] += int(nbytes)
        c["fields"] += int(nfields)
        c["explained"] = c["explained"] and bool(explained)

    untouched = int(((a != b) & ~owned).sum())
    if untouched:
        add("untouched bytes (must stay poison)", untouched, untouched, False)

    key = inputs["key"].float().reshape(-1, D)
    value = inputs["value"].float().reshape(-1, D)
    # Key codes.
    ka, kbb = a[key_addr], b[key_addr]
    key_byte_diff = (ka != kbb)
    flip_rows = torch.zeros(key.shape[0], dtype=torch.bool, device=dev)
    if key_fp8:
        if key_byte_diff.any():
            add("fp8 key bytes", key_byte_diff.sum(), key_byte_diff.sum(), False)
    else:
        ca, cb = unpack(ka, kb, D), unpack(kbb, kb, D)
        diff = ca != cb
        if diff.any():
            rows, cols = diff.nonzero(as_tuple=True)
            k = key[rows]
            norm = torch.sqrt((k.double() ** 2).sum(dim=1)).float()
            x = k / (norm[:, None] + 1e-8)
            pit = inputs["pit"].double()
            idx = torch.arange(rows.shape[0], device=dev)
            y = (x.double() @ pit)[idx, cols]
            # The fp32 rounding bound of one coordinate of x̂ · Πᵀ in any summation order is about
            # D · 2^-24 · Σ|x̂_i Πᵀ_ij|; distances are given in units of 2^-24 · Σ|x̂_i Πᵀ_ij|
            # (one "rounding unit"), which also covers midpoints at 0.
            unit = (x.double().abs() @ pit.abs())[idx, cols] * 2.0 ** -24
            lo = torch.minimum(ca[rows, cols], cb[rows, cols])
            mid = inputs["midpoints"].double()[lo.clamp(max=inputs["midpoints"].shape[0] - 1)]
            dist = (y - mid).abs() / unit
            one_off = (ca[rows, cols] - cb[rows, cols]).abs() == 1
            near = one_off & (dist <= D)
            flip_rows[rows] = True
            add("MSE index one off, |y - midpoint| <= D rounding units of fp32 (rotation rounding: "
                "fp32 GEMM/FWHT vs fp64, or two fp32 summation orders)",
                key_byte_diff.sum(), int(near.sum()), bool(near.all()))
            if not near.all():
                add("MSE index other", 0, int((~near).sum()), False)
            classes["_max_flip_units"] = float(dist.max())
    # Metadata.
    for f in range(num_meta):
        fa = a[meta_base + 2 * f * BLOCK].long() | (a[meta_base + 2 * f * BLOCK + 1].long() << 8)
        fb = b[meta_base + 2 * f * BLOCK].long() | (b[meta_base + 2 * f * BLOCK + 1].long() << 8)
        d = fa != fb
        if not d.any():
            continue
        nbytes = int(((a[meta_base + 2 * f * BLOCK] != b[meta_base + 2 * f * BLOCK]).long()
                      + (a[meta_base + 2 * f * BLOCK + 1] != b[meta_base + 2 * f * BLOCK + 1])
                      .long()).sum())
        name = (["v_scale", "v_zero"] if key_fp8 else ["k_norm", "v_scale", "v_zero"])[f]
        ulps = (fa - fb).abs()
        if name == "k_norm":
            follows = d & flip_rows
            add("k_norm of a row with an index flip (the norm correction follows the indices)",
                0, int(follows.sum()), True)
            rest = d & ~flip_rows
            if rest.any():
                add("k_norm 1 fp16 ulp (seed: fp32 torch norm and fp32 1/sqrt correction; tqkv: "
                    "fp64 sums)", 0, int(rest.sum()), bool((ulps[rest] == 1).all()))
            classes.setdefault("k_norm bytes", {"bytes": 0, "fields": 0, "explained": True})
            classes["k_norm bytes"]["bytes"] += nbytes
        else:
            add(f"{name} fp16 differs ({int(ulps[d].max())} ulp max: seed's approximate fp32 "
                "division (vmax - vmin) / levels)", nbytes, int(d.sum()),
                bool((ulps[d] <= 1).all()))
    # Value codes: where they differ, how close the reference's t = (v - vmin) / scale + 0.5 is to
    # an integer (the seed divides approximately and truncates).
    va, vbb = a[val_addr], b[val_addr]
    vdiff_bytes = va != vbb
    if vdiff_bytes.any():
        ca, cb = unpack(va, vb, D), unpack(vbb, vb, D)
        diff = ca != cb
        rows, cols = diff.nonzero(as_tuple=True)
        v = value[rows]
        vmin = v.amin(dim=1).clamp(-65504, 65504)
        vmax = v.amax(dim=1).clamp(-65504, 65504)
        levels = float(2 ** vb - 1)
        scale = (vmax - vmin) / levels
        scale = torch.where(scale > 1e-8, scale, torch.full_like(scale, 1e-8))
        t = (value[rows, cols] - vmin) / scale + 0.5
        dist = (t - torch.round(t)).abs().double() / ulp32(t)
        near = ((ca[rows, cols] - cb[rows, cols]).abs() == 1) & (dist <= 8)
        add("value code one off at a .5 tie (t within 8 ulp of an integer: seed's approximate "
            "division + truncation vs IEEE division + floor)", vdiff_bytes.sum(),
            int(near.sum()), True)
        if not near.all():
            add("value code other (follows a different fp32 scale in the seed?)", 0,
                int((~near).sum()), False)
    explained = all(c.get("explained", True) for k, c in classes.items() if not k.startswith("_"))
    return {"against": other_name, "bytes_total": int(a.numel()), "bytes_differ": total_diff,
            "classes": classes, "all_explained": explained}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed-module", required=True, help="folder holding seed_store.py")
    ap.add_argument("--inputs", default="/tmp/store_bench")
    ap.add_argument("--ours", required=True, help="store_bench.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, args.seed_module)
    import seed_store as seed  # noqa: E402

    torch.backends.cuda.matmul.allow_tf32 = False  # the seed's fp32 GEMM as vLLM runs it
    try:
        ours = json.load(open(args.ours))
    except OSError as e:
        print(f"no store_bench results ({e}); timing the seed on the default shapes only")
        ours = {"store": [{"n": n} for n in (16, 64, 256, 2048, 16384, 65536)],
                "copy_gbps": float("nan"), "read_gbps": float("nan")}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "times": [], "bytes": []}

    # 2. Bytes first (small, and a failure here should not cost the timings).
    tables_by_preset = {}
    for preset in PRESETS:
        try:
            inputs = load_inputs(os.path.join(args.inputs, f"inputs_{preset}.safetensors"))
        except Exception as e:  # keep going: the timings need only the tables
            print(f"{preset}: no inputs from store_bench ({e})")
            inputs = None
        if inputs is None:
            dummy = torch.zeros(1, device="cuda", dtype=torch.float32)
            tables_by_preset[preset] = {"pit": torch.eye(D, device="cuda"), "midpoints": dummy,
                                        "centroids": dummy}
            continue
        tables = {k: inputs.get(k) for k in ("pit", "midpoints", "centroids")}
        if tables["pit"] is None:  # FP8: unused by the seed
            dummy = torch.zeros(1, device="cuda", dtype=torch.float32)
            tables = {"pit": torch.eye(D, device="cuda"), "midpoints": dummy, "centroids": dummy}
        tables_by_preset[preset] = tables
        cache = inputs["cache_init"].clone()
        try:
            seed_call(seed, preset, inputs["key"], inputs["value"], cache,
                      inputs["slot_mapping"], tables)
            torch.cuda.synchronize()
        except Exception as e:
            print(f"{preset}: the seed failed: {e}")
            continue
        for other in ("cache_fwht", "cache_gemm", "cache_fp8", "cache_cpu"):
            if other in inputs:
                try:
                    r = compare(preset, inputs, cache, inputs[other], other[6:])
                except Exception as e:
                    print(f"{preset} vs {other}: comparison failed: {e}")
                    continue
                r["preset"] = preset
                report["bytes"].append(r)
                print(f"{preset:20s} seed vs {other[6:]:4s}: {r['bytes_differ']:7d} of "
                      f"{r['bytes_total']} bytes differ; explained: {r['all_explained']}")
                for name, c in r["classes"].items():
                    if not name.startswith("_"):
                        print(f"    {c['bytes']:7d} bytes, {c['fields']:7d} fields  {name}"
                              f"{'' if c['explained'] else '  [NOT EXPLAINED]'}")
                if "_max_flip_units" in r["classes"]:
                    print(f"    largest |y - midpoint| of a flipped index: "
                          f"{r['classes']['_max_flip_units']:.2f} rounding units")
        sys.stdout.flush()

    # 1. Timings.
    sizes = sorted({row["n"] for row in ours["store"]})
    gen = torch.Generator().manual_seed(1234)
    for n in sizes:
        set_elems = n * H * D
        sets = int(min(max(4 * l2 // (2 * set_elems * 2) + 1, 2), 4096))
        keys = torch.randn(sets, n, H, D, device="cuda").to(torch.bfloat16)
        values = (torch.randn(sets, n, H, D, device="cuda") + 0.3).to(torch.bfloat16)
        slots, num_blocks = slot_mapping(n, gen)
        slots = slots.to("cuda")
        for preset in PRESETS:
            _, _, _, _, slot_bytes = fmt_sizes(preset)
            cache = torch.zeros(num_blocks, BLOCK * H * slot_bytes, dtype=torch.uint8,
                                device="cuda")
            tables = tables_by_preset[preset]

            def call(i, preset=preset, cache=cache, tables=tables):
                seed_call(seed, preset, keys[i % sets], values[i % sets], cache, slots, tables)

            try:
                us = time_us(call)
            except Exception as e:
                print(f"seed {preset} N={n}: {e}")
                continue
            g_us = None
            if n <= 2048:
                try:
                    g_us = graph_us(call, 100 if n <= 256 else 20)
                except Exception as e:  # report, keep going
                    print(f"graph capture of the seed failed: {e}")
            report["times"].append({"preset": preset, "n": n, "us": us, "graph_us": g_us})
            print(f"seed {preset:20s} N={n:6d} {us:10.2f} us  graph "
                  f"{'-' if g_us is None else f'{g_us:.2f}'} us")
            sys.stdout.flush()
        del keys, values
        torch.cuda.empty_cache()

    # 3. Side by side.
    copy = ours["copy_gbps"]
    lines = [f"device {report['device']}; copy ceiling {copy:.0f} GB/s, read-only "
             f"{ours['read_gbps']:.0f} GB/s (measured by store_bench in this run)",
             "| preset | N | min MB | tqkv fwht/fp8 us (graph) | % of copy | tqkv gemm us (graph) | "
             "% of copy | seed us (graph) | seed / tqkv default | seed / tqkv gemm |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    seed_times = {(t["preset"], t["n"]): t for t in report["times"]}
    by = {}
    for row in ours["store"]:
        if "preset" in row:
            by.setdefault((row["preset"], row["n"]), {})[row["path"]] = row

    def cell(r):
        if r is None:
            return "-", "-"
        g = f" ({r['graph_us']:.1f})" if r.get("graph_us") else ""
        return f"{r['us']:.1f}{g}", f"{100 * r['frac_copy']:.0f}"

    for preset in PRESETS:
        for n in sizes:
            paths = by.get((preset, n), {})
            default = paths.get("fp8") or paths.get("fwht")
            gemm = paths.get("gemm")
            s = seed_times.get((preset, n))
            d_us, d_frac = cell(default)
            g_cell, g_frac = cell(gemm)
            s_cell = "-"
            r1 = r2 = "-"
            if s:
                s_cell = f"{s['us']:.1f}" + (f" ({s['graph_us']:.1f})" if s["graph_us"] else "")
                r1 = f"{s['us'] / default['us']:.1f}x" if default else "-"
                r2 = f"{s['us'] / gemm['us']:.1f}x" if gemm else "-"
            if not (default or gemm):
                lines.append(f"| {preset} | {n} | - | - | - | - | - | {s_cell} | - | - |")
                continue
            mb = (default or gemm)["min_bytes"] / 1e6
            lines.append(f"| {preset} | {n} | {mb:.2f} | {d_us} | {d_frac} | {g_cell} | {g_frac} | "
                         f"{s_cell} | {r1} | {r2} |")
    table = "\n".join(lines)
    print(table)
    report["table"] = table
    json.dump(report, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
