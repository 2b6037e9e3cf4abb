#include "kvcache/cache_format.h"

#include <fmt/format.h>

#include "quant/preset.h"
#include "runtime/error.h"

namespace tqkv {

CacheFormat MakeCacheFormat(std::string_view name, int head_dim, int num_kv_heads,
                            int block_size) {
  CacheFormat f;
  f.name = std::string(name);
  f.head_dim = head_dim;
  f.num_kv_heads = num_kv_heads;
  f.block_size = block_size;
  if (name == kBf16FormatName || name == kFp16FormatName) {
    f.bf16 = true;
    f.bf16_format = MakeBf16BlockFormat(head_dim, num_kv_heads, block_size,
                                        name == kFp16FormatName ? DType::kF16 : DType::kBF16);
    f.block_bytes = f.bf16_format.block_bytes;
    f.slot_bytes = f.bf16_format.SlotBytes();
    return f;
  }
  const Preset* preset = nullptr;
  for (const Preset& p : AllPresets()) {
    if (p.name == name) preset = &p;
  }
  if (preset == nullptr) {
    throw InvalidArgument(
        "MakeCacheFormat", "format", fmt::format("\"{}\"", name),
        fmt::format("{}, {}, {}", kBf16FormatName, kFp16FormatName, PresetNames()));
  }
  f.turboquant = MakeBlockFormat(*preset, head_dim, num_kv_heads, block_size);
  f.block_bytes = f.turboquant.block_bytes;
  f.slot_bytes = f.turboquant.slot_bytes;
  return f;
}

CacheLayout CacheFormat::layout() const {
  if (bf16) return bf16_format.layout();
  // The preset's own name (static storage), not this struct's string.
  for (const Preset& p : AllPresets()) {
    if (p.name == name) return {p.name, head_dim, num_kv_heads, block_size};
  }
  return {{}, head_dim, num_kv_heads, block_size};  // not made by MakeCacheFormat: matches none
}

FormatTag MakeFormatTag(const CacheFormat& format, uint64_t rotation_id) {
  return FormatTag{format.name, format.head_dim, format.block_size, rotation_id};
}

namespace {

CapacityRow Row(const CacheFormat& f, int64_t memory_bytes, int num_layers) {
  CapacityRow r;
  r.format = f.name;
  r.block_bytes = f.block_bytes;
  r.bytes_per_block = f.block_bytes * num_layers;
  r.bytes_per_token = f.slot_bytes * f.num_kv_heads * num_layers;
  r.num_blocks = memory_bytes / r.bytes_per_block;
  r.num_tokens = r.num_blocks > 1 ? (r.num_blocks - 1) * f.block_size : 0;
  return r;
}

std::string Grouped(int64_t n) {  // 1234567 -> "1,234,567"
  std::string digits = fmt::format("{}", n < 0 ? -n : n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return n < 0 ? "-" + out : out;
}

}  // namespace

CapacityReport ComputeCapacity(int64_t memory_bytes, std::string_view format, int num_layers,
                               int num_kv_heads, int head_dim, int block_size) {
  constexpr const char* kWhere = "ComputeCapacity";
  if (memory_bytes < 0) throw InvalidArgument(kWhere, "memory_bytes", memory_bytes, ">= 0");
  if (num_layers < 1 || num_layers > 4096) {
    throw InvalidArgument(kWhere, "num_layers", num_layers, "1 to 4096");
  }
  const CacheFormat f = MakeCacheFormat(format, head_dim, num_kv_heads, block_size);
  const CacheFormat b = MakeCacheFormat(kBf16FormatName, head_dim, num_kv_heads, block_size);
  CapacityReport report;
  report.memory_bytes = memory_bytes;
  report.num_layers = num_layers;
  report.num_kv_heads = num_kv_heads;
  report.head_dim = head_dim;
  report.block_size = block_size;
  report.format = Row(f, memory_bytes, num_layers);
  report.bf16 = Row(b, memory_bytes, num_layers);
  // Per-token bytes, not the floored token counts: a ratio that does not depend on memory size.
  report.format.vs_bf16 =
      static_cast<double>(report.bf16.bytes_per_token) / report.format.bytes_per_token;
  return report;
}

std::string FormatCapacityTable(const CapacityReport& r) {
  std::string out = fmt::format(
      "KV cache capacity in {:.2f} GiB: {} layers, {} KV heads, head_dim {}, block size {}\n",
      static_cast<double>(r.memory_bytes) / (int64_t{1} << 30), r.num_layers, r.num_kv_heads,
      r.head_dim, r.block_size);
  out += fmt::format("{:<20} {:>13} {:>15} {:>15} {:>17} {:>8}\n", "format", "bytes/token",
                     "bytes/block", "blocks", "tokens", "vs bf16");
  auto row = [&](const CapacityRow& c) {
    out += fmt::format("{:<20} {:>13} {:>15} {:>15} {:>17} {:>7.2f}x\n", c.format,
                       Grouped(c.bytes_per_token), Grouped(c.bytes_per_block),
                       Grouped(c.num_blocks), Grouped(c.num_tokens), c.vs_bf16);
  };
  row(r.bf16);
  if (r.format.format != r.bf16.format) row(r.format);
  return out;
}

}  // namespace tqkv
