#include "runtime/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <system_error>
#include <tuple>
#include <utility>

namespace tqkv {
namespace {

using Json = nlohmann::json;

constexpr std::string_view kMetadataKey = "__metadata__";
constexpr std::string_view kAllowedDTypes = "F32, F16, BF16, I32, I64, U8";
constexpr std::array<DType, 6> kAllDTypes = {DType::kF32, DType::kF16, DType::kBF16,
                                             DType::kI32, DType::kI64, DType::kU8};
// Names and values from a hostile file can be arbitrarily long; messages keep this much of them.
constexpr size_t kMaxQuotedChars = 120;
// A missing-tensor message lists at most this many of the present names.
constexpr size_t kMaxListedNames = 32;

std::optional<DType> LookupDType(std::string_view name) {
  for (DType dtype : kAllDTypes) {
    if (DTypeName(dtype) == name) return dtype;
  }
  return std::nullopt;
}

// `s` as a JSON string literal (so control characters and quotes are escaped, invalid UTF-8 is
// replaced rather than thrown on), shortened to kMaxQuotedChars.
std::string Quote(std::string_view s) {
  std::string quoted = Json(std::string(s.substr(0, kMaxQuotedChars)))
                           .dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > kMaxQuotedChars) {
    quoted += fmt::format("... ({} bytes)", s.size());
  }
  return quoted;
}

// A short description of a JSON value for an error message. Containers are described, not
// dumped: dump() recurses, and a hostile header may nest arbitrarily deep.
std::string Describe(const Json& value) {
  switch (value.type()) {
    case Json::value_t::string:
      return Quote(value.get_ref<const std::string&>());
    case Json::value_t::array: {
      const bool flat = value.size() <= 8 && std::all_of(value.begin(), value.end(), [](auto& v) {
                          return v.is_primitive() && !v.is_string();
                        });
      if (flat) return value.dump();
      return fmt::format("(an array of {} elements)", value.size());
    }
    case Json::value_t::object:
      return fmt::format("(an object of {} keys)", value.size());
    default:
      return value.dump();  // number, boolean or null: never nested
  }
}

// Multiplies non-negative a and b, or returns nullopt if the product overflows int64.
std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t product;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

// A SAX pass over the header before the DOM parse: the nesting depth, and a repeated key within
// one object (nlohmann silently keeps the last of two equal keys, which would let a file say two
// different things about one tensor). Only the top level and the objects directly inside it are
// checked: anything deeper is rejected by the schema checks anyway, and not tracking it keeps
// memory bounded for deeply nested input. Linear in the header (nlohmann's parser callbacks, used
// before, rescan the parent object whenever an object closes: 20,000 tensors took 2.8 s).
class HeaderChecker {
 public:
  using number_integer_t = Json::number_integer_t;
  using number_unsigned_t = Json::number_unsigned_t;
  using number_float_t = Json::number_float_t;
  using string_t = Json::string_t;
  using binary_t = Json::binary_t;

  explicit HeaderChecker(std::string_view source_name) : source_name_(source_name) {}

  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(number_integer_t) { return true; }
  bool number_unsigned(number_unsigned_t) { return true; }
  bool number_float(number_float_t, const string_t&) { return true; }
  bool string(string_t&) { return true; }
  bool binary(binary_t&) { return true; }
  bool start_object(std::size_t) {
    Open();
    ++object_depth_;
    if (object_depth_ <= kCheckedDepth) keys_.emplace_back();
    return true;
  }
  bool key(string_t& key) {
    if (object_depth_ <= kCheckedDepth) {
      if (!keys_.back().insert(key).second) {
        throw Error(
            fmt::format("{}: header has the key {} twice in one object{}", source_name_, Quote(key),
                        keys_.size() == 1 ? "" : fmt::format(" (inside {})", Quote(outer_key_))));
      }
      if (keys_.size() == 1) outer_key_ = key;
    }
    return true;
  }
  bool end_object() {
    if (object_depth_ <= kCheckedDepth) keys_.pop_back();
    --object_depth_;
    --depth_;
    return true;
  }
  bool start_array(std::size_t) {
    Open();
    return true;
  }
  bool end_array() {
    --depth_;
    return true;
  }
  // The DOM parse that follows reports the error itself, with its position.
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) {
    return false;
  }

