// The four TurboQuant presets (../shared/docs/TURBOQUANT.md, "Presets").
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace tqkv {

enum class KeyCoding {
  kFp8,  // FP8 E4M3FN per element, no rotation, no norm
  kMse,  // rotation + Lloyd-Max codebook, per-token norm
};

struct Preset {
  std::string_view name;
  KeyCoding key_coding;
  int key_bits;          // 8 for FP8; 3 or 4 for the codebook
  int value_bits;        // uniform min/max quantization of values: 3 or 4
  bool norm_correction;  // MSE presets: stored norm divided by the centroid vector's norm
};

// All presets, in the order of TURBOQUANT.md's table.
std::span<const Preset> AllPresets();

// The preset with this name; an unknown name throws tqkv::Error listing the valid names.
const Preset& PresetByName(std::string_view name);

// "turboquant_k8v4, turboquant_4bit_nc, ..." (for messages and --help).
std::string PresetNames();

}  // namespace tqkv
