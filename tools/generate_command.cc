// `tqkv generate`: a GGUF Llama model generating text on the CPU with tqkv's KV cache: each prompt
// prefilled in chunks through the block manager, then one token per decode step, every layer's K/V
// stored into the layer's paged cache and attended from there.
#include <fmt/format.h>

#include <memory>
#include <string>
#include <vector>

#include "model/engine.h"
#include "model/gguf.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "tools/commands.h"

namespace tqkv::cli {
namespace {

struct GenerateFlags {
  std::string model;
  std::vector<std::string> prompts = {"The capital of France is"};
  int max_tokens = 32;
  std::string preset = "turboquant_4bit_nc";
  int boundary_layers = 0;
  float temperature = 0.0f;
  uint64_t seed = 0;
  int chunk = 128;
  bool chat = false;
};

void RunGenerate(const GenerateFlags& flags) {
  const model::GgufFile file = model::GgufFile::Open(flags.model);
  const model::LlamaModel llama = model::LlamaModel::FromGguf(file);
  const model::Tokenizer tokenizer = model::Tokenizer::FromGguf(file);
  model::CpuEngine engine(llama, {flags.preset, flags.boundary_layers, 16, 0});
  const int32_t stop = flags.chat ? tokenizer.Find("<|im_end|>") : tokenizer.eos_id();
  fmt::print("{} on the CPU, KV cache {}{}: {} bytes per token (bf16: {})\n", flags.model,
             flags.preset,
             flags.boundary_layers > 0 ? fmt::format(" + bf16 x{}", flags.boundary_layers) : "",
             engine.kv_bytes_per_token(),
             llama.config().num_layers * llama.config().num_kv_heads * 4 * llama.config().head_dim);
  for (const std::string& prompt : flags.prompts) {
    const std::string text =
        flags.chat ? fmt::format("<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", prompt)
                   : prompt;
    const std::vector<int32_t> ids = tokenizer.Encode(text, /*parse_special=*/flags.chat);
    const model::Generation g =
        engine.Generate(ids, flags.max_tokens, flags.chunk, {flags.temperature, flags.seed}, stop);
    std::vector<int32_t> shown = g.tokens;
    if (!shown.empty() && shown.back() == stop) shown.pop_back();
    fmt::print("\n> {}\n{}{}\n", prompt, flags.chat ? "" : prompt, tokenizer.Decode(shown));
    fmt::print(
        "  [{} prompt tokens ({} from the prefix cache) at {:.0f} tokens/s, {} new at "
        "{:.1f} tokens/s]\n",
        ids.size(), g.prefix_hit_tokens,
        static_cast<double>(ids.size() - g.prefix_hit_tokens) / g.prefill_seconds, g.tokens.size(),
        g.tokens.size() > 1 ? static_cast<double>(g.tokens.size() - 1) / g.decode_seconds : 0.0);
  }
}

}  // namespace

void AddGenerateCommand(CLI::App& app) {
  auto flags = std::make_shared<GenerateFlags>();
  CLI::App* cmd = app.add_subcommand(
      "generate",
      "Generate text with a GGUF Llama model on the CPU, its KV cache in tqkv (one prompt after "
      "another; no batching yet)");
  cmd->add_option("--model", flags->model,
                  "GGUF file (python3 tools/model/fetch_model.py fetches SmolLM2-135M)")
      ->required();
  cmd->add_option("--prompt", flags->prompts, "prompt (repeatable)")->capture_default_str();
  cmd->add_option("--max-tokens", flags->max_tokens, "new tokens per prompt at most")
      ->check(CLI::Range(0, 1 << 16))
      ->capture_default_str();
  cmd->add_option("--preset", flags->preset, "a TurboQuant preset or bf16")->capture_default_str();
  cmd->add_option("--boundary-layers", flags->boundary_layers, "bf16 layers at each end")
      ->capture_default_str();
  cmd->add_option("--temperature", flags->temperature, "0: greedy")
      ->check(CLI::Range(0.0, 100.0))
      ->capture_default_str();
  cmd->add_option("--seed", flags->seed, "sampling seed")->capture_default_str();
  cmd->add_option("--chunk", flags->chunk, "prefill chunk (tokens per step)")
      ->check(CLI::Range(1, 8192))
      ->capture_default_str();
  cmd->add_flag("--chat", flags->chat, "wrap each prompt in the model's chat turns");
  cmd->callback([flags] { RunGenerate(*flags); });
}

}  // namespace tqkv::cli
