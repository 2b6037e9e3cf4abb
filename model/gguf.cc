#include "model/gguf.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>

#include "quant/numerics.h"
#include "runtime/error.h"

namespace tqkv::model {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian uint32
constexpr uint64_t kDefaultAlignment = 32;
// Sanity bounds: far above any real file, low enough that a corrupt count cannot make the reader
// allocate unbounded memory before the bytes run out.
constexpr uint64_t kMaxDims = 4;
constexpr uint32_t kMaxArrayDepth = 2;

struct TypeLayout {
  int64_t block_elems;  // 0: unknown type
  int64_t block_bytes;
};

TypeLayout LayoutOf(uint32_t type) {
  switch (type) {
    case 0:
      return {1, 4};  // F32
    case 1:
      return {1, 2};  // F16
    case 2:
      return {32, 18};  // Q4_0
    case 3:
      return {32, 20};  // Q4_1
    case 6:
      return {32, 22};  // Q5_0
    case 7:
      return {32, 24};  // Q5_1
    case 8:
      return {32, 34};  // Q8_0
    case 9:
      return {32, 36};  // Q8_1
    case 10:
      return {256, 84};  // Q2_K
    case 11:
      return {256, 110};  // Q3_K
    case 12:
      return {256, 144};  // Q4_K
    case 13:
      return {256, 176};  // Q5_K
    case 14:
      return {256, 210};  // Q6_K
    case 15:
      return {256, 292};  // Q8_K
    case 24:
      return {1, 1};  // I8
    case 25:
      return {1, 2};  // I16
    case 26:
      return {1, 4};  // I32
    case 27:
      return {1, 8};  // I64
    case 28:
      return {1, 8};  // F64
    case 30:
      return {1, 2};  // BF16
    default:
      return {0, 0};
  }
}

bool CanDequantize(uint32_t type) {
  return type == 0 || type == 1 || type == 2 || type == 3 || type == 8 || type == 30;
}

// A bounds-checked cursor over the file's bytes.
class Reader {
 public:
  Reader(const std::vector<uint8_t>& bytes, const std::string& name) : b_(bytes), name_(name) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return b_.size() - pos_; }

  [[noreturn]] void Fail(std::string_view what) const {
    throw Error(fmt::format("GGUF file {}: {} (at byte {} of {})", name_, what, pos_, b_.size()));
  }
  void Need(uint64_t n, std::string_view what) const {
    if (n > remaining()) {
      Fail(fmt::format("truncated: {} needs {} bytes, {} left", what, n, remaining()));
    }
  }
  template <typename T>
  T Read(std::string_view what) {
    Need(sizeof(T), what);
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string ReadString(std::string_view what) {
    const auto n = Read<uint64_t>(what);
    Need(n, what);
    std::string s(reinterpret_cast<const char*>(b_.data() + pos_), n);
    pos_ += n;
    return s;
  }

 private:
  const std::vector<uint8_t>& b_;
  const std::string& name_;
  uint64_t pos_ = 0;
};

// Bytes one element of a scalar type takes in the file (for bounding array counts).
uint64_t ScalarBytes(GgufType t) {
  switch (t) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kBool:
      return 1;
    case GgufType::kU16:
    case GgufType::kI16:
      return 2;
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kF32:
      return 4;
    case GgufType::kU64:
    case GgufType::kI64:
    case GgufType::kF64:
    case GgufType::kString:
      return 8;  // at least its length field
    case GgufType::kArray:
      return 12;  // at least its type and count
  }
  return 1;
}

