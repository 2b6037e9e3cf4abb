#include "kvcache/cache_format.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "quant/preset.h"
#include "runtime/error.h"

namespace tqkv {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// The bf16 layout (quant/block_format.h) against formulas written out by hand: keys
// [block_size, H, D] then values [block_size, H, D], bf16.
TEST(Bf16BlockFormatTest, OffsetsMatchHandFormulasAndTileTheBlock) {
  for (int d : {64, 128, 256}) {
    for (int h : {1, 3, 8}) {
      for (int bs : {16, 32, 128}) {
        const Bf16BlockFormat f = MakeBf16BlockFormat(d, h, bs);
        ASSERT_EQ(f.block_bytes, int64_t{bs} * h * 2 * d * 2);
        EXPECT_EQ(f.SlotBytes(), 4 * d);
        std::vector<int> covered(static_cast<size_t>(f.block_bytes), 0);
        for (int p = 0; p < bs; ++p) {
          for (int head = 0; head < h; ++head) {
            EXPECT_EQ(f.KeyOffset(p, head), (int64_t{p} * h + head) * d * 2);
            EXPECT_EQ(f.ValueOffset(p, head), int64_t{bs} * h * d * 2 + (int64_t{p} * h + head) * d * 2);
            for (int64_t i = 0; i < 2 * d; ++i) {
              ++covered[static_cast<size_t>(f.KeyOffset(p, head) + i)];
              ++covered[static_cast<size_t>(f.ValueOffset(p, head) + i)];
            }
          }
        }
        for (int c : covered) ASSERT_EQ(c, 1);
      }
    }
  }
}

TEST(Bf16BlockFormatTest, RejectsBadSizes) {
  EXPECT_THROW(MakeBf16BlockFormat(0, 8, 16), Error);
  EXPECT_THROW(MakeBf16BlockFormat(96, 8, 16), Error);
  EXPECT_THROW(MakeBf16BlockFormat(128, 0, 16), Error);
  EXPECT_THROW(MakeBf16BlockFormat(128, 8, 0), Error);
}

TEST(CacheFormatTest, PresetsUseTheTurboQuantBlockFormat) {
  for (const Preset& p : AllPresets()) {
    const CacheFormat f = MakeCacheFormat(p.name, 128, 8, 16);
    const BlockFormat expect = MakeBlockFormat(p, 128, 8, 16);
    EXPECT_FALSE(f.bf16);
    EXPECT_EQ(f.name, p.name);
    EXPECT_EQ(f.block_bytes, expect.block_bytes);
    EXPECT_EQ(f.slot_bytes, expect.slot_bytes);
    EXPECT_EQ(f.turboquant.meta_offset, expect.meta_offset);
  }
  const CacheFormat b = MakeCacheFormat("bf16", 128, 8, 16);
  EXPECT_TRUE(b.bf16);
  EXPECT_EQ(b.block_bytes, 16 * 8 * 512);
  EXPECT_EQ(b.bf16_format.dtype, DType::kBF16);
  // fp16: the same layout and sizes, fp16 elements, its own name (so prefix-cache tags differ).
  const CacheFormat h = MakeCacheFormat("fp16", 128, 8, 16);
  EXPECT_TRUE(h.bf16);
  EXPECT_EQ(h.bf16_format.dtype, DType::kF16);
  EXPECT_EQ(h.block_bytes, b.block_bytes);
  EXPECT_EQ(h.slot_bytes, b.slot_bytes);
  EXPECT_NE(HashFormatTag(MakeFormatTag(h, 0)), HashFormatTag(MakeFormatTag(b, 0)));
  const CapacityReport r = ComputeCapacity(int64_t{1} << 30, "fp16", 32, 8, 128);
  EXPECT_EQ(r.format.num_tokens, r.bf16.num_tokens);
  EXPECT_DOUBLE_EQ(r.format.vs_bf16, 1.0);
  EXPECT_THAT(FormatCapacityTable(r), HasSubstr("fp16"));
}

TEST(CacheFormatTest, UnknownNameListsBf16AndThePresets) {
  try {
    MakeCacheFormat("fp8", 128, 8, 16);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("format = \"fp8\""), HasSubstr("bf16"), HasSubstr("fp16"),
                                HasSubstr("turboquant_4bit_nc")));
  }
  EXPECT_THROW(MakeCacheFormat("turboquant_4bit_nc", 96, 8, 16), Error);  // head_dim
}

