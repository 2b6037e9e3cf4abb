// `tqkv generate`: a GGUF Llama model serving prompts with tqkv's KV cache (CPU or CUDA). The
// prompts arrive over time (--arrive-every), and a continuous-batching server (model/server.h) runs
// them together: chunked prefill through the block manager, prefix caching of a shared system
// prompt, one token per sequence and decode step (with --spec-tokens, the accepted drafts of
// prompt lookup and one more), preemption when the block pool runs short. Every layer's K/V are
// stored into the layer's paged cache and attended from there.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "model/cuda_engine.h"
#include "model/engine.h"
#include "model/gguf.h"
#include "model/llama.h"
#include "model/server.h"
#include "model/tokenizer.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "tools/cli_util.h"
#include "tools/commands.h"

namespace tqkv::cli {
namespace {

struct GenerateFlags {
  std::string model = kDefaultModel;
  std::vector<std::string> prompts = {"What is the capital of France?",
                                      "Write one sentence about the sea.",
                                      "Name three colors of the rainbow."};
  bool raw = false;  // prompts as plain text, not chat turns
  std::string system = "You are a helpful assistant. Answer briefly.";
  int max_tokens = 32;
  std::string preset = "turboquant_4bit_nc";
  int boundary_layers = 0;
  float temperature = 0.0f;
  uint64_t seed = 0;
  int step_tokens = 128;
  int max_running = 16;
  int arrive_every = 2;
  int32_t num_blocks = 0;
  std::string device = "cpu";
  int spec_tokens = 0;
};

void RunGenerate(const GenerateFlags& flags) {
  // (CLI11's range check lets NaN through.)
  if (!std::isfinite(flags.temperature)) {
    throw InvalidArgument("tqkv generate", "--temperature", flags.temperature, "0 to 100");
  }
  const std::string path = ResolveModelPath(flags.model, "tqkv generate");
  const model::GgufFile file = model::GgufFile::Open(path);
  const model::LlamaModel llama = model::LlamaModel::FromGguf(file);
  const model::Tokenizer tokenizer = model::Tokenizer::FromGguf(file);
  const bool chat = !flags.raw;
  // A chat turn ends at <|im_end|> or, should the model end its text there, at end-of-text.
  std::vector<int32_t> stops;
  for (const int32_t t : {chat ? tokenizer.Find("<|im_end|>") : -1, tokenizer.eos_id()}) {
    if (t >= 0 && std::find(stops.begin(), stops.end(), t) == stops.end()) stops.push_back(t);
  }
  if (stops.empty()) {
    Logger().warn(
        "tqkv generate: the model's tokenizer has no {}end-of-text token: every request runs to "
        "--max-tokens",
        chat ? "<|im_end|> or " : "");
  }

  std::vector<model::Request> requests;
  int32_t blocks = 1;  // the null block
  for (size_t i = 0; i < flags.prompts.size(); ++i) {
    const std::string text =
        chat ? fmt::format(
                   "<|im_start|>system\n{}<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                   "<|im_start|>assistant\n",
                   flags.system, flags.prompts[i])
             : flags.prompts[i];
    model::Request r;
    r.prompt = tokenizer.Encode(text, /*parse_special=*/chat);
    r.max_new_tokens = flags.max_tokens;
    r.sampling = {flags.temperature, flags.seed + i};
    r.stop_tokens = stops;
    blocks += static_cast<int32_t>((r.prompt.size() + flags.max_tokens + 15) / 16);
    requests.push_back(std::move(r));
  }
  // Default pool: every request at once without sharing (no preemption).
  const model::KvPolicy policy{flags.preset, flags.boundary_layers, 16,
                               flags.num_blocks > 0 ? flags.num_blocks : blocks};
  std::unique_ptr<model::Engine> engine;
  if (flags.device == "cuda") {
    engine = std::make_unique<model::CudaEngine>(llama, policy);
  } else {
    engine = std::make_unique<model::CpuEngine>(llama, policy);
  }
  model::ServerOptions options{flags.max_running, flags.step_tokens};
  options.spec_tokens = flags.spec_tokens;
  model::Server server(*engine, options);
  // Every request is checked before the first step, so that a bad one fails the run before any
  // other has run.
  for (size_t i = 0; i < requests.size(); ++i) {
    try {
      server.Check(requests[i]);
    } catch (const Error& e) {
      throw Error(
          fmt::format("tqkv generate: prompt {} of {}: {} (--max-tokens {}, --num-blocks {})",
                      i + 1, requests.size(), e.what(), flags.max_tokens, policy.num_blocks));
    }
  }
  const model::LlamaConfig& c = llama.config();
  fmt::print("{}: {} layers on {}, KV cache {}{}: {} bytes per token (bf16: {}), {} blocks of 16\n",
             std::filesystem::path(path).filename().string(), c.num_layers,
             flags.device == "cuda" ? "CUDA" : "the CPU", flags.preset,
             flags.boundary_layers > 0 ? fmt::format(" + bf16 x{}", flags.boundary_layers) : "",
             engine->kv_bytes_per_token(), c.num_layers * c.num_kv_heads * 4 * c.head_dim,
             engine->manager().Stats().num_blocks);

  const auto t0 = std::chrono::steady_clock::now();
  size_t next = 0;
  for (int step = 0; next < requests.size() || !server.idle(); ++step) {
    while (next < requests.size() && static_cast<int64_t>(next) * flags.arrive_every <= step) {
      server.Submit(requests[next++]);
    }
    server.Step();
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  for (size_t i = 0; i < requests.size(); ++i) {
    const model::Completion& done = server.completion(static_cast<int>(i));
    std::vector<int32_t> shown = done.tokens;
    if (!shown.empty() && std::find(stops.begin(), stops.end(), shown.back()) != stops.end()) {
      shown.pop_back();
    }
    fmt::print("\n> {}\n{}{}\n", flags.prompts[i], chat ? "" : flags.prompts[i],
               done.error.empty() ? tokenizer.Decode(shown) : "[failed: " + done.error + "]");
    fmt::print(
        "  [{} prompt tokens, {} from the prefix cache; {} new; first token after {:.2f} s, "
        "done after {:.2f} s; preempted {} times]\n",
        requests[i].prompt.size(), done.prefix_hit_tokens, done.tokens.size(),
        done.first_token_seconds, done.finish_seconds, done.preemptions);
  }
  const model::ServerStats& s = server.stats();
  fmt::print(
      "\n{} requests in {} steps, {:.2f} s: {} tokens generated ({:.1f} tokens/s), {} computed "
      "({} from the prefix cache), up to {} sequences per step, {} preemptions; model {:.2f} s, "
      "block manager and sampling {:.3f} s\n",
      requests.size(), s.steps, wall, s.generated_tokens,
      static_cast<double>(s.generated_tokens) / wall, s.computed_tokens, s.prefix_hit_tokens,
      s.max_batch_sequences, s.preemptions, s.compute_seconds, s.manager_seconds);
  if (flags.spec_tokens > 0) {
    fmt::print("speculative decoding (prompt lookup): {} drafts verified, {} accepted ({:.0f} %)\n",
               s.draft_tokens, s.accepted_drafts,
               s.draft_tokens > 0 ? 100.0 * s.accepted_drafts / s.draft_tokens : 0.0);
  }
  // A request that failed (its prompt and tokens need more blocks than the pool) fails the run.
  int failed = 0;
  std::string first;
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::string& error = server.completion(static_cast<int>(i)).error;
    if (error.empty()) continue;
    if (failed++ == 0) first = fmt::format("request {}: {}", i, error);
  }
  if (failed > 0) {
    throw Error(fmt::format("tqkv generate: {} of {} requests failed ({}); raise --num-blocks ({})",
                            failed, requests.size(), first, policy.num_blocks));
  }
}

}  // namespace

void AddGenerateCommand(CLI::App& app) {
  auto flags = std::make_shared<GenerateFlags>();
  CLI::App* cmd = app.add_subcommand(
      "generate",
      "Serve prompts with a GGUF Llama model on the CPU or CUDA, its KV cache in tqkv: continuous "
      "batching, chunked prefill, prefix caching, preemption, speculative decoding");
  cmd->add_option("--model", flags->model,
                  "GGUF file (tools/setup.sh fetches SmolLM2-135M-Instruct)")
      ->capture_default_str();
  cmd->add_option("--prompt", flags->prompts, "prompt (repeatable; default: three questions)");
  cmd->add_flag("--raw", flags->raw, "prompts as plain text (default: chat turns)");
  cmd->add_option("--system", flags->system, "the chat system prompt every request shares")
      ->capture_default_str();
  cmd->add_option("--max-tokens", flags->max_tokens, "new tokens per prompt at most")
      ->check(CLI::Range(1, 1 << 16))
      ->capture_default_str();
  cmd->add_option("--preset", flags->preset, "a TurboQuant preset or bf16")->capture_default_str();
  cmd->add_option("--boundary-layers", flags->boundary_layers, "bf16 layers at each end")
      ->capture_default_str();
  cmd->add_option("--temperature", flags->temperature, "0: greedy")
      ->check(CLI::Range(0.0, 100.0))
      ->capture_default_str();
  cmd->add_option("--seed", flags->seed, "sampling seed (request i uses seed + i)")
      ->check(WholeUint64())
      ->capture_default_str();
  cmd->add_option("--step-tokens", flags->step_tokens,
                  "tokens per step: decode rows, then prompt chunks")
      ->check(CLI::Range(1, 8192))
      ->capture_default_str();
  cmd->add_option("--max-running", flags->max_running, "sequences in flight")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--arrive-every", flags->arrive_every, "steps between prompt arrivals")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--num-blocks", flags->num_blocks,
                  "KV blocks of 16 tokens (0: room for every request at once)")
      ->check(CLI::Range(0, 1 << 24))
      ->capture_default_str();
  cmd->add_option("--spec-tokens", flags->spec_tokens,
                  "draft tokens per decoding sequence and step, from its own context (prompt "
                  "lookup), verified in the same step; 0: none")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  cmd->add_option("--device", flags->device, "cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  cmd->callback([flags] { RunGenerate(*flags); });
}

}  // namespace tqkv::cli
