#include "model/gguf.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/gguf_writer.h"
#include "quant/numerics.h"
#include "runtime/error.h"

namespace tqkv::model {
namespace {

using ::testing::HasSubstr;

using Writer = GgufWriter;

uint16_t Half(float x) { return FloatToHalfBits(x); }

// A file with metadata of every scalar kind, a string array, and tensors of each dequantized type.
struct Sample {
  std::vector<uint8_t> bytes;
  std::vector<float> f32, f16, q4_1, q8_0, q4_0;
};

Sample MakeSample(uint32_t alignment = 32) {
  Sample s;
  Writer w;
  w.Put<uint32_t>(0x46554747).Put<uint32_t>(3).Put<uint64_t>(5).Put<uint64_t>(8);
  w.Str("general.architecture").Put<uint32_t>(8).Str("llama");
  w.Str("general.alignment").Put<uint32_t>(4).Put<uint32_t>(alignment);
  w.Str("llama.block_count").Put<uint32_t>(4).Put<uint32_t>(30);
  w.Str("llama.rope.freq_base").Put<uint32_t>(6).Put<float>(100000.0f);
  w.Str("neg").Put<uint32_t>(11).Put<int64_t>(-5);
  w.Str("flag").Put<uint32_t>(7).Put<uint8_t>(1);
  w.Str("huge").Put<uint32_t>(10).Put<uint64_t>(std::numeric_limits<uint64_t>::max());
  w.Str("tokenizer.ggml.tokens").Put<uint32_t>(9).Put<uint32_t>(8).Put<uint64_t>(3);
  w.Str("a").Str("bc").Str("\xc4\xa0the");

  // Tensor table: f32 [3, 2], f16 [4], q4_1 [32, 2], q8_0 [32], q4_0 [32].
  std::vector<uint8_t> data;
  auto tensor = [&](const std::string& name, std::vector<uint64_t> dims, uint32_t type,
                    const std::vector<uint8_t>& payload) {
    while (data.size() % alignment != 0) data.push_back(0);
    w.Str(name).Put<uint32_t>(static_cast<uint32_t>(dims.size()));
    for (uint64_t d : dims) w.Put<uint64_t>(d);
    w.Put<uint32_t>(type).Put<uint64_t>(data.size());
    data.insert(data.end(), payload.begin(), payload.end());
  };
  auto append = [](std::vector<uint8_t>& v, const void* p, size_t n) {
    v.insert(v.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
  };
  {
    std::vector<uint8_t> p;
    for (int i = 0; i < 6; ++i) {
      const float x = 0.5f * i - 1.25f;
      s.f32.push_back(x);
      append(p, &x, 4);
    }
    tensor("t.f32", {3, 2}, 0, p);
  }
  {
    std::vector<uint8_t> p;
    for (float x : {1.0f, -2.5f, 0.099975586f, 65504.0f}) {
      const uint16_t h = Half(x);
      s.f16.push_back(HalfBitsToFloat(h));
      append(p, &h, 2);
    }
    tensor("t.f16", {4}, 1, p);
  }
  {
    std::vector<uint8_t> p;
    for (int blk = 0; blk < 2; ++blk) {
      const uint16_t d = Half(0.125f * (blk + 1)), m = Half(-1.0f + blk);
      append(p, &d, 2);
      append(p, &m, 2);
      float expect[32];
      for (int j = 0; j < 16; ++j) {
        const int lo = (j + blk) % 16, hi = 15 - j;
        p.push_back(static_cast<uint8_t>(lo | (hi << 4)));
        expect[j] = lo * HalfBitsToFloat(d) + HalfBitsToFloat(m);
        expect[j + 16] = hi * HalfBitsToFloat(d) + HalfBitsToFloat(m);
      }
      s.q4_1.insert(s.q4_1.end(), expect, expect + 32);
    }
    tensor("t.q4_1", {32, 2}, 3, p);
  }
  {
    std::vector<uint8_t> p;
    const uint16_t d = Half(0.01f);
    append(p, &d, 2);
    for (int j = 0; j < 32; ++j) {
      const int8_t q = static_cast<int8_t>(j * 8 - 128);
      p.push_back(static_cast<uint8_t>(q));
      s.q8_0.push_back(q * HalfBitsToFloat(d));
    }
    tensor("t.q8_0", {32}, 8, p);
  }
  {
    std::vector<uint8_t> p;
    const uint16_t d = Half(-0.5f);
    append(p, &d, 2);
    float expect[32];
    for (int j = 0; j < 16; ++j) {
      p.push_back(static_cast<uint8_t>(j | ((15 - j) << 4)));
      expect[j] = (j - 8) * HalfBitsToFloat(d);
      expect[j + 16] = (15 - j - 8) * HalfBitsToFloat(d);
    }
    s.q4_0.assign(expect, expect + 32);
    tensor("t.q4_0", {32}, 2, p);
  }
  w.Align(alignment);
  w.bytes.insert(w.bytes.end(), data.begin(), data.end());
  s.bytes = std::move(w.bytes);
  return s;
}

TEST(GgufTest, ReadsMetadataOfEveryKind) {
  const GgufFile f = GgufFile::Parse(MakeSample().bytes, "sample");
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.GetString("general.architecture"), "llama");
  EXPECT_EQ(f.GetInt("llama.block_count"), 30);
  EXPECT_EQ(f.GetInt("neg"), -5);
  EXPECT_FLOAT_EQ(f.GetFloat("llama.rope.freq_base"), 100000.0);
  ASSERT_NE(f.Find("flag"), nullptr);
  EXPECT_EQ(f.Find("flag")->type, GgufType::kBool);
  EXPECT_EQ(f.Find("flag")->i, 1);
  // A U64 past int64 is kept in `u`; GetInt names it instead of returning -1.
  EXPECT_EQ(f.Find("huge")->u, std::numeric_limits<uint64_t>::max());
  EXPECT_THAT([&] { f.GetInt("huge"); },
              ::testing::ThrowsMessage<Error>(
                  HasSubstr("metadata 'huge' = 18446744073709551615 is past int64")));
  EXPECT_EQ(f.GetStrings("tokenizer.ggml.tokens"),
            (std::vector<std::string>{"a", "bc", "\xc4\xa0the"}));
  EXPECT_EQ(f.Find("missing"), nullptr);
  EXPECT_THAT([&] { f.GetString("missing"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("no metadata 'missing'")));
  EXPECT_THAT([&] { f.GetInt("general.architecture"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("is not an integer")));
  EXPECT_THAT([&] { f.GetStrings("llama.block_count"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("is not an array of strings")));
}

TEST(GgufTest, TensorTableAndDequantizationOfEveryType) {
  for (uint32_t alignment : {32u, 64u}) {
    const Sample s = MakeSample(alignment);
    const GgufFile f = GgufFile::Parse(s.bytes, "sample");
    ASSERT_EQ(f.tensors().size(), 5u);
    const GgufTensor& t = f.Tensor("t.f32");
    EXPECT_EQ(t.dims, (std::vector<int64_t>{3, 2}));
    EXPECT_EQ(t.num_elements, 6);
    EXPECT_EQ(t.num_bytes, 24);
    EXPECT_EQ(f.Dequantize(t), s.f32);
    EXPECT_EQ(f.Dequantize(f.Tensor("t.f16")), s.f16);
    const GgufTensor& q41 = f.Tensor("t.q4_1");
    EXPECT_EQ(q41.num_bytes, 40);
    EXPECT_EQ(f.Dequantize(q41), s.q4_1);
    EXPECT_EQ(f.Dequantize(f.Tensor("t.q8_0")), s.q8_0);
    EXPECT_EQ(f.Dequantize(f.Tensor("t.q4_0")), s.q4_0);
    EXPECT_FALSE(f.HasTensor("t.none"));
    EXPECT_THAT([&] { f.Tensor("t.none"); },
                ::testing::ThrowsMessage<Error>(HasSubstr("no tensor 't.none'")));
  }
}

// Every prefix of a valid file is rejected with a message (never a crash or an out-of-bounds
// read: the ASan run of this test checks that too).
TEST(GgufTest, EveryTruncationIsAnError) {
  const std::vector<uint8_t> bytes = MakeSample().bytes;
  for (size_t n = 0; n < bytes.size(); ++n) {
    std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_THROW(GgufFile::Parse(std::move(cut), "cut"), Error) << "prefix of " << n << " bytes";
  }
}

TEST(GgufTest, CorruptHeadersNameTheProblem) {
  const std::vector<uint8_t> good = MakeSample().bytes;
  auto expect_error = [&](size_t at, std::vector<uint8_t> patch, const std::string& what) {
    std::vector<uint8_t> b = good;
    std::copy(patch.begin(), patch.end(), b.begin() + static_cast<std::ptrdiff_t>(at));
    EXPECT_THAT(
        [&] { GgufFile::Parse(b, "bad.gguf"); },
        ::testing::ThrowsMessage<Error>(::testing::AllOf(HasSubstr("bad.gguf"), HasSubstr(what))))
        << what;
  };
  expect_error(0, {'G', 'G', 'U', 'X'}, "is not 'GGUF'");
  expect_error(4, {1, 0, 0, 0}, "version 1");
  expect_error(8, {0xff, 0xff, 0xff, 0xff, 0xff, 0, 0, 0}, "tensor count");
  expect_error(16, {0xff, 0xff, 0xff, 0xff, 0xff, 0, 0, 0}, "metadata count");
  // The first key's length: larger than the file.
  expect_error(24, {0xff, 0xff, 0xff, 0x7f, 0, 0, 0, 0}, "truncated");
  // The first value's type (after "general.architecture"): 13 is not a type.
  expect_error(24 + 8 + 20, {13, 0, 0, 0}, "unknown value type 13");
  // general.alignment = 24.
  const size_t align_at = 24 + 8 + 20 + 4 + 8 + 5 + 8 + 17 + 4;
  expect_error(align_at, {24, 0, 0, 0}, "not a power of two");
}

TEST(GgufTest, OpeningADirectoryIsAnError) {
  const std::string dir = ::testing::TempDir();
  EXPECT_THAT([&] { GgufFile::Open(dir); },
              ::testing::ThrowsMessage<Error>(HasSubstr("not a regular file")));
  EXPECT_THAT([&] { GgufFile::Open(dir + "/no such file.gguf"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("cannot open")));
}

TEST(GgufTest, TensorEntriesAreChecked) {
  // A file with one tensor whose fields are set per case.
  auto file = [](uint32_t n_dims, uint64_t dim0, uint32_t type, uint64_t offset,
                 size_t data_bytes) {
    Writer w;
    w.Put<uint32_t>(0x46554747).Put<uint32_t>(3).Put<uint64_t>(1).Put<uint64_t>(0);
    w.Str("w").Put<uint32_t>(n_dims);
    for (uint32_t d = 0; d < n_dims; ++d) w.Put<uint64_t>(d == 0 ? dim0 : 1);
    w.Put<uint32_t>(type).Put<uint64_t>(offset);
    w.Align(32);
    w.bytes.resize(w.bytes.size() + data_bytes, 0);
    return w.bytes;
  };
  EXPECT_NO_THROW(GgufFile::Parse(file(1, 32, 3, 0, 20), "ok"));
  auto expect_error = [&](std::vector<uint8_t> b, const std::string& what) {
    EXPECT_THAT([&] { GgufFile::Parse(std::move(b), "t.gguf"); },
                ::testing::ThrowsMessage<Error>(HasSubstr(what)))
        << what;
  };
  expect_error(file(0, 32, 3, 0, 20), "0 dimensions");
  expect_error(file(5, 32, 3, 0, 20), "5 dimensions");
  expect_error(file(1, 0, 3, 0, 20), "dimension 0 = 0");
  expect_error(file(1, 32, 99, 0, 20), "unknown type 99");
  expect_error(file(1, 31, 3, 0, 20), "not a multiple of Q4_1's block of 32");
  expect_error(file(1, 32, 3, 8, 20), "not aligned to 32");
  expect_error(file(1, 32, 3, 0, 19), "past the end of the file");
  expect_error(file(1, 64, 3, 0, 20), "past the end of the file");
  // Two tensors sharing bytes: [32, 2] Q4_1 (40 bytes) at 0 and the second at 32, inside it; at 64
  // the two are apart.
  auto two = [](uint64_t second_offset) {
    Writer w;
    w.Put<uint32_t>(0x46554747).Put<uint32_t>(3).Put<uint64_t>(2).Put<uint64_t>(0);
    w.Str("a").Put<uint32_t>(2).Put<uint64_t>(32).Put<uint64_t>(2);
    w.Put<uint32_t>(3).Put<uint64_t>(0);
    w.Str("b").Put<uint32_t>(1).Put<uint64_t>(32);
    w.Put<uint32_t>(3).Put<uint64_t>(second_offset);
    w.Align(32);
    w.bytes.resize(w.bytes.size() + 96, 0);
    return w.bytes;
  };
  EXPECT_NO_THROW(GgufFile::Parse(two(64), "apart.gguf"));
  expect_error(two(32),
               "tensor 'b' (data offset 32) begins inside tensor 'a' (40 bytes at data "
               "offset 0)");
  expect_error(two(0), "begins inside tensor");
  // Listed but not dequantized: Q4_K.
  const GgufFile k = GgufFile::Parse(file(1, 256, 12, 0, 144), "k.gguf");
  EXPECT_THAT([&] { k.Dequantize(k.Tensor("w")); },
              ::testing::ThrowsMessage<Error>(HasSubstr("type Q4_K")));
}

// The real model of issue 36 (tools/test.sh fetches it: tools/model/fetch_model.py), against
// values from an independent reader, llama.cpp's gguf-py (tools/model/gguf_reference.py): the
// metadata, the tensor count, and for seven tensors of four types their dims, type, first and
// last elements and sums after dequantization.
TEST(GgufTest, SmolLm2MatchesGgufPy) {
  const char* path = std::getenv("TQKV_SMOLLM2_GGUF");
  if (path == nullptr || *path == '\0') GTEST_SKIP() << "TQKV_SMOLLM2_GGUF not set";
  std::ifstream in("model/testdata/smollm2_gguf_reference.json");
  ASSERT_TRUE(in) << "model/testdata/smollm2_gguf_reference.json";
  const nlohmann::json ref = nlohmann::json::parse(in);
  const GgufFile f = GgufFile::Open(path);
  EXPECT_EQ(f.tensors().size(), ref["num_tensors"].get<size_t>());
  for (const auto& [key, value] : ref["metadata"].items()) {
    if (key == "num_tokens") {
      EXPECT_EQ(f.GetStrings("tokenizer.ggml.tokens").size(), value.get<size_t>());
    } else if (key == "num_merges") {
      EXPECT_EQ(f.GetStrings("tokenizer.ggml.merges").size(), value.get<size_t>());
    } else if (value.is_string()) {
      EXPECT_EQ(f.GetString(key), value.get<std::string>()) << key;
    } else if (value.is_number_integer()) {
      EXPECT_EQ(f.GetInt(key), value.get<int64_t>()) << key;
    } else {
      EXPECT_EQ(f.GetFloat(key), value.get<double>()) << key;
    }
  }
  for (const auto& [name, want] : ref["tensors"].items()) {
    SCOPED_TRACE(name);
    const GgufTensor& t = f.Tensor(name);
    EXPECT_EQ(t.dims, want["dims"].get<std::vector<int64_t>>());
    EXPECT_EQ(GgmlTypeName(t.type), want["type"].get<std::string>());
    const std::vector<float> x = f.Dequantize(t);
    const auto head = want["head"].get<std::vector<double>>();
    const auto tail = want["tail"].get<std::vector<double>>();
    for (size_t k = 0; k < head.size(); ++k) {
      EXPECT_EQ(x[k], head[k]) << "element " << k;
      EXPECT_EQ(x[x.size() - tail.size() + k], tail[k]) << "element " << x.size() - tail.size() + k;
    }
    double sum = 0.0, sum_sq = 0.0;
    for (float v : x) {
      sum += v;
      sum_sq += double{v} * v;
    }
    EXPECT_NEAR(sum, want["sum"].get<double>(), 1e-9 * (1.0 + sum_sq));
    EXPECT_NEAR(sum_sq, want["sum_sq"].get<double>(), 1e-9 * sum_sq);
  }
}

}  // namespace
}  // namespace tqkv::model
