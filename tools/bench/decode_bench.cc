// Decode attention benchmark on the GPU, Llama-3-8B layer shape (Hq 32, Hk 8, D 128, block 16):
// turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_k8v4 and the bf16 and fp16 kernels (the
// uncompressed ones; both compared with PyTorch's bf16 decode, the same bytes) for batch 1, 16,
// 64, 256 x context 1k, 4k, 16k, 32k. Reports µs per call (query rotation + split kernel + merge)
// launched back to back on a stream and replayed from a CUDA graph (as engines run decode steps;
// at small shapes the stream figure is the host's launch rate), the cache bytes read, GB/s and
// the fraction of the read ceiling measured in this run (from the graph time), and, given
// --torch-json (from torch_decode_bench.py in the same device call), PyTorch's bf16 SDPA decode
// on the same shapes, both ways, with the ratios. The "read floor" is the same number of bytes
// read by the plainest one-kernel read (bench_kernels.h, ReadFloor) in a graph: at small shapes
// the launch and the ramp of any kernel are a large part of a call, and this says how large.
// Where the plan splits sequences, the "read + merge floor" is that read followed by the decode's
// own merge kernel over the plan's splits: the least any decode split this way can take.
//
//   decode_bench [--quick] [--torch-json PATH] [--json OUT] [--only KIND:B:L] [--kind KIND]
//                [--hq 32] [--head-dim 128] [--batches 1,16] [--contexts 1024,4096]
//                [--tps 0,512,...]   (split lengths to time; 0 = the plan's choice)
//                [--narrow auto|never|always] [--unstaged] [--no-one-cta] [--no-pdl]
//                                    (the plan's kernel choices, DecodeOptions)
#if TQKV_HAVE_CUDA
#include <cuda_runtime.h>
#endif
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attention/decode_cuda.h"
#if TQKV_HAVE_CUDA
#include "attention/decode_launch.h"
#include "runtime/cuda_check.h"
#endif
#include "runtime/error.h"
#include "runtime/memory.h"
#include "runtime/stream.h"
#include "tools/bench/bench_kernels.h"

