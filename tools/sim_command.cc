// `tqkv sim`: the engine-shaped serving simulation (tools/sim.h).
#include <fmt/format.h>

#include <cstdint>
#include <span>
#include <string>

#include "runtime/error.h"
#include "runtime/safetensors.h"
#include "tools/cli_util.h"
#include "tools/commands.h"
#include "tools/sim.h"

namespace tqkv::cli {

void AddSimCommand(CLI::App& app) {
  auto config = std::make_shared<sim::SimConfig>();
  auto json = std::make_shared<std::string>();
  auto no_prefix = std::make_shared<bool>(false);
  auto* cmd = app.add_subcommand(
      "sim", "Serving simulation over the real block manager, store and decode (CPU or CUDA)");
  cmd->add_option("--layers", config->layers, "transformer layers")->capture_default_str();
  cmd->add_option("--q-heads", config->q_heads, "query heads")->capture_default_str();
  cmd->add_option("--kv-heads", config->kv_heads, "KV heads (must divide --q-heads)")
      ->capture_default_str();
  cmd->add_option("--head-dim", config->head_dim, "64, 128, 256")->capture_default_str();
  cmd->add_option("--preset", config->preset,
                  "turboquant_k8v4, turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_3bit_nc, "
                  "bf16 or fp16 (uncompressed)")
      ->capture_default_str();
  cmd->add_option("--block-size", config->block_size, "16, 32, 64, 128")->capture_default_str();
  cmd->add_option("--num-blocks", config->num_blocks,
                  "cache blocks (default: sized so that preemption happens)");
  cmd->add_option("--kv-memory", config->kv_memory_gib, "KV memory in GiB (instead of blocks)");
  cmd->add_option("--requests", config->requests, "requests")->capture_default_str();
  cmd->add_option("--prompt-len", config->prompt_len, "prompt tokens per request")
      ->capture_default_str();
  cmd->add_option("--shared-prefix", config->shared_prefix,
                  "system-prompt tokens every request shares")
      ->capture_default_str();
  cmd->add_option("--decode-len", config->decode_len, "generated tokens per branch")
      ->capture_default_str();
  cmd->add_option("--spec-tokens", config->spec_tokens,
                  "draft tokens verified per decoding sequence and step (0: none)")
      ->capture_default_str();
  cmd->add_option("--sliding-window", config->sliding_window,
                  "sliding-window attention: a token at position p attends to (p - W, p]; 0: "
                  "whole context")
      ->capture_default_str();
  cmd->add_option("--prefill-chunk", config->prefill_chunk, "prompt tokens per step")
      ->capture_default_str();
  cmd->add_option("--max-running", config->max_running, "sequences in flight")
      ->capture_default_str();
  cmd->add_option("--fork-fraction", config->fork_fraction,
                  "fraction of requests that fork a second branch (n = 2 sampling)")
      ->capture_default_str();
  cmd->add_option("--seed", config->seed, "seed of the workload and the activations")
      ->check(WholeUint64())
      ->capture_default_str();
  cmd->add_option("--device", config->device, "cpu (default) or cuda")->capture_default_str();
  cmd->add_flag("--no-prefix-caching", *no_prefix, "disable prefix caching");
  cmd->add_flag("--check", config->check_invariants,
                "check the block manager's invariants after every step");
  auto no_kernel_timing = std::make_shared<bool>(false);
  cmd->add_flag("--no-kernel-timing", *no_kernel_timing,
                "cuda: skip the pass that replays each step's stores and decodes from CUDA "
                "graphs to time the kernels alone");
  cmd->add_option("--json", *json, "also write the report as JSON to this path");
  cmd->callback([config, json, no_prefix, no_kernel_timing] {
    config->enable_prefix_caching = !*no_prefix;
    config->kernel_timing = !*no_kernel_timing;
    const sim::SimReport report = sim::RunSim(*config);
    fmt::print("{}", sim::FormatReport(*config, report));
    if (!json->empty()) {
      const std::string text = sim::ReportJson(*config, report);
      WriteFileAtomically(*json,
                          std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()),
                          "tqkv sim --json");
    }
  });
}

}  // namespace tqkv::cli
