// `tqkv eval`: a GGUF Llama model teacher-forced over a text through tqkv's KV cache (CPU or
// CUDA engine; the fp32 reference on the CPU), per cache policy: perplexity and its change against
// the exact fp32 reference and against the same model with a bf16 cache, top-1 next-token agreement
// with each, and KV bytes per token.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "model/cuda_engine.h"
#include "model/engine.h"
#include "model/gguf.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "quant/preset.h"
#include "runtime/device.h"
#include "runtime/error.h"
#include "runtime/safetensors.h"
#include "tools/cli_util.h"
#include "tools/commands.h"

namespace tqkv::cli {
namespace {

struct EvalFlags {
  std::string model = kDefaultModel;
  std::string text = "/usr/share/common-licenses/GPL-3";  // Debian's base-files
  int tokens = 4096;
  int window = 512;
  int chunk = 128;
  std::vector<std::string> presets = {"turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                                      "turboquant_3bit_nc"};
  std::vector<int> boundary_layers = {0, 2};
  bool diagnose = false;
  std::string device = "cpu";
  std::string json;
};

// Negative log-likelihood of each next token, and the argmax, per position but the last.
struct Scores {
  std::vector<double> nll;
  std::vector<int32_t> top1;
};

Scores Score(const std::vector<float>& logits, std::span<const int32_t> ids, int vocab) {
  Scores s;
  for (size_t t = 0; t + 1 < ids.size(); ++t) {
    const float* row = logits.data() + t * vocab;
    const float mx = *std::max_element(row, row + vocab);
    double sum = 0.0;
    for (int i = 0; i < vocab; ++i) sum += std::exp(double{row[i]} - mx);
    s.nll.push_back(mx + std::log(sum) - row[ids[t + 1]]);
    s.top1.push_back(static_cast<int32_t>(std::max_element(row, row + vocab) - row));
  }
  return s;
}

void RunEval(const EvalFlags& flags) {
  const auto start = std::chrono::steady_clock::now();
  const model::GgufFile file =
      model::GgufFile::Open(ResolveModelPath(flags.model, "tqkv eval"));
  const model::LlamaModel llama = model::LlamaModel::FromGguf(file);
  if (flags.diagnose && flags.device != "cpu") {
    throw InvalidArgument("tqkv eval", "--device", flags.device,
                          "cpu with --diagnose (the layer errors are the CPU engine's)");
  }
  // A missing device is said before the reference runs (minutes at the default length).
  if (flags.device == "cuda") RequireCudaDevice("tqkv eval --device cuda");
  if (flags.window > llama.config().context) {
    throw InvalidArgument(
        "tqkv eval", "--window", flags.window,
        fmt::format("at most the model's context_length = {}", llama.config().context));
  }
  // The policies are checked before the reference runs (minutes at the default length).
  for (const std::string& p : flags.presets) {
    try {
      (void)PresetByName(p);
    } catch (const Error&) {
      throw InvalidArgument("tqkv eval", "--presets", p,
                            "a TurboQuant preset (tqkv info lists them; the bf16 cache always "
                            "runs)");
    }
    if (std::count(flags.presets.begin(), flags.presets.end(), p) > 1) {
      throw InvalidArgument("tqkv eval", "--presets", p, "each preset once");
    }
  }
  for (int b : flags.boundary_layers) {
    if (b < 0 || b > llama.config().num_layers / 2) {
      throw InvalidArgument("tqkv eval", "--boundary-layers", b,
                            fmt::format("0 to {} (half the model's {} layers)",
                                        llama.config().num_layers / 2, llama.config().num_layers));
    }
    if (std::count(flags.boundary_layers.begin(), flags.boundary_layers.end(), b) > 1) {
      throw InvalidArgument("tqkv eval", "--boundary-layers", b, "each count once");
    }
  }
  const model::Tokenizer tokenizer = model::Tokenizer::FromGguf(file);
  std::ifstream in(flags.text, std::ios::binary);
  if (!in || !std::filesystem::is_regular_file(flags.text)) {
    throw InvalidArgument("tqkv eval", "--text", flags.text, "a readable text file");
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  std::vector<int32_t> ids = tokenizer.Encode(buffer.str());
  if (static_cast<int>(ids.size()) < flags.tokens) {
    throw InvalidArgument("tqkv eval", "--tokens", flags.tokens,
                          fmt::format("at most the text's {} tokens", ids.size()));
  }
  ids.resize(static_cast<size_t>(flags.tokens));
  const int vocab = llama.config().vocab;
  const int windows = (flags.tokens + flags.window - 1) / flags.window;
  auto window_ids = [&](int w) {
    const int begin = w * flags.window;
    return std::span<const int32_t>(ids).subspan(
        static_cast<size_t>(begin),
        static_cast<size_t>(std::min(flags.window, flags.tokens - begin)));
  };
  // The reference: exact fp32 attention over an fp32 cache.
  std::vector<Scores> ref;
  double ref_nll = 0.0;
  size_t scored = 0;
  for (int w = 0; w < windows; ++w) {
    ref.push_back(Score(model::ReferenceForward(llama, window_ids(w)), window_ids(w), vocab));
    for (double x : ref.back().nll) ref_nll += x;
    scored += ref.back().nll.size();
  }
  const double ref_ppl = std::exp(ref_nll / static_cast<double>(scored));
  fmt::print("{}: {} tokens of {} in {} windows of {}, prefill chunks of {}, on {}\n", flags.model,
             flags.tokens, flags.text, windows, flags.window, flags.chunk,
             flags.device == "cuda" ? "CUDA" : "the CPU");
  fmt::print("{:<28} {:>10} {:>9} {:>8} {:>14} {:>13} {:>12} {:>8}\n", "KV cache", "perplexity",
             "change", "top-1", "change (bf16)", "top-1 (bf16)", "KV B/token", "vs bf16");
  fmt::print("{:<28} {:>10.4f}\n", "fp32 (reference)", ref_ppl);
  nlohmann::json report = {{"model", flags.model},           {"text", flags.text},
                           {"tokens", flags.tokens},         {"window", flags.window},
                           {"device", flags.device},         {"reference_ppl", ref_ppl},
                           {"runs", nlohmann::json::array()}};
  std::vector<std::pair<std::string, int>> policies = {{"bf16", 0}};
  for (const std::string& p : flags.presets) {
    for (int b : flags.boundary_layers) policies.emplace_back(p, b);
  }
  int64_t bf16_bytes = 0;
  double bf16_ppl = 0.0;
  std::vector<std::vector<int32_t>> bf16_top1;  // the bf16 cache's argmax per window and position
  for (const auto& [preset, boundary] : policies) {
    std::unique_ptr<model::Engine> owned;
    if (flags.device == "cuda") {
      owned = std::make_unique<model::CudaEngine>(llama, model::KvPolicy{preset, boundary, 16, 0});
    } else {
      owned = std::make_unique<model::CpuEngine>(llama, model::KvPolicy{preset, boundary, 16, 0});
    }
    model::Engine& engine = *owned;
    double nll = 0.0;
    size_t agree = 0, agree_bf16 = 0;
    const bool is_bf16 = preset == "bf16";
    model::LayerErrors errors;
    for (int w = 0; w < windows; ++w) {
      // Windows are scored apart: a window that repeats an earlier one's tokens would take them
      // from the prefix cache, and Forward leaves such rows NaN.
      if (w > 0) engine.manager().ClearPrefixCache();
      const Scores s =
          Score(engine.Forward(window_ids(w), flags.chunk, flags.diagnose ? &errors : nullptr),
                window_ids(w), vocab);
      if (is_bf16) bf16_top1.push_back(s.top1);
      for (size_t t = 0; t < s.nll.size(); ++t) {
        nll += s.nll[t];
        agree += s.top1[t] == ref[w].top1[t];
        agree_bf16 += s.top1[t] == bf16_top1[w][t];
      }
    }
    const double ppl = std::exp(nll / static_cast<double>(scored));
    const double change = 100.0 * (ppl / ref_ppl - 1.0);
    const double top1 = static_cast<double>(agree) / static_cast<double>(scored);
    const int64_t bytes = engine.kv_bytes_per_token();
    if (is_bf16) bf16_bytes = bytes, bf16_ppl = ppl;
    const double change_bf16 = 100.0 * (ppl / bf16_ppl - 1.0);
    const double top1_bf16 = static_cast<double>(agree_bf16) / static_cast<double>(scored);
    const std::string name = boundary > 0 ? fmt::format("{} + bf16 x{}", preset, boundary) : preset;
    fmt::print("{:<28} {:>10.4f} {:>+8.2f}% {:>8.4f} {:>+13.2f}% {:>13.4f} {:>12} {:>7.2f}x\n", name,
               ppl, change, top1, change_bf16, top1_bf16, bytes,
               static_cast<double>(bf16_bytes) / static_cast<double>(bytes));
    nlohmann::json run = {{"preset", preset},
                          {"boundary_layers", boundary},
                          {"ppl", ppl},
                          {"ppl_change_percent", change},
                          {"top1_agreement", top1},
                          {"ppl_change_vs_bf16_percent", change_bf16},
                          {"top1_agreement_vs_bf16", top1_bf16},
                          {"kv_bytes_per_token", bytes}};
    if (flags.diagnose) {
      std::vector<double> key, value, cosine, worst;
      for (int l = 0; l < llama.config().num_layers; ++l) {
        key.push_back(errors.key_mse(l));
        value.push_back(errors.value_mse(l));
        cosine.push_back(errors.mean_cosine(l));
        worst.push_back(errors.cosine_min[l]);
      }
      const auto [kmin, kmax] = std::minmax_element(key.begin(), key.end());
      fmt::print(
          "{:<28} key rel. MSE per layer {:.4f} .. {:.4f}, value {:.4f} (mean); attention "
          "cosine per layer {:.5f} (mean), {:.5f} (worst layer), {:.4f} (worst output)\n",
          "", *kmin, *kmax, std::accumulate(value.begin(), value.end(), 0.0) / value.size(),
          std::accumulate(cosine.begin(), cosine.end(), 0.0) / cosine.size(),
          *std::min_element(cosine.begin(), cosine.end()),
          *std::min_element(worst.begin(), worst.end()));
      run["layer_key_mse"] = key;
      run["layer_value_mse"] = value;
      run["layer_mean_cosine"] = cosine;
      run["layer_min_cosine"] = worst;
    }
    std::fflush(stdout);
    report["runs"].push_back(run);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fmt::print("{:.1f} s\n", seconds);
  if (!flags.json.empty()) {
    // (A file name that is not UTF-8 is written with U+FFFD in its place, not refused at the end.)
    const std::string text =
        report.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    WriteFileAtomically(flags.json,
                        std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()),
                        "tqkv eval --json");
  }
}

}  // namespace

void AddEvalCommand(CLI::App& app) {
  auto flags = std::make_shared<EvalFlags>();
  CLI::App* cmd = app.add_subcommand(
      "eval",
      "Teacher-force a GGUF Llama model over a text through tqkv's KV cache: perplexity, top-1 "
      "agreement with the fp32 reference and KV bytes per token, per policy");
  cmd->add_option("--model", flags->model,
                  "GGUF file (tools/setup.sh fetches SmolLM2-135M-Instruct)")
      ->capture_default_str();
  cmd->add_option("--text", flags->text, "UTF-8 text file")->capture_default_str();
  cmd->add_option("--tokens", flags->tokens, "tokens of the text to score")
      ->check(CLI::Range(2, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--window", flags->window,
                  "tokens per sequence (context of each window; at most the model's "
                  "context_length)")
      ->check(CLI::Range(2, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--chunk", flags->chunk, "prefill chunk (tokens per step)")
      ->check(CLI::Range(1, 8192))
      ->capture_default_str();
  cmd->add_option("--presets", flags->presets, "TurboQuant presets")->capture_default_str();
  cmd->add_option("--boundary-layers", flags->boundary_layers,
                  "bf16 layers at each end, per preset")
      ->capture_default_str();
  cmd->add_flag("--diagnose", flags->diagnose,
                "also each layer's key and value relative MSE and attention-output cosine "
                "against exact fp32 attention (slower; CPU only)");
  cmd->add_option("--device", flags->device,
                  "cpu or cuda: the engine of the cache policies (the fp32 reference runs on "
                  "the CPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--json", flags->json, "write the results as JSON");
  cmd->callback([flags] { RunEval(*flags); });
}

}  // namespace tqkv::cli
