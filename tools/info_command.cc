// `tqkv info`: version, CUDA support, devices, and the presets' sizes.
#include <fmt/format.h>

#include <memory>
#include <string>

#include "kvcache/cache_format.h"
#include "quant/block_format.h"
#include "quant/preset.h"
#include "runtime/device.h"
#include "runtime/error.h"
#include "runtime/version.h"
#include "tools/commands.h"

namespace tqkv::cli {
namespace {

void PrintInfo() {
  fmt::print("tqkv {}\n", kVersion);
  fmt::print("CUDA compiled in: {}\n", CudaCompiledIn() ? "yes" : "no");
  const auto devices = QueryDevices();
  if (devices.empty()) {
    fmt::print("CUDA devices: none\n");
  } else {
    fmt::print("CUDA devices: {}\n", devices.size());
    for (const auto& d : devices) {
      fmt::print("  [{}] {}: {} SMs, {:.1f} GiB, compute capability {}.{}, L2 {:.0f} MiB\n",
                 d.ordinal, d.name, d.sm_count,
                 static_cast<double>(d.total_memory_bytes) / (1 << 30), d.compute_major,
                 d.compute_minor, static_cast<double>(d.l2_cache_bytes) / (1 << 20));
    }
  }

  fmt::print("\nPresets: bytes per token per KV head (K + V + metadata), compression vs bf16\n");
  fmt::print("{:<20} {:>6} {:>6} {:>13} {:>13} {:>13}\n", "preset", "K bits", "V bits", "D=64",
             "D=128", "D=256");
  auto row = [](std::string_view name, std::string_view kbits, std::string_view vbits,
                auto bytes_for) {
    std::string cells;
    for (int d : kHeadDims) {
      const int bytes = bytes_for(d);
      cells += fmt::format(" {:>6} {:>5.2f}x", bytes, 4.0 * d / bytes);
    }
    fmt::print("{:<20} {:>6} {:>6}{}\n", name, kbits, vbits, cells);
  };
  row("bf16", "16", "16", [](int d) { return 4 * d; });
  for (const Preset& p : AllPresets()) {
    row(p.name, p.key_coding == KeyCoding::kFp8 ? "fp8" : fmt::format("{}", p.key_bits),
        fmt::format("{}", p.value_bits),
        [&](int d) { return MakeBlockFormat(p, d, 1, 16).slot_bytes; });
  }
}

}  // namespace

struct CapacityFlags {
  double memory_gib = 0;
  std::string preset = "turboquant_4bit_nc";
  int layers = 32, kv_heads = 8, head_dim = 128, block_size = 16;
};

void AddInfoCommand(CLI::App& app) {
  auto flags = std::make_shared<CapacityFlags>();
  auto* cmd = app.add_subcommand(
      "info", "Version, CUDA devices and preset sizes; with --memory, what fits in that memory");
  auto* memory =
      cmd->add_option("--memory", flags->memory_gib,
                      "KV-cache memory in GiB: print blocks and tokens that fit, next to "
                      "bf16")
          ->check(CLI::PositiveNumber);
  // The shape flags describe the capacity table: without --memory they would be ignored.
  cmd->add_option("--preset", flags->preset, "a preset, bf16 or fp16")
      ->capture_default_str()
      ->needs(memory);
  cmd->add_option("--layers", flags->layers, "layers")->capture_default_str()->needs(memory);
  cmd->add_option("--kv-heads", flags->kv_heads, "KV heads")->capture_default_str()->needs(memory);
  cmd->add_option("--head-dim", flags->head_dim, "head dim")->capture_default_str()->needs(memory);
  cmd->add_option("--block-size", flags->block_size, "tokens per block")
      ->capture_default_str()
      ->needs(memory);
  cmd->callback([flags] {
    std::string capacity;  // computed first: a bad flag is one error line, nothing else
    // Unset is 0; NaN fails the comparison; 2^33 GiB is 2^63 bytes.
    if (!(flags->memory_gib >= 0 && flags->memory_gib < 0x1p33)) {
      throw InvalidArgument("tqkv info", "--memory", flags->memory_gib, "0 (unset) to 2^33 GiB");
    }
    if (flags->memory_gib > 0) {
      capacity = FormatCapacityTable(ComputeCapacity(
          static_cast<int64_t>(flags->memory_gib * double(int64_t{1} << 30)), flags->preset,
          flags->layers, flags->kv_heads, flags->head_dim, flags->block_size));
    }
    PrintInfo();
    if (!capacity.empty()) fmt::print("\n{}", capacity);
  });
}

}  // namespace tqkv::cli
