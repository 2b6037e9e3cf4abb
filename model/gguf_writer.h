// Test-only: GGUF bytes written field by field, from the format's description (model/gguf.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tqkv::model {

class GgufWriter {
 public:
  template <typename T>
  GgufWriter& Put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof(T));
    return *this;
  }
  GgufWriter& Str(const std::string& s) {
    Put<uint64_t>(s.size());
    bytes.insert(bytes.end(), s.begin(), s.end());
    return *this;
  }
  void Align(size_t a) {
    while (bytes.size() % a != 0) bytes.push_back(0);
  }
  // Magic, version 3 and the two counts.
  GgufWriter& Header(uint64_t num_tensors, uint64_t num_metadata) {
    return Put<uint32_t>(0x46554747)
        .Put<uint32_t>(3)
        .Put<uint64_t>(num_tensors)
        .Put<uint64_t>(num_metadata);
  }
  GgufWriter& String(const std::string& key, const std::string& value) {
    return Str(key).Put<uint32_t>(8).Str(value);
  }
  GgufWriter& F32(const std::string& key, float value) {
    return Str(key).Put<uint32_t>(6).Put<float>(value);
  }
  GgufWriter& U32(const std::string& key, uint32_t value) {
    return Str(key).Put<uint32_t>(4).Put<uint32_t>(value);
  }
  GgufWriter& Ints(const std::string& key, const std::vector<int32_t>& values) {
    Str(key).Put<uint32_t>(9).Put<uint32_t>(5).Put<uint64_t>(values.size());
    for (int32_t v : values) Put<int32_t>(v);
    return *this;
  }
  GgufWriter& Strings(const std::string& key, const std::vector<std::string>& values) {
    Str(key).Put<uint32_t>(9).Put<uint32_t>(8).Put<uint64_t>(values.size());
    for (const std::string& v : values) Str(v);
    return *this;
  }
  std::vector<uint8_t> bytes;
};

}  // namespace tqkv::model
