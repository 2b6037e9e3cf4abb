#include "tools/cli_util.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>
#include <utility>

#include "runtime/error.h"

namespace tqkv::cli {

const CLI::Validator& WholeUint64() {
  static const CLI::Validator validator(
      [](std::string& v) -> std::string {
        uint64_t x = 0;
        const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
        if (v.empty() || ec != std::errc() || end != v.data() + v.size()) {
          return fmt::format("{} is not a whole number from 0 to {}", v,
                             std::numeric_limits<uint64_t>::max());
        }
        return {};
      },
      "UINT64");
  return validator;
}

const Tensor& RequireFloatTensor(const SafetensorsFile& file, std::string_view name, int rank) {
  const Tensor& t = file.at(name);
  if (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16) {
    throw Error(fmt::format("{}: tensor '{}' has dtype {}; allowed: F32, F16, BF16",
                            file.source_name, name, DTypeName(t.dtype)));
  }
  if (static_cast<int>(t.shape.size()) != rank) {
    throw Error(fmt::format("{}: tensor '{}' has shape [{}]; allowed: {} dims", file.source_name,
                            name, fmt::join(t.shape, ", "), rank));
  }
  return t;
}

void RequireDim(const SafetensorsFile& file, std::string_view name, const Tensor& tensor, int dim,
                int64_t expected, std::string_view what) {
  if (tensor.shape[dim] != expected) {
    throw Error(fmt::format("{}: tensor '{}' has shape [{}]; dim {} must be {} ({})",
                            file.source_name, name, fmt::join(tensor.shape, ", "), dim, expected,
                            what));
  }
}

int DimAsInt(const SafetensorsFile& file, std::string_view name, const Tensor& tensor, int dim,
             std::string_view what) {
  const int64_t size = tensor.shape[dim];
  if (size > std::numeric_limits<int>::max()) {
    throw Error(fmt::format("{}: tensor '{}' has shape [{}]; dim {} ({}) must be at most {}",
                            file.source_name, name, fmt::join(tensor.shape, ", "), dim, what,
                            std::numeric_limits<int>::max()));
  }
  return static_cast<int>(size);
}

StoreInputTensors RequireStoreInputs(const SafetensorsFile& in) {
  StoreInputTensors t;
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
  t.key = &key;
  t.value = &value;
  t.slot_mapping = &slots;
  t.num_kv_heads = DimAsInt(in, "key", key, 1, "Hk, the KV heads");
  t.head_dim = DimAsInt(in, "key", key, 2, "D, the head dim");
  return t;
}

StoreInputs MakeStoreInputs(const StoreInputTensors& t) {
  StoreInputs inputs;
  inputs.key = t.key->data.data();
  inputs.value = t.value->data.data();
  inputs.dtype = t.key->dtype;
  inputs.slot_mapping = t.slot_mapping->data.data();
  inputs.slot_dtype = t.slot_mapping->dtype;
  inputs.num_tokens = t.key->shape[0];
  return inputs;
}

void CheckNumBlocks(int64_t num_blocks, const BlockFormat& f) {
  constexpr int64_t kMaxBlocks = int64_t{std::numeric_limits<int32_t>::max()} + 1;
  if (num_blocks < 1 || num_blocks > kMaxBlocks) {
    throw InvalidArgument(
        "tqkv store", "--num-blocks", num_blocks,
        fmt::format("1 to {} (int32 block ids; blocks of {} bytes)", kMaxBlocks, f.block_bytes));
  }
}

std::map<std::string, std::string, std::less<>> CacheMetadata(const Quantizer& q) {
  const BlockFormat& f = q.format();
  return {{"preset", std::string(q.preset().name)},
          {"head_dim", std::to_string(f.head_dim)},
          {"num_kv_heads", std::to_string(f.num_kv_heads)},
          {"block_size", std::to_string(f.block_size)},
          {"rotation", std::string(RotationKindName(q.rotation().kind))},
          {"rotation_id", fmt::format("{:016x}", q.rotation().id)}};
}

void CheckCacheMetadata(const SafetensorsFile& cache_file, const Quantizer& q) {
  const auto ours = CacheMetadata(q);
  // In this order, so that the first difference reported is the one to fix.
  constexpr std::pair<const char*, const char*> kEntries[] = {
      {"preset", "--preset"},
      {"block_size", "--block-size"},
      {"head_dim", "the query's or key's head_dim"},
      {"num_kv_heads", "the KV heads of the key, or the cache's block_bytes"},
      {"rotation", "--rotation, or a 'rotation' tensor"},
      {"rotation_id", "--rotation and --seed, or the 'rotation' tensor"}};
  for (const auto& [entry, source] : kEntries) {
    const auto it = cache_file.metadata.find(entry);
    if (it == cache_file.metadata.end()) continue;
    const std::string& want = ours.find(entry)->second;
    if (it->second != want) {
      throw Error(fmt::format(
          "{}: the cache was written with {} {}, and this run has {} {} (from {}); run with the "
          "flags it was stored with",
          cache_file.source_name, entry, it->second, entry, want, source));
    }
  }
}

Tensor TakeStoreCache(SafetensorsFile& prev, int64_t num_blocks, const BlockFormat& f) {
  prev.Require("cache", DType::kU8, 2);
  Tensor cache = std::move(prev.tensors.at("cache"));
  RequireDim(prev, "cache", cache, 0, num_blocks, "--num-blocks");
  RequireDim(prev, "cache", cache, 1, f.block_bytes,
             fmt::format("block_bytes of {} at D={}, H={}, block {}", f.block_bytes, f.head_dim,
                         f.num_kv_heads, f.block_size));
  return cache;
}

DecodeInputTensors RequireDecodeInputs(const SafetensorsFile& cache_file, const SafetensorsFile& in,
                                       const QuantizerFlags& flags) {
  DecodeInputTensors t;
  const Tensor& cache = cache_file.Require("cache", DType::kU8, 2);
  const Tensor& query = RequireFloatTensor(in, "query", 3);
  const Tensor& tables = in.Require("block_tables", DType::kI32, 2);
  const Tensor& lens = in.Require("seq_lens", DType::kI32, 1);
  const bool varlen = in.contains("query_start_loc");
  const int64_t batch = varlen ? lens.shape[0] : query.shape[0];
  if (varlen) {
    const Tensor& loc = in.Require("query_start_loc", DType::kI32, 1);
    RequireDim(in, "query_start_loc", loc, 0, batch + 1, "B + 1, the sequences of 'seq_lens' + 1");
    RequireDim(in, "block_tables", tables, 0, batch, "B, the sequences of 'seq_lens'");
    t.query_start_loc = &loc;
    t.batch = DimAsInt(in, "seq_lens", lens, 0, "B, the sequences");
  } else {
    RequireDim(in, "block_tables", tables, 0, batch, "B, the sequences of 'query'");
    RequireDim(in, "seq_lens", lens, 0, batch, "B, the sequences of 'query'");
    t.batch = DimAsInt(in, "query", query, 0, "B, the sequences");
  }
  t.num_tokens = DimAsInt(in, "query", query, 0, "T, the query rows");
  t.cache = &cache;
  t.query = &query;
  t.block_tables = &tables;
  t.seq_lens = &lens;
  t.num_q_heads = DimAsInt(in, "query", query, 1, "Hq, the query heads");
  t.head_dim = DimAsInt(in, "query", query, 2, "D, the head dim");
  t.max_blocks_per_seq = DimAsInt(in, "block_tables", tables, 1, "W, the blocks per sequence");
  // (Empty, they have no data: the reference would report a null pointer, not which tensor.)
  for (const auto& [file, name, tensor, dim, what] :
       {std::tuple{&cache_file, "cache", &cache, 0, "NB, the cache's blocks"},
        std::tuple{&in, "block_tables", &tables, 1, "W, the blocks per sequence"}}) {
    if (tensor->shape[dim] < 1) {
      throw Error(fmt::format("{}: tensor '{}' has shape [{}]; dim {} ({}) must be at least 1",
                              file->source_name, name, fmt::join(tensor->shape, ", "), dim, what));
    }
  }

  // The KV head count follows from the cache's block_bytes.
  const Preset& preset = PresetByName(flags.preset);
  const int64_t per_head_block =
      int64_t{MakeBlockFormat(preset, t.head_dim, 1, flags.block_size).block_bytes};
  const int64_t block_bytes = cache.shape[1];
  if (block_bytes % per_head_block != 0) {
    throw Error(fmt::format(
        "{}: cache block_bytes {} is not a multiple of {} (one KV head of {} at D={}, block {}); "
        "check --preset, --block-size and the query's head_dim",
        cache_file.source_name, block_bytes, per_head_block, preset.name, t.head_dim,
        flags.block_size));
  }
  const int64_t num_kv_heads = block_bytes / per_head_block;
  if (num_kv_heads > kMaxKvHeads) {
    throw Error(fmt::format(
        "{}: cache block_bytes {} holds {} KV heads of {} bytes ({} at D={}, block {}); allowed: "
        "at most {}",
        cache_file.source_name, block_bytes, num_kv_heads, per_head_block, preset.name, t.head_dim,
        flags.block_size, kMaxKvHeads));
  }
  t.num_kv_heads = static_cast<int>(num_kv_heads);
  return t;
}

DecodeInputs MakeDecodeInputs(const DecodeInputTensors& t, std::optional<float> scale,
                              std::vector<float>& query_f32) {
  query_f32.resize(static_cast<size_t>(t.query->num_elements()));
  for (size_t i = 0; i < query_f32.size(); ++i) {
    query_f32[i] = LoadAsFloat(t.query->data.data(), t.query->dtype, static_cast<int64_t>(i));
  }
  DecodeInputs inputs;
  inputs.query = query_f32.data();
  inputs.num_seqs = t.batch;
  inputs.num_q_heads = t.num_q_heads;
  inputs.block_tables = t.block_tables->values<int32_t>().data();
  inputs.max_blocks_per_seq = t.max_blocks_per_seq;
  inputs.seq_lens = t.seq_lens->values<int32_t>().data();
  inputs.scale = scale;
  return inputs;
}

std::vector<int32_t> AttentionQueryStarts(const DecodeInputTensors& t, std::string_view why) {
  if (t.query_start_loc != nullptr) {
    const std::span<const int32_t> loc = t.query_start_loc->values<int32_t>();
    return {loc.begin(), loc.end()};
  }
  const std::span<const int32_t> lens = t.seq_lens->values<int32_t>();
  for (int b = 0; b < t.batch; ++b) {
    if (lens[static_cast<size_t>(b)] == 0) {
      throw InvalidArgument(
          "tqkv decode", fmt::format("seq_lens[{}]", b), 0,
          fmt::format(">= 1 where decode runs as attention of one new token per sequence ({})",
                      why));
    }
  }
  std::vector<int32_t> starts(static_cast<size_t>(t.batch) + 1);
  std::iota(starts.begin(), starts.end(), 0);
  return starts;
}

AttentionArgs MakeAttentionArgs(const DecodeInputTensors& t, const Quantizer& q,
                                std::span<const int32_t> query_start_loc,
                                std::optional<float> scale, int32_t sliding_window) {
  AttentionArgs a;
  a.query = t.query->data.data();
  a.query_dtype = t.query->dtype;
  a.num_seqs = t.batch;
  a.num_tokens = t.num_tokens;
  a.num_q_heads = t.num_q_heads;
  a.query_start_loc = query_start_loc.data();
  a.seq_lens = t.seq_lens->values<int32_t>().data();
  a.block_tables = t.block_tables->values<int32_t>().data();
  a.max_blocks_per_seq = t.max_blocks_per_seq;
  a.cache = {t.cache->data.data(), t.cache->shape[0], q.layout()};
  a.scale = scale;
  a.sliding_window = sliding_window;
  a.output_dtype = DType::kF32;
  return a;
}

Quantizer MakeQuantizer(const QuantizerFlags& flags, int head_dim, int num_kv_heads,
                        const SafetensorsFile& in) {
  const Preset& preset = PresetByName(flags.preset);
  MakeBlockFormat(preset, head_dim, num_kv_heads, flags.block_size);  // validate the shape first
  // Checked for FP8 keys too, which take no rotation: a misspelt flag is an error everywhere.
  const RotationKind kind = ParseRotationKind(flags.rotation);
  if (preset.key_coding == KeyCoding::kFp8) {
    return Quantizer(preset, head_dim, num_kv_heads, flags.block_size, Rotation{});
  }
  Rotation rotation;
  if (in.contains("rotation")) {
    const Tensor& r = in.Require("rotation", DType::kF32, 2);
    RequireDim(in, "rotation", r, 0, head_dim, "head_dim");
    RequireDim(in, "rotation", r, 1, head_dim, "head_dim");
    rotation = RotationFromMatrix(r.values<float>(), head_dim);
  } else {
    rotation = MakeRotation(kind, head_dim, flags.seed);
  }
  std::optional<Codebook> codebook;
  if (in.contains("centroids")) {
    const Tensor& c = in.Require("centroids", DType::kF32, 1);
    codebook = CodebookFromCentroids(c.values<float>(), preset.key_bits);
  }
  return Quantizer(preset, head_dim, num_kv_heads, flags.block_size, std::move(rotation),
                   std::move(codebook));
}

void AddQuantizerFlags(CLI::App& cmd, QuantizerFlags& flags, bool block_size_required) {
  cmd.add_option("--preset", flags.preset, "turboquant_k8v4, turboquant_4bit_nc, "
                                           "turboquant_k3v4_nc, turboquant_3bit_nc")
      ->required();
  auto* bs = cmd.add_option("--block-size", flags.block_size, "tokens per block: 16, 32, 64, 128");
  if (block_size_required) bs->required();
  cmd.add_option("--rotation", flags.rotation,
                 "hadamard (default), hadamard_signs, haar; a 'rotation' tensor in the input "
                 "file overrides it");
  cmd.add_option("--seed", flags.seed, "seed of hadamard_signs / haar (default 0)")
      ->check(WholeUint64());
}

std::string ResolveModelPath(const std::string& path, std::string_view where) {
  const char* ws = std::getenv("BUILD_WORKSPACE_DIRECTORY");
  const std::string resolved = ws == nullptr || std::filesystem::path(path).is_absolute()
                                   ? path
                                   : (std::filesystem::path(ws) / path).string();
  if (!std::filesystem::exists(resolved)) {
    throw InvalidArgument(where, "--model", resolved,
                          "an existing GGUF file (python3 tools/model/fetch_model.py fetches the "
                          "default)");
  }
  return resolved;
}

}  // namespace tqkv::cli
