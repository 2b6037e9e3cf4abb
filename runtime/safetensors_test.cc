#include "runtime/safetensors.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tqkv {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr std::string_view kSource = "test.safetensors";

// A file with the given header text (unpadded, length prefix computed) and data buffer.
std::vector<uint8_t> MakeFile(std::string_view header, std::vector<uint8_t> data = {}) {
  std::vector<uint8_t> bytes(8);
  uint64_t size = header.size();
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(size >> (8 * i));
  bytes.insert(bytes.end(), header.begin(), header.end());
  bytes.insert(bytes.end(), data.begin(), data.end());
  return bytes;
}

// The message of the tqkv::Error that parsing `bytes` throws, or "<no error>".
std::string ParseError(const std::vector<uint8_t>& bytes) {
  try {
    ParseSafetensors(bytes, kSource);
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

std::string ParseError(std::string_view header, std::vector<uint8_t> data = {}) {
  return ParseError(MakeFile(header, std::move(data)));
}

std::vector<uint8_t> HexBytes(std::string_view hex) {
  std::vector<uint8_t> bytes;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    bytes.push_back(static_cast<uint8_t>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  }
  return bytes;
}

template <typename T>
std::vector<T> ValuesOf(const Tensor& tensor) {
  const std::span<const T> values = tensor.values<T>();
  return {values.begin(), values.end()};
}

// A file with every dtype, a scalar, an empty tensor and metadata.
SafetensorsFile EveryDTypeFile() {
  SafetensorsFile file;
  const std::vector<float> f32 = {1.5f,  -0.0f,   std::numeric_limits<float>::infinity(),
                                  3e38f, -1e-45f, 7.0f};
  file.tensors["f32"] = Tensor::FromValues<float>(DType::kF32, {2, 3}, f32);
  const std::vector<uint16_t> f16 = {0x3C00, 0xBC00, 0x7BFF, 0x7E00};  // 1, -1, 65504, NaN
  file.tensors["f16"] = Tensor::FromValues<uint16_t>(DType::kF16, {4}, f16);
  const std::vector<uint16_t> bf16 = {0x3F80, 0xC000, 0x7F80};  // 1, -2, inf
  file.tensors["bf16"] = Tensor::FromValues<uint16_t>(DType::kBF16, {1, 3, 1}, bf16);
  const std::vector<int32_t> i32 = {std::numeric_limits<int32_t>::min(), -1, 0,
                                    std::numeric_limits<int32_t>::max()};
  file.tensors["i32"] = Tensor::FromValues<int32_t>(DType::kI32, {2, 2}, i32);
  const std::vector<int64_t> i64 = {std::numeric_limits<int64_t>::min(), 42};
  file.tensors["i64"] = Tensor::FromValues<int64_t>(DType::kI64, {2}, i64);
  const std::vector<uint8_t> u8 = {0, 1, 128, 255, 7};
  file.tensors["u8"] = Tensor::FromValues<uint8_t>(DType::kU8, {5}, u8);
  const std::vector<float> scalar = {-2.25f};
  file.tensors["scalar"] = Tensor::FromValues<float>(DType::kF32, {}, scalar);
  file.tensors["empty"] = Tensor::FromValues<int64_t>(DType::kI64, {3, 0, 2}, {});
  file.metadata = {{"format", "pt"}, {"note", "caf\u00e9 \"quoted\"\n"}, {"", "empty key"}};
  return file;
}

void ExpectSameContents(const SafetensorsFile& actual, const SafetensorsFile& expected) {
  EXPECT_EQ(actual.metadata, expected.metadata);
  ASSERT_EQ(actual.tensors.size(), expected.tensors.size());
  for (const auto& [name, tensor] : expected.tensors) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(actual.contains(name));
    const Tensor& got = actual.at(name);
    EXPECT_EQ(got.dtype, tensor.dtype);
    EXPECT_EQ(got.shape, tensor.shape);
    EXPECT_EQ(got.data, tensor.data);  // bytewise, so NaN and -0.0 are compared exactly
  }
}

// ------------------------------------------------------------------------------------------------
// DType and Tensor

TEST(DTypeTest, NamesSizesAndParsing) {
  struct Case {
    DType dtype;
    std::string_view name;
    int64_t size;
  };
  for (const Case& c :
       {Case{DType::kF32, "F32", 4}, Case{DType::kF16, "F16", 2}, Case{DType::kBF16, "BF16", 2},
        Case{DType::kI32, "I32", 4}, Case{DType::kI64, "I64", 8}, Case{DType::kU8, "U8", 1}}) {
    EXPECT_EQ(DTypeName(c.dtype), c.name);
    EXPECT_EQ(DTypeSize(c.dtype), c.size);
    EXPECT_EQ(ParseDType(c.name), c.dtype);
  }
}

TEST(DTypeTest, UnknownNameThrowsListingTheSupportedOnes) {
  for (std::string_view name : {"F64", "f32", "", "BOOL", "F32 "}) {
    try {
      ParseDType(name);
      FAIL() << "no throw for " << name;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), AllOf(HasSubstr("ParseDType: invalid dtype"),
                                  HasSubstr("allowed: F32, F16, BF16, I32, I64, U8")));
    }
  }
}

TEST(TensorTest, NumElementsOfScalarEmptyAndInvalidShapes) {
  Tensor t;
  EXPECT_EQ(t.num_elements(), 1);  // shape {} is a scalar
  t.shape = {2, 3, 4};
  EXPECT_EQ(t.num_elements(), 24);
  t.shape = {5, 0, 7};
  EXPECT_EQ(t.num_elements(), 0);
  t.shape = {2, -3};
  EXPECT_THROW(t.num_elements(), Error);
  t.shape = {int64_t{1} << 32, int64_t{1} << 32};
  EXPECT_THROW(t.num_elements(), Error);
}

