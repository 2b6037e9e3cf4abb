// Whole-model serving speed on a CUDA device (issue 36): SmolLM2-135M's shape (or a GGUF file
// with --model) on CudaEngine, driven by model::Server. For each cache policy and batch: B
// requests of --context prompt tokens (distinct, so no prefix hits) are prefilled in steps of
// --step-tokens, then --steps decode steps of B rows each are timed on the wall clock (the
// engine's whole step: Schedule, uploads, every kernel, the argmax back, one synchronization).
// Reported: decode tokens/s, µs per step, the bytes a step must read (bf16 weights of the linear
// layers and the output layer, plus the cache of every sequence) as GB/s and the fraction of a
// read-only ceiling measured in the same run, prefill tokens/s, and KV bytes per token. All
// policies run in one process on the same weights. With --spec-tokens K the server drafts K tokens
// per decoding sequence and step by prompt lookup (ServerOptions::spec_tokens) and verifies them
// in the step: decode tokens/s then counts every token a step commits, and the table gives the
// tokens per sequence and step. Random weights repeat one token (SmolLM2's shape: 24 of 24 tokens
// on the CPU), so K drafts are made and kept every step (ProposeDrafts continues a repetition):
// the most speculative decoding can gain at the shape (such steps run kernel by kernel, not from a
// graph); a real model's text keeps fewer.
//
//   model_bench [--model F.gguf] [--presets bf16 turboquant_4bit_nc ...] [--batches 1 64]
//               [--context 4096] [--steps 64] [--spec-tokens 0] [--json out.json]
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "model/cuda_engine.h"
#include "model/gguf.h"
#include "model/llama.h"
#include "model/server.h"
#include "runtime/device.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "runtime/stream.h"
#include "tools/bench/bench_kernels.h"