GgufValue ReadValue(Reader& r, uint32_t raw_type, const std::string& key, uint32_t depth) {
  if (raw_type > static_cast<uint32_t>(GgufType::kF64)) {
    r.Fail(fmt::format("metadata '{}' has unknown value type {}; allowed: 0 to 12", key, raw_type));
  }
  GgufValue v;
  v.type = static_cast<GgufType>(raw_type);
  switch (v.type) {
    case GgufType::kU8:
      v.u = r.Read<uint8_t>(key);
      v.i = static_cast<int64_t>(v.u);
      break;
    case GgufType::kI8:
      v.i = r.Read<int8_t>(key);
      break;
    case GgufType::kU16:
      v.u = r.Read<uint16_t>(key);
      v.i = static_cast<int64_t>(v.u);
      break;
    case GgufType::kI16:
      v.i = r.Read<int16_t>(key);
      break;
    case GgufType::kU32:
      v.u = r.Read<uint32_t>(key);
      v.i = static_cast<int64_t>(v.u);
      break;
    case GgufType::kI32:
      v.i = r.Read<int32_t>(key);
      break;
    case GgufType::kU64:
      v.u = r.Read<uint64_t>(key);
      v.i = v.u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                ? static_cast<int64_t>(v.u)
                : -1;
      break;
    case GgufType::kI64:
      v.i = r.Read<int64_t>(key);
      break;
    case GgufType::kF32:
      v.f = r.Read<float>(key);
      break;
    case GgufType::kF64:
      v.f = r.Read<double>(key);
      break;
    case GgufType::kBool: {
      const auto b = r.Read<uint8_t>(key);
      if (b > 1) r.Fail(fmt::format("metadata '{}': bool value {}; allowed: 0 or 1", key, b));
      v.i = b;
      break;
    }
    case GgufType::kString:
      v.s = r.ReadString(key);
      break;
    case GgufType::kArray: {
      if (depth >= kMaxArrayDepth) {
        r.Fail(fmt::format("metadata '{}': arrays nested deeper than {}", key, kMaxArrayDepth));
      }
      const auto elem = r.Read<uint32_t>(key);
      const auto count = r.Read<uint64_t>(key);
      if (elem > static_cast<uint32_t>(GgufType::kF64)) {
        r.Fail(fmt::format("metadata '{}': unknown array element type {}", key, elem));
      }
      v.array_type = static_cast<GgufType>(elem);
      if (count > r.remaining() / ScalarBytes(v.array_type)) {
        r.Fail(fmt::format("metadata '{}': array of {} elements does not fit in the file", key,
                           count));
      }
      // Reserved up to a bound: an element takes several times the bytes it needs in the file,
      // and a corrupt count should fail on its first bad element, not on the reservation.
      const size_t reserve = static_cast<size_t>(std::min<uint64_t>(count, uint64_t{1} << 20));
      switch (v.array_type) {
        case GgufType::kF32:
        case GgufType::kF64:
          v.floats.reserve(reserve);
          break;
        case GgufType::kString:
          v.strings.reserve(reserve);
          break;
        case GgufType::kArray:
          break;
        default:
          v.ints.reserve(reserve);
      }
      for (uint64_t k = 0; k < count; ++k) {
        GgufValue e = ReadValue(r, elem, key, depth + 1);
        switch (v.array_type) {
          case GgufType::kF32:
          case GgufType::kF64:
            v.floats.push_back(e.f);
            break;
          case GgufType::kString:
            v.strings.push_back(std::move(e.s));
            break;
          case GgufType::kArray:
            v.arrays.push_back(std::move(e));
            break;
          default:  // integers and bools
            v.ints.push_back(e.i);
        }
      }
      break;
    }
  }
  return v;
}

bool IsInteger(GgufType t) {
  switch (t) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kU16:
    case GgufType::kI16:
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kU64:
    case GgufType::kI64:
      return true;
    default:
      return false;
  }
}

float Bf16BitsToFloat(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }
float HalfAt(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return HalfBitsToFloat(h);
}

}  // namespace

std::string_view GgmlTypeName(uint32_t type) {
  switch (type) {
    case 0:
      return "F32";
    case 1:
      return "F16";
    case 2:
      return "Q4_0";
    case 3:
      return "Q4_1";
    case 6:
      return "Q5_0";
    case 7:
      return "Q5_1";
    case 8:
      return "Q8_0";
    case 9:
      return "Q8_1";
    case 10:
      return "Q2_K";
    case 11:
      return "Q3_K";
    case 12:
      return "Q4_K";
    case 13:
      return "Q5_K";
    case 14:
      return "Q6_K";
    case 15:
      return "Q8_K";
    case 24:
      return "I8";
    case 25:
      return "I16";
    case 26:
      return "I32";
    case 27:
      return "I64";
    case 28:
      return "F64";
    case 30:
      return "BF16";
    default:
      return "unknown";
  }
}