TEST(TensorTest, FromValuesCopiesLittleEndianBytes) {
  const std::vector<int32_t> values = {0x01020304, -2};
  const Tensor t = Tensor::FromValues<int32_t>(DType::kI32, {2}, values);
  EXPECT_EQ(t.data, (std::vector<uint8_t>{0x04, 0x03, 0x02, 0x01, 0xFE, 0xFF, 0xFF, 0xFF}));
  EXPECT_EQ(ValuesOf<int32_t>(t), values);
}

TEST(TensorTest, ValuesWithTheWrongElementTypeNamesBothTypes) {
  const std::vector<float> values = {1.0f};
  const Tensor t = Tensor::FromValues<float>(DType::kF32, {1}, values);
  try {
    t.values<int32_t>();
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("dtype F32"), HasSubstr("int32_t (I32)")));
  }
  // uint16_t carries both 16-bit float dtypes, and nothing else.
  const std::vector<uint16_t> bits = {0x3C00};
  EXPECT_NO_THROW(Tensor::FromValues<uint16_t>(DType::kF16, {1}, bits).values<uint16_t>());
  EXPECT_NO_THROW(Tensor::FromValues<uint16_t>(DType::kBF16, {1}, bits).values<uint16_t>());
  EXPECT_THROW(Tensor::FromValues<uint16_t>(DType::kI32, {1}, bits), Error);
  EXPECT_THROW(Tensor::FromValues<float>(DType::kI32, {1}, values), Error);
}

TEST(TensorTest, FromValuesRejectsACountThatDoesNotMatchTheShape) {
  const std::vector<float> values = {1.0f, 2.0f, 3.0f};
  try {
    Tensor::FromValues<float>(DType::kF32, {2, 2}, values);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("values.size() = 3"), HasSubstr("allowed: 4")));
  }
}

// ------------------------------------------------------------------------------------------------
// Format: pinned bytes, both directions

TEST(SafetensorsFormatTest, SerializedBytesArePinned) {
  SafetensorsFile file;
  const std::vector<float> x = {1.0f, -2.0f};
  file.tensors["y"] = Tensor::FromValues<uint8_t>(DType::kU8, {}, std::vector<uint8_t>{7});
  file.tensors["x"] = Tensor::FromValues<float>(DType::kF32, {2}, x);
  file.metadata["k"] = "v";

  // Metadata first, tensors in name order, compact JSON padded with spaces to a multiple of 8
  // (130 -> 136 = 0x88 bytes), then the tensors' little-endian bytes back to back.
  const std::string header =
      R"({"__metadata__":{"k":"v"},"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("y":{"dtype":"U8","shape":[],"data_offsets":[8,9]}}      )";
  std::vector<uint8_t> expected = {0x88, 0, 0, 0, 0, 0, 0, 0};
  expected.insert(expected.end(), header.begin(), header.end());
  for (uint8_t b : {0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0xC0, 0x07}) expected.push_back(b);

  EXPECT_EQ(SerializeSafetensors(file), expected);
  ExpectSameContents(ParseSafetensors(expected, kSource), file);
}

TEST(SafetensorsFormatTest, EmptyFileIsAPaddedEmptyObject) {
  EXPECT_EQ(SerializeSafetensors(SafetensorsFile{}),
            (std::vector<uint8_t>{8, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' ', ' ', ' ', ' ', ' '}));
  const SafetensorsFile parsed = ParseSafetensors(MakeFile("{}"), kSource);
  EXPECT_TRUE(parsed.tensors.empty());
  EXPECT_TRUE(parsed.metadata.empty());
}

// Written by the reference implementation (Python safetensors 0.8.0, safetensors.numpy.save) for
// {"w": float32 [[1.5, -2]], "h": float16 [1, -0.5, 65504], "i": int32 [-1, 7], "s": int64 42
// (0-d), "e": uint8 zeros((2, 0)), "b": uint8 [1, 2, 255]} with metadata {"format": "np",
// "k": "v"}. It orders tensors by alignment, not by name.
constexpr std::string_view kReferenceFileHex =
    "70010000000000007b225f5f6d657461646174615f5f223a7b22666f726d6174223a226e70222c226b223a227622"
    "7d2c2273223a7b226474797065223a22493634222c227368617065223a5b5d2c22646174615f6f666673657473"
    "223a5b302c385d7d2c2277223a7b226474797065223a22463332222c227368617065223a5b312c325d2c226461"
    "74615f6f666673657473223a5b382c31365d7d2c2269223a7b226474797065223a22493332222c227368617065"
    "223a5b325d2c22646174615f6f666673657473223a5b31362c32345d7d2c2268223a7b226474797065223a2246"
    "3136222c227368617065223a5b335d2c22646174615f6f666673657473223a5b32342c33305d7d2c2262223a7b"
    "226474797065223a225538222c227368617065223a5b335d2c22646174615f6f666673657473223a5b33302c33"
    "335d7d2c2265223a7b226474797065223a225538222c227368617065223a5b322c305d2c22646174615f6f6666"
    "73657473223a5b33332c33335d7d7d2a000000000000000000c03f000000c0ffffffff07000000003c00b8ff7b"
    "0102ff";

