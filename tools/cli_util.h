// Helpers shared by the tqkv subcommands that read and write safetensors files.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "attention/attention.h"
#include "attention/decode_cpu.h"
#include "quant/quantizer.h"
#include "runtime/safetensors.h"

namespace tqkv::cli {

// For uint64 flags (seeds): a decimal number from 0 to 2^64 - 1. CLI11 alone reads a larger one
// as 2^64 - 1 and a negative one through a floating-point range check.
const CLI::Validator& WholeUint64();

// Flags that select a quantizer, as given on the command line.
struct QuantizerFlags {
  std::string preset;
  int block_size = 16;
  std::string rotation = "hadamard";
  uint64_t seed = 0;
};

// Builds the quantizer for (flags, head_dim, num_kv_heads). An optional F32 tensor `rotation`
// [D, D] in `in` replaces --rotation (Πᵀ, used unchanged) and an optional F32 `centroids`
// [2^bits] replaces the built-in codebook.
Quantizer MakeQuantizer(const QuantizerFlags& flags, int head_dim, int num_kv_heads,
                        const SafetensorsFile& in);

// A float tensor (F32, F16 or BF16) of the given rank; throws naming the file and the tensor.
const Tensor& RequireFloatTensor(const SafetensorsFile& file, std::string_view name, int rank);

// Throws unless tensor.shape[dim] == expected, naming the file, the tensor and both sizes.
void RequireDim(const SafetensorsFile& file, std::string_view name, const Tensor& tensor, int dim,
                int64_t expected, std::string_view what);

// tensor.shape[dim] as an int; throws naming the file, the tensor and the dim when it does not fit.
int DimAsInt(const SafetensorsFile& file, std::string_view name, const Tensor& tensor, int dim,
             std::string_view what);

// The input tensors of `tqkv store`, checked by RequireStoreInputs: key and value F32, F16 or BF16
// [N, Hk, D] of one dtype and shape, slot_mapping I32 or I64 [N]. The pointers refer into the file.
struct StoreInputTensors {
  const Tensor* key = nullptr;
  const Tensor* value = nullptr;
  const Tensor* slot_mapping = nullptr;
  int head_dim = 0;      // D (MakeQuantizer checks the allowed values)
  int num_kv_heads = 0;  // Hk
};
StoreInputTensors RequireStoreInputs(const SafetensorsFile& in);

// The StoreInputs (host pointers into the tensors) of checked store inputs.
StoreInputs MakeStoreInputs(const StoreInputTensors& tensors);

// `tqkv store --num-blocks`: from 1 to 2^31 (block tables hold int32 ids).
void CheckNumBlocks(int64_t num_blocks, const BlockFormat& format);

// What `tqkv store` records in a cache file's metadata: preset, head_dim, num_kv_heads,
// block_size, rotation and rotation_id.
std::map<std::string, std::string, std::less<>> CacheMetadata(const Quantizer& q);

// A cache file written by `tqkv store` must be read (decode, store --cache-in) with the format and
// rotation it was written with: throws naming the file, the entry, both values and the flag that
// sets it. Entries the file does not have (a cache written elsewhere) are not checked.
void CheckCacheMetadata(const SafetensorsFile& cache_file, const Quantizer& q);

// `tqkv store --cache-in`: checks that `prev` has 'cache' U8 [num_blocks, block_bytes of `format`]
// and moves it out.
Tensor TakeStoreCache(SafetensorsFile& prev, int64_t num_blocks, const BlockFormat& format);

// The inputs of `tqkv decode`, checked by RequireDecodeInputs: 'cache' U8 [NB, block_bytes] from
// the cache file; query F32, F16 or BF16 [B, Hq, D], block_tables I32 [B, W] and seq_lens I32 [B]
// from the input file, or with query_start_loc I32 [B + 1] several new tokens per sequence: query
// [T, Hq, D] (attention/attention.h). The KV head count follows from block_bytes, the preset and
// block size of `flags`, and D. (DecodeCpu / AttentionCpu check the rest: GQA ratio, seq_lens,
// query starts, block ids.)
struct DecodeInputTensors {
  const Tensor* cache = nullptr;
  const Tensor* query = nullptr;
  const Tensor* block_tables = nullptr;
  const Tensor* seq_lens = nullptr;
  const Tensor* query_start_loc = nullptr;  // null: one query per sequence
  int num_tokens = 0;          // T: query rows (B without query_start_loc)
  int batch = 0;               // B
  int num_q_heads = 0;         // Hq
  int head_dim = 0;            // D
  int max_blocks_per_seq = 0;  // W
  int num_kv_heads = 0;        // Hk
};
DecodeInputTensors RequireDecodeInputs(const SafetensorsFile& cache_file, const SafetensorsFile& in,
                                       const QuantizerFlags& flags);

// The DecodeInputs of checked decode inputs; the query is converted to F32 into `query_f32`,
// which must outlive the result.
DecodeInputs MakeDecodeInputs(const DecodeInputTensors& tensors, std::optional<float> scale,
                              std::vector<float>& query_f32);

// The query starts of checked decode inputs that run as attention (AttentionArgs): the file's
// query_start_loc, or without one, one new token per sequence (0, 1, ..., B), for which every
// sequence needs a token: throws naming seq_lens[b] and `why` (what makes decode run as attention).
std::vector<int32_t> AttentionQueryStarts(const DecodeInputTensors& tensors, std::string_view why);

// The AttentionArgs of checked decode inputs (host pointers into the tensors and `query_start_loc`;
// the query in its own dtype, output F32), the output and lse left to the caller.
AttentionArgs MakeAttentionArgs(const DecodeInputTensors& tensors, const Quantizer& q,
                                std::span<const int32_t> query_start_loc,
                                std::optional<float> scale, int32_t sliding_window);

// Adds the quantizer-selecting flags to a subcommand.
void AddQuantizerFlags(CLI::App& cmd, QuantizerFlags& flags, bool block_size_required);

// The GGUF model `generate` and `eval` default to: tools/model/fetch_model.py's file, which
// tools/setup.sh fetches.
inline constexpr const char* kDefaultModel = ".models/SmolLM2-135M-Instruct.Q4_1.gguf";
// A model path as given, or for a relative path under `bazel run`, from the workspace (not the
// runfiles tree). Throws tqkv::Error naming --model when the file does not exist.
std::string ResolveModelPath(const std::string& path, std::string_view where);

}  // namespace tqkv::cli
