// Attention for several new tokens per sequence on the GPU (CudaAttention), Llama-3-8B layer shape
// (Hq 32, Hk 8, D 128, block 16), the shapes of the issue:
//   verify   batch 64 x 4k context, 1, 4 and 8 new tokens: on the decode kernels (one sequence
//            per query row for 4 and 8), and on the chunk kernel
//   prefill  batch 1, a chunk of 2,048 or 8,192 tokens after a cached prefix of 0, 8k or 32k
//   mixed    63 decode rows at 4k then one 2,048-token chunk in one call (the decode rows said
//            to come first, AttentionOptions::leading_decode_seqs; "gathered": found on the
//            device), and the two apart
// Long chunks run the prefill kernel and verify passes the decode kernels' half-precision variant
// (ChunkPrecision::kHalf, the default); the shapes named "exact" run fp32-level numerics instead
// (the chunk kernel; the decode kernels' hi + lo products); "own-o": verify passes of 9-32
// columns on the kernels whose warps each hold their own output (DecodeOptions::shared_o =
// false), beside the default's shared-output kernel.
// for turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_k8v4 and bf16. Each shape is timed as
// a CUDA graph of calls rotating over disjoint block sets (at least 256 MB together, so calls read
// HBM, not L2): µs per call, FLOPs (4 · D · Hq per (query row, attended token), causal), TFLOP/s
// and its fraction of 790 TFLOP/s (PERFORMANCE.md, bf16 dense measured), cache bytes read, GB/s
// and the fraction of the read ceiling measured in this run, and the extra device memory of the
// call (its workspace). --json OUT writes the rows for torch_attention_bench.py's joint table.
//
//   attention_bench [--quick] [--json OUT] [--kind NAME] [--only TEXT]
//                   [--heads HQ:HK:D]  (another layer shape, e.g. 9:3:64 for SmolLM2-135M)
//                   [--verify-q N]...  (adds verify 64x4k qN and its chunk-kernel twin)
//                   [--decode-tokens-per-split N]  (the decode kernels' splits, for a sweep;
//                                                   default: the plan's choice)
//                   [--tokens-per-split N]  (the chunk and prefill kernels' splits,
//                                                   AttentionOptions::tokens_per_split)
//                   [--decode-narrow auto|never|always]  (DecodeOptions::narrow: the narrow
//                                                   split kernels, for a comparison)
//                   [--blocks shuffled|ordered] [--seed N]  (where each shape's blocks lie in
//                                   the pool: shuffled by the seed, default 3, and the shape's
//                                   name; or in order, as a fresh pool hands them out)
//                   [--repeat N]  (the whole run N times in one process, the same placements)
#if TQKV_HAVE_CUDA
#include <cuda_runtime.h>
#endif
#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "attention/attention_cuda.h"
#include "quant/quantizer.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "runtime/stream.h"
#include "tools/bench/bench_kernels.h"
#if TQKV_HAVE_CUDA
#include "runtime/cuda_check.h"
#endif

#if TQKV_HAVE_CUDA
namespace tqkv::bench {
namespace {

constexpr int kBlock = 16;

// The attention layer's heads: Llama-3-8B's by default, another model's with --heads.
struct Heads {
  int q = 32, kv = 8, dim = 128;
};
constexpr double kPeakTflops = 790.0;  // bf16 dense, measured (PERFORMANCE.md)

double Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// µs per call of `calls` calls captured in one CUDA graph: median of 5 replays.
double GraphUs(const std::function<void(int)>& run, int calls, StreamHandle stream) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TQKV_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < calls; ++i) run(i);
  TQKV_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  TQKV_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  TQKV_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  Event start, end;
  std::vector<float> ms;
  for (int r = 0; r < 5; ++r) {
    start.Record(stream);
    TQKV_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    end.Record(stream);
    end.Synchronize();
    ms.push_back(Event::ElapsedMs(start, end) / calls);
  }
  TQKV_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TQKV_CUDA_CHECK(cudaGraphDestroy(graph));
  return Median(ms) * 1e3;
}