TEST(SafetensorsFormatTest, ReadsAFileWrittenByTheReferenceImplementation) {
  const std::vector<uint8_t> bytes = HexBytes(kReferenceFileHex);
  ASSERT_EQ(bytes.size(), 409u);
  const SafetensorsFile file = ParseSafetensors(bytes, kSource);
  EXPECT_EQ(file.metadata,
            (std::map<std::string, std::string, std::less<>>{{"format", "np"}, {"k", "v"}}));
  ASSERT_EQ(file.tensors.size(), 6u);
  EXPECT_EQ(file.Require("w", DType::kF32, 2).shape, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(ValuesOf<float>(file.at("w")), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(ValuesOf<uint16_t>(file.Require("h", DType::kF16, 1)),
            (std::vector<uint16_t>{0x3C00, 0xB800, 0x7BFF}));
  EXPECT_EQ(ValuesOf<int32_t>(file.Require("i", DType::kI32, 1)), (std::vector<int32_t>{-1, 7}));
  EXPECT_EQ(ValuesOf<int64_t>(file.Require("s", DType::kI64, 0)), (std::vector<int64_t>{42}));
  EXPECT_EQ(file.Require("e", DType::kU8, 2).shape, (std::vector<int64_t>{2, 0}));
  EXPECT_TRUE(file.at("e").data.empty());
  EXPECT_EQ(ValuesOf<uint8_t>(file.Require("b", DType::kU8, 1)), (std::vector<uint8_t>{1, 2, 255}));

  // Our writer lays the same tensors out in name order; the contents are unchanged.
  ExpectSameContents(ParseSafetensors(SerializeSafetensors(file), kSource), file);
}

TEST(SafetensorsFormatTest, AcceptsHeaderPaddingGapsAndTrailingBytes) {
  // Padding with spaces (and other JSON whitespace), a gap between tensors and bytes after the
  // last one are all unambiguous, and other writers produce some of them.
  const SafetensorsFile file =
      ParseSafetensors(MakeFile(R"({"b":{"dtype":"U8","shape":[1],"data_offsets":[3,4]},)"
                                R"("a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}    )"
                                "\n\t ",
                                {10, 11, 99, 12, 99, 99}),
                       kSource);
  EXPECT_EQ(ValuesOf<uint8_t>(file.at("a")), (std::vector<uint8_t>{10, 11}));
  EXPECT_EQ(ValuesOf<uint8_t>(file.at("b")), (std::vector<uint8_t>{12}));
}

// ------------------------------------------------------------------------------------------------
// Round trips

TEST(SafetensorsRoundTripTest, EveryDTypeScalarEmptyTensorAndMetadataInMemory) {
  const SafetensorsFile file = EveryDTypeFile();
  const std::vector<uint8_t> bytes = SerializeSafetensors(file);
  uint64_t header_size = 0;
  std::memcpy(&header_size, bytes.data(), 8);
  EXPECT_EQ(header_size % 8, 0u);
  const SafetensorsFile parsed = ParseSafetensors(bytes, kSource);
  ExpectSameContents(parsed, file);
  EXPECT_EQ(parsed.source_name, kSource);
  EXPECT_EQ(ValuesOf<float>(parsed.at("scalar")), (std::vector<float>{-2.25f}));
  EXPECT_EQ(parsed.at("scalar").num_elements(), 1);
  EXPECT_EQ(parsed.at("empty").num_elements(), 0);
  EXPECT_TRUE(parsed.at("empty").values<int64_t>().empty());
  // Serializing again is byte-identical.
  EXPECT_EQ(SerializeSafetensors(parsed), bytes);
}

std::string TempPath(std::string_view name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + std::string(name);
}

TEST(SafetensorsRoundTripTest, WriteThenReadAFileAndOverwriteIt) {
  const std::string path = TempPath("round_trip.safetensors");
  std::filesystem::remove(path);
  const SafetensorsFile file = EveryDTypeFile();
  WriteSafetensors(path, file);
  const SafetensorsFile read = ReadSafetensors(path);
  ExpectSameContents(read, file);
  EXPECT_EQ(read.source_name, path);
  EXPECT_EQ(std::filesystem::file_size(path), SerializeSafetensors(file).size());

  // Writing again replaces the file completely (it gets shorter here).
  SafetensorsFile smaller;
  smaller.tensors["only"] = Tensor::FromValues<uint8_t>(DType::kU8, {1}, std::vector<uint8_t>{3});
  WriteSafetensors(path, smaller);
  ExpectSameContents(ReadSafetensors(path), smaller);
  EXPECT_EQ(std::filesystem::file_size(path), SerializeSafetensors(smaller).size());
}

// ------------------------------------------------------------------------------------------------
// Lookup helpers

TEST(SafetensorsLookupTest, MissingTensorListsThePresentOnes) {
  SafetensorsFile file = ParseSafetensors(SerializeSafetensors(EveryDTypeFile()), kSource);
  try {
    file.at("weights");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "test.safetensors: no tensor named 'weights'; present: bf16, empty, f16, f32, i32, "
              "i64, scalar, u8");
  }
  EXPECT_FALSE(file.contains("weights"));
  EXPECT_THROW(file.Require("weights", DType::kF32, 1), Error);
}

// A crafted name (long, with terminal escapes) is shortened and escaped in the message: a 200 KB
// name with ESC[2J made a 200 KB error that cleared the screen.
TEST(SafetensorsLookupTest, NamesInMessagesAreShortenedAndEscaped) {
  SafetensorsFile file;
  file.source_name = "crafted";
  const std::string long_name = "\x1b[2J" + std::string(200000, 'a');
  file.tensors[long_name] = Tensor{DType::kU8, {1}, std::vector<uint8_t>(1)};
  try {
    file.at("\x07" "bell");
    FAIL() << "no throw";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_LT(what.size(), 300u);
    EXPECT_EQ(what.find('\x1b'), std::string::npos);
    EXPECT_EQ(what.find('\x07'), std::string::npos);
    EXPECT_THAT(what, HasSubstr("'\\x07bell'"));
    EXPECT_THAT(what, HasSubstr("\\x1b[2Jaaa"));
    EXPECT_THAT(what, HasSubstr("... (200004 bytes)"));
  }
}

TEST(SafetensorsLookupTest, RequireChecksDTypeAndRank) {
  const SafetensorsFile file = ParseSafetensors(SerializeSafetensors(EveryDTypeFile()), kSource);
  EXPECT_EQ(&file.Require("f32", DType::kF32, 2), &file.at("f32"));
  try {
    file.Require("f32", DType::kF16, 2);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(),
                AllOf(HasSubstr("test.safetensors: tensor 'f32' has dtype F32 and shape [2, 3]"),
                      HasSubstr("required: dtype F16, rank 2")));
  }
  try {
    file.Require("f32", DType::kF32, 3);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("(rank 2)"), HasSubstr("required: dtype F32, rank 3")));
  }
}

