// libFuzzer target: the input checks of `tqkv store` and `tqkv decode` (tools/cli_util.h), then
// the CPU reference store, decode or attention they guard, on arbitrary bytes. As in `tqkv
// decode`, a file with query_start_loc (several new tokens per sequence), or a sliding window,
// runs AttentionCpu, else DecodeCpu.
//
// Input: an 8-byte prefix standing in for the command-line flags, then a safetensors file that
// stands in for --in (and for --cache-in / --cache: its 'cache' tensor).
//   byte 0: bit 0 command (0 store, 1 decode); bits 1-2 preset (AllPresets() order);
//           bits 3-4 block size 16/32/64/128; bits 5-6 --rotation hadamard, hadamard_signs,
//           haar, or an invalid name; bit 7: store takes the cache from the file (--cache-in),
//           decode passes --scale
//   byte 1: --num-blocks of store (0 to 3)
//   byte 2: --seed
//   byte 3: --sliding-window of decode (0: none)
//   bytes 4-7: --scale of decode (a little-endian float)
// A tqkv::Error is the expected rejection of bad input. Anything else fails: any other exception,
// a crash, a failed TQKV_CHECK, a sanitizer report or a leak. Built and run by tools/fuzz/run.sh.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

#include "attention/attention_cpu.h"
#include "attention/decode_cpu.h"
#include "quant/preset.h"
#include "quant/quantizer.h"
#include "runtime/error.h"
#include "runtime/safetensors.h"
#include "tools/cli_util.h"

namespace {

using namespace tqkv;

// Zero-filled caches above this size are skipped (fuzzer memory, not a library limit).
constexpr int64_t kMaxCacheBytes = int64_t{16} << 20;

void Store(const cli::QuantizerFlags& flags, int64_t num_blocks, bool cache_from_file,
           const SafetensorsFile& in) {
  const cli::StoreInputTensors tensors = cli::RequireStoreInputs(in);
  const Quantizer q = cli::MakeQuantizer(flags, tensors.head_dim, tensors.num_kv_heads, in);
  const BlockFormat& f = q.format();
  cli::CheckNumBlocks(num_blocks, f);
  Tensor cache;
  if (cache_from_file) {
    SafetensorsFile prev = in;
    cache = cli::TakeStoreCache(prev, num_blocks, f);
  } else {
    if (num_blocks * f.block_bytes > kMaxCacheBytes) return;
    cache.data.assign(static_cast<size_t>(num_blocks * f.block_bytes), 0);
  }
  q.StoreCpu(cli::MakeStoreInputs(tensors), {cache.data.data(), num_blocks, q.layout()});
}

void Decode(const cli::QuantizerFlags& flags, std::optional<float> scale, int32_t window,
            const SafetensorsFile& in) {
  const cli::DecodeInputTensors tensors = cli::RequireDecodeInputs(in, in, flags);
  const Quantizer q = cli::MakeQuantizer(flags, tensors.head_dim, tensors.num_kv_heads, in);
  if (tensors.query_start_loc != nullptr || window > 0) {
    const std::vector<int32_t> loc = cli::AttentionQueryStarts(tensors, "--sliding-window");
    const size_t rows = static_cast<size_t>(int64_t{tensors.num_tokens} * tensors.num_q_heads);
    std::vector<float> output(rows * static_cast<size_t>(tensors.head_dim)), lse(rows);
    AttentionArgs a = cli::MakeAttentionArgs(tensors, q, loc, scale, window);
    a.output = output.data();
    a.lse = lse.data();
    AttentionCpu(q, a);
    return;
  }
  std::vector<float> query_f32;
  const DecodeInputs inputs = cli::MakeDecodeInputs(tensors, scale, query_f32);
  std::vector<float> output(query_f32.size());
  std::vector<float> lse(static_cast<size_t>(int64_t{tensors.batch} * tensors.num_q_heads));
  DecodeCpu(q, {tensors.cache->data.data(), tensors.cache->shape[0], q.layout()}, inputs,
            {output.data(), lse.data()});
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr size_t kPrefix = 8;
  if (size < kPrefix) return 0;
  const uint8_t mode = data[0];
  const bool decode = mode & 1;
  const std::span<const Preset> presets = AllPresets();
  cli::QuantizerFlags flags;
  flags.preset = std::string(presets[((mode >> 1) & 3) % presets.size()].name);
  flags.block_size = 16 << ((mode >> 3) & 3);
  static const char* const kRotations[] = {"hadamard", "hadamard_signs", "haar", "hadamard2"};
  flags.rotation = kRotations[(mode >> 5) & 3];
  flags.seed = data[2];
  const bool bit7 = mode & 0x80;
  const int64_t num_blocks = data[1] & 3;
  float scale_value;
  std::memcpy(&scale_value, data + 4, sizeof(float));
  const std::optional<float> scale = bit7 ? std::optional<float>(scale_value) : std::nullopt;

  try {
    const SafetensorsFile in = ParseSafetensors(
        std::span<const uint8_t>(data + kPrefix, size - kPrefix), "in.safetensors");
    if (decode) {
      Decode(flags, scale, data[3], in);
    } else {
      Store(flags, num_blocks, bit7, in);
    }
  } catch (const Error& e) {
    // Rejected with a clear error: fine. TQKV_FUZZ_VERBOSE=1 prints why (to check the seeds).
    if (std::getenv("TQKV_FUZZ_VERBOSE")) std::fprintf(stderr, "rejected: %s\n", e.what());
    return 0;
  }
  if (std::getenv("TQKV_FUZZ_VERBOSE")) std::fprintf(stderr, "accepted\n");
  return 0;
}