 private:
  // A valid header nests 3 levels (object, tensor entry, shape); stopping far deeper input at the
  // first excess level keeps its memory bounded (a 10 MB run of '[' took 540 MB).
  void Open() {
    if (++depth_ > kMaxDepth) {
      throw Error(fmt::format("{}: header nests deeper than {} levels", source_name_, kMaxDepth));
    }
  }
  static constexpr int kCheckedDepth = 2;
  static constexpr int kMaxDepth = 8;
  std::string_view source_name_;
  int depth_ = 0;
  int object_depth_ = 0;
  std::vector<std::set<std::string>> keys_;
  std::string outer_key_;
};

struct Entry {
  std::string_view name;
  uint64_t begin;
  uint64_t end;
};

// Reads a non-negative JSON integer that fits in int64 (nlohmann stores every non-negative
// integer literal as unsigned, negative ones as signed, and anything else, including integers too
// large for uint64, as float).
std::optional<int64_t> NonNegativeInt64(const Json& value) {
  if (!value.is_number_unsigned()) return std::nullopt;
  const uint64_t v = value.get<uint64_t>();
  if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return static_cast<int64_t>(v);
}

// Validates one tensor entry of the header; fills `tensor` (without data) and its byte range.
void ParseTensorEntry(std::string_view where, const Json& entry, uint64_t data_size, Tensor& tensor,
                      Entry& range) {
  if (!entry.is_object()) {
    throw InvalidArgument(where, "entry", Describe(entry),
                          "an object with \"dtype\", \"shape\" and \"data_offsets\"");
  }
  for (const auto& [key, unused] : entry.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      // Rejected rather than ignored: a misspelt field would otherwise surface as a confusing
      // "missing" error, and no field is defined beyond these three.
      throw InvalidArgument(where, "field", Quote(key), "\"dtype\", \"shape\", \"data_offsets\"");
    }
  }
  for (std::string_view field : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(field)) {
      throw Error(
          fmt::format("{}: missing field \"{}\"; an entry needs \"dtype\", \"shape\" and "
                      "\"data_offsets\"",
                      where, field));
    }
  }

  const Json& dtype = entry["dtype"];
  if (!dtype.is_string()) {
    throw InvalidArgument(where, "dtype", Describe(dtype),
                          fmt::format("a string, one of {}", kAllowedDTypes));
  }
  const std::optional<DType> parsed_dtype = LookupDType(dtype.get_ref<const std::string&>());
  if (!parsed_dtype) throw InvalidArgument(where, "dtype", Describe(dtype), kAllowedDTypes);
  tensor.dtype = *parsed_dtype;

  const Json& shape = entry["shape"];
  if (!shape.is_array()) {
    throw InvalidArgument(where, "shape", Describe(shape), "an array of non-negative integers");
  }
  int64_t num_elements = 1;
  tensor.shape.reserve(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    const std::optional<int64_t> dim = NonNegativeInt64(shape[i]);
    if (!dim) {
      throw InvalidArgument(where, fmt::format("shape[{}]", i), Describe(shape[i]),
                            "an integer from 0 to 2^63-1");
    }
    tensor.shape.push_back(*dim);
    // Once a dim is 0 the count stays 0 whatever follows, so later huge dims cannot overflow it.
    const std::optional<int64_t> product = CheckedMul(num_elements, *dim);
    if (!product) {
      throw InvalidArgument(where, "shape", Describe(shape),
                            "a shape whose element count fits in int64");
    }
    num_elements = *product;
  }
  const std::optional<int64_t> num_bytes = CheckedMul(num_elements, DTypeSize(tensor.dtype));
  if (!num_bytes) {
    throw InvalidArgument(where, "shape", Describe(shape),
                          fmt::format("a shape whose size in bytes ({} x {} bytes) fits in int64",
                                      num_elements, DTypeSize(tensor.dtype)));
  }

  const Json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    throw InvalidArgument(where, "data_offsets", Describe(offsets),
                          "[begin, end], two non-negative integers with begin <= end");
  }
  range.begin = offsets[0].get<uint64_t>();
  range.end = offsets[1].get<uint64_t>();
  if (range.begin > range.end) {
    throw InvalidArgument(where, "data_offsets", Describe(offsets), "begin <= end");
  }
  if (range.end - range.begin != static_cast<uint64_t>(*num_bytes)) {
    throw InvalidArgument(
        where, "data_offsets", Describe(offsets),
        fmt::format("a range of {} bytes ({} elements of shape {} x {} bytes for {})", *num_bytes,
                    num_elements, Describe(shape), DTypeSize(tensor.dtype),
                    DTypeName(tensor.dtype)));
  }
  if (range.end > data_size) {
    throw InvalidArgument(where, "data_offsets", Describe(offsets),
                          fmt::format("a range within the {}-byte data buffer", data_size));
  }
}