// ------------------------------------------------------------------------------------------------
// Validation on read: each rule, with the message it gives

TEST(SafetensorsValidationTest, FileShorterThanTheLengthPrefix) {
  for (size_t size = 0; size < 8; ++size) {
    EXPECT_THAT(ParseError(std::vector<uint8_t>(size, 0)),
                AllOf(StartsWith("test.safetensors: "),
                      HasSubstr(std::to_string(size) + " bytes, shorter than the 8-byte")));
  }
}

TEST(SafetensorsValidationTest, HeaderLengthLargerThanTheFile) {
  std::vector<uint8_t> bytes = MakeFile("{}");
  bytes[0] = 11;  // 10 bytes follow the length
  EXPECT_THAT(ParseError(bytes),
              HasSubstr("test.safetensors: invalid header length = 11; allowed: at most 2 "));
}

TEST(SafetensorsValidationTest, AbsurdHeaderLength) {
  std::vector<uint8_t> bytes(8, 0xFF);  // 2^64 - 1
  EXPECT_THAT(ParseError(bytes), HasSubstr("invalid header length = 18446744073709551615; "
                                           "allowed: at most 100000000 bytes"));
  bytes = {0x01, 0xE1, 0xF5, 0x05, 0, 0, 0, 0};  // 100000001
  EXPECT_THAT(ParseError(bytes), HasSubstr("header length = 100000001"));
}

TEST(SafetensorsValidationTest, HeaderNotValidJson) {
  for (std::string_view header : {"", "{", "{\"a\":}", "{} x", "nul", "{\"a\":\"\xff\"}"}) {
    EXPECT_THAT(ParseError(header), HasSubstr("test.safetensors: header is not valid JSON"))
        << header;
  }
}

TEST(SafetensorsValidationTest, HeaderNotAnObject) {
  EXPECT_THAT(ParseError("[1, 2]"),
              HasSubstr("invalid header = a JSON array; allowed: a JSON object"));
  EXPECT_THAT(ParseError("\"x\""), HasSubstr("invalid header = a JSON string"));
  EXPECT_THAT(ParseError("7"), HasSubstr("invalid header = a JSON number"));
}

TEST(SafetensorsValidationTest, EntryNotAnObject) {
  EXPECT_THAT(ParseError(R"({"t": [1, 2]})"),
              HasSubstr("test.safetensors: tensor \"t\": invalid entry = [1,2]; allowed: an "
                        "object with"));
}

TEST(SafetensorsValidationTest, EntryMissingAField) {
  EXPECT_THAT(ParseError(R"({"t": {"shape": [1], "data_offsets": [0, 1]}})"),
              HasSubstr("tensor \"t\": missing field \"dtype\""));
  EXPECT_THAT(ParseError(R"({"t": {"dtype": "U8", "data_offsets": [0, 1]}})"),
              HasSubstr("tensor \"t\": missing field \"shape\""));
  EXPECT_THAT(ParseError(R"({"t": {"dtype": "U8", "shape": [1]}})", {0}),
              HasSubstr("tensor \"t\": missing field \"data_offsets\""));
}

TEST(SafetensorsValidationTest, EntryWithAnUnknownField) {
  EXPECT_THAT(
      ParseError(R"({"t": {"dtype": "U8", "shape": [1], "data_offset": [0, 1]}})", {0}),
      HasSubstr("tensor \"t\": invalid field = \"data_offset\"; allowed: \"dtype\", \"shape\", "
                "\"data_offsets\""));
}

TEST(SafetensorsValidationTest, EntryFieldsOfTheWrongJsonType) {
  EXPECT_THAT(ParseError(R"({"t": {"dtype": 5, "shape": [1], "data_offsets": [0, 1]}})", {0}),
              HasSubstr("tensor \"t\": invalid dtype = 5; allowed: a string, one of F32"));
  EXPECT_THAT(ParseError(R"({"t": {"dtype": "U8", "shape": 1, "data_offsets": [0, 1]}})", {0}),
              HasSubstr("invalid shape = 1; allowed: an array of non-negative integers"));
  EXPECT_THAT(ParseError(R"({"t": {"dtype": "U8", "shape": [1.0], "data_offsets": [0, 1]}})", {0}),
              HasSubstr("invalid shape[0] = 1.0; allowed: an integer from 0 to 2^63-1"));
  EXPECT_THAT(ParseError(R"({"t": {"dtype": "U8", "shape": ["1"], "data_offsets": [0, 1]}})", {0}),
              HasSubstr("invalid shape[0] = \"1\""));
  EXPECT_THAT(ParseError(R"({"t": {"dtype": "U8", "shape": [1], "data_offsets": "0,1"}})", {0}),
              HasSubstr("invalid data_offsets = \"0,1\"; allowed: [begin, end], two non-negative "
                        "integers with begin <= end"));
}

TEST(SafetensorsValidationTest, UnknownDType) {
  EXPECT_THAT(ParseError(R"({"t": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})",
                         std::vector<uint8_t>(8)),
              HasSubstr("test.safetensors: tensor \"t\": invalid dtype = \"F64\"; allowed: F32, "
                        "F16, BF16, I32, I64, U8"));
}

TEST(SafetensorsValidationTest, NegativeOrTooLargeDims) {
  EXPECT_THAT(ParseError(R"({"t": {"dtype": "U8", "shape": [2, -1], "data_offsets": [0, 0]}})"),
              HasSubstr("tensor \"t\": invalid shape[1] = -1; allowed: an integer from 0"));
  EXPECT_THAT(
      ParseError(
          R"({"t": {"dtype": "U8", "shape": [9223372036854775808], "data_offsets": [0, 0]}})"),
      HasSubstr("invalid shape[0] = 9223372036854775808"));
  EXPECT_THAT(
      ParseError(R"({"t": {"dtype": "U8", "shape": [1e400], "data_offsets": [0, 0]}})"),
      HasSubstr("header is not valid JSON"));  // out of range for double: nlohmann rejects it
}