double ReadCeilingGbs(Stream& stream) {
  const int64_t bytes = int64_t{4} << 30;
  DeviceBuffer<uint8_t> a(bytes);
  DeviceBuffer<uint32_t> sink(4096);
  FillRandomBytes(a.data(), bytes, 1, stream.get());
  Event start, end;
  std::vector<float> ms;
  for (int i = 0; i < 6; ++i) {
    start.Record(stream.get());
    ReadFloor(a.data(), bytes, sink.data(), stream.get());
    end.Record(stream.get());
    end.Synchronize();
    if (i > 0) ms.push_back(Event::ElapsedMs(start, end));
  }
  return double(bytes) / (Median(ms) * 1e-3) / 1e9;
}

// One step shape: per sequence, its context length after the step and its new tokens.
struct Shape {
  std::string name;
  std::vector<int32_t> lens, q_lens;
  bool decode_kernels = true;
  ChunkPrecision precision = ChunkPrecision::kHalf;
  int verify_max_group = AttentionOptions{}.verify_max_group;
  int verify_max_q_len = AttentionOptions{}.verify_max_q_len;
  int leading_decode_seqs = 0;  // AttentionOptions::leading_decode_seqs
  int leading_max_q_len = 1;    // AttentionOptions::leading_max_q_len
  int decode_tokens_per_split = 0;  // DecodeOptions::tokens_per_split (0: the plan's choice)
  int tokens_per_split = 0;         // AttentionOptions::tokens_per_split (0: the plan's choice)
  DecodeOptions::Narrow decode_narrow = DecodeOptions::Narrow::kAuto;
  bool shared_o = DecodeOptions{}.shared_o;
  int window = 0;            // AttentionArgs::sliding_window
  bool plan_window = false;  // and DecodeOptions::sliding_window
};

Shape Uniform(std::string name, int batch, int context, int q_len, bool decode_kernels = true) {
  return {std::move(name), std::vector<int32_t>(batch, context), std::vector<int32_t>(batch, q_len),
          decode_kernels};
}

struct Row {
  std::string kind, shape;
  double us = 0, flops = 0, bytes = 0, workspace = 0;
  int splits = 0;
};

