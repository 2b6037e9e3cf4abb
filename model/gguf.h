// A reader for GGUF model files (llama.cpp's format, versions 2 and 3): the metadata, the tensor
// table, and each tensor's data dequantized to fp32 (F32, F16, BF16, Q4_0, Q4_1, Q8_0).
//
// The file is read into memory once; every length, count, dimension and offset is checked against
// the bytes that are there before it is used, and a file that breaks the format throws tqkv::Error
// naming the file, what was wrong and where (byte offset).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tqkv::model {

// Metadata value types (gguf_type).
enum class GgufType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

// Tensor element types (ggml_type) this reader knows; others are listed but not dequantized.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ8_0 = 8,
  kBF16 = 30,
};
std::string_view GgmlTypeName(uint32_t type);

struct GgufValue {
  GgufType type = GgufType::kU8;
  // Scalars: integers in `i` (unsigned ones too, when they fit) or `u`, floats in `f`.
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0.0;
  std::string s;
  // Arrays: the elements' type, and the elements packed by kind (a GgufValue per element took
  // ~100 bytes for each byte of a U8 array in the file).
  GgufType array_type = GgufType::kU8;
  std::vector<int64_t> ints;         // integers (as `i` above) and bools
  std::vector<double> floats;        // F32, F64
  std::vector<std::string> strings;  // strings
  std::vector<GgufValue> arrays;     // arrays of arrays
};

struct GgufTensor {
  std::string name;
  std::vector<int64_t> dims;  // ne[0] first: the fastest-varying (a row's length)
  uint32_t type = 0;          // ggml_type
  uint64_t offset = 0;        // from the start of the data section
  int64_t num_elements = 0;
  int64_t num_bytes = 0;
};

class GgufFile {
 public:
  // Reads and checks the whole file (every count and size within bounds, every tensor aligned,
  // inside the file and sharing no byte with another). Throws tqkv::Error.
  static GgufFile Open(const std::string& path);
  // The same from bytes in memory (`name` is used in messages).
  static GgufFile Parse(std::vector<uint8_t> bytes, std::string name);

  uint32_t version() const { return version_; }
  const std::string& name() const { return name_; }
  const std::unordered_map<std::string, GgufValue>& metadata() const { return metadata_; }
  const std::vector<GgufTensor>& tensors() const { return tensors_; }

  // Metadata lookups; each throws naming the key if it is missing or of another type.
  const GgufValue* Find(std::string_view key) const;
  std::string GetString(std::string_view key) const;
  int64_t GetInt(std::string_view key) const;                       // any integer type
  double GetFloat(std::string_view key) const;                      // F32 or F64
  std::vector<std::string> GetStrings(std::string_view key) const;  // array of strings
  std::vector<int64_t> GetInts(std::string_view key) const;         // array of integers
  std::vector<double> GetFloats(std::string_view key) const;        // array of floats

  const GgufTensor& Tensor(std::string_view name) const;  // throws if absent
  bool HasTensor(std::string_view name) const;
  std::span<const uint8_t> TensorBytes(const GgufTensor& t) const;
  // The tensor's elements as fp32, in storage order (ne[0] fastest). Throws for a type it cannot
  // dequantize.
  std::vector<float> Dequantize(const GgufTensor& t) const;

 private:
  std::string name_;
  std::vector<uint8_t> bytes_;
  uint32_t version_ = 0;
  uint64_t data_offset_ = 0;
  std::unordered_map<std::string, GgufValue> metadata_;
  std::vector<GgufTensor> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

// Dequantizes `count` elements of `type` from `src` (whole blocks; count a multiple of the block
// size). Exposed for tests.
void DequantizeRow(uint32_t type, const uint8_t* src, int64_t count, float* dst);

}  // namespace tqkv::model