#if TQKV_HAVE_CUDA
namespace tqkv::bench {
namespace {

constexpr int kHk = 8, kBlock = 16;
int g_d = 128;  // --head-dim
int g_hq = 32;  // query heads, --hq: 64 gives GQA group 8 (the unpacked kernel)
// Split lengths to time, --tps 0,512,1024: 0 is the plan's own choice (CudaDecoder::Plan).
std::vector<int> g_tps = {0};
// --narrow auto|never|always, --unstaged, --no-one-cta, --no-pdl: the plan's kernel choices.
DecodeOptions g_options;

// read_gbs, the ceiling a decode is judged against, is the faster of two read-only kernels
// over 4 GiB: ReadAll (a grid-stride reduction) and ReadFloor
// (one 32 KB tile per CTA, every load issued up front), which reads 3-4 % faster; the bf16 decode
// itself had read 2-3 % faster than ReadAll at 64 x 32k.
struct Ceilings {
  double copy_gbs = 0, read_gbs = 0, read_all_gbs = 0, read_tiles_gbs = 0;
};

double MedianMs(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Ceilings MeasureCeilings(Stream& stream) {
  const int64_t bytes = int64_t{4} << 30;
  DeviceBuffer<uint8_t> a(bytes), b(bytes);
  FillRandomBytes(a.data(), bytes, 1, stream.get());
  DeviceBuffer<uint32_t> sink(4096);
  sink.FillBytes(0, stream.get());
  Event start, end;
  std::vector<float> copy_ms, read_ms, tiles_ms;
  for (int i = 0; i < 6; ++i) {
    start.Record(stream.get());
    TQKV_CUDA_CHECK(
        cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, stream.get()));
    end.Record(stream.get());
    end.Synchronize();
    if (i > 0) copy_ms.push_back(Event::ElapsedMs(start, end));
    start.Record(stream.get());
    ReadAll(a.data(), bytes, sink.data(), 4096, stream.get());
    end.Record(stream.get());
    end.Synchronize();
    if (i > 0) read_ms.push_back(Event::ElapsedMs(start, end));
    start.Record(stream.get());
    ReadFloor(a.data(), bytes, sink.data(), stream.get());
    end.Record(stream.get());
    end.Synchronize();
    if (i > 0) tiles_ms.push_back(Event::ElapsedMs(start, end));
  }
  Ceilings c;
  c.copy_gbs = 2.0 * bytes / (MedianMs(copy_ms) * 1e-3) / 1e9;
  c.read_all_gbs = double(bytes) / (MedianMs(read_ms) * 1e-3) / 1e9;
  c.read_tiles_gbs = double(bytes) / (MedianMs(tiles_ms) * 1e-3) / 1e9;
  c.read_gbs = std::max(c.read_all_gbs, c.read_tiles_gbs);
  return c;
}

struct Kind {
  std::string name;        // preset, "bf16" or "fp16"
  int64_t slot_bytes = 0;  // per token per KV head
};

struct Result {
  std::string kind;
  int batch = 0, context = 0;
  double us = 0, graph_us = 0, bytes = 0, gbs = 0, frac = 0, torch_us = 0, torch_graph_us = 0;
  double floor_us = 0;  // ReadFloor of the same bytes, in a graph: what one plain kernel takes
  // ReadFloor then the decode's own merge kernel (a programmatic dependent, as in Run) over the
  // plan's splits, in a graph: what any decode that splits the sequences this way and merges
  // with this kernel takes at the least. 0 where the plan has one split (no merge).
  double merge_floor_us = 0;
  int splits = 0, tokens_per_split = 0;
  bool narrow = false;   // the plan's narrow layout (4-warp units, four per SM)
  bool hi_only = false;  // k3v4_nc's hi-only twin (with narrow: its paired CTAs)
  bool one_cta = false;  // 4bit_nc's one-CTA-per-SM twin
};

// µs per call of `calls` calls of run(i) captured into one CUDA graph: median of 7 replays.
double GraphUs(const std::function<void(int)>& run, int calls, StreamHandle stream) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TQKV_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < calls; ++i) run(i);
  TQKV_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  TQKV_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  TQKV_CUDA_CHECK(cudaGraphLaunch(exec, stream));  // warm-up
  Event start, end;
  std::vector<float> ms;
  for (int r = 0; r < 7; ++r) {
    start.Record(stream);
    TQKV_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    end.Record(stream);
    end.Synchronize();
    ms.push_back(Event::ElapsedMs(start, end) / calls);
  }
  TQKV_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TQKV_CUDA_CHECK(cudaGraphDestroy(graph));
  return MedianMs(ms) * 1e3;
}

// Small shapes rotate among disjoint sets of the cache (and the read floor among ranges of the
// pool) that hold >= kRotateBytes together, five times the H200's 50 MB L2, and at least 8; a
// graph holds one call per set (at least 16), so every replay reads each set once and the calls
// read HBM, not L2 (with at most 8 sets, as before commit 944e934, at batch 1 × 1k-4k their 9-35 MB
// stayed in L2, for PyTorch's SDPA as well).
constexpr int64_t kRotateBytes = int64_t{256} << 20;
int RotatingSets(int64_t set_bytes, int64_t available_bytes) {
  const int64_t want = std::max<int64_t>(8, (kRotateBytes + set_bytes - 1) / set_bytes);
  return static_cast<int>(std::max<int64_t>(1, std::min(want, available_bytes / set_bytes)));
}

