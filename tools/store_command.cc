// `tqkv store`: quantize K/V from a safetensors file into a paged cache (CPU reference).
#include <fmt/format.h>

#include "quant/quantizer.h"
#include "runtime/error.h"
#include "runtime/safetensors.h"
#include "tools/cli_util.h"
#include "tools/commands.h"

namespace tqkv::cli {
namespace {

struct StoreFlags {
  QuantizerFlags quant;
  int64_t num_blocks = 0;
  std::string in, cache_in, out;
};

void RunStore(const StoreFlags& flags) {
  const SafetensorsFile in = ReadSafetensors(flags.in);
  const Tensor& key = RequireFloatTensor(in, "key", 3);
  const Tensor& value = RequireFloatTensor(in, "value", 3);
  if (value.dtype != key.dtype || value.shape != key.shape) {
    throw Error(fmt::format("{}: tensor 'value' ({} [{}]) must match 'key' ({} [{}])",
                            in.source_name, DTypeName(value.dtype), fmt::join(value.shape, ", "),
                            DTypeName(key.dtype), fmt::join(key.shape, ", ")));
  }
  const Tensor& slots = in.at("slot_mapping");
  if ((slots.dtype != DType::kI32 && slots.dtype != DType::kI64) || slots.shape.size() != 1) {
    throw Error(fmt::format("{}: tensor 'slot_mapping' must be I32 or I64 [N]; it is {} [{}]",
                            in.source_name, DTypeName(slots.dtype), fmt::join(slots.shape, ", ")));
  }
  RequireDim(in, "slot_mapping", slots, 0, key.shape[0], "N, the tokens of 'key'");
  const Quantizer q = MakeQuantizer(flags.quant, static_cast<int>(key.shape[2]),
                                    static_cast<int>(key.shape[1]), in);
  const BlockFormat& f = q.format();
  if (flags.num_blocks < 1) throw InvalidArgument("tqkv store", "--num-blocks", flags.num_blocks, ">= 1");

  SafetensorsFile out;
  out.source_name = flags.out;
  Tensor cache;
  if (!flags.cache_in.empty()) {
    SafetensorsFile prev = ReadSafetensors(flags.cache_in);
    prev.Require("cache", DType::kU8, 2);
    cache = std::move(prev.tensors.at("cache"));
    RequireDim(prev, "cache", cache, 0, flags.num_blocks, "--num-blocks");
    RequireDim(prev, "cache", cache, 1, f.block_bytes,
               fmt::format("block_bytes of {} at D={}, H={}, block {}", f.block_bytes,
                           f.head_dim, f.num_kv_heads, f.block_size));
  } else {
    cache.dtype = DType::kU8;
    cache.shape = {flags.num_blocks, f.block_bytes};
    cache.data.assign(static_cast<size_t>(flags.num_blocks * f.block_bytes), 0);
  }
  StoreInputs inputs;
  inputs.key = key.data.data();
  inputs.value = value.data.data();
  inputs.dtype = key.dtype;
  inputs.slot_mapping = slots.data.data();
  inputs.slot_dtype = slots.dtype;
  inputs.num_tokens = key.shape[0];
  q.StoreCpu(inputs, {cache.data.data(), flags.num_blocks});
  out.tensors.emplace("cache", std::move(cache));
  out.metadata = {{"preset", std::string(q.preset().name)},
                  {"head_dim", std::to_string(f.head_dim)},
                  {"num_kv_heads", std::to_string(f.num_kv_heads)},
                  {"block_size", std::to_string(f.block_size)},
                  {"rotation", std::string(RotationKindName(q.rotation().kind))},
                  {"rotation_id", fmt::format("{:016x}", q.rotation().id)}};
  WriteSafetensors(flags.out, out);
}

}  // namespace

void AddStoreCommand(CLI::App& app) {
  auto flags = std::make_shared<StoreFlags>();
  auto* cmd = app.add_subcommand(
      "store", "Quantize key/value [N, Hk, D] into a paged cache at slot_mapping [N] (CPU)");
  AddQuantizerFlags(*cmd, flags->quant, /*block_size_required=*/true);
  cmd->add_option("--num-blocks", flags->num_blocks, "blocks in the cache")->required();
  cmd->add_option("--in", flags->in, "safetensors with key, value, slot_mapping "
                                     "[, rotation, centroids]")
      ->required();
  cmd->add_option("--cache-in", flags->cache_in, "cache to update (default: a zero-filled one)");
  cmd->add_option("--out", flags->out, "safetensors to write with 'cache' U8 [NB, block_bytes]")
      ->required();
  cmd->callback([flags] { RunStore(*flags); });
}

}  // namespace tqkv::cli
