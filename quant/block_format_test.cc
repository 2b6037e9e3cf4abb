#include "quant/block_format.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>

#include "quant/preset.h"
#include "runtime/error.h"

namespace tqkv {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(PresetTest, FourPresetsByName) {
  EXPECT_EQ(AllPresets().size(), 4u);
  EXPECT_EQ(PresetByName("turboquant_k8v4").key_coding, KeyCoding::kFp8);
  EXPECT_EQ(PresetByName("turboquant_4bit_nc").key_bits, 4);
  EXPECT_EQ(PresetByName("turboquant_k3v4_nc").key_bits, 3);
  EXPECT_EQ(PresetByName("turboquant_k3v4_nc").value_bits, 4);
  EXPECT_EQ(PresetByName("turboquant_3bit_nc").value_bits, 3);
  EXPECT_TRUE(PresetByName("turboquant_3bit_nc").norm_correction);
}

TEST(PresetTest, UnknownNameListsValidOnes) {
  try {
    PresetByName("turboquant_2bit");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("\"turboquant_2bit\""), HasSubstr("turboquant_k8v4"),
                                HasSubstr("turboquant_4bit_nc"), HasSubstr("turboquant_k3v4_nc"),
                                HasSubstr("turboquant_3bit_nc")));
  }
}

// TURBOQUANT.md's worked example: 4bit_nc, D=128, H=8, block 16.
TEST(BlockFormatTest, WorkedExample) {
  const BlockFormat f = MakeBlockFormat(PresetByName("turboquant_4bit_nc"), 128, 8, 16);
  EXPECT_EQ(f.data_per_slot, 128);
  EXPECT_EQ(f.slot_bytes, 134);
  EXPECT_EQ(f.block_bytes, 17152);
  EXPECT_EQ(f.meta_offset, 16384);
  EXPECT_EQ(f.KeyCodesOffset(5, 3), 5504);
  EXPECT_EQ(f.ValueCodesOffset(5, 3), 5504 + 64);
  EXPECT_EQ(f.MetaOffset(MetaField::kKeyNorm, 5, 3), 16682);
  EXPECT_EQ(f.MetaOffset(MetaField::kValueScale, 5, 3), 16714);
  EXPECT_EQ(f.MetaOffset(MetaField::kValueZero, 5, 3), 16746);
}

// Bytes per token-head at D=128 from TURBOQUANT.md's table.
TEST(BlockFormatTest, SlotBytesMatchThePresetTable) {
  EXPECT_EQ(MakeBlockFormat(PresetByName("turboquant_k8v4"), 128, 1, 16).slot_bytes, 196);
  EXPECT_EQ(MakeBlockFormat(PresetByName("turboquant_4bit_nc"), 128, 1, 16).slot_bytes, 134);
  EXPECT_EQ(MakeBlockFormat(PresetByName("turboquant_k3v4_nc"), 128, 1, 16).slot_bytes, 118);
  EXPECT_EQ(MakeBlockFormat(PresetByName("turboquant_3bit_nc"), 128, 1, 16).slot_bytes, 102);
}

// Every offset of every (preset, D, H, block size) against formulas written out by hand, and
// every byte of a block covered exactly once.
TEST(BlockFormatTest, OffsetsMatchHandWrittenFormulasAndTileTheBlock) {
  for (const Preset& preset : AllPresets()) {
    const bool fp8 = preset.key_coding == KeyCoding::kFp8;
    for (int d : {64, 128, 256}) {
      for (int h_count : {1, 2, 8}) {
        for (int bs : {16, 32, 64, 128}) {
          const BlockFormat f = MakeBlockFormat(preset, d, h_count, bs);
          const int key_bytes = fp8 ? d : d * preset.key_bits / 8;
          const int val_bytes = d * preset.value_bits / 8;
          const int nm = fp8 ? 2 : 3;
          const int dps = key_bytes + val_bytes;
          ASSERT_EQ(f.key_data_bytes, key_bytes);
          ASSERT_EQ(f.val_data_bytes, val_bytes);
          ASSERT_EQ(f.slot_bytes, dps + 2 * nm);
          ASSERT_EQ(f.meta_offset, int64_t{bs} * h_count * dps);
          ASSERT_EQ(f.block_bytes, int64_t{bs} * h_count * (dps + 2 * nm));
          std::vector<int> covered(f.block_bytes, 0);
          for (int p = 0; p < bs; ++p) {
            for (int h = 0; h < h_count; ++h) {
              const int64_t data = int64_t{p} * h_count * dps + int64_t{h} * dps;
              ASSERT_EQ(f.KeyCodesOffset(p, h), data);
              ASSERT_EQ(f.ValueCodesOffset(p, h), data + key_bytes);
              for (int b = 0; b < dps; ++b) ++covered[data + b];
              const int64_t meta = f.meta_offset;
              if (!fp8) {
                ASSERT_EQ(f.MetaOffset(MetaField::kKeyNorm, p, h), meta + 2 * (h * 3 * bs + p));
              }
              const int scale_field = fp8 ? 0 : 1;
              ASSERT_EQ(f.MetaOffset(MetaField::kValueScale, p, h),
                        meta + 2 * (h * nm * bs + scale_field * bs + p));
              ASSERT_EQ(f.MetaOffset(MetaField::kValueZero, p, h),
                        meta + 2 * (h * nm * bs + (scale_field + 1) * bs + p));
              for (int field = 0; field < nm; ++field) {
                const int64_t at = meta + 2 * (int64_t{h} * nm * bs + field * bs + p);
                ++covered[at];
                ++covered[at + 1];
              }
            }
          }
          for (int64_t b = 0; b < f.block_bytes; ++b) {
            ASSERT_EQ(covered[b], 1)
                << preset.name << " D=" << d << " H=" << h_count << " bs=" << bs << " byte " << b;
          }
        }
      }
    }
  }
}