std::vector<Result> RunKind(const Kind& kind, const std::vector<int>& batches,
                            const std::vector<int>& contexts, const Ceilings& ceil,
                            Stream& stream) {
  const bool fp16 = kind.name == "fp16";
  const bool bf16 = kind.name == "bf16" || fp16;  // an uncompressed cache
  auto fill16 = fp16 ? FillRandomF16 : FillRandomBf16;
  std::optional<Quantizer> quantizer;
  std::optional<CudaDecoder> decoder;
  int64_t block_bytes;
  if (bf16) {
    const Bf16BlockFormat f =
        MakeBf16BlockFormat(g_d, kHk, kBlock, fp16 ? DType::kF16 : DType::kBF16);
    block_bytes = f.block_bytes;
    decoder.emplace(f);
  } else {
    quantizer.emplace(Quantizer::Create(kind.name, g_d, kHk, kBlock));
    block_bytes = quantizer->format().block_bytes;
    decoder.emplace(*quantizer);
  }
  // One pool sized for the largest shape and at least 1 GiB, so small shapes rotate among
  // several block sets and are measured from HBM, not L2.
  int64_t max_blocks = 0;
  for (int b : batches) {
    for (int c : contexts) max_blocks = std::max<int64_t>(max_blocks, int64_t{b} * c / kBlock);
  }
  const int64_t pool_blocks = std::max(max_blocks, (int64_t{1} << 30) / block_bytes);
  DeviceBuffer<uint8_t> pool(pool_blocks * block_bytes);
  DeviceBuffer<uint32_t> sink(1024);
  if (bf16) {
    fill16(reinterpret_cast<uint16_t*>(pool.data()), pool.size_bytes() / 2, 7, stream.get());
  } else {
    const BlockFormat& f = quantizer->format();
    FillRandomBytes(pool.data(), pool.size_bytes(), 7, stream.get());
    FixCompressedCache(pool.data(), pool_blocks, f.block_bytes, f.meta_offset, kHk, f.num_meta,
                       kBlock, f.key_data_bytes, f.data_per_slot, f.fp8_keys, stream.get());
  }
  TQKV_CUDA_CHECK(cudaGetLastError());

  std::vector<Result> results;
  std::mt19937 rng(3);
  for (int batch : batches) {
    for (int context : contexts) {
      for (int tps : g_tps) {
        const int blocks_per_seq = context / kBlock;
        const int64_t set_blocks = int64_t{batch} * blocks_per_seq;
        const int sets = RotatingSets(set_blocks * block_bytes, pool_blocks * block_bytes);
        const int graph_calls = std::max(16, sets);
        std::vector<int32_t> ids(pool_blocks);
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), rng);
        std::vector<int32_t> tables(static_cast<size_t>(sets * set_blocks));
        std::copy(ids.begin(), ids.begin() + tables.size(), tables.begin());
        DeviceBuffer<int32_t> d_tables(static_cast<int64_t>(tables.size()));
        d_tables.CopyFromHost(tables);
        std::vector<int32_t> lens(batch, context);
        DeviceBuffer<int32_t> d_lens(batch);
        d_lens.CopyFromHost(lens);
        DeviceBuffer<uint16_t> query(int64_t{batch} * g_hq * g_d);
        fill16(query.data(), query.size(), 11, stream.get());
        DeviceBuffer<uint16_t> out(int64_t{batch} * g_hq * g_d);
        DeviceBuffer<float> lse(int64_t{batch} * g_hq);
        DecodePlan plan;
        try {
          DecodeOptions options = g_options;
          options.tokens_per_split = tps;
          plan = decoder->Plan(batch, g_hq, blocks_per_seq, options);
        } catch (const Error& e) {
          fmt::print("  {} B={} L={} tps={}: {}\n", kind.name, batch, context, tps, e.what());
          continue;
        }
        DeviceBuffer<uint8_t> ws(plan.workspace_bytes);
        CudaDecodeArgs a;
        a.query = query.data();
        a.query_dtype = fp16 ? DType::kF16 : DType::kBF16;
        a.cache = {pool.data(), pool_blocks, decoder->layout()};
        a.seq_lens = d_lens.data();
        a.output = out.data();
        a.output_dtype = fp16 ? DType::kF16 : DType::kBF16;
        a.lse = lse.data();
        a.workspace = ws.data();
        a.workspace_bytes = ws.size_bytes();
        auto run = [&](int i) {
          a.block_tables = d_tables.data() + (i % sets) * set_blocks;
          decoder->Run(plan, a, stream.get());
        };
        for (int i = 0; i < 3; ++i) run(i);
        Event start, end;
        std::vector<float> ms;
        const int reps = 10;
        for (int r = 0; r < 7; ++r) {
          start.Record(stream.get());
          for (int i = 0; i < reps; ++i) run(r * reps + i);
          end.Record(stream.get());
          end.Synchronize();
          ms.push_back(Event::ElapsedMs(start, end) / reps);
        }
        Result res;
        res.kind = kind.name;
        res.batch = batch;
        res.context = context;
        res.us = MedianMs(ms) * 1e3;
        // The graph holds one call per rotating table set, at least 16 (the same work as above).
        res.graph_us = GraphUs(run, graph_calls, stream.get());
        res.bytes = double(batch) * context * kHk * kind.slot_bytes;
        res.gbs = res.bytes / (res.graph_us * 1e-6) / 1e9;
        res.frac = res.gbs / ceil.read_gbs;
        // The same number of bytes read contiguously by the plainest one-kernel read, rotating
        // over disjoint ranges of the pool as the decode rotates its sets (RotatingSets).
        const auto floor_bytes = static_cast<int64_t>(res.bytes);
        const int floor_sets = RotatingSets(floor_bytes, pool.size_bytes());
        res.floor_us = GraphUs(
            [&](int i) {
              ReadFloor(pool.data() + (i % floor_sets) * floor_bytes, floor_bytes, sink.data(),
                        stream.get());
            },
            std::max(16, floor_sets), stream.get());
        if (plan.max_splits > 1) {
          // Partials of zeros with LSEs of zero: the merge's loads, sums and stores are the same
          // whatever the values.
          DeviceBuffer<float> partial(int64_t{batch} * g_hq * plan.max_splits * g_d);
          DeviceBuffer<float> partial_lse(int64_t{batch} * g_hq * plan.max_splits);
          TQKV_CUDA_CHECK(cudaMemsetAsync(partial.data(), 0, partial.size_bytes(), stream.get()));
          TQKV_CUDA_CHECK(
              cudaMemsetAsync(partial_lse.data(), 0, partial_lse.size_bytes(), stream.get()));
          decode_detail::MergeParams mp;
          mp.partial_out = partial.data();
          mp.partial_lse = partial_lse.data();
          mp.seq_lens = d_lens.data();
          mp.output = out.data();
          mp.lse = lse.data();
          mp.out_dtype = fp16 ? DType::kF16 : DType::kBF16;
          mp.num_seqs = batch;
          mp.num_q_heads = g_hq;
          mp.head_dim = g_d;
          mp.tokens_per_split = plan.tokens_per_split;
          mp.max_splits = plan.max_splits;
          res.merge_floor_us = GraphUs(
              [&](int i) {
                ReadFloor(pool.data() + (i % floor_sets) * floor_bytes, floor_bytes, sink.data(),
                          stream.get(), /*trigger_dependents=*/true);
                TQKV_CUDA_CHECK(decode_detail::LaunchDecodeMerge(mp, stream.get()));
              },
              std::max(16, floor_sets), stream.get());
        }
        res.splits = plan.max_splits;
        res.tokens_per_split = plan.tokens_per_split;
        res.narrow = plan.narrow;
        res.hi_only = plan.hi_only;
        res.one_cta = plan.one_cta;
        results.push_back(res);
        fmt::print(
            "  {:<20} B={:<4} L={:<6} {:9.1f} us  graph {:9.1f} us  {:8.1f} MB  {:7.0f} GB/s  "
            "{:5.1f}% of read ceiling  (splits {} x {} tokens{})  read floor {:.1f} us "
            "({:.1f}% of read ceiling){}\n",
            kind.name, batch, context, res.us, res.graph_us, res.bytes / 1e6, res.gbs,
            100 * res.frac, plan.max_splits, plan.tokens_per_split,
            plan.narrow ? (plan.hi_only ? ", narrow, paired hi-only" : ", narrow")
                        : (plan.hi_only ? ", hi-only" : (plan.one_cta ? ", one-CTA" : "")),
            res.floor_us, 100 * res.bytes / (res.floor_us * 1e-6) / 1e9 / ceil.read_gbs,
            res.merge_floor_us > 0
                ? fmt::format("  read + merge floor {:.1f} us ({:.1f}%)", res.merge_floor_us,
                              100 * res.bytes / (res.merge_floor_us * 1e-6) / 1e9 / ceil.read_gbs)
                : std::string());
        std::fflush(stdout);
      }
    }
  }
  return results;
}