TEST(SafetensorsValidationTest, ElementCountOrByteSizeOverflow) {
  EXPECT_THAT(ParseError(R"({"t": {"dtype": "U8", "shape": [4294967296, 4294967296],)"
                         R"( "data_offsets": [0, 0]}})"),
              HasSubstr("invalid shape = [4294967296,4294967296]; allowed: a shape whose element "
                        "count fits in int64"));
  EXPECT_THAT(ParseError(R"({"t": {"dtype": "F32", "shape": [4611686018427387904],)"
                         R"( "data_offsets": [0, 0]}})"),
              HasSubstr("size in bytes (4611686018427387904 x 4 bytes) fits in int64"));
  // A 0 dim makes the tensor empty whatever the other dims are: no overflow.
  const SafetensorsFile file = ParseSafetensors(
      MakeFile(R"({"t": {"dtype": "I64", "shape": [0, 4611686018427387904, 4611686018427387904],)"
               R"( "data_offsets": [0, 0]}})"),
      kSource);
  EXPECT_EQ(file.at("t").num_elements(), 0);
}

TEST(SafetensorsValidationTest, DataOffsetsNotTwoOrderedNonNegativeIntegers) {
  const std::string prefix = R"({"t": {"dtype": "U8", "shape": [2], "data_offsets": )";
  for (std::string_view offsets : {"[0]", "[0, 2, 2]", "[]", "[-1, 1]", "[0, 2.0]", "[0, \"2\"]",
                                   "[0, null]", "[0, 18446744073709551616]"}) {
    EXPECT_THAT(ParseError(prefix + std::string(offsets) + "}}", {1, 2}),
                HasSubstr("tensor \"t\": invalid data_offsets = "))
        << offsets;
  }
  EXPECT_THAT(ParseError(prefix + "[2, 0]}}", {1, 2}),
              HasSubstr("invalid data_offsets = [2,0]; allowed: begin <= end"));
}

TEST(SafetensorsValidationTest, ByteSizeOfShapeAndDTypeDiffersFromTheRange) {
  EXPECT_THAT(ParseError(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})",
                         std::vector<uint8_t>(8)),
              HasSubstr("tensor \"t\": invalid data_offsets = [0,4]; allowed: a range of 8 bytes "
                        "(2 elements of shape [2] x 4 bytes for F32)"));
  EXPECT_THAT(ParseError(R"({"t": {"dtype": "BF16", "shape": [], "data_offsets": [0, 4]}})",
                         std::vector<uint8_t>(4)),
              HasSubstr("allowed: a range of 2 bytes"));
}

TEST(SafetensorsValidationTest, RangeOutsideTheDataBuffer) {
  EXPECT_THAT(ParseError(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
                         std::vector<uint8_t>(7)),
              HasSubstr("tensor \"t\": invalid data_offsets = [0,8]; allowed: a range within the "
                        "7-byte data buffer"));
  // Offsets near 2^64: begin + size must not wrap around into the buffer.
  EXPECT_THAT(ParseError(R"({"t": {"dtype": "U8", "shape": [7], "data_offsets": )"
                         R"([18446744073709551608, 18446744073709551615]}})",
                         std::vector<uint8_t>(8)),
              HasSubstr("a range within the 8-byte data buffer"));
  // An empty tensor past the end is outside too.
  EXPECT_THAT(ParseError(R"({"t": {"dtype": "U8", "shape": [0], "data_offsets": [9, 9]}})",
                         std::vector<uint8_t>(8)),
              HasSubstr("within the 8-byte data buffer"));
}

TEST(SafetensorsValidationTest, OverlappingRanges) {
  EXPECT_THAT(ParseError(R"({"b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]},)"
                         R"( "a": {"dtype": "U8", "shape": [5], "data_offsets": [0, 5]}})",
                         std::vector<uint8_t>(8)),
              HasSubstr("test.safetensors: tensors \"a\" (data_offsets [0, 5]) and \"b\" "
                        "(data_offsets [4, 8]) overlap"));
  EXPECT_THAT(ParseError(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                         R"( "b": {"dtype": "I32", "shape": [], "data_offsets": [0, 4]}})",
                         std::vector<uint8_t>(4)),
              HasSubstr("overlap"));
  // Adjacent ranges, and an empty tensor inside another's range, share no bytes.
  EXPECT_EQ(ParseError(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                       R"( "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]},)"
                       R"( "c": {"dtype": "F32", "shape": [0], "data_offsets": [2, 2]}})",
                       std::vector<uint8_t>(8)),
            "<no error>");
}

// A NUL byte in the header is refused: the JSON parser stopped there and dropped the rest (a
// second tensor, invalid UTF-8) without a word.
TEST(SafetensorsValidationTest, ANulByteInTheHeaderIsRefused) {
  const std::string header =
      std::string(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]})") + '\0' +
      R"(,"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})";
  EXPECT_THAT(ParseError(header, {1, 2}), HasSubstr("test.safetensors: header has a NUL byte at "
                                                    "offset 52"));
  EXPECT_THAT(ParseError(std::string("{}") + '\0'), HasSubstr("NUL byte at offset 2"));
}

// Many tensors parse in linear time: the duplicate-key check ran as a parser callback, which
// rescans the parent object whenever an object closes (20,000 tensors took 2.8 s).
TEST(SafetensorsValidationTest, ManyTensorsParseQuickly) {
  std::string header = "{";
  const int n = 50000;
  for (int i = 0; i < n; ++i) {
    header += fmt::format(R"({}"t{}":{{"dtype":"U8","shape":[1],"data_offsets":[{},{}]}})",
                          i == 0 ? "" : ",", i, i, i + 1);
  }
  header += "}";
  const auto start = std::chrono::steady_clock::now();
  const SafetensorsFile file = ParseSafetensors(MakeFile(header, std::vector<uint8_t>(n)), kSource);
  EXPECT_EQ(file.tensors.size(), static_cast<size_t>(n));
  // (Quadratic, 50,000 took ~17 s; linear, well under one even under the sanitizers.)
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 8.0);
}