std::vector<Row> RunKind(const std::string& kind, const Heads& heads,
                         const std::vector<Shape>& shapes, double read_gbs, bool shuffled,
                         uint32_t seed, Stream& stream) {
  const int hq = heads.q, hk = heads.kv, dim = heads.dim;
  const bool plain = kind == "bf16";
  std::optional<Quantizer> q;
  std::optional<CudaAttention> attn;
  int64_t block_bytes = 0, slot_bytes = 0;
  if (plain) {
    const Bf16BlockFormat f = MakeBf16BlockFormat(dim, hk, kBlock, DType::kBF16);
    attn.emplace(f);
    block_bytes = f.block_bytes;
    slot_bytes = f.SlotBytes();
  } else {
    q.emplace(Quantizer::Create(kind, dim, hk, kBlock));
    attn.emplace(*q);
    block_bytes = q->format().block_bytes;
    slot_bytes = q->format().slot_bytes;
  }
  int64_t max_blocks = 0;
  for (const Shape& s : shapes) {
    int64_t n = 0;
    for (int32_t l : s.lens) n += (l + kBlock - 1) / kBlock;
    max_blocks = std::max(max_blocks, n);
  }
  const int64_t pool_blocks = std::max(max_blocks, (int64_t{1} << 30) / block_bytes);
  DeviceBuffer<uint8_t> pool(pool_blocks * block_bytes);
  if (plain) {
    FillRandomBf16(reinterpret_cast<uint16_t*>(pool.data()), pool.size_bytes() / 2, 7,
                   stream.get());
  } else {
    const BlockFormat& f = q->format();
    FillRandomBytes(pool.data(), pool.size_bytes(), 7, stream.get());
    FixCompressedCache(pool.data(), pool_blocks, f.block_bytes, f.meta_offset, hk, f.num_meta,
                       kBlock, f.key_data_bytes, f.data_per_slot, f.fp8_keys, stream.get());
  }
  std::vector<Row> rows;
  for (const Shape& s : shapes) {
    const int batch = static_cast<int>(s.lens.size());
    int max_len = 0, max_q = 0, tokens = 0;
    int64_t set_blocks = 0;
    double flops = 0, bytes = 0;
    std::vector<int32_t> loc = {0};
    for (int b = 0; b < batch; ++b) {
      max_len = std::max(max_len, s.lens[b]);
      max_q = std::max(max_q, s.q_lens[b]);
      tokens += s.q_lens[b];
      loc.push_back(tokens);
      set_blocks += (s.lens[b] + kBlock - 1) / kBlock;
      for (int i = 0; i < s.q_lens[b]; ++i) {
        const int seen = s.lens[b] - s.q_lens[b] + i + 1;
        flops += 4.0 * dim * hq * (s.window > 0 ? std::min(seen, s.window) : seen);
      }
      // (Under a window: the first new token's window through the last new token.)
      bytes += double(s.window > 0 ? std::min(s.lens[b], s.window + s.q_lens[b] - 1) : s.lens[b]) *
               hk * slot_bytes;
    }
    const int width = (max_len + kBlock - 1) / kBlock;
    const int sets = static_cast<int>(std::clamp<int64_t>(
        ((int64_t{256} << 20) + set_blocks * block_bytes - 1) / (set_blocks * block_bytes), 1,
        pool_blocks / set_blocks));
    std::vector<int32_t> ids(pool_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    if (shuffled) {  // from the seed and the shape's name: the same whatever runs before it
      std::seed_seq from{seed, static_cast<uint32_t>(std::hash<std::string>{}(s.name))};
      std::mt19937 rng(from);
      std::shuffle(ids.begin(), ids.end(), rng);
    }
    std::vector<int32_t> tables(static_cast<size_t>(sets) * batch * width, 0);
    int next = 0;
    for (int set = 0; set < sets; ++set) {
      for (int b = 0; b < batch; ++b) {
        for (int i = 0; i < (s.lens[b] + kBlock - 1) / kBlock; ++i) {
          tables[(static_cast<size_t>(set) * batch + b) * width + i] = ids[next++];
        }
      }
    }
    DeviceBuffer<int32_t> d_tables(static_cast<int64_t>(tables.size())), d_lens(batch),
        d_loc(batch + 1);
    d_tables.CopyFromHost(tables);
    d_lens.CopyFromHost(s.lens);
    d_loc.CopyFromHost(loc);
    DeviceBuffer<uint16_t> query(int64_t{tokens} * hq * dim), out(int64_t{tokens} * hq * dim);
    FillRandomBf16(query.data(), query.size(), 11, stream.get());
    DeviceBuffer<float> lse(int64_t{tokens} * hq);
    AttentionOptions options;
    options.decode_kernels = s.decode_kernels;
    options.chunk_precision = s.precision;
    options.verify_precision = s.precision;
    options.verify_max_group = s.verify_max_group;
    options.verify_max_q_len = s.verify_max_q_len;
    options.leading_decode_seqs = s.leading_decode_seqs;
    options.leading_max_q_len = s.leading_max_q_len;
    options.decode.tokens_per_split = s.decode_tokens_per_split;
    options.tokens_per_split = s.tokens_per_split;
    options.decode.narrow = s.decode_narrow;
    options.decode.shared_o = s.shared_o;
    if (s.plan_window) options.decode.sliding_window = s.window;
    const AttentionPlan plan = attn->Plan(batch, tokens, hq, width, max_q, options);
    DeviceBuffer<uint8_t> ws(std::max<int64_t>(1, plan.workspace_bytes));
    AttentionArgs a;
    a.query = query.data();
    a.query_dtype = DType::kBF16;
    a.num_seqs = batch;
    a.num_tokens = tokens;
    a.num_q_heads = hq;
    a.query_start_loc = d_loc.data();
    a.seq_lens = d_lens.data();
    a.max_blocks_per_seq = width;
    a.cache = {pool.data(), pool_blocks, attn->layout()};
    a.sliding_window = s.window;
    a.output = out.data();
    a.output_dtype = DType::kBF16;
    a.lse = lse.data();
    a.workspace = ws.data();
    a.workspace_bytes = ws.size_bytes();
    auto run = [&](int i) {
      a.block_tables = d_tables.data() + static_cast<int64_t>(i % sets) * batch * width;
      attn->Run(plan, a, stream.get());
    };
    for (int i = 0; i < 2; ++i) run(i);
    Row r;
    r.kind = kind;
    r.shape = s.name;
    r.us = GraphUs(run, std::max(4, std::min(16, sets)), stream.get());
    r.flops = flops;
    r.bytes = bytes;
    r.workspace = static_cast<double>(plan.workspace_bytes);
    const bool decode_kernels = plan.decode || plan.verify_rows;
    r.splits = decode_kernels ? plan.decode_plan.max_splits : plan.max_splits;
    rows.push_back(r);
    fmt::print(
        "  {:<20} {:<24} {:9.1f} us  {:7.1f} TFLOP/s ({:4.1f}% of {:.0f})  {:8.1f} MB  "
        "{:6.0f} GB/s ({:4.1f}% of read ceiling)  workspace {:.1f} MB  {}{} splits\n",
        kind, s.name, r.us, flops / (r.us * 1e-6) / 1e12,
        100 * flops / (r.us * 1e-6) / 1e12 / kPeakTflops, kPeakTflops, bytes / 1e6,
        bytes / (r.us * 1e-6) / 1e9, 100 * bytes / (r.us * 1e-6) / 1e9 / read_gbs,
        r.workspace / 1e6,
        plan.verify_rows ? fmt::format("decode kernels, {} passes of {} rows, ", plan.verify_passes,
                                       plan.verify_pass_rows)
        : plan.leading_max_q_len > 1
            ? fmt::format("leading rows on the decode kernels, {} passes of {} rows, then the {} "
                          "kernel, ",
                          plan.verify_passes, plan.verify_pass_rows,
                          plan.prefill ? "prefill" : "chunk")
        : plan.decode  ? "decode kernels, "
        : plan.prefill ? "prefill kernel, "
                       : "chunk kernel, ",
        r.splits);
    std::fflush(stdout);
    if (s.leading_decode_seqs <= 0 || s.leading_decode_seqs >= batch) continue;
    // A mixed step's two parts, each a call of its own over the same rows, blocks and buffers as
    // the mixed call: its leading decode rows, then the rest. (Timed as shapes of their own, with
    // blocks of their own, the same k8v4 decode rows took 163 or 188 µs on an H100 as the blocks,
    // or what ran before them, changed.)
    const int lead = s.leading_decode_seqs;
    std::vector<int32_t> rest_loc;
    for (int b = lead; b <= batch; ++b) rest_loc.push_back(loc[b] - loc[lead]);
    DeviceBuffer<int32_t> d_rest_loc(batch - lead + 1);
    d_rest_loc.CopyFromHost(rest_loc);
    double parts_us = 0;
    for (const bool decode_part : {true, false}) {
      const int b0 = decode_part ? 0 : lead, nb = decode_part ? lead : batch - lead;
      const int row0 = loc[b0], nt = loc[b0 + nb] - row0;
      int part_max_q = 0;
      for (int b = b0; b < b0 + nb; ++b) part_max_q = std::max(part_max_q, s.q_lens[b]);
      AttentionOptions part_options = options;
      part_options.leading_decode_seqs = 0;
      const AttentionPlan part_plan = attn->Plan(nb, nt, hq, width, part_max_q, part_options);
      DeviceBuffer<uint8_t> part_ws(std::max<int64_t>(1, part_plan.workspace_bytes));
      AttentionArgs pa = a;
      pa.num_seqs = nb;
      pa.num_tokens = nt;
      pa.query = query.data() + int64_t{row0} * hq * dim;
      pa.output = out.data() + int64_t{row0} * hq * dim;
      pa.lse = lse.data() + int64_t{row0} * hq;
      pa.query_start_loc = decode_part ? d_loc.data() : d_rest_loc.data();
      pa.seq_lens = d_lens.data() + b0;
      pa.workspace = part_ws.data();
      pa.workspace_bytes = part_ws.size_bytes();
      auto run_part = [&](int i) {
        pa.block_tables = d_tables.data() + (static_cast<int64_t>(i % sets) * batch + b0) * width;
        attn->Run(part_plan, pa, stream.get());
      };
      for (int i = 0; i < 2; ++i) run_part(i);
      const double us = GraphUs(run_part, std::max(4, std::min(16, sets)), stream.get());
      parts_us += us;
      fmt::print("  {:<20} {:<24} {:9.1f} us  ({} alone, the same rows and blocks)\n", kind,
                 s.name + (decode_part ? " | decode" : " | rest"), us,
                 decode_part ? fmt::format("its {} leading decode rows", lead)
                             : fmt::format("its other {} sequences", nb));
    }
    fmt::print("  {:<20} {:<24} {:9.1f} us  (its parts' sum; the call takes {:.3f}x it)\n", kind,
               s.name + " | sum", parts_us, r.us / parts_us);
    std::fflush(stdout);
  }
  return rows;
}

int Main(int argc, char** argv) {
  bool quick = false;
  std::string json_out, only_kind, only_shape;
  int decode_tokens_per_split = 0, tokens_per_split = 0;
  DecodeOptions::Narrow decode_narrow = DecodeOptions::Narrow::kAuto;
  bool shuffled = true;
  uint32_t seed = 3;
  int repeat = 1;
  Heads heads;
  std::vector<int> extra_q;
  // A whole decimal number from lo to hi, or nullopt.
  auto parse_int = [](const std::string& v, int lo, int hi) -> std::optional<int> {
    size_t used = 0;
    int x = 0;
    try {
      x = std::stoi(v, &used);
    } catch (const std::exception&) {
      return std::nullopt;
    }
    if (used != v.size() || x < lo || x > hi) return std::nullopt;
    return x;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      quick = true;
    } else if (arg == "--json" && i + 1 < argc) {
      json_out = argv[++i];
    } else if (arg == "--kind" && i + 1 < argc) {
      only_kind = argv[++i];
    } else if (arg == "--blocks" && i + 1 < argc &&
               (std::string_view(argv[i + 1]) == "shuffled" ||
                std::string_view(argv[i + 1]) == "ordered")) {
      shuffled = std::string_view(argv[++i]) == "shuffled";
    } else if (arg == "--seed" && i + 1 < argc && parse_int(argv[i + 1], 0, 1 << 30)) {
      seed = static_cast<uint32_t>(*parse_int(argv[++i], 0, 1 << 30));
    } else if (arg == "--repeat" && i + 1 < argc && parse_int(argv[i + 1], 1, 100)) {
      repeat = *parse_int(argv[++i], 1, 100);
    } else if (arg == "--only" && i + 1 < argc) {
      only_shape = argv[++i];
    } else if ((arg == "--decode-tokens-per-split" || arg == "--tokens-per-split") &&
               i + 1 < argc) {
      const std::string v = argv[++i];
      const std::optional<int> tps = parse_int(v, 0, 1 << 30);
      if (!tps) {
        fmt::print(stderr, "attention_bench: {} = {}: want 0 (the plan's choice) or {}\n", arg, v,
                   arg == "--tokens-per-split" ? "a positive count of tokens"
                                               : "a multiple of 64 from 64 to 8,192");
        return 2;
      }
      (arg == "--tokens-per-split" ? tokens_per_split : decode_tokens_per_split) = *tps;
    } else if (arg == "--heads" && i + 1 < argc) {
      const std::string v = argv[++i];
      const size_t a = v.find(':'), b = a == std::string::npos ? a : v.find(':', a + 1);
      std::optional<int> hq, hk, d;
      if (b != std::string::npos) {
        hq = parse_int(v.substr(0, a), 1, 256);
        hk = parse_int(v.substr(a + 1, b - a - 1), 1, 256);
        d = parse_int(v.substr(b + 1), 64, 256);
      }
      if (!hq || !hk || !d || *hq % *hk != 0) {
        fmt::print(stderr,
                   "attention_bench: --heads = {}: want QUERY_HEADS:KV_HEADS:HEAD_DIM, query heads "
                   "a multiple of the KV heads (e.g. 32:8:128, Llama-3-8B; 9:3:64, SmolLM2-135M)\n",
                   v);
        return 2;
      }
      heads = {*hq, *hk, *d};
    } else if (arg == "--verify-q" && i + 1 < argc) {
      const std::string v = argv[++i];
      const std::optional<int> q = parse_int(v, 1, 64);
      if (!q) {
        fmt::print(stderr, "attention_bench: --verify-q = {}: want 1 to 64 new tokens\n", v);
        return 2;
      }
      extra_q.push_back(*q);
    } else if (arg == "--decode-narrow" && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v == "auto") {
        decode_narrow = DecodeOptions::Narrow::kAuto;
      } else if (v == "never") {
        decode_narrow = DecodeOptions::Narrow::kNever;
      } else if (v == "always") {
        decode_narrow = DecodeOptions::Narrow::kAlways;
      } else {
        fmt::print(stderr, "attention_bench: --decode-narrow = {}: want auto, never or always\n",
                   v);
        return 2;
      }
    } else {
      fmt::print(stderr,
                 "usage: attention_bench [--quick] [--json OUT] [--kind NAME] [--only TEXT] "
                 "[--heads HQ:HK:D] [--verify-q N]... [--decode-tokens-per-split N] "
                 "[--tokens-per-split N] "
                 "[--decode-narrow auto|never|always] [--blocks shuffled|ordered] [--seed N] "
                 "[--repeat N]\n");
      return 2;
    }
  }
  std::vector<Shape> shapes = {
      Uniform("verify 64x4k q1", 64, 4096, 1),
      Uniform("verify 64x4k q1 chunk", 64, 4096, 1, false),
      Uniform("verify 64x4k q4", 64, 4096, 4),
      Uniform("verify 64x4k q4 chunk", 64, 4096, 4, false),
      Uniform("verify 64x4k q8", 64, 4096, 8),
      Uniform("verify 64x4k q8 chunk", 64, 4096, 8, false),
  };
  for (int q : extra_q) {
    shapes.push_back(Uniform(fmt::format("verify 64x4k q{}", q), 64, 4096, q));
    shapes.push_back(Uniform(fmt::format("verify 64x4k q{} chunk", q), 64, 4096, q, false));
  }
  // Smaller batches of the same verify: at 32 × 4k the one-split plan's grid (a CTA per sequence
  // and KV head at Llama-3-8B's 8 KV heads) is one round of two CTAs per SM on 132 SMs, at 64 × 4k
  // two, so their difference is what a round costs beyond its share of the work.
  for (int batch : {16, 32}) {
    for (int q : {1, 4, 8}) {
      shapes.push_back(Uniform(fmt::format("verify {}x4k q{}", batch, q), batch, 4096, q));
    }
  }
  // Verify passes of fewer rows beside the GQA heads (AttentionOptions::verify_max_group 4, 8 and
  // 16: one, two and four new tokens per pass at GQA 4).
  for (int q : {4, 8}) {
    for (int g : {4, 8, 16}) {
      const int group = heads.q / heads.kv;
      // (the default's single pass, or passes of no whole number of new tokens)
      if (g / group >= q || g % group != 0) continue;
      Shape v = Uniform(fmt::format("verify 64x4k q{} rows{}", q, g / group), 64, 4096, q);
      v.verify_max_group = g;
      shapes.push_back(v);
    }
  }
  // Longer drafts (16 and 32 new tokens): the plan's choice, verify passes on the decode kernels
  // ("passes": AttentionOptions::verify_max_q_len raised to q) and the prefill kernel ("prefill":
  // verify_max_q_len 0), as the plan weighs them.
  auto long_drafts = [&](const std::string& name, int batch, int len, int q) {
    shapes.push_back(Uniform(name, batch, len, q));
    for (const int max_q_len : {q, 0}) {
      Shape v = Uniform(name + (max_q_len > 0 ? " passes" : " prefill"), batch, len, q);
      v.verify_max_q_len = max_q_len;
      shapes.push_back(v);
    }
  };
  for (int q : {16, 32}) long_drafts(fmt::format("verify 64x4k q{}", q), 64, 4096, q);
  long_drafts("verify 1x128k q16", 1, 131072, 16);
  for (int chunk : {2048, 8192}) {
    for (int prefix : {0, 8192, 32768}) {
      if (quick && chunk == 8192 && prefix == 8192) continue;
      shapes.push_back(
          Uniform(fmt::format("prefill {} +{}k", chunk, prefix / 1024), 1, prefix + chunk, chunk));
    }
  }
  // Chunked prefill with a small step budget (a serving engine's 256 or 512 prompt tokens per
  // step): the chunk after 1k and 4k of its prompt.
  for (int chunk : {256, 512}) {
    for (int prefix : {1024, 4096}) {
      shapes.push_back(
          Uniform(fmt::format("prefill {} +{}k", chunk, prefix / 1024), 1, prefix + chunk, chunk));
    }
  }
  // Verify passes of 9-32 columns on the kernels the shared-output kernel replaced (its warps
  // each hold their own output): 4 and 8 new tokens (16 and 32 columns at GQA 4), and 32 new
  // tokens in passes of 8; with --verify-q 2, 2 new tokens (8 columns: k8v4's exact kernels).
  for (const char* name :
       {"verify 64x4k q2", "verify 64x4k q4", "verify 64x4k q8", "verify 64x4k q32 passes"}) {
    for (const Shape& s : std::vector<Shape>(shapes)) {
      if (s.name != name) continue;
      Shape own = s;
      own.name += " own-o";
      own.shared_o = false;
      shapes.push_back(own);
    }
  }
  // Long chunks and verify passes at fp32-level numerics (ChunkPrecision::kExact: the chunk
  // kernel, the decode kernels' hi + lo products), for the ratio.
  for (const char* name :
       {"verify 64x4k q4", "verify 64x4k q8", "prefill 2048 +0k", "prefill 2048 +32k"}) {
    for (const Shape& s : std::vector<Shape>(shapes)) {
      if (s.name != name) continue;
      Shape exact = s;
      exact.name += " exact";
      exact.precision = ChunkPrecision::kExact;
      shapes.push_back(exact);
    }
  }
  // The extra device memory at 128k (the workspace does not grow with the context).
  shapes.push_back(Uniform("verify 1x128k q8", 1, 131072, 8));
  // The same without the decode kernels (a sliding window's plan): the prefill kernel, and the
  // chunk kernel ("exact").
  shapes.push_back(Uniform("verify 1x128k q8 chunk", 1, 131072, 8, false));
  shapes.push_back(shapes.back());
  shapes.back().name += " exact";
  shapes.back().precision = ChunkPrecision::kExact;
  shapes.push_back(Uniform("prefill 2048 +128k", 1, 131072 + 2048, 2048));
  // The decode rows first, as vLLM orders a step, and said so (leading_decode_seqs: they run in
  // place); "gathered": the same step with the one-token sequences found on the device.
  Shape mixed{"mixed 2048 + 63x4k", std::vector<int32_t>(63, 4096), std::vector<int32_t>(63, 1)};
  mixed.lens.push_back(2048);
  mixed.q_lens.push_back(2048);
  mixed.leading_decode_seqs = 63;
  shapes.push_back(mixed);
  Shape mixed_gathered = mixed;
  mixed_gathered.name += " gathered";
  mixed_gathered.leading_decode_seqs = 0;
  shapes.push_back(mixed_gathered);
  Shape mixed_exact = mixed;
  mixed_exact.name += " exact";
  mixed_exact.precision = ChunkPrecision::kExact;
  shapes.push_back(mixed_exact);
  // Speculative decoding beside a chunk: 63 sequences with 4 or 8 new tokens first
  // (AttentionOptions::leading_max_q_len: verify passes in place), and without saying so (every
  // row on the prefill kernel).
  for (int q : {4, 8}) {
    Shape spec{fmt::format("mixed 2048 + 63x4k q{}", q), std::vector<int32_t>(63, 4096),
               std::vector<int32_t>(63, q)};
    spec.lens.push_back(2048);
    spec.q_lens.push_back(2048);
    spec.leading_decode_seqs = 63;
    spec.leading_max_q_len = q;
    shapes.push_back(spec);
    spec.name += " unsaid";
    spec.leading_decode_seqs = 0;
    spec.leading_max_q_len = 1;
    shapes.push_back(spec);
  }
  // A small-budget step as `tqkv sim` makes them: 31 sequences verifying 4 new tokens at 2k
  // (leading), beside the next 256 tokens of a prompt after 1k.
  Shape small{"mixed 256 + 31x2k q4", std::vector<int32_t>(31, 2048), std::vector<int32_t>(31, 4)};
  small.lens.push_back(1024 + 256);
  small.q_lens.push_back(256);
  small.leading_decode_seqs = 31;
  small.leading_max_q_len = 4;
  shapes.push_back(small);
  shapes.push_back(Uniform("decode 63x4k", 63, 4096, 1));
  // One token per sequence under a sliding window (the decode kernels from the chunk holding the
  // window's first position; windows that start inside a chunk; "planned": with the splits
  // sized for the window, DecodeOptions::sliding_window) and on the chunk kernel ("chunk"),
  // beside the same count of tokens without one ("none").
  for (const auto& [name, batch, context, window] :
       {std::tuple{"window 64x4k w1000", 64, 4096, 1000},
        {"window 64x1000 none", 64, 1000, 0},
        {"window 1x32k w4000", 1, 32768, 4000},
        {"window 1x4000 none", 1, 4000, 0}}) {
    shapes.push_back(Uniform(name, batch, context, 1));
    shapes.back().window = window;
    if (window == 0) continue;
    shapes.push_back(shapes.back());
    shapes.back().name += " planned";  // the decode splits sized for the window
    shapes.back().plan_window = true;
    shapes.push_back(Uniform(std::string(name) + " chunk", batch, context, 1, false));
    shapes.back().window = window;
  }
  // Verify under a sliding window: with the plan told of it (its splits sized for the window,
  // "planned") and untold ("untold"), the passes on the decode kernels; without the decode
  // kernels ("chunk", as every kind ran it before); beside the same count of tokens without a
  // window, on the plan's kernels and on those whose warps hold their own outputs ("own-o", as
  // a window ran before the shared-output kernel's window twin).
  for (int q : {4, 8}) {
    shapes.push_back(Uniform(fmt::format("window 64x4k w1000 q{} planned", q), 64, 4096, q));
    shapes.back().window = 1000;
    shapes.back().plan_window = true;
    shapes.push_back(Uniform(fmt::format("window 64x4k w1000 q{} untold", q), 64, 4096, q));
    shapes.back().window = 1000;
    shapes.push_back(Uniform(fmt::format("window 64x4k w1000 q{} chunk", q), 64, 4096, q, false));
    shapes.back().window = 1000;
    shapes.push_back(
        Uniform(fmt::format("window 64x{} none q{}", 1000 + q - 1, q), 64, 1000 + q - 1, q));
    shapes.push_back(shapes.back());
    shapes.back().name += " own-o";
    shapes.back().shared_o = false;
  }
  // A mixed step under a sliding window: the decode rows in place on the decode kernels; "chunk":
  // every row on the prefill kernel, as they ran before.
  Shape window_mixed = mixed;
  window_mixed.name = "window mixed 2048 + 63x4k w1000";
  window_mixed.window = 1000;
  shapes.push_back(window_mixed);
  window_mixed.name += " chunk";
  window_mixed.decode_kernels = false;
  shapes.push_back(window_mixed);
  for (Shape& s : shapes) {
    s.decode_tokens_per_split = decode_tokens_per_split;
    s.tokens_per_split = tokens_per_split;
    s.decode_narrow = decode_narrow;
    // The shared-output kernel takes precedence over the narrow choice: a narrow comparison runs
    // on the kernels with their own outputs.
    if (decode_narrow != DecodeOptions::Narrow::kAuto) s.shared_o = false;
  }
  if (!only_shape.empty()) {  // the shapes whose name contains it (one shape under ncu)
    std::erase_if(shapes,
                  [&](const Shape& s) { return s.name.find(only_shape) == std::string::npos; });
  }
  Stream stream;
  const double read_gbs = ReadCeilingGbs(stream);
  fmt::print("read ceiling {:.0f} GB/s; {} query heads, {} KV heads, head_dim {}\n", read_gbs,
             heads.q, heads.kv, heads.dim);
  std::vector<std::string> kinds = {"turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_k8v4",
                                    "bf16"};
  if (!only_kind.empty()) kinds = {only_kind};
  nlohmann::json all = nlohmann::json::array();
  for (int i = 0; i < repeat * static_cast<int>(kinds.size()); ++i) {
    const std::string& kind = kinds[i % kinds.size()];
    for (const Row& r : RunKind(kind, heads, shapes, read_gbs, shuffled, seed, stream)) {
      all.push_back({{"kind", r.kind},
                     {"shape", r.shape},
                     {"us", r.us},
                     {"flops", r.flops},
                     {"bytes", r.bytes},
                     {"workspace", r.workspace},
                     {"splits", r.splits},
                     {"read_gbs", read_gbs}});
    }
  }
  if (!json_out.empty()) std::ofstream(json_out) << all.dump(1) << "\n";
  return 0;
}

}  // namespace
}  // namespace tqkv::bench

int main(int argc, char** argv) {
  try {
    return tqkv::bench::Main(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "attention_bench: {}\n", e.what());
    return 1;
  }
}
#else
#include <cstdio>
int main() {
  std::puts("attention_bench: this build has no CUDA support");
  return 0;
}
#endif