TEST(BlockFormatTest, RejectsUnsupportedShapesWithClearMessages) {
  const Preset& p = PresetByName("turboquant_4bit_nc");
  auto message = [&](int d, int h, int bs) -> std::string {
    try {
      MakeBlockFormat(p, d, h, bs);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_THAT(message(96, 8, 16), AllOf(HasSubstr("head_dim = 96"), HasSubstr("64, 128, 256")));
  EXPECT_THAT(message(128, 8, 48),
              AllOf(HasSubstr("block_size = 48"), HasSubstr("16, 32, 64, 128")));
  EXPECT_THAT(message(128, 0, 16), HasSubstr("num_kv_heads = 0"));
  EXPECT_THAT(message(128, 257, 16), HasSubstr("num_kv_heads = 257"));
}

}  // namespace
}  // namespace tqkv

namespace tqkv {
namespace {

TEST(BlockFormatTest, BlockBytesOfEveryLayout) {
  for (const char* name :
       {"turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"}) {
    const BlockFormat f = MakeBlockFormat(PresetByName(name), 64, 3, 32);
    EXPECT_EQ(BlockBytesOf({PresetByName(name).name, 64, 3, 32}), f.block_bytes) << name;
  }
  EXPECT_EQ(BlockBytesOf(MakeBf16BlockFormat(128, 8, 16).layout()), 16 * 8 * 512);
  EXPECT_EQ(BlockBytesOf(MakeBf16BlockFormat(256, 2, 64, DType::kF16).layout()), 64 * 2 * 1024);
  EXPECT_THAT(
      [] {
        BlockBytesOf({"int8", 128, 8, 16});
      },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("int8")));
  EXPECT_THAT(
      [] {
        BlockBytesOf({"bf16", 96, 8, 16});
      },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("head_dim = 96")));
}

// A caller's format is taken only as MakeBf16BlockFormat makes it: an edited value offset would
// read keys as values, an edited block size past a block.
TEST(Bf16BlockFormatTest, CheckRefusesAnEditedFormat) {
  const Bf16BlockFormat f = MakeBf16BlockFormat(64, 2, 16, DType::kF16);
  const Bf16BlockFormat same = CheckBf16BlockFormat("Caller", f);
  EXPECT_EQ(same.value_offset, f.value_offset);
  EXPECT_EQ(same.block_bytes, f.block_bytes);
  EXPECT_EQ(same.dtype, DType::kF16);
  Bf16BlockFormat moved = f;
  moved.value_offset = 0;
  EXPECT_THAT([&] { CheckBf16BlockFormat("Caller", moved); },
              ::testing::ThrowsMessage<Error>(
                  ::testing::HasSubstr("Caller: invalid format.value_offset = 0; allowed: 4096")));
  Bf16BlockFormat longer = f;
  longer.block_bytes += 16;
  EXPECT_THAT([&] { CheckBf16BlockFormat("Caller", longer); },
              ::testing::ThrowsMessage<Error>(
                  ::testing::HasSubstr("format.block_bytes = 8208; allowed: 8192")));
  Bf16BlockFormat odd = f;
  odd.head_dim = 96;
  EXPECT_THAT([&] { CheckBf16BlockFormat("Caller", odd); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("head_dim = 96")));
}

TEST(Bf16BlockFormatTest, KeysThenValuesTokenMajor) {
  const Bf16BlockFormat f = MakeBf16BlockFormat(128, 8, 16);
  EXPECT_EQ(f.block_bytes, 16 * 8 * 512);
  EXPECT_EQ(f.value_offset, 16 * 8 * 256);
  EXPECT_EQ(f.KeyOffset(5, 3), 2 * (5 * 8 + 3) * 128);
  EXPECT_EQ(f.ValueOffset(5, 3), f.value_offset + 2 * (5 * 8 + 3) * 128);
  EXPECT_THROW(MakeBf16BlockFormat(96, 8, 16), Error);
  EXPECT_THROW(MakeBf16BlockFormat(128, 8, 8), Error);
  EXPECT_EQ(f.dtype, DType::kBF16);
  // fp16 elements: the same layout.
  const Bf16BlockFormat h = MakeBf16BlockFormat(128, 8, 16, DType::kF16);
  EXPECT_EQ(h.dtype, DType::kF16);
  EXPECT_EQ(h.block_bytes, f.block_bytes);
  EXPECT_EQ(h.ValueOffset(5, 3), f.ValueOffset(5, 3));
  try {
    MakeBf16BlockFormat(128, 8, 16, DType::kF32);
    ADD_FAILURE() << "an F32 element type was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("dtype = F32"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("BF16 or F16"));
  }
}

}  // namespace
}  // namespace tqkv