void DequantizeRow(uint32_t type, const uint8_t* src, int64_t count, float* dst) {
  switch (type) {
    case 0:
      std::memcpy(dst, src, static_cast<size_t>(count) * 4);
      return;
    case 1:
      for (int64_t i = 0; i < count; ++i) dst[i] = HalfAt(src + 2 * i);
      return;
    case 30:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        dst[i] = Bf16BitsToFloat(b);
      }
      return;
    case 2:  // Q4_0: d, 16 bytes; element j = (nibble j - 8) · d (low nibbles first)
      for (int64_t blk = 0; blk < count / 32; ++blk) {
        const uint8_t* b = src + 18 * blk;
        const float d = HalfAt(b);
        for (int j = 0; j < 16; ++j) {
          dst[32 * blk + j] = static_cast<float>((b[2 + j] & 0x0F) - 8) * d;
          dst[32 * blk + j + 16] = static_cast<float>((b[2 + j] >> 4) - 8) * d;
        }
      }
      return;
    case 3:  // Q4_1: d, m, 16 bytes; element j = nibble j · d + m
      for (int64_t blk = 0; blk < count / 32; ++blk) {
        const uint8_t* b = src + 20 * blk;
        const float d = HalfAt(b), m = HalfAt(b + 2);
        for (int j = 0; j < 16; ++j) {
          dst[32 * blk + j] = static_cast<float>(b[4 + j] & 0x0F) * d + m;
          dst[32 * blk + j + 16] = static_cast<float>(b[4 + j] >> 4) * d + m;
        }
      }
      return;
    case 8:  // Q8_0: d, 32 signed bytes; element j = q_j · d
      for (int64_t blk = 0; blk < count / 32; ++blk) {
        const uint8_t* b = src + 34 * blk;
        const float d = HalfAt(b);
        for (int j = 0; j < 32; ++j) {
          dst[32 * blk + j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
        }
      }
      return;
    default:
      throw InvalidArgument("DequantizeRow", "type", GgmlTypeName(type),
                            "F32, F16, BF16, Q4_0, Q4_1 or Q8_0");
  }
}

GgufFile GgufFile::Open(const std::string& path) {
  // A directory "opens" and reports a size of 2^63 - 1 on some file systems.
  std::error_code error;
  if (std::filesystem::exists(path, error) && !std::filesystem::is_regular_file(path, error)) {
    throw Error(fmt::format("GGUF file {}: not a regular file", path));
  }
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw Error(fmt::format("GGUF file {}: cannot open", path));
  const std::streamsize size = in.tellg();
  if (size < 0) throw Error(fmt::format("GGUF file {}: cannot read its size", path));
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  in.seekg(0);
  if (size > 0 && !in.read(reinterpret_cast<char*>(bytes.data()), size)) {
    throw Error(fmt::format("GGUF file {}: read failed", path));
  }
  return Parse(std::move(bytes), path);
}