TEST(CacheFormatTest, FormatTagNamesFormatAndRotation) {
  const FormatTag t = MakeFormatTag(MakeCacheFormat("turboquant_k3v4_nc", 64, 2, 32), 42);
  EXPECT_EQ(t.preset, "turboquant_k3v4_nc");
  EXPECT_EQ(t.head_dim, 64);
  EXPECT_EQ(t.block_size, 32);
  EXPECT_EQ(t.rotation_id, 42u);
}

// Llama-3-8B's shape (32 layers, 8 KV heads, D 128) in 80 GiB, worked by hand:
//   bf16: 16 tokens * 8 heads * 512 B = 64 KiB per layer-block, 2 MiB per block id
//         -> 40960 blocks, (40960 - 1) * 16 = 655344 tokens
//   4bit_nc: 16 * 8 * 134 = 17152 B per layer-block, 548864 B per block id
//         -> floor(85899345920 / 548864) = 156503 blocks, 156502 * 16 = 2504032 tokens
TEST(CapacityTest, Llama8bIn80GiB) {
  const CapacityReport r = ComputeCapacity(int64_t{80} << 30, "turboquant_4bit_nc", 32, 8, 128, 16);
  EXPECT_EQ(r.bf16.block_bytes, 65536);
  EXPECT_EQ(r.bf16.bytes_per_block, 2 << 20);
  EXPECT_EQ(r.bf16.bytes_per_token, 131072);
  EXPECT_EQ(r.bf16.num_blocks, 40960);
  EXPECT_EQ(r.bf16.num_tokens, 655344);
  EXPECT_DOUBLE_EQ(r.bf16.vs_bf16, 1.0);
  EXPECT_EQ(r.format.format, "turboquant_4bit_nc");
  EXPECT_EQ(r.format.block_bytes, 17152);
  EXPECT_EQ(r.format.bytes_per_block, 548864);
  EXPECT_EQ(r.format.bytes_per_token, 134 * 8 * 32);
  EXPECT_EQ(r.format.num_blocks, 156503);
  EXPECT_EQ(r.format.num_tokens, 2504032);
  EXPECT_NEAR(r.format.vs_bf16, 512.0 / 134, 1e-12);
}

TEST(CapacityTest, TooLittleMemoryHoldsNoTokens) {
  const CapacityReport r = ComputeCapacity(1 << 20, "turboquant_k8v4", 32, 8, 128, 16);
  EXPECT_EQ(r.format.num_blocks, 1);  // one block id is 32 * 25088 B = 784 KiB
  EXPECT_EQ(r.format.num_tokens, 0);  // ... and it would be the null block
  EXPECT_EQ(ComputeCapacity(0, "bf16", 1, 1, 64, 16).bf16.num_tokens, 0);
}

TEST(CapacityTest, RejectsBadArguments) {
  EXPECT_THROW(ComputeCapacity(-1, "bf16", 32, 8, 128), Error);
  EXPECT_THROW(ComputeCapacity(1 << 30, "bf16", 0, 8, 128), Error);
  EXPECT_THROW(ComputeCapacity(1 << 30, "nope", 32, 8, 128), Error);
  EXPECT_THROW(ComputeCapacity(1 << 30, "turboquant_3bit_nc", 32, 8, 128, 8), Error);
}

TEST(CapacityTest, TableShowsBothRows) {
  const std::string table =
      FormatCapacityTable(ComputeCapacity(int64_t{80} << 30, "turboquant_4bit_nc", 32, 8, 128, 16));
  EXPECT_THAT(table, HasSubstr("KV cache capacity in 80.00 GiB: 32 layers, 8 KV heads, "
                               "head_dim 128, block size 16\n"));
  EXPECT_THAT(table, HasSubstr("vs bf16"));
  EXPECT_THAT(table, HasSubstr("655,344"));
  EXPECT_THAT(table, HasSubstr("2,504,032"));
  EXPECT_THAT(table, HasSubstr("3.82x"));
  // bf16 first, then the format.
  EXPECT_LT(table.find("\nbf16 "), table.find("\nturboquant_4bit_nc "));
  EXPECT_EQ(std::count(table.begin(), table.end(), '\n'), 4);
  const std::string bf16_only = FormatCapacityTable(ComputeCapacity(1 << 30, "bf16", 2, 2, 64));
  EXPECT_EQ(std::count(bf16_only.begin(), bf16_only.end(), '\n'), 3);
}

}  // namespace
}  // namespace tqkv