int Main(int argc, char** argv) {
  bool quick = false;
  std::string torch_json, json_out, only, kind_filter, batch_list, context_list;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0)
      quick = true;
    else if (std::strcmp(argv[i], "--torch-json") == 0 && i + 1 < argc)
      torch_json = argv[++i];
    else if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc)
      json_out = argv[++i];
    else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc)
      only = argv[++i];
    else if (std::strcmp(argv[i], "--kind") == 0 && i + 1 < argc)
      kind_filter = argv[++i];
    else if (std::strcmp(argv[i], "--batches") == 0 && i + 1 < argc)
      batch_list = argv[++i];
    else if (std::strcmp(argv[i], "--contexts") == 0 && i + 1 < argc)
      context_list = argv[++i];
    else if (std::strcmp(argv[i], "--hq") == 0 && i + 1 < argc)
      g_hq = std::stoi(argv[++i]);
    else if (std::strcmp(argv[i], "--head-dim") == 0 && i + 1 < argc)
      g_d = std::stoi(argv[++i]);
    else if (std::strcmp(argv[i], "--narrow") == 0 && i + 1 < argc) {
      const std::string v = argv[++i];
      g_options.narrow = v == "never"    ? DecodeOptions::Narrow::kNever
                         : v == "always" ? DecodeOptions::Narrow::kAlways
                                         : DecodeOptions::Narrow::kAuto;
    } else if (std::strcmp(argv[i], "--unstaged") == 0)
      g_options.staged = false;
    else if (std::strcmp(argv[i], "--no-one-cta") == 0)
      g_options.one_cta_twin = false;
    else if (std::strcmp(argv[i], "--no-pdl") == 0)
      g_options.dependent_launch = false;
    else if (std::strcmp(argv[i], "--tps") == 0 && i + 1 < argc) {
      g_tps.clear();
      std::stringstream list(argv[++i]);
      for (std::string item; std::getline(list, item, ',');) g_tps.push_back(std::stoi(item));
    }
  }
  RequireCudaDevice("decode_bench");
  const auto dev = QueryDevices().front();
  fmt::print("decode_bench on {} ({} SMs)\n", dev.name, dev.sm_count);
  Stream stream;
  const Ceilings ceil = MeasureCeilings(stream);
  fmt::print(
      "ceilings: copy {:.0f} GB/s (read+write), read-only {:.0f} GB/s (the faster of ReadAll "
      "{:.0f} and ReadFloor {:.0f})\n",
      ceil.copy_gbs, ceil.read_gbs, ceil.read_all_gbs, ceil.read_tiles_gbs);
  std::vector<int> batches = {1, 16, 64, 256}, contexts = {1024, 4096, 16384, 32768};
  if (quick) {
    batches = {1, 64};
    contexts = {4096, 32768};
  }
  std::vector<Kind> kinds;
  for (const char* p : {"turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_k8v4"}) {
    kinds.push_back({p, MakeBlockFormat(PresetByName(p), g_d, 1, kBlock).slot_bytes});
  }
  kinds.push_back({"bf16", 4 * g_d});
  kinds.push_back({"fp16", 4 * g_d});
  auto ints = [](const std::string& list) {
    std::vector<int> v;
    std::stringstream in(list);
    for (std::string item; std::getline(in, item, ',');) v.push_back(std::stoi(item));
    return v;
  };
  if (!batch_list.empty()) batches = ints(batch_list);       // --batches 1,16
  if (!context_list.empty()) contexts = ints(context_list);  // --contexts 1024,4096
  if (!kind_filter.empty()) {                                // --kind KIND: every shape of one kind
    std::erase_if(kinds, [&](const Kind& k) { return k.name != kind_filter; });
  }
  if (!only.empty()) {  // --only KIND:BATCH:CONTEXT, e.g. for a profiler run
    const auto c1 = only.find(':'), c2 = only.rfind(':');
    const std::string name = only.substr(0, c1);
    std::erase_if(kinds, [&](const Kind& k) { return k.name != name; });
    batches = {std::stoi(only.substr(c1 + 1, c2 - c1 - 1))};
    contexts = {std::stoi(only.substr(c2 + 1))};
  }
  std::vector<Result> all;
  for (const Kind& k : kinds) {
    auto r = RunKind(k, batches, contexts, ceil, stream);
    all.insert(all.end(), r.begin(), r.end());
  }
  std::map<std::string, double> torch, torch_graph;
  if (!torch_json.empty()) {
    std::ifstream in(torch_json);
    if (in) {
      const auto j = nlohmann::json::parse(in);
      for (const auto& e : j["results"]) {
        const std::string key =
            fmt::format("{},{}", e["batch"].get<int>(), e["context"].get<int>());
        torch[key] = e["us"];
        if (e.contains("graph_us")) torch_graph[key] = e["graph_us"];
      }
    }
  }
  fmt::print(
      "\n| kind | batch | context | µs (stream) | µs (graph) | MB read | GB/s | % read ceiling | "
      "torch µs (stream) | torch µs (graph) | torch / ours (stream) | torch / ours (graph) | "
      "read floor µs | floor / ours | read + merge floor µs |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  nlohmann::json out = {{"device", dev.name},
                        {"copy_gbs", ceil.copy_gbs},
                        {"read_gbs", ceil.read_gbs},
                        {"read_all_gbs", ceil.read_all_gbs},
                        {"read_floor_gbs", ceil.read_tiles_gbs},
                        {"results", nlohmann::json::array()}};
  auto num = [](double x) { return x > 0 ? fmt::format("{:.1f}", x) : std::string("-"); };
  auto ratio = [](double a, double b) {
    return a > 0 && b > 0 ? fmt::format("{:.2f}x", a / b) : std::string("-");
  };
  for (Result& r : all) {
    const std::string key = fmt::format("{},{}", r.batch, r.context);
    r.torch_us = torch.contains(key) ? torch[key] : 0;
    r.torch_graph_us = torch_graph.contains(key) ? torch_graph[key] : 0;
    fmt::print(
        "| {} | {} | {} | {:.1f} | {:.1f} | {:.1f} | {:.0f} | {:.1f} | {} | {} | {} | {} | {} | {} "
        "| {} |\n",
        r.kind, r.batch, r.context, r.us, r.graph_us, r.bytes / 1e6, r.gbs, 100 * r.frac,
        num(r.torch_us), num(r.torch_graph_us), ratio(r.torch_us, r.us),
        ratio(r.torch_graph_us, r.graph_us), num(r.floor_us), ratio(r.floor_us, r.graph_us),
        num(r.merge_floor_us));
    out["results"].push_back({{"kind", r.kind},
                              {"batch", r.batch},
                              {"context", r.context},
                              {"us", r.us},
                              {"graph_us", r.graph_us},
                              {"bytes", r.bytes},
                              {"gbs", r.gbs},
                              {"fraction_of_read_ceiling", r.frac},
                              {"torch_us", r.torch_us},
                              {"torch_graph_us", r.torch_graph_us},
                              {"read_floor_us", r.floor_us},
                              {"read_merge_floor_us", r.merge_floor_us},
                              {"splits", r.splits},
                              {"tokens_per_split", r.tokens_per_split},
                              {"narrow", r.narrow},
                              {"hi_only", r.hi_only},
                              {"one_cta", r.one_cta}});
  }
  if (!json_out.empty()) std::ofstream(json_out) << out.dump(1) << "\n";
  return 0;
}

}  // namespace
}  // namespace tqkv::bench

#endif  // TQKV_HAVE_CUDA

int main(int argc, char** argv) {
#if !TQKV_HAVE_CUDA
  (void)argc;
  (void)argv;
  fmt::print(stderr, "decode_bench: this build has no CUDA support\n");
  return 1;
#else
  try {
    return tqkv::bench::Main(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "decode_bench: error: {}\n", e.what());
    return 1;
  }
#endif
}