GgufFile GgufFile::Parse(std::vector<uint8_t> bytes, std::string name) {
  GgufFile f;
  f.name_ = std::move(name);
  f.bytes_ = std::move(bytes);
  Reader r(f.bytes_, f.name_);
  const auto magic = r.Read<uint32_t>("magic");
  if (magic != kMagic) r.Fail(fmt::format("magic {:#010x} is not 'GGUF'", magic));
  f.version_ = r.Read<uint32_t>("version");
  if (f.version_ != 2 && f.version_ != 3) {
    r.Fail(fmt::format("version {}; supported: 2 and 3", f.version_));
  }
  const auto num_tensors = r.Read<uint64_t>("tensor count");
  const auto num_kv = r.Read<uint64_t>("metadata count");
  // Each entry takes at least 12 (metadata) or 24 (tensor info) bytes.
  if (num_kv > r.remaining() / 12) r.Fail(fmt::format("metadata count {} too large", num_kv));
  for (uint64_t k = 0; k < num_kv; ++k) {
    std::string key = r.ReadString("metadata key");
    const auto type = r.Read<uint32_t>(key);
    GgufValue v = ReadValue(r, type, key, 0);
    if (!f.metadata_.emplace(key, std::move(v)).second) {
      r.Fail(fmt::format("metadata key '{}' appears twice", key));
    }
  }
  if (num_tensors > r.remaining() / 24) {
    r.Fail(fmt::format("tensor count {} too large", num_tensors));
  }
  uint64_t alignment = kDefaultAlignment;
  if (const GgufValue* a = f.Find("general.alignment")) {
    if (!IsInteger(a->type) || a->i <= 0 || (a->i & (a->i - 1)) != 0) {
      r.Fail(fmt::format("general.alignment {} is not a power of two", a->i));
    }
    alignment = static_cast<uint64_t>(a->i);
  }
  f.tensors_.reserve(num_tensors);
  for (uint64_t k = 0; k < num_tensors; ++k) {
    GgufTensor t;
    t.name = r.ReadString("tensor name");
    const auto n_dims = r.Read<uint32_t>(t.name);
    if (n_dims == 0 || n_dims > kMaxDims) {
      r.Fail(
          fmt::format("tensor '{}' has {} dimensions; allowed: 1 to {}", t.name, n_dims, kMaxDims));
    }
    t.num_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const auto n = r.Read<uint64_t>(t.name);
      if (n == 0 || n > (uint64_t{1} << 40) ||
          static_cast<uint64_t>(t.num_elements) > (uint64_t{1} << 50) / n) {
        r.Fail(fmt::format("tensor '{}' dimension {} = {} is out of range", t.name, d, n));
      }
      t.dims.push_back(static_cast<int64_t>(n));
      t.num_elements *= static_cast<int64_t>(n);
    }
    t.type = r.Read<uint32_t>(t.name);
    t.offset = r.Read<uint64_t>(t.name);
    const TypeLayout layout = LayoutOf(t.type);
    if (layout.block_elems == 0) {
      r.Fail(fmt::format("tensor '{}' has unknown type {}", t.name, t.type));
    }
    if (t.dims[0] % layout.block_elems != 0) {
      r.Fail(fmt::format("tensor '{}': row length {} is not a multiple of {}'s block of {}", t.name,
                         t.dims[0], GgmlTypeName(t.type), layout.block_elems));
    }
    t.num_bytes = t.num_elements / layout.block_elems * layout.block_bytes;
    if (t.offset % alignment != 0) {
      r.Fail(
          fmt::format("tensor '{}' offset {} is not aligned to {}", t.name, t.offset, alignment));
    }
    if (!f.tensor_index_.emplace(t.name, f.tensors_.size()).second) {
      r.Fail(fmt::format("tensor '{}' appears twice", t.name));
    }
    f.tensors_.push_back(std::move(t));
  }
  f.data_offset_ = (r.pos() + alignment - 1) / alignment * alignment;
  for (const GgufTensor& t : f.tensors_) {
    const uint64_t size = f.bytes_.size();
    if (f.data_offset_ > size || t.offset > size - f.data_offset_ ||
        static_cast<uint64_t>(t.num_bytes) > size - f.data_offset_ - t.offset) {
      throw Error(fmt::format(
          "GGUF file {}: tensor '{}' ({} bytes at data offset {}) lies past the end of the file "
          "({} bytes, data section at {})",
          f.name_, t.name, t.num_bytes, t.offset, size, f.data_offset_));
    }
  }
  // Each tensor's bytes are its own: two that share bytes would each read the other's data.
  std::vector<size_t> by_offset(f.tensors_.size());
  std::iota(by_offset.begin(), by_offset.end(), size_t{0});
  std::sort(by_offset.begin(), by_offset.end(),
            [&](size_t a, size_t b) { return f.tensors_[a].offset < f.tensors_[b].offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const GgufTensor& a = f.tensors_[by_offset[i - 1]];
    const GgufTensor& b = f.tensors_[by_offset[i]];
    if (b.offset - a.offset < static_cast<uint64_t>(a.num_bytes)) {
      throw Error(fmt::format(
          "GGUF file {}: tensor '{}' (data offset {}) begins inside tensor '{}' ({} bytes at data "
          "offset {}); each tensor must have bytes of its own",
          f.name_, b.name, b.offset, a.name, a.num_bytes, a.offset));
    }
  }
  return f;
}

