#include "quant/preset.h"

#include <fmt/format.h>

#include <array>

#include "runtime/error.h"

namespace tqkv {
namespace {

constexpr std::array<Preset, 4> kPresets = {{
    {"turboquant_k8v4", KeyCoding::kFp8, 8, 4, false},
    {"turboquant_4bit_nc", KeyCoding::kMse, 4, 4, true},
    {"turboquant_k3v4_nc", KeyCoding::kMse, 3, 4, true},
    {"turboquant_3bit_nc", KeyCoding::kMse, 3, 3, true},
}};

}  // namespace

std::span<const Preset> AllPresets() { return kPresets; }

std::string PresetNames() {
  std::string names;
  for (const Preset& p : kPresets) {
    if (!names.empty()) names += ", ";
    names += p.name;
  }
  return names;
}

const Preset& PresetByName(std::string_view name) {
  for (const Preset& p : kPresets) {
    if (p.name == name) return p;
  }
  throw InvalidArgument("PresetByName", "preset", fmt::format("\"{}\"", name), PresetNames());
}

}  // namespace tqkv
