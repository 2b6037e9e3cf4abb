// Reading and writing safetensors files.
//
// Format: an 8-byte little-endian uint64 header length N, N bytes of UTF-8 JSON header (possibly
// padded with trailing spaces), then the data buffer. The header is an object mapping each tensor
// name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data buffer), plus an
// optional "__metadata__" object of string -> string. Tensor data is little-endian.
//
// Everything read is untrusted: ParseSafetensors validates the whole header and every range before
// copying a byte, and every failure is a tqkv::Error naming the source, the tensor, the offending
// value and what is allowed. Tensors are copied out, so a parsed SafetensorsFile owns its data and
// does not refer to the input.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "runtime/dtype.h"
#include "runtime/error.h"

namespace tqkv {

// The data buffer is little-endian and is copied to and from memory as is.
static_assert(std::endian::native == std::endian::little,
              "safetensors I/O assumes a little-endian host");

// DType, DTypeName (the on-disk name) and DTypeSize come from runtime/dtype.h.
// Inverse of DTypeName; any other name throws tqkv::Error listing the supported ones.
DType ParseDType(std::string_view name);

namespace detail {

// The C++ type that carries one element of each dtype in memory. F16 and BF16 have no native type
// here and are carried as their raw uint16_t bits, so uint16_t matches both.
template <typename T>
constexpr bool CarriesDType(DType dtype) {
  if constexpr (std::is_same_v<T, float>) return dtype == DType::kF32;
  if constexpr (std::is_same_v<T, uint16_t>) return dtype == DType::kF16 || dtype == DType::kBF16;
  if constexpr (std::is_same_v<T, int32_t>) return dtype == DType::kI32;
  if constexpr (std::is_same_v<T, int64_t>) return dtype == DType::kI64;
  if constexpr (std::is_same_v<T, uint8_t>) return dtype == DType::kU8;
  return false;
}

template <typename T>
constexpr bool kIsCarrier =
    std::is_same_v<T, float> || std::is_same_v<T, uint16_t> || std::is_same_v<T, int32_t> ||
    std::is_same_v<T, int64_t> || std::is_same_v<T, uint8_t>;

// "float (F32)", "uint16_t (F16 or BF16)", ... for error messages.
template <typename T>
std::string_view CarrierDescription() {
  if constexpr (std::is_same_v<T, float>) return "float (F32)";
  if constexpr (std::is_same_v<T, uint16_t>) return "uint16_t (F16 or BF16)";
  if constexpr (std::is_same_v<T, int32_t>) return "int32_t (I32)";
  if constexpr (std::is_same_v<T, int64_t>) return "int64_t (I64)";
  if constexpr (std::is_same_v<T, uint8_t>) return "uint8_t (U8)";
}

// Throws the dtype-mismatch error of Tensor::FromValues / Tensor::values.
[[noreturn]] void ThrowDTypeMismatch(std::string_view where, DType dtype,
                                     std::string_view requested);
// Throws Tensor::values' error for data that is not its shape's size.
[[noreturn]] void ThrowSizeMismatch(std::string_view where, size_t bytes, int64_t elements,
                                    size_t element_bytes);

}  // namespace detail

// A dense, row-major tensor that owns its little-endian bytes.
// Invariant kept by FromValues and by the reader (checked again by the writer, since the fields
// are public): data.size() == num_elements() * DTypeSize(dtype).
struct Tensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // {} is a scalar (one element); a 0 dim makes an empty tensor
  std::vector<uint8_t> data;

  // Product of the dims (1 for a scalar). Throws tqkv::Error for a negative dim or an element
  // count that overflows int64.
  int64_t num_elements() const;

  // Builds a tensor of `dtype` from values whose C++ type carries that dtype (see CarriesDType);
  // values.size() must equal the element count of `shape`.
  template <typename T>
  static Tensor FromValues(DType dtype, std::vector<int64_t> shape, std::span<const T> values);

  // The data as elements of T; T must carry this tensor's dtype, otherwise tqkv::Error names both.
  // The span points into `data` and lives as long as it is not resized.
  template <typename T>
  std::span<const T> values() const;
};