const GgufValue* GgufFile::Find(std::string_view key) const {
  const auto it = metadata_.find(std::string(key));
  return it == metadata_.end() ? nullptr : &it->second;
}

namespace {
const GgufValue& Require(const GgufFile& f, std::string_view key) {
  const GgufValue* v = f.Find(key);
  if (v == nullptr) throw Error(fmt::format("GGUF file {}: no metadata '{}'", f.name(), key));
  return *v;
}
[[noreturn]] void WrongType(const GgufFile& f, std::string_view key, std::string_view wanted) {
  throw Error(fmt::format("GGUF file {}: metadata '{}' is not {}", f.name(), key, wanted));
}
}  // namespace

std::string GgufFile::GetString(std::string_view key) const {
  const GgufValue& v = Require(*this, key);
  if (v.type != GgufType::kString) WrongType(*this, key, "a string");
  return v.s;
}

int64_t GgufFile::GetInt(std::string_view key) const {
  const GgufValue& v = Require(*this, key);
  if (!IsInteger(v.type)) WrongType(*this, key, "an integer");
  if (v.type == GgufType::kU64 &&
      v.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    throw Error(fmt::format("GGUF file {}: metadata '{}' = {} is past int64", name(), key, v.u));
  }
  return v.i;
}

double GgufFile::GetFloat(std::string_view key) const {
  const GgufValue& v = Require(*this, key);
  if (v.type != GgufType::kF32 && v.type != GgufType::kF64) WrongType(*this, key, "a float");
  return v.f;
}

std::vector<std::string> GgufFile::GetStrings(std::string_view key) const {
  const GgufValue& v = Require(*this, key);
  if (v.type != GgufType::kArray || v.array_type != GgufType::kString) {
    WrongType(*this, key, "an array of strings");
  }
  return v.strings;
}

std::vector<int64_t> GgufFile::GetInts(std::string_view key) const {
  const GgufValue& v = Require(*this, key);
  if (v.type != GgufType::kArray || !IsInteger(v.array_type)) {
    WrongType(*this, key, "an array of integers");
  }
  return v.ints;
}

std::vector<double> GgufFile::GetFloats(std::string_view key) const {
  const GgufValue& v = Require(*this, key);
  if (v.type != GgufType::kArray ||
      (v.array_type != GgufType::kF32 && v.array_type != GgufType::kF64)) {
    WrongType(*this, key, "an array of floats");
  }
  return v.floats;
}

bool GgufFile::HasTensor(std::string_view name) const {
  return tensor_index_.contains(std::string(name));
}

const GgufTensor& GgufFile::Tensor(std::string_view name) const {
  const auto it = tensor_index_.find(std::string(name));
  if (it == tensor_index_.end()) {
    throw Error(fmt::format("GGUF file {}: no tensor '{}'", name_, name));
  }
  return tensors_[it->second];
}

std::span<const uint8_t> GgufFile::TensorBytes(const GgufTensor& t) const {
  return {bytes_.data() + data_offset_ + t.offset, static_cast<size_t>(t.num_bytes)};
}

std::vector<float> GgufFile::Dequantize(const GgufTensor& t) const {
  if (!CanDequantize(t.type)) {
    throw Error(
        fmt::format("GGUF file {}: tensor '{}' has type {}; dequantized: F32, F16, BF16, "
                    "Q4_0, Q4_1, Q8_0",
                    name_, t.name, GgmlTypeName(t.type)));
  }
  std::vector<float> out(static_cast<size_t>(t.num_elements));
  DequantizeRow(t.type, TensorBytes(t).data(), t.num_elements, out.data());
  return out;
}

}  // namespace tqkv::model