#if TQKV_HAVE_CUDA
namespace tqkv::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Read-only ceiling: ReadAll over 4 GiB, the median of 5.
double ReadCeilingGbs() {
  const int64_t bytes = int64_t{4} << 30;
  Stream stream;
  DeviceBuffer<uint8_t> a(bytes);
  FillRandomBytes(a.data(), bytes, 1, stream.get());
  DeviceBuffer<uint32_t> sink(4096);
  std::vector<double> s;
  for (int i = 0; i < 6; ++i) {
    stream.Synchronize();
    const auto t0 = Clock::now();
    ReadAll(a.data(), bytes, sink.data(), 4096, stream.get());
    stream.Synchronize();
    if (i > 0) s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(s.begin(), s.end());
  return bytes / s[s.size() / 2] / 1e9;
}

struct Result {
  std::string preset;
  int batch = 0;
  double decode_tokens_per_s = 0, us_per_step = 0, read_mb = 0, gbs = 0, frac = 0;
  double prefill_tokens_per_s = 0;
  int64_t kv_bytes_per_token = 0;
  double kv_gib = 0;
  double tokens_per_step = 1;  // per sequence (above 1 with --spec-tokens)
};

Result Run(const model::LlamaModel& llama, const std::string& preset, int batch, int context,
           int steps, int step_tokens, int spec, bool graphs, double ceiling_gbs) {
  const int bs = 16;
  // Every step may commit spec + 1 tokens per sequence.
  const int max_new =
      (steps + 12 + static_cast<int>(int64_t{batch} * context / step_tokens) + 4) * (spec + 1);
  const int32_t blocks = batch * ((context + max_new + bs - 1) / bs + 1) + 2;
  model::CudaEngine engine(llama, {preset, 0, bs, blocks}, {graphs, 32});
  model::ServerOptions options{batch, step_tokens};
  options.spec_tokens = spec;
  model::Server server(engine, options);
  const int vocab = llama.config().vocab;
  for (int b = 0; b < batch; ++b) {
    std::mt19937_64 rng(1000 + b);
    model::Request r;
    r.prompt.resize(static_cast<size_t>(context));
    for (int32_t& t : r.prompt) t = static_cast<int32_t>(rng() % vocab);
    // Sequences prefilled early decode while later ones prefill: room for those steps too.
    r.max_new_tokens = max_new;
    server.Submit(std::move(r));
  }
  auto all_decoding = [&] {
    for (int b = 0; b < batch; ++b) {
      if (server.completion(b).tokens.empty()) return false;
    }
    return true;
  };
  const auto p0 = Clock::now();
  while (!all_decoding()) server.Step();
  const double prefill_s = std::chrono::duration<double>(Clock::now() - p0).count();
  for (int i = 0; i < 3; ++i) server.Step();  // warm: every kernel of a decode step loaded
  const int64_t before = server.stats().generated_tokens;
  const auto t0 = Clock::now();
  for (int i = 0; i < steps; ++i) server.Step();
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  const int64_t generated = server.stats().generated_tokens - before;
  if (spec == 0 ? generated != int64_t{batch} * steps : generated < int64_t{batch} * steps) {
    throw Error(fmt::format("model_bench: {} tokens in {} decode steps of batch {}", generated,
                            steps, batch));
  }
  Result r;
  r.preset = preset;
  r.batch = batch;
  r.kv_bytes_per_token = engine.kv_bytes_per_token();
  r.kv_gib = static_cast<double>(blocks) * bs * r.kv_bytes_per_token / double(1 << 30);
  const model::LlamaConfig& c = llama.config();
  const int kv = c.num_kv_heads * c.head_dim;
  const double weight_bytes =
      2.0 * (double(c.num_layers) * c.hidden * (2.0 * c.hidden + 2.0 * kv + 3.0 * c.ffn) +
             double(vocab) * c.hidden);
  r.tokens_per_step = static_cast<double>(generated) / (double{batch} * steps);
  const double mean_ctx = context + 4 + r.tokens_per_step * steps / 2.0;
  const double bytes = weight_bytes + batch * mean_ctx * r.kv_bytes_per_token;
  r.us_per_step = s / steps * 1e6;
  r.decode_tokens_per_s = static_cast<double>(generated) / s;
  r.read_mb = bytes / 1e6;
  r.gbs = bytes / (s / steps) / 1e9;
  r.frac = r.gbs / ceiling_gbs;
  r.prefill_tokens_per_s = double(batch) * context / prefill_s;
  return r;
}

int Main(int argc, char** argv) {
  CLI::App app{"whole-model decode and prefill speed on CudaEngine"};
  std::string model_path, json_path;
  std::vector<std::string> presets = {"bf16", "turboquant_k8v4", "turboquant_4bit_nc",
                                      "turboquant_3bit_nc"};
  std::vector<int> batches = {1, 64};
  int context = 4096, steps = 64, step_tokens = 16384, spec = 0;
  bool no_graphs = false;
  app.add_option("--model", model_path, "GGUF file (default: SmolLM2-135M's shape, random weights)");
  app.add_option("--presets", presets)->capture_default_str();
  app.add_option("--batches", batches)->capture_default_str();
  app.add_option("--context", context,
                 "prompt tokens per sequence; with the decoded tokens at most the model's "
                 "context_length (SmolLM2: 8,192), as the server refuses longer requests")
      ->capture_default_str();
  app.add_option("--steps", steps)->capture_default_str();
  app.add_option("--step-tokens", step_tokens)->capture_default_str();
  app.add_option("--spec-tokens", spec, "drafts per decoding sequence and step (prompt lookup)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  app.add_option("--json", json_path);
  app.add_flag("--no-graphs", no_graphs, "launch decode steps kernel by kernel");
  CLI11_PARSE(app, argc, argv);
  if (CudaDeviceCount() == 0) {
    fmt::print(stderr, "model_bench: no CUDA device\n");
    return 1;
  }
  const model::LlamaModel llama =
      model_path.empty()
          ? model::LlamaModel::RandomInit(model::LlamaModel::SmolLm2Config(), 1)
          : model::LlamaModel::FromGguf(model::GgufFile::Open(model_path));
  const std::string what = model_path.empty() ? "SmolLM2-135M shape, random weights" : model_path;
  const double ceiling = ReadCeilingGbs();
  fmt::print(
      "model_bench: {} ({} layers), context {}, {} decode steps ({}), {} drafts per sequence "
      "and step; read ceiling {:.0f} GB/s\n",
      what, llama.config().num_layers, context, steps,
      no_graphs ? "kernel by kernel" : "CUDA graphs", spec, ceiling);
  std::vector<Result> results;
  for (int batch : batches) {
    for (const std::string& preset : presets) {
      results.push_back(
          Run(llama, preset, batch, context, steps, step_tokens, spec, !no_graphs, ceiling));
      const Result& r = results.back();
      fmt::print(
          "  {:<20} B={:<3} decode {:9.0f} tok/s ({:.2f} per sequence and step) {:8.1f} us/step  "
          "{:7.1f} MB/step {:6.0f} GB/s {:5.1f}% of read ceiling  prefill {:8.0f} tok/s  KV {} "
          "B/token ({:.2f} GiB pool)\n",
          r.preset, r.batch, r.decode_tokens_per_s, r.tokens_per_step, r.us_per_step, r.read_mb,
          r.gbs, 100 * r.frac, r.prefill_tokens_per_s, r.kv_bytes_per_token, r.kv_gib);
    }
  }
  fmt::print("\n| batch | cache | KV B/token | decode tok/s | vs bf16 | µs/step | GB/s | % read ceiling | prefill tok/s |\n|---|---|---|---|---|---|---|---|---|\n");
  nlohmann::json j;
  j["model"] = what;
  j["context"] = context;
  j["read_ceiling_gbs"] = ceiling;
  j["decode_graphs"] = !no_graphs;
  j["spec_tokens"] = spec;
  for (const Result& r : results) {
    double bf16 = 0;
    for (const Result& o : results) {
      if (o.batch == r.batch && o.preset == "bf16") bf16 = o.decode_tokens_per_s;
    }
    fmt::print("| {} | {} | {} | {:.0f} | {} | {:.0f} | {:.0f} | {:.1f} % | {:.0f} |\n", r.batch,
               r.preset, r.kv_bytes_per_token, r.decode_tokens_per_s,
               bf16 > 0 ? fmt::format("{:.2f}x", r.decode_tokens_per_s / bf16) : "-",
               r.us_per_step, r.gbs, 100 * r.frac, r.prefill_tokens_per_s);
    j["runs"].push_back({{"preset", r.preset},
                         {"batch", r.batch},
                         {"decode_tokens_per_s", r.decode_tokens_per_s},
                         {"us_per_step", r.us_per_step},
                         {"read_mb_per_step", r.read_mb},
                         {"gbs", r.gbs},
                         {"fraction_of_read_ceiling", r.frac},
                         {"prefill_tokens_per_s", r.prefill_tokens_per_s},
                         {"tokens_per_sequence_and_step", r.tokens_per_step},
                         {"kv_bytes_per_token", r.kv_bytes_per_token}});
  }
  if (!json_path.empty()) std::ofstream(json_path) << j.dump(2) << "\n";
  return 0;
}

}  // namespace
}  // namespace tqkv::bench

int main(int argc, char** argv) {
  try {
    return tqkv::bench::Main(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "model_bench: {}\n", e.what());
    return 1;
  }
}
#else
#include <cstdio>
int main() {
  std::puts("model_bench: this build has no CUDA support");
  return 0;
}
#endif