// The contents of one safetensors file. Tensors are kept in name order, which is also the order
// the writer lays them out in.
struct SafetensorsFile {
  std::map<std::string, Tensor, std::less<>> tensors;
  std::map<std::string, std::string, std::less<>> metadata;
  // Where the contents came from (a path, or the name given to ParseSafetensors); used in error
  // messages of the lookup helpers.
  std::string source_name;

  bool contains(std::string_view name) const { return tensors.find(name) != tensors.end(); }
  // Throws tqkv::Error "<source>: no tensor named 'name'; present: a, b, c" when absent.
  const Tensor& at(std::string_view name) const;
  // at(name), and also checks the dtype and the number of dims, throwing tqkv::Error naming the
  // tensor, what it has and what was required.
  const Tensor& Require(std::string_view name, DType dtype, int64_t rank) const;
};

// Headers larger than this are rejected as corrupt before anything is allocated for them (the
// same limit as the reference implementation).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// Parses and validates a complete safetensors file held in memory. `source_name` prefixes every
// error message and becomes SafetensorsFile::source_name.
SafetensorsFile ParseSafetensors(std::span<const uint8_t> bytes, std::string_view source_name);

// The bytes of a safetensors file: header with "__metadata__" first (omitted when empty), then the
// tensors in name order; the header is padded with spaces so the data buffer starts at a multiple
// of 8 bytes, and tensors are stored contiguously in name order. Throws tqkv::Error for a tensor
// whose data size does not match its shape and dtype, or for a name "__metadata__".
std::vector<uint8_t> SerializeSafetensors(const SafetensorsFile& file);

// Reads the whole file at `path` and parses it (errors are prefixed with the path).
SafetensorsFile ReadSafetensors(const std::string& path);

// Serializes `file` and writes it to `path` through a temporary file in the same directory that is
// renamed over `path` only once fully written, so a failure (tqkv::Error) leaves neither a partial
// file nor a temporary behind, and an existing file at `path` is either fully replaced or kept.
void WriteSafetensors(const std::string& path, const SafetensorsFile& file);

// Writes `bytes` to `path` all or nothing (WriteSafetensors' way): a temporary file next to it,
// flushed, then renamed over it; through a symbolic link its target; never over something that
// is not a regular file. Throws tqkv::Error prefixed with `where`, leaving `path` as it was.
void WriteFileAtomically(const std::string& path, std::span<const uint8_t> bytes,
                         std::string_view where);

// ---------------------------------------------------------------------------------------------
// Template definitions.

template <typename T>
Tensor Tensor::FromValues(DType dtype, std::vector<int64_t> shape, std::span<const T> values) {
  static_assert(detail::kIsCarrier<T>,
                "element type must be float, uint16_t, int32_t, int64_t or uint8_t");
  if (!detail::CarriesDType<T>(dtype)) {
    detail::ThrowDTypeMismatch("Tensor::FromValues", dtype, detail::CarrierDescription<T>());
  }
  Tensor tensor;
  tensor.dtype = dtype;
  tensor.shape = std::move(shape);
  const int64_t count = tensor.num_elements();
  if (static_cast<int64_t>(values.size()) != count) {
    throw InvalidArgument("Tensor::FromValues", "values.size()", values.size(),
                          fmt::format("{} (the element count of the shape)", count));
  }
  tensor.data.resize(values.size_bytes());
  if (!values.empty()) std::memcpy(tensor.data.data(), values.data(), values.size_bytes());
  return tensor;
}

template <typename T>
std::span<const T> Tensor::values() const {
  static_assert(detail::kIsCarrier<T>,
                "element type must be float, uint16_t, int32_t, int64_t or uint8_t");
  if (!detail::CarriesDType<T>(dtype)) {
    detail::ThrowDTypeMismatch("Tensor::values", dtype, detail::CarrierDescription<T>());
  }
  // A tensor built or changed by hand may hold other than its shape's bytes: not cut short here.
  if (static_cast<int64_t>(data.size()) != num_elements() * static_cast<int64_t>(sizeof(T))) {
    detail::ThrowSizeMismatch("Tensor::values", data.size(), num_elements(), sizeof(T));
  }
  // The bytes come from operator new (aligned for every carrier type) and are only ever written
  // through memcpy or uint8_t, which may alias any type, so viewing them as T is sound in practice.
  return {reinterpret_cast<const T*>(data.data()), data.size() / sizeof(T)};
}

}  // namespace tqkv