// Tensors built or changed by hand: values() of data that is not the shape's size, and a dtype
// outside the enum (it was written as "?", which nothing reads back), are refused.
TEST(SafetensorsValidationTest, HandMadeTensorsAreCheckedBeforeUse) {
  Tensor t{DType::kF32, {2}, std::vector<uint8_t>(5)};
  EXPECT_THAT([&] { (void)t.values<float>(); },
              ::testing::ThrowsMessage<Error>(HasSubstr(
                  "Tensor::values: invalid data.size() = 5; allowed: 8 (2 elements of 4 bytes")));
  SafetensorsFile file;
  file.tensors["odd"] = Tensor{static_cast<DType>(99), {}, {}};
  EXPECT_THAT([&] { (void)SerializeSafetensors(file); },
              ::testing::ThrowsMessage<Error>(HasSubstr("tensor \"odd\": invalid dtype = 99")));
}

TEST(SafetensorsValidationTest, DuplicateKeys) {
  const std::string entry = R"({"dtype": "U8", "shape": [1], "data_offsets": [0, 1]})";
  EXPECT_THAT(ParseError(R"({"t": )" + entry + R"(, "t": )" + entry + "}", {0}),
              HasSubstr("test.safetensors: header has the key \"t\" twice in one object"));
  EXPECT_THAT(ParseError(R"({"t": {"dtype": "U8", "shape": [1], "dtype": "F32",)"
                         R"( "data_offsets": [0, 1]}})",
                         {0}),
              HasSubstr("header has the key \"dtype\" twice in one object (inside \"t\")"));
  EXPECT_THAT(ParseError(R"({"__metadata__": {"k": "a", "k": "b"}})"),
              HasSubstr("key \"k\" twice in one object (inside \"__metadata__\")"));
  // Equal keys in different objects are fine.
  EXPECT_EQ(ParseError(R"({"__metadata__": {"t": "x"}, "t": )" + entry + "}", {0}), "<no error>");
}

TEST(SafetensorsValidationTest, MetadataNotAnObjectOfStrings) {
  EXPECT_THAT(ParseError(R"({"__metadata__": ["a"]})"),
              HasSubstr("test.safetensors: __metadata__: invalid value = (an array of 1 "
                        "elements); allowed: an object of string values"));
  EXPECT_THAT(ParseError(R"({"__metadata__": {"step": 3}})"),
              HasSubstr("__metadata__: invalid value of \"step\" = 3; allowed: a string"));
}

// Deep nesting neither exhausts the stack nor the memory: it is refused at the first level past
// what a valid header needs (a 10 MB run of '[' took 540 MB when it was parsed whole).
TEST(SafetensorsValidationTest, DeeplyNestedHeadersAreRefusedAtTheDepthLimit) {
  const int depth = 200000;
  std::string nested = R"({"t": )" + std::string(depth, '[') + std::string(depth, ']') + "}";
  EXPECT_THAT(ParseError(nested), HasSubstr("test.safetensors: header nests deeper than 8 levels"));
  std::string objects;
  for (int i = 0; i < depth; ++i) objects += R"({"a":)";
  objects += "1" + std::string(depth, '}');
  EXPECT_THAT(ParseError(objects), HasSubstr("header nests deeper than 8 levels"));
  EXPECT_THAT(ParseError(std::string(depth, '[')), HasSubstr("header nests deeper than 8 levels"));
  // Up to the limit, the schema checks answer as before.
  EXPECT_THAT(ParseError(R"({"t": [[[[[1]]]]]})"), HasSubstr("tensor \"t\": invalid entry"));
}

TEST(SafetensorsValidationTest, LongAndControlCharacterNamesAreQuotedAndShortened) {
  const std::string message =
      ParseError(R"({")" + std::string("bad\\nname") + std::string(1000, 'x') + R"(": 1})");
  EXPECT_THAT(message, AllOf(HasSubstr("tensor \"bad\\nname"), HasSubstr("... (1008 bytes)")));
  EXPECT_LT(message.size(), 400u);
}

// ------------------------------------------------------------------------------------------------
// Fuzzing: corrupt a valid file in many ways; parsing must succeed or throw tqkv::Error, nothing
// else, and whatever it accepts must be self-consistent.

struct Outcome {
  bool accepted = false;
  std::string error;  // the tqkv::Error message when not accepted
};

// Parses `bytes`. Fails the test on any exception other than tqkv::Error, and on an accepted file
// whose tensors are not self-consistent.
Outcome ParseAcceptsOrThrowsError(const std::vector<uint8_t>& bytes) {
  try {
    const SafetensorsFile file = ParseSafetensors(bytes, kSource);
    for (const auto& [name, tensor] : file.tensors) {
      EXPECT_EQ(static_cast<int64_t>(tensor.data.size()),
                tensor.num_elements() * DTypeSize(tensor.dtype))
          << name;
    }
    return {true, ""};
  } catch (const Error& e) {
    return {false, e.what()};
  } catch (const std::exception& e) {
    ADD_FAILURE() << "unexpected exception type: " << e.what();
  } catch (...) {
    ADD_FAILURE() << "unexpected non-std exception";
  }
  return {false, "<unexpected exception>"};
}

TEST(SafetensorsFuzzTest, EveryTruncationIsRejectedCleanly) {
  const std::vector<uint8_t> bytes = SerializeSafetensors(EveryDTypeFile());
  int accepted = 0;
  for (size_t size = 0; size <= bytes.size(); ++size) {
    accepted += ParseAcceptsOrThrowsError({bytes.begin(), bytes.begin() + size}).accepted;
  }
  // Only the complete file is valid: the last tensor's range ends at the end of the file.
  EXPECT_EQ(accepted, 1);
}

