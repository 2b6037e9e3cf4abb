#include "tools/cli_util.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <optional>

#include "runtime/error.h"

namespace tqkv::cli {

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

Quantizer MakeQuantizer(const QuantizerFlags& flags, int head_dim, int num_kv_heads,
                        const SafetensorsFile& in) {
  const Preset& preset = PresetByName(flags.preset);
  MakeBlockFormat(preset, head_dim, num_kv_heads, flags.block_size);  // validate the shape first
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
    rotation = MakeRotation(ParseRotationKind(flags.rotation), head_dim, flags.seed);
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
  cmd.add_option("--seed", flags.seed, "seed of hadamard_signs / haar (default 0)");
}

}  // namespace tqkv::cli