std::string ErrnoMessage(int error) { return std::generic_category().message(error); }

}  // namespace

DType ParseDType(std::string_view name) {
  const std::optional<DType> dtype = LookupDType(name);
  if (!dtype) throw InvalidArgument("ParseDType", "dtype", Quote(name), kAllowedDTypes);
  return *dtype;
}

namespace detail {

void ThrowDTypeMismatch(std::string_view where, DType dtype, std::string_view requested) {
  throw Error(fmt::format("{}: tensor has dtype {}; requested element type {}", where,
                          DTypeName(dtype), requested));
}

void ThrowSizeMismatch(std::string_view where, size_t bytes, int64_t elements,
                       size_t element_bytes) {
  throw InvalidArgument(
      where, "data.size()", bytes,
      fmt::format("{} ({} elements of {} bytes, the shape's)",
                  elements * static_cast<int64_t>(element_bytes), elements, element_bytes));
}

}  // namespace detail

int64_t Tensor::num_elements() const {
  int64_t count = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      throw InvalidArgument("Tensor::num_elements", fmt::format("shape[{}]", i), shape[i],
                            "0 or more");
    }
    const std::optional<int64_t> product = CheckedMul(count, shape[i]);
    if (!product) {
      throw InvalidArgument("Tensor::num_elements", "shape", fmt::format("{}", shape),
                            "a shape whose element count fits in int64");
    }
    count = *product;
  }
  return count;
}

