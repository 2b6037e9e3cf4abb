// Test helper: recomputes what `tqkv store` and `tqkv decode` wrote, with the library's own
// reference (Quantizer::StoreCpu, DecodeCpu), and requires identical bytes and outputs.
//   cli_roundtrip_check PRESET BLOCK_SIZE NUM_BLOCKS ROTATION SEED STORE_IN CACHE_OUT QUERY_IN OUT
#include <fmt/format.h>

#include <cstdlib>
#include <cstring>

#include "attention/decode_cpu.h"
#include "quant/quantizer.h"
#include "runtime/safetensors.h"
#include "tools/cli_util.h"

int main(int argc, char** argv) {
  using namespace tqkv;
  if (argc != 10) {
    fmt::print(stderr,
               "usage: {} PRESET BLOCK_SIZE NUM_BLOCKS ROTATION SEED STORE_IN CACHE_OUT QUERY_IN "
               "OUT\n",
               argv[0]);
    return 2;
  }
  cli::QuantizerFlags flags;
  flags.preset = argv[1];
  flags.block_size = std::atoi(argv[2]);
  const int64_t num_blocks = std::atoll(argv[3]);
  flags.rotation = argv[4];
  flags.seed = std::strtoull(argv[5], nullptr, 10);
  const SafetensorsFile in = ReadSafetensors(argv[6]);
  const SafetensorsFile cache_out = ReadSafetensors(argv[7]);
  const SafetensorsFile query_in = ReadSafetensors(argv[8]);
  const SafetensorsFile decoded = ReadSafetensors(argv[9]);

  const Tensor& key = in.at("key");
  const Tensor& slots = in.at("slot_mapping");
  const Quantizer q =
      cli::MakeQuantizer(flags, static_cast<int>(key.shape[2]), static_cast<int>(key.shape[1]), in);
  std::vector<uint8_t> cache(static_cast<size_t>(num_blocks * q.format().block_bytes), 0);
  StoreInputs s;
  s.key = key.data.data();
  s.value = in.at("value").data.data();
  s.dtype = key.dtype;
  s.slot_mapping = slots.data.data();
  s.slot_dtype = slots.dtype;
  s.num_tokens = key.shape[0];
  q.StoreCpu(s, {cache.data(), num_blocks, q.layout()});
  if (cache != cache_out.at("cache").data) {
    fmt::print("FAIL: cache bytes written by tqkv store differ from Quantizer::StoreCpu\n");
    return 1;
  }

  const Tensor& query = query_in.at("query");
  DecodeInputs d;
  d.query = query.values<float>().data();
  d.num_seqs = static_cast<int>(query.shape[0]);
  d.num_q_heads = static_cast<int>(query.shape[1]);
  d.block_tables = query_in.at("block_tables").values<int32_t>().data();
  d.max_blocks_per_seq = static_cast<int>(query_in.at("block_tables").shape[1]);
  d.seq_lens = query_in.at("seq_lens").values<int32_t>().data();
  std::vector<float> out(query.values<float>().size()), lse(d.num_seqs * d.num_q_heads);
  DecodeCpu(q, {cache.data(), num_blocks, q.layout()}, d, {out.data(), lse.data()});
  const auto got_out = decoded.at("output").values<float>();
  const auto got_lse = decoded.at("lse").values<float>();
  if (got_out.size() != out.size() ||
      std::memcmp(got_out.data(), out.data(), out.size() * 4) != 0 ||
      got_lse.size() != lse.size() ||
      std::memcmp(got_lse.data(), lse.data(), lse.size() * 4) != 0) {
    fmt::print("FAIL: output/lse written by tqkv decode differ from DecodeCpu\n");
    return 1;
  }
  fmt::print("ok: {} cache bytes and {} outputs match the library reference\n", cache.size(),
             out.size() + lse.size());
  return 0;
}