// Characters that keep a header JSON-like, so mutations reach the schema checks instead of
// stopping at the JSON parser.
constexpr std::string_view kJsonChars = "0123456789-+.eE,:[]{}\" _\\nulltrue";

TEST(SafetensorsFuzzTest, RandomByteCorruptionIsAcceptedOrRejectedWithError) {
  const std::vector<uint8_t> original = SerializeSafetensors(EveryDTypeFile());
  uint64_t header_size = 0;
  std::memcpy(&header_size, original.data(), 8);
  const size_t data_begin = 8 + header_size;

  std::mt19937 rng(20240611);
  auto uniform = [&](size_t lo, size_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<size_t>(lo, hi)(rng);
  };
  int accepted = 0;
  constexpr int kIterations = 4000;
  for (int iteration = 0; iteration < kIterations; ++iteration) {
    std::vector<uint8_t> bytes = original;
    const int mutations = static_cast<int>(uniform(1, 4));
    for (int m = 0; m < mutations; ++m) {
      switch (uniform(0, 5)) {
        case 0:  // flip a bit anywhere
          bytes[uniform(0, bytes.size() - 1)] ^= static_cast<uint8_t>(1u << uniform(0, 7));
          break;
        case 1:  // overwrite a byte of the length prefix
          bytes[uniform(0, 7)] = static_cast<uint8_t>(uniform(0, 255));
          break;
        case 2: {  // a plausible but wrong header length
          const uint64_t size = uniform(0, bytes.size());
          std::memcpy(bytes.data(), &size, 8);
          break;
        }
        case 3:  // overwrite a header byte with anything
          bytes[uniform(8, data_begin - 1)] = static_cast<uint8_t>(uniform(0, 255));
          break;
        case 4:  // overwrite a header byte with a JSON character
          bytes[uniform(8, data_begin - 1)] = kJsonChars[uniform(0, kJsonChars.size() - 1)];
          break;
        case 5:  // overwrite a data byte: always still valid
          bytes[uniform(data_begin, bytes.size() - 1)] = static_cast<uint8_t>(uniform(0, 255));
          break;
      }
    }
    // Sometimes also truncate or extend (last, so the index ranges above stay valid).
    if (uniform(0, 4) == 0) bytes.resize(uniform(0, bytes.size() + 16), 0);
    accepted += ParseAcceptsOrThrowsError(bytes).accepted;
  }
  // Both outcomes must occur, or the mutations are not exercising the parser.
  EXPECT_GT(accepted, kIterations / 50);
  EXPECT_LT(accepted, kIterations / 2);
}

// Edits the header text and re-frames it with the right length, so most mutants get past the
// framing and JSON checks and exercise the per-tensor and overlap checks.
TEST(SafetensorsFuzzTest, HeaderEditsAreAcceptedOrRejectedWithError) {
  const std::vector<uint8_t> original = SerializeSafetensors(EveryDTypeFile());
  uint64_t header_size = 0;
  std::memcpy(&header_size, original.data(), 8);
  const std::string header(original.begin() + 8, original.begin() + 8 + header_size);
  const std::vector<uint8_t> data(original.begin() + 8 + header_size, original.end());

  std::mt19937 rng(7);
  auto uniform = [&](size_t lo, size_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<size_t>(lo, hi)(rng);
  };
  int accepted = 0;
  int entry_rejections = 0;  // errors about one tensor, or about two overlapping
  constexpr int kIterations = 4000;
  for (int iteration = 0; iteration < kIterations; ++iteration) {
    std::string text = header;
    const int edits = static_cast<int>(uniform(1, 3));
    for (int e = 0; e < edits && !text.empty(); ++e) {
      const size_t at = uniform(0, text.size() - 1);
      switch (uniform(0, 4)) {
        case 0: {  // change a digit: shapes and offsets stay well-formed JSON but go wrong
          const size_t digit = text.find_first_of("0123456789", at);
          if (digit != std::string::npos) text[digit] = static_cast<char>('0' + uniform(0, 9));
          break;
        }
        case 1:  // insert a JSON character
          text.insert(at, 1, kJsonChars[uniform(0, kJsonChars.size() - 1)]);
          break;
        case 2:  // delete a character
          text.erase(at, 1);
          break;
        case 3: {  // copy a piece of the header elsewhere (duplicates keys, entries, numbers)
          const std::string piece = text.substr(uniform(0, text.size() - 1), uniform(1, 40));
          text.insert(at, piece);
          break;
        }
        case 4:  // overwrite with any byte
          text[at] = static_cast<char>(uniform(0, 255));
          break;
      }
    }
    std::vector<uint8_t> tail = data;
    if (uniform(0, 4) == 0) tail.resize(uniform(0, data.size() + 16), 0);
    const Outcome outcome = ParseAcceptsOrThrowsError(MakeFile(text, tail));
    accepted += outcome.accepted;
    if (outcome.error.find("tensor") != std::string::npos ||
        outcome.error.find("__metadata__") != std::string::npos) {
      ++entry_rejections;
    }
  }
  EXPECT_GT(accepted, kIterations / 50);
  EXPECT_GT(entry_rejections, kIterations / 10);
}

// ------------------------------------------------------------------------------------------------
// Writing

bool DirectoryHasOnly(const std::string& dir, const std::vector<std::string>& names) {
  std::vector<std::string> present;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    present.push_back(entry.path().filename().string());
  }
  std::sort(present.begin(), present.end());
  std::vector<std::string> expected = names;
  std::sort(expected.begin(), expected.end());
  return present == expected;
}