namespace {

// A name from a file as it goes into a message: at most 64 bytes, control bytes escaped (a
// crafted name must not fill a terminal or move its cursor).
std::string ShownName(std::string_view name) {
  constexpr size_t kMaxShown = 64;
  std::string out;
  for (size_t i = 0; i < name.size() && i < kMaxShown; ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  if (name.size() > kMaxShown) out += fmt::format("... ({} bytes)", name.size());
  return out;
}

}  // namespace

const Tensor& SafetensorsFile::at(std::string_view name) const {
  const auto it = tensors.find(name);
  if (it != tensors.end()) return it->second;
  std::string present;
  size_t listed = 0;
  for (const auto& [present_name, unused] : tensors) {
    if (listed == kMaxListedNames) {
      present += fmt::format(", ... ({} more)", tensors.size() - listed);
      break;
    }
    if (listed > 0) present += ", ";
    present += ShownName(present_name);
    ++listed;
  }
  if (tensors.empty()) present = "(none)";
  throw Error(
      fmt::format("{}: no tensor named '{}'; present: {}", source_name, ShownName(name), present));
}

const Tensor& SafetensorsFile::Require(std::string_view name, DType dtype, int64_t rank) const {
  const Tensor& tensor = at(name);
  if (tensor.dtype != dtype || static_cast<int64_t>(tensor.shape.size()) != rank) {
    throw Error(
        fmt::format("{}: tensor '{}' has dtype {} and shape {} (rank {}); required: dtype "
                    "{}, rank {}",
                    source_name, name, DTypeName(tensor.dtype), tensor.shape, tensor.shape.size(),
                    DTypeName(dtype), rank));
  }
  return tensor;
}

SafetensorsFile ParseSafetensors(std::span<const uint8_t> bytes, std::string_view source_name) {
  if (bytes.size() < 8) {
    throw Error(fmt::format("{}: file is {} bytes, shorter than the 8-byte header length",
                            source_name, bytes.size()));
  }
  uint64_t header_size = 0;
  std::memcpy(&header_size, bytes.data(), 8);  // little-endian host, see the header
  const uint64_t available = bytes.size() - 8;
  if (header_size > kMaxSafetensorsHeaderBytes) {
    throw InvalidArgument(source_name, "header length", header_size,
                          fmt::format("at most {} bytes", kMaxSafetensorsHeaderBytes));
  }
  if (header_size > available) {
    throw InvalidArgument(
        source_name, "header length", header_size,
        fmt::format("at most {} (the bytes after the 8-byte length in a {}-byte file)", available,
                    bytes.size()));
  }
  const auto* header_begin = reinterpret_cast<const char*>(bytes.data() + 8);
  const std::span<const uint8_t> data = bytes.subspan(8 + header_size);

  // JSON text holds no NUL byte; nlohmann stops at one and drops what follows (a second tensor,
  // invalid UTF-8 after it) without a word.
  if (const void* nul = std::memchr(header_begin, 0, header_size)) {
    throw Error(fmt::format("{}: header has a NUL byte at offset {} of {}; JSON text has none",
                            source_name, static_cast<const char*>(nul) - header_begin,
                            header_size));
  }
  Json header;
  try {
    HeaderChecker checker(source_name);
    Json::sax_parse(header_begin, header_begin + header_size, &checker);
    header = Json::parse(header_begin, header_begin + header_size);
  } catch (const Json::exception& e) {
    // Invalid JSON, invalid UTF-8, trailing garbage or an empty header.
    throw Error(fmt::format("{}: header is not valid JSON: {}", source_name, e.what()));
  }
  if (!header.is_object()) {
    throw InvalidArgument(source_name, "header", fmt::format("a JSON {}", header.type_name()),
                          "a JSON object");
  }

  SafetensorsFile file;
  file.source_name = std::string(source_name);
  std::vector<Entry> ranges;
  for (const auto& [name, value] : header.items()) {
    if (name == kMetadataKey) {
      const std::string where = fmt::format("{}: {}", source_name, kMetadataKey);
      if (!value.is_object()) {
        throw InvalidArgument(where, "value", Describe(value), "an object of string values");
      }
      for (const auto& [key, item] : value.items()) {
        if (!item.is_string()) {
          throw InvalidArgument(where, fmt::format("value of {}", Quote(key)), Describe(item),
                                "a string");
        }
        file.metadata.emplace(key, item.get<std::string>());
      }
      continue;
    }
    const std::string where = fmt::format("{}: tensor {}", source_name, Quote(name));
    Tensor tensor;
    Entry range{};
    ParseTensorEntry(where, value, data.size(), tensor, range);
    // `name` refers into `header`, which outlives `ranges`.
    range.name = name;
    ranges.push_back(range);
    file.tensors.emplace(name, std::move(tensor));
  }

  // Gaps between tensors and bytes after the last one are accepted (the data is still
  // unambiguous); shared bytes are not. Empty tensors occupy no bytes and overlap nothing.
  std::erase_if(ranges, [](const Entry& e) { return e.begin == e.end; });
  std::sort(ranges.begin(), ranges.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].begin < ranges[i - 1].end) {
      throw Error(
          fmt::format("{}: tensors {} (data_offsets [{}, {}]) and {} (data_offsets [{}, "
                      "{}]) overlap; each tensor needs its own bytes",
                      source_name, Quote(ranges[i - 1].name), ranges[i - 1].begin,
                      ranges[i - 1].end, Quote(ranges[i].name), ranges[i].begin, ranges[i].end));
    }
  }

  // Everything is validated: copy the data out.
  for (const Entry& range : ranges) {
    const auto src = data.subspan(range.begin, range.end - range.begin);
    file.tensors.find(range.name)->second.data.assign(src.begin(), src.end());
  }
  return file;
}

