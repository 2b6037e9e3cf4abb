// Helpers shared by the tqkv subcommands that read and write safetensors files.
#pragma once

#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>

#include "quant/quantizer.h"
#include "runtime/safetensors.h"

namespace tqkv::cli {

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

// Adds the quantizer-selecting flags to a subcommand.
void AddQuantizerFlags(CLI::App& cmd, QuantizerFlags& flags, bool block_size_required);

}  // namespace tqkv::cli