TEST(SafetensorsWriteTest, UnwritablePathThrowsAndLeavesNoFile) {
  const std::string path = "/nonexistent-tqkv-dir/sub/out.safetensors";
  try {
    WriteSafetensors(path, EveryDTypeFile());
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("WriteSafetensors"), HasSubstr(path),
                                HasSubstr("No such file or directory")));
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(SafetensorsWriteTest, ATargetThatIsNotARegularFileIsNotReplaced) {
  const std::string dir = TempPath("not_regular");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/target.safetensors/inner");
  for (const std::string target : {dir + "/target.safetensors", std::string("/dev/null")}) {
    try {
      WriteSafetensors(target, EveryDTypeFile());
      ADD_FAILURE() << "no throw for " << target;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), AllOf(HasSubstr(target), HasSubstr("is not a regular file")));
    }
  }
  EXPECT_TRUE(DirectoryHasOnly(dir, {"target.safetensors"}));
  EXPECT_TRUE(std::filesystem::is_directory(dir + "/target.safetensors"));
  EXPECT_TRUE(std::filesystem::is_character_file("/dev/null"));
}

TEST(SafetensorsWriteTest, WritingThroughASymbolicLinkWritesItsTarget) {
  const std::string dir = TempPath("symlink");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/data");
  WriteSafetensors(dir + "/data/real.safetensors", SafetensorsFile{});
  std::filesystem::create_symlink("data/real.safetensors", dir + "/link.safetensors");
  WriteSafetensors(dir + "/link.safetensors", EveryDTypeFile());
  EXPECT_TRUE(std::filesystem::is_symlink(dir + "/link.safetensors"));
  EXPECT_EQ(ReadSafetensors(dir + "/data/real.safetensors").tensors.size(),
            EveryDTypeFile().tensors.size());
  EXPECT_TRUE(DirectoryHasOnly(dir + "/data", {"real.safetensors"}));
  // A dangling link: its target is created, the link stays.
  std::filesystem::create_symlink("data/new.safetensors", dir + "/dangling.safetensors");
  WriteSafetensors(dir + "/dangling.safetensors", EveryDTypeFile());
  EXPECT_TRUE(std::filesystem::is_symlink(dir + "/dangling.safetensors"));
  EXPECT_TRUE(std::filesystem::is_regular_file(dir + "/data/new.safetensors"));
}

// The same all-or-nothing write for any bytes (the CLI's JSON reports): the content replaces the
// file's, and errors carry the caller's prefix and leave the target as it was.
TEST(SafetensorsWriteTest, WriteFileAtomicallyReplacesOrLeavesTheFile) {
  const std::string dir = TempPath("atomic_text");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/a_directory");
  const std::string path = dir + "/report.json";
  for (std::string_view text : {std::string_view("{\"first\": 1}\n"), std::string_view("{}\n")}) {
    WriteFileAtomically(path, std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()),
                        "tqkv test --json");
    std::ifstream in(path);
    const std::string read((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(read, text);
  }
  EXPECT_THAT([&] { WriteFileAtomically(dir + "/a_directory", {}, "tqkv test --json"); },
              ::testing::ThrowsMessage<Error>(
                  AllOf(HasSubstr("tqkv test --json: "), HasSubstr("is not a regular file"))));
  EXPECT_TRUE(DirectoryHasOnly(dir, {"a_directory", "report.json"}));
}

TEST(SafetensorsWriteTest, ReadOnlyDirectoryThrowsAndLeavesNoFile) {
  if (geteuid() == 0) GTEST_SKIP() << "root ignores directory permissions";
  const std::string dir = TempPath("read_only");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  chmod(dir.c_str(), 0555);
  EXPECT_THROW(WriteSafetensors(dir + "/out.safetensors", EveryDTypeFile()), Error);
  chmod(dir.c_str(), 0755);
  EXPECT_TRUE(DirectoryHasOnly(dir, {}));
}

TEST(SafetensorsWriteTest, InvalidTensorThrowsBeforeCreatingAnything) {
  const std::string dir = TempPath("invalid_tensor");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  SafetensorsFile file;
  file.tensors["t"] = Tensor{DType::kF32, {2}, std::vector<uint8_t>(7)};
  try {
    WriteSafetensors(dir + "/out.safetensors", file);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("WriteSafetensors(" + dir +
                                          "/out.safetensors): tensor "
                                          "\"t\": invalid data.size() = 7"),
                                HasSubstr("2 elements of shape [2] x 4 bytes for F32")));
  }
  EXPECT_TRUE(DirectoryHasOnly(dir, {}));

  file.tensors["t"] = Tensor{DType::kF32, {-2}, {}};
  EXPECT_THAT([&] { SerializeSafetensors(file); },
              ::testing::ThrowsMessage<Error>(HasSubstr("shape[0] = -2")));
  file.tensors.clear();
  file.tensors["__metadata__"] = Tensor{DType::kU8, {0}, {}};
  EXPECT_THAT([&] { SerializeSafetensors(file); },
              ::testing::ThrowsMessage<Error>(HasSubstr("invalid tensor name = \"__metadata__\"")));
  file.tensors.clear();
  file.metadata["k"] = "\xff";
  EXPECT_THAT([&] { SerializeSafetensors(file); },
              ::testing::ThrowsMessage<Error>(HasSubstr("not valid UTF-8")));
}

TEST(SafetensorsReadTest, MissingFileThrowsNamingIt) {
  const std::string path = TempPath("does_not_exist.safetensors");
  EXPECT_THAT([&] { ReadSafetensors(path); },
              ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("cannot open"), HasSubstr(path))));
}

TEST(SafetensorsReadTest, DirectoryThrowsInsteadOfReadingIt) {
  const std::string dir = TempPath("a_directory.safetensors");
  std::filesystem::create_directories(dir);
  EXPECT_THAT([&] { ReadSafetensors(dir); },
              ::testing::ThrowsMessage<Error>(HasSubstr(dir + " is not a regular file")));
}

TEST(SafetensorsReadTest, ErrorsFromAFileNameThePath) {
  const std::string path = TempPath("corrupt.safetensors");
  {
    std::ofstream out(path, std::ios::binary);
    out << "short";
  }
  EXPECT_THAT([&] { ReadSafetensors(path); },
              ::testing::ThrowsMessage<Error>(StartsWith(path + ": file is 5 bytes")));
}

}  // namespace
}  // namespace tqkv