namespace {

// SerializeSafetensors, with `where` naming the caller in error messages.
std::vector<uint8_t> Serialize(const SafetensorsFile& file, const std::string& where) {
  // ordered_json keeps insertion order: "__metadata__" first, then tensors in name order, and
  // each entry's fields in the order the reference implementation writes them.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!file.metadata.empty()) {
    nlohmann::ordered_json metadata = nlohmann::ordered_json::object();
    for (const auto& [key, value] : file.metadata) metadata[key] = value;
    header[std::string(kMetadataKey)] = std::move(metadata);
  }
  uint64_t offset = 0;
  for (const auto& [name, tensor] : file.tensors) {
    if (name == kMetadataKey) {
      throw InvalidArgument(where, "tensor name", Quote(name),
                            "any name except \"__metadata__\", which holds the metadata");
    }
    if (DTypeSize(tensor.dtype) == 0) {  // not one of the enum's values: "?" on disk
      throw InvalidArgument(fmt::format("{}: tensor {}", where, Quote(name)), "dtype",
                            static_cast<int>(tensor.dtype), "F32, F16, BF16, I32, I64, U8");
    }
    int64_t num_elements = 0;
    try {
      num_elements = tensor.num_elements();
    } catch (const Error& e) {
      throw Error(fmt::format("{}: tensor {}: {}", where, Quote(name), e.what()));
    }
    const std::optional<int64_t> num_bytes = CheckedMul(num_elements, DTypeSize(tensor.dtype));
    if (!num_bytes || static_cast<uint64_t>(*num_bytes) != tensor.data.size()) {
      throw InvalidArgument(
          fmt::format("{}: tensor {}", where, Quote(name)), "data.size()", tensor.data.size(),
          fmt::format("{} elements of shape {} x {} bytes for {}", num_elements, tensor.shape,
                      DTypeSize(tensor.dtype), DTypeName(tensor.dtype)));
    }
    const uint64_t end = offset + tensor.data.size();
    header[name] = {{"dtype", std::string(DTypeName(tensor.dtype))},
                    {"shape", tensor.shape},
                    {"data_offsets", {offset, end}}};
    offset = end;
  }

  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const nlohmann::ordered_json::exception& e) {
    throw Error(fmt::format("{}: a tensor name or metadata string is not valid UTF-8: {}", where,
                            e.what()));
  }
  // Pad so the data buffer starts 8-byte aligned within the file (as the reference writer does).
  header_text.append((8 - header_text.size() % 8) % 8, ' ');

  std::vector<uint8_t> bytes;
  bytes.reserve(8 + header_text.size() + offset);
  const uint64_t header_size = header_text.size();
  bytes.resize(8);
  std::memcpy(bytes.data(), &header_size, 8);  // little-endian host
  bytes.insert(bytes.end(), header_text.begin(), header_text.end());
  for (const auto& [name, tensor] : file.tensors) {
    bytes.insert(bytes.end(), tensor.data.begin(), tensor.data.end());
  }
  return bytes;
}

}  // namespace

std::vector<uint8_t> SerializeSafetensors(const SafetensorsFile& file) {
  return Serialize(file, "SerializeSafetensors");
}

SafetensorsFile ReadSafetensors(const std::string& path) {
  // The whole file is read and then parsed, so the file and its tensors are in memory together;
  // simple, and all validation lives in ParseSafetensors.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw Error(fmt::format("ReadSafetensors: cannot open {}: {}", path, ErrnoMessage(errno)));
  }
  auto fail = [&](std::string_view what, int error) {
    ::close(fd);
    throw Error(fmt::format("ReadSafetensors: {} {}: {}", what, path, ErrnoMessage(error)));
  };
  struct stat info {};
  if (::fstat(fd, &info) != 0) fail("cannot stat", errno);
  // A directory or device has no meaningful size; reading one must not allocate st_size bytes.
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    throw Error(fmt::format("ReadSafetensors: {} is not a regular file", path));
  }
  std::vector<uint8_t> bytes(static_cast<size_t>(info.st_size));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("cannot read", errno);
    if (n == 0) {
      ::close(fd);
      throw Error(fmt::format("ReadSafetensors: {} shrank from {} to {} bytes while being read",
                              path, bytes.size(), done));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return ParseSafetensors(bytes, path);
}

void WriteFileAtomically(const std::string& path_arg, std::span<const uint8_t> bytes,
                         std::string_view where) {
  // The rename below replaces the directory entry: through a symbolic link, write its target
  // (not the link), and never replace something that is not a regular file (a device node).
  // (A dangling link resolves to itself in weakly_canonical: follow links by hand first.)
  std::error_code error_code;
  std::filesystem::path target = path_arg;
  for (int hops = 0;
       std::filesystem::is_symlink(std::filesystem::symlink_status(target, error_code)); ++hops) {
    if (hops == 40) {
      throw Error(fmt::format("{}: {}: too many levels of symbolic links", where, path_arg));
    }
    const std::filesystem::path link = std::filesystem::read_symlink(target, error_code);
    if (error_code) break;
    target = link.is_absolute() ? link : target.parent_path() / link;
  }
  // (symlink_status fails for a path that cannot be searched: weakly_canonical reports it.)
  const std::string path = std::filesystem::weakly_canonical(target, error_code).string();
  if (error_code) {
    throw Error(fmt::format("{}: cannot resolve {}: {}", where, path_arg, error_code.message()));
  }
  if (std::filesystem::exists(path, error_code) &&
      !std::filesystem::is_regular_file(path, error_code)) {
    throw Error(fmt::format("{}: {} exists and is not a regular file", where, path_arg));
  }

  // The temporary lives in the target's directory so that rename() is atomic (same filesystem).
  std::string tmp_path = path + ".tmp.XXXXXX";
  const int fd = mkstemp(tmp_path.data());
  if (fd < 0) {
    throw Error(fmt::format("{}: cannot create a temporary file next to {}: {}", where, path,
                            ErrnoMessage(errno)));
  }
  auto fail = [&](std::string_view what, int error) {
    ::close(fd);  // may already be closed; harmless
    ::unlink(tmp_path.c_str());
    throw Error(fmt::format("{}: {} {}: {}", where, what, path, ErrnoMessage(error)));
  };
  // mkstemp creates the file 0600; give it the usual permissions of a data file.
  if (::fchmod(fd, 0644) != 0) fail("cannot set permissions for", errno);
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("cannot write", errno);
    }
    written += static_cast<size_t>(n);
  }
  // fsync before rename, so that after a crash `path` holds either the old or the new contents.
  if (::fsync(fd) != 0) fail("cannot flush", errno);
  if (::close(fd) != 0) {
    const int error = errno;
    ::unlink(tmp_path.c_str());
    throw Error(fmt::format("{}: cannot close {}: {}", where, path, ErrnoMessage(error)));
  }
  if (std::rename(tmp_path.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp_path.c_str());
    throw Error(fmt::format("{}: cannot rename the temporary file to {}: {}", where, path,
                            ErrnoMessage(error)));
  }
}

void WriteSafetensors(const std::string& path, const SafetensorsFile& file) {
  // Serialize first: an invalid tensor is reported before anything touches the filesystem.
  const std::vector<uint8_t> bytes = Serialize(file, fmt::format("WriteSafetensors({})", path));
  WriteFileAtomically(path, bytes, "WriteSafetensors");
}

}  // namespace tqkv
