#include "quant/quantizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <set>

#include "quant/numerics.h"
#include "quant/packing.h"
#include "runtime/error.h"
#include "tests/synthetic_kv.h"

namespace tqkv {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

const char* const kPresetNames[] = {"turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                                    "turboquant_3bit_nc"};

StoreInputs Inputs(const std::vector<float>& k, const std::vector<float>& v,
                   const std::vector<int64_t>& slots) {
  StoreInputs in;
  in.key = k.data();
  in.value = v.data();
  in.dtype = DType::kF32;
  in.slot_mapping = slots.data();
  in.slot_dtype = DType::kI64;
  in.num_tokens = static_cast<int64_t>(slots.size());
  return in;
}

uint16_t MetaBits(const Quantizer& q, const std::vector<uint8_t>& cache, MetaField field,
                  int64_t slot, int h) {
  const BlockFormat& f = q.format();
  return LoadHalfBits(cache.data() + (slot / f.block_size) * f.block_bytes +
                      f.MetaOffset(field, static_cast<int>(slot % f.block_size), h));
}

// The bytes a (slot, head) owns: its data bytes and its fp16 fields.
std::vector<int64_t> OwnedBytes(const BlockFormat& f, int64_t slot, int h) {
  std::vector<int64_t> bytes;
  const int64_t base = (slot / f.block_size) * f.block_bytes;
  const int pos = static_cast<int>(slot % f.block_size);
  for (int b = 0; b < f.data_per_slot; ++b) bytes.push_back(base + f.KeyCodesOffset(pos, h) + b);
  for (MetaField m : {MetaField::kKeyNorm, MetaField::kValueScale, MetaField::kValueZero}) {
    if (f.fp8_keys && m == MetaField::kKeyNorm) continue;
    bytes.push_back(base + f.MetaOffset(m, pos, h));
    bytes.push_back(base + f.MetaOffset(m, pos, h) + 1);
  }
  return bytes;
}

// Values d % 16 · 0.5 at D = 64: vmin 0, scale 0.5, codes d % 16, nibbles low-first.
// Key 3·e0 under the Hadamard rotation: y = +1/8 in every coordinate.
TEST(QuantizerTest, GoldenBytes4Bit) {
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 64, 1, 16);
  std::vector<float> k(64, 0.0f), v(64);
  k[0] = 3.0f;
  for (int d = 0; d < 64; ++d) v[d] = (d % 16) * 0.5f;
  std::vector<uint8_t> cache(q.format().block_bytes, 0);
  q.StoreCpu(Inputs(k, v, {0}), {cache.data(), 1, q.layout()});
  const BlockFormat& f = q.format();
  const int idx = q.codebook().Bucketize(0.125f);
  const uint8_t key_byte = static_cast<uint8_t>(idx | (idx << 4));
  for (int b = 0; b < 32; ++b) ASSERT_EQ(cache[f.KeyCodesOffset(0, 0) + b], key_byte) << b;
  const uint8_t want_values[8] = {0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE};
  for (int b = 0; b < 32; ++b) ASSERT_EQ(cache[f.ValueCodesOffset(0, 0) + b], want_values[b % 8]);
  const double c = q.codebook().centroids[idx];
  EXPECT_EQ(MetaBits(q, cache, MetaField::kKeyNorm, 0, 0),
            FloatToHalfBits(static_cast<float>(3.0 / std::sqrt(64.0 * c * c + 1e-16))));
  EXPECT_EQ(MetaBits(q, cache, MetaField::kValueScale, 0, 0), 0x3800);  // 0.5
  EXPECT_EQ(MetaBits(q, cache, MetaField::kValueZero, 0, 0), 0x0000);
}

// 3-bit values d % 8: each group of 8 codes 0..7 is the 24-bit word 0xFAC688, little-endian.
TEST(QuantizerTest, GoldenBytes3Bit) {
  const Quantizer q = Quantizer::Create("turboquant_3bit_nc", 64, 2, 16);
  std::vector<float> k(128, 1.0f), v(128);
  for (int d = 0; d < 128; ++d) v[d] = static_cast<float>(d % 8);
  std::vector<uint8_t> cache(q.format().block_bytes * 2, 0);
  q.StoreCpu(Inputs(k, v, {21}), {cache.data(), 2, q.layout()});  // block 1, position 5
  const BlockFormat& f = q.format();
  for (int h = 0; h < 2; ++h) {
    const uint8_t* values = cache.data() + f.block_bytes + f.ValueCodesOffset(5, h);
    for (int g = 0; g < 8; ++g) {
      ASSERT_EQ(values[3 * g + 0], 0x88);
      ASSERT_EQ(values[3 * g + 1], 0xC6);
      ASSERT_EQ(values[3 * g + 2], 0xFA);
    }
    EXPECT_EQ(MetaBits(q, cache, MetaField::kValueScale, 21, h), 0x3C00);  // 1.0
  }
  // Key all-ones: x̂ = e/8 · 1, so y = x̂·H/8 is (1, 0, ..., 0): index of 1.0 then of 0.0.
  const uint8_t* keys = cache.data() + f.block_bytes + f.KeyCodesOffset(5, 0);
  EXPECT_EQ(UnpackCode(keys, 0, 3), q.codebook().Bucketize(1.0f));
  for (int d = 1; d < 64; ++d) ASSERT_EQ(UnpackCode(keys, d, 3), q.codebook().Bucketize(0.0f));
}

TEST(QuantizerTest, Fp8KeysAreE4M3OfTheInput) {
  const Quantizer q = Quantizer::Create("turboquant_k8v4", 128, 2, 16);
  EXPECT_FALSE(q.uses_rotation());
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 30.0f);
  std::vector<float> k(256), v(256);
  for (auto& x : k) x = normal(rng);
  for (auto& x : v) x = normal(rng);
  k[3] = 1000.0f;  // saturates
  std::vector<uint8_t> cache(q.format().block_bytes, 0);
  q.StoreCpu(Inputs(k, v, {7}), {cache.data(), 1, q.layout()});
  for (int h = 0; h < 2; ++h) {
    for (int d = 0; d < 128; ++d) {
      ASSERT_EQ(cache[q.format().KeyCodesOffset(7, h) + d], FloatToE4M3(k[h * 128 + d]));
    }
  }
  EXPECT_EQ(cache[q.format().KeyCodesOffset(7, 0) + 3], 0x7E);
  const DequantizedSlot s = q.Dequantize({cache.data(), 1, q.layout()}, 7, 1);
  for (int d = 0; d < 128; ++d) EXPECT_EQ(s.key[d], E4M3ToFloat(FloatToE4M3(k[128 + d])));
}

// fp16 / bf16 inputs give the same bytes as fp32 inputs holding the same values; int32 slot
// mappings the same as int64.
TEST(QuantizerTest, InputDtypesAndSlotDtypesAgree) {
  for (const char* preset : kPresetNames) {
    const Quantizer q = Quantizer::Create(preset, 128, 4, 16);
    const int n = 37;
    std::mt19937 rng(std::random_device{}());
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<uint16_t> k16(n * 4 * 128), v16(k16.size()), kb(k16.size()), vb(k16.size());
    std::vector<float> kf16(k16.size()), vf16(k16.size()), kfb(k16.size()), vfb(k16.size());
    for (size_t i = 0; i < k16.size(); ++i) {
      k16[i] = FloatToHalfBits(normal(rng));
      v16[i] = FloatToHalfBits(normal(rng));
      kb[i] = FloatToBFloat16Bits(normal(rng));
      vb[i] = FloatToBFloat16Bits(normal(rng));
      kf16[i] = HalfBitsToFloat(k16[i]);
      vf16[i] = HalfBitsToFloat(v16[i]);
      kfb[i] = BFloat16BitsToFloat(kb[i]);
      vfb[i] = BFloat16BitsToFloat(vb[i]);
    }
    std::vector<int64_t> slots(n);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    std::vector<int32_t> slots32(slots.begin(), slots.end());
    const int64_t blocks = 3;
    std::vector<uint8_t> a(blocks * q.format().block_bytes, 0), b = a, c = a, e = a;
    q.StoreCpu(Inputs(kf16, vf16, slots), {a.data(), blocks, q.layout()});
    StoreInputs in = Inputs(kf16, vf16, slots);
    in.key = k16.data();
    in.value = v16.data();
    in.dtype = DType::kF16;
    q.StoreCpu(in, {b.data(), blocks, q.layout()});
    EXPECT_EQ(a, b) << preset << " fp16";
    in.slot_mapping = slots32.data();
    in.slot_dtype = DType::kI32;
    q.StoreCpu(in, {c.data(), blocks, q.layout()});
    EXPECT_EQ(a, c) << preset << " int32 slots";

    std::vector<uint8_t> d = a;
    std::fill(d.begin(), d.end(), 0);
    q.StoreCpu(Inputs(kfb, vfb, slots), {d.data(), blocks, q.layout()});
    in = Inputs(kfb, vfb, slots);
    in.key = kb.data();
    in.value = vb.data();
    in.dtype = DType::kBF16;
    q.StoreCpu(in, {e.data(), blocks, q.layout()});
    EXPECT_EQ(d, e) << preset << " bf16";
  }
}

// Padding slots write nothing; bytes of slots that were not written keep the poison pattern.
TEST(QuantizerTest, OnlyTheOwnedBytesOfWrittenSlotsChange) {
  for (const char* preset : kPresetNames) {
    const Quantizer q = Quantizer::Create(preset, 64, 3, 32);
    const BlockFormat& f = q.format();
    const int64_t blocks = 4;
    std::vector<float> k(50 * 3 * 64), v(k.size());
    std::mt19937 rng(std::random_device{}());
    std::normal_distribution<float> normal;
    for (auto& x : k) x = normal(rng);
    for (auto& x : v) x = normal(rng);
    std::vector<int64_t> all(blocks * 32);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int64_t> slots(all.begin(), all.begin() + 50);
    for (int i = 0; i < 50; i += 7) slots[i] = -1;  // padding
    std::vector<uint8_t> cache(blocks * f.block_bytes, 0xA5), clean(cache.size(), 0);
    q.StoreCpu(Inputs(k, v, slots), {cache.data(), blocks, q.layout()});
    q.StoreCpu(Inputs(k, v, slots), {clean.data(), blocks, q.layout()});
    std::vector<bool> owned(cache.size(), false);
    for (int64_t s : slots) {
      if (s < 0) continue;
      for (int h = 0; h < 3; ++h) {
        for (int64_t byte : OwnedBytes(f, s, h)) owned[byte] = true;
      }
    }
    for (size_t i = 0; i < cache.size(); ++i) {
      ASSERT_EQ(cache[i], owned[i] ? clean[i] : 0xA5) << preset << " byte " << i;
    }
  }
}

TEST(QuantizerTest, OutOfRangeSlotIsAnErrorAndWritesNothing) {
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 128, 2, 16);
  std::vector<float> k(4 * 256, 1.0f), v(k.size(), 1.0f);
  std::vector<uint8_t> cache(10 * q.format().block_bytes, 0x5A);
  const std::vector<uint8_t> before = cache;
  try {
    q.StoreCpu(Inputs(k, v, {0, 1, 2, 160}), {cache.data(), 10, q.layout()});
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("slot_mapping[3] = 160"), HasSubstr("0 to 159")));
  }
  EXPECT_EQ(cache, before);
  try {
    q.StoreCpu(Inputs(k, v, {5, 9, 5, -1}), {cache.data(), 10, q.layout()});
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("slot_mapping[2] = 5"), HasSubstr("token 0")));
  }
  EXPECT_EQ(cache, before);
  StoreInputs bad = Inputs(k, v, {0});
  bad.dtype = DType::kI32;
  EXPECT_THROW(q.StoreCpu(bad, {cache.data(), 10, q.layout()}), Error);
  bad = Inputs(k, v, {0});
  bad.slot_dtype = DType::kF32;
  EXPECT_THROW(q.StoreCpu(bad, {cache.data(), 10, q.layout()}), Error);
  EXPECT_EQ(cache, before);
  // Inputs inside the cache the call writes: a slot_mapping there could be rewritten by an
  // earlier token and send a later one past the cache after the checks.
  const std::vector<int64_t> slots = {0, 1};
  std::memcpy(cache.data() + cache.size() - 16, slots.data(), 16);
  const std::vector<uint8_t> with_slots = cache;
  bad = Inputs(k, v, slots);
  bad.slot_mapping = cache.data() + cache.size() - 16;
  EXPECT_THAT(
      [&] {
        q.StoreCpu(bad, {cache.data(), 10, q.layout()});
      },
      ::testing::ThrowsMessage<Error>(
          AllOf(HasSubstr("cache ("), HasSubstr("slot_mapping ("), HasSubstr("overlap"))));
  bad = Inputs(k, v, slots);
  bad.value = reinterpret_cast<const float*>(cache.data());
  EXPECT_THAT(
      [&] {
        q.StoreCpu(bad, {cache.data(), 10, q.layout()});
      },
      ::testing::ThrowsMessage<Error>(
          AllOf(HasSubstr("cache ("), HasSubstr("value ("), HasSubstr("overlap"))));
  EXPECT_EQ(cache, with_slots);
}

// A cache of another layout (another preset, or the same preset sized for other shapes) is
// refused by name before anything is written: its blocks are another size, so the store would
// write at the wrong offsets or past its end.
TEST(QuantizerTest, CacheOfAnotherLayoutIsAnErrorAndWritesNothing) {
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 128, 2, 16);
  std::vector<float> k(2 * 256, 1.0f), v(k.size(), 1.0f);
  std::vector<uint8_t> cache(10 * q.format().block_bytes, 0x5A);
  const std::vector<uint8_t> before = cache;
  const CacheLayout own = q.layout();
  EXPECT_EQ(own, (CacheLayout{"turboquant_4bit_nc", 128, 2, 16}));
  const Quantizer k8 = Quantizer::Create("turboquant_k8v4", 128, 2, 16);
  const Quantizer wide = Quantizer::Create("turboquant_4bit_nc", 128, 2, 32);
  for (const CacheLayout& other :
       {k8.layout(), wide.layout(), Quantizer::Create("turboquant_4bit_nc", 64, 2, 16).layout(),
        Quantizer::Create("turboquant_4bit_nc", 128, 4, 16).layout(),
        MakeBf16BlockFormat(128, 2, 16).layout(), CacheLayout{}}) {
    try {
      q.StoreCpu(Inputs(k, v, {0, 17}), {cache.data(), 10, other});
      ADD_FAILURE() << "no error for " << DescribeLayout(other);
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("Quantizer::StoreCpu: invalid cache.layout = (" +
                                      DescribeLayout(other) +
                                      "); allowed: the layout this call was made for "
                                      "(turboquant_4bit_nc, head_dim 128, 2 KV heads, block 16)"));
    }
    EXPECT_EQ(cache, before);
  }
  EXPECT_EQ(DescribeLayout(CacheLayout{}), "no format, head_dim 0, 0 KV heads, block 0");
  // The same layout built another way is the same layout.
  q.StoreCpu(Inputs(k, v, {0, 17}),
             {cache.data(), 10, CacheLayout{"turboquant_4bit_nc", 128, 2, 16}});
  EXPECT_NE(cache, before);
}

// Non-finite keys or values never give inf/NaN metadata and never touch other slots.
TEST(QuantizerTest, NonFiniteInputsGiveFiniteMetadata) {
  for (const char* preset : kPresetNames) {
    const Quantizer q = Quantizer::Create(preset, 64, 1, 16);
    const BlockFormat& f = q.format();
    const float specials[] = {INFINITY, -INFINITY, NAN, 1e30f, -1e30f};
    std::vector<float> k, v;
    std::vector<int64_t> slots;
    for (int t = 0; t < 6; ++t) {
      for (int d = 0; d < 64; ++d) {
        k.push_back(t < 5 && d % 5 == 0 ? specials[t] : 0.5f * d);
        v.push_back(t < 5 && d % 3 == 0 ? specials[(t + 2) % 5] : -0.25f * d);
      }
      slots.push_back(t * 2);
    }
    // Token 5 is all-NaN in K and V.
    std::fill(k.end() - 64, k.end(), NAN);
    std::fill(v.end() - 64, v.end(), NAN);
    std::vector<uint8_t> cache(f.block_bytes, 0xEE);
    q.StoreCpu(Inputs(k, v, slots), {cache.data(), 1, q.layout()});
    for (int64_t s : slots) {
      for (MetaField m : {MetaField::kKeyNorm, MetaField::kValueScale, MetaField::kValueZero}) {
        if (f.fp8_keys && m == MetaField::kKeyNorm) continue;
        const float x = HalfBitsToFloat(MetaBits(q, cache, m, s, 0));
        ASSERT_TRUE(std::isfinite(x)) << preset << " slot " << s << " field " << int(m);
      }
      const DequantizedSlot out = q.Dequantize({cache.data(), 1, q.layout()}, s, 0);
      for (float x : out.value) ASSERT_TRUE(std::isfinite(x)) << preset << " slot " << s;
    }
    for (int64_t s = 1; s < 16; s += 2) {  // odd slots untouched
      for (int64_t byte : OwnedBytes(f, s, 0)) ASSERT_EQ(cache[byte], 0xEE);
    }
  }
}

struct Accuracy {
  double key_rel_mse = 0;          // E ||k − k̂||² / ||k||²
  double value_rel_mse = 0;        // E ||v − v̂||² / ||v||²
  double worst_value_excess = -1;  // max of |v − v̂| − bound (must be <= 0)
};

Accuracy MeasureRoundTrip(const Quantizer& q, int tokens) {
  const BlockFormat& f = q.format();
  testing::SyntheticKvOptions o;
  o.num_kv_heads = f.num_kv_heads;
  o.num_q_heads = f.num_kv_heads;
  o.head_dim = f.head_dim;
  o.seed = std::random_device{}();
  testing::SyntheticKv gen(o);
  std::vector<float> k, v;
  gen.Generate(0, tokens, k, v);
  std::vector<int64_t> slots(tokens);
  std::iota(slots.begin(), slots.end(), 0);
  const int64_t blocks = (tokens + f.block_size - 1) / f.block_size;
  std::vector<uint8_t> cache(blocks * f.block_bytes);
  q.StoreCpu(Inputs(k, v, slots), {cache.data(), blocks, q.layout()});
  Accuracy acc;
  const int d = f.head_dim;
  const int levels = (1 << f.value_bits) - 1;
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < f.num_kv_heads; ++h) {
      const DequantizedSlot s = q.Dequantize({cache.data(), blocks, q.layout()}, t, h);
      const float* kt = &k[(int64_t(t) * f.num_kv_heads + h) * d];
      const float* vt = &v[(int64_t(t) * f.num_kv_heads + h) * d];
      double ke = 0, kn = 0, ve = 0, vn = 0;
      const float vmin = *std::min_element(vt, vt + d), vmax = *std::max_element(vt, vt + d);
      const double scale = (vmax - vmin) / levels;
      // Half a step, plus what fp16 rounding of scale and zero can add (2^-11 relative each).
      const double bound =
          0.5 * scale * (1 + 1e-5) + levels * scale * 0x1.0p-11 + std::abs(vmin) * 0x1.0p-11 + 1e-6;
      for (int i = 0; i < d; ++i) {
        ke += (kt[i] - s.key[i]) * double(kt[i] - s.key[i]);
        kn += double(kt[i]) * kt[i];
        ve += (vt[i] - s.value[i]) * double(vt[i] - s.value[i]);
        vn += double(vt[i]) * vt[i];
        acc.worst_value_excess =
            std::max(acc.worst_value_excess, std::abs(vt[i] - s.value[i]) - bound);
      }
      acc.key_rel_mse += ke / kn;
      acc.value_rel_mse += ve / vn;
    }
  }
  acc.key_rel_mse /= tokens * f.num_kv_heads;
  acc.value_rel_mse /= tokens * f.num_kv_heads;
  return acc;
}

// Round-trip error per preset on realistic keys (large channels, RoPE). Bounds: codebook presets
// sit near the Lloyd-Max MSE of their bit width (0.0095 at 4 bits, 0.034 at 3; the norm
// correction trades a little MSE for unbiased inner products, so allow ~25 %); FP8 E4M3 has a
// relative step of 2^-3, i.e. an MSE near 2^-6/12 ≈ 1.3e-3 relative; values never err by more
// than half a step plus fp16 rounding of scale and zero; their MSE is step²/12 with step =
// range / levels, range ≈ 5.2σ for 128 Gaussian values: 0.0100 (4-bit), 0.046 (3-bit) relative.
TEST(QuantizerTest, RoundTripAccuracyPerPreset) {
  const double key_bound[] = {0.003, 0.012, 0.043, 0.043};
  const double value_bound[] = {0.012, 0.012, 0.012, 0.055};
  for (int p = 0; p < 4; ++p) {
    const Quantizer q = Quantizer::Create(kPresetNames[p], 128, 4, 16);
    const Accuracy a = MeasureRoundTrip(q, 300);
    std::printf("%-20s D=128: key relative MSE %.5f, value relative MSE %.5f\n", kPresetNames[p],
                a.key_rel_mse, a.value_rel_mse);
    EXPECT_LT(a.key_rel_mse, key_bound[p]) << kPresetNames[p];
    EXPECT_LT(a.value_rel_mse, value_bound[p]) << kPresetNames[p];
    EXPECT_LE(a.worst_value_excess, 0.0) << kPresetNames[p];
  }
}

TEST(QuantizerTest, DequantizedKeyIsTheRotatedCodebookVectorRotatedBack) {
  const Quantizer q = Quantizer::Create("turboquant_k3v4_nc", 128, 1, 16, RotationKind::kHaar, 3);
  std::vector<float> k(128), v(128, 0.0f);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (auto& x : k) x = normal(rng);
  std::vector<uint8_t> cache(q.format().block_bytes);
  q.StoreCpu(Inputs(k, v, {3}), {cache.data(), 1, q.layout()});
  const DequantizedSlot s = q.Dequantize({cache.data(), 1, q.layout()}, 3, 0);
  const float norm = HalfBitsToFloat(MetaBits(q, cache, MetaField::kKeyNorm, 3, 0));
  const std::set<float> centroids(q.codebook().centroids.begin(), q.codebook().centroids.end());
  double n_rot = 0, n_back = 0;
  for (int j = 0; j < 128; ++j) {
    ASSERT_TRUE(centroids.count(s.key_rotated[j] / norm) == 1 ||
                std::any_of(centroids.begin(), centroids.end(),
                            [&](float c) { return norm * c == s.key_rotated[j]; }));
    n_rot += double(s.key_rotated[j]) * s.key_rotated[j];
    n_back += double(s.key[j]) * s.key[j];
  }
  EXPECT_NEAR(n_rot, n_back, 1e-4 * n_rot);  // rotating back preserves the norm
  // Rotating the stored key forward again gives key_rotated.
  std::vector<float> again(128);
  q.RotateQuery(s.key.data(), again.data());
  for (int j = 0; j < 128; ++j) EXPECT_NEAR(again[j], s.key_rotated[j], 1e-5);
}

TEST(QuantizerTest, CallerRotationAndCentroidsAreUsedUnchanged) {
  const Preset& p = PresetByName("turboquant_4bit_nc");
  const Rotation haar = MakeRotation(RotationKind::kHaar, 64, 5);
  const Quantizer built =
      Quantizer::Create("turboquant_4bit_nc", 64, 1, 16, RotationKind::kHaar, 5);
  const Quantizer custom(p, 64, 1, 16, RotationFromMatrix(haar.matrix, 64));
  std::vector<float> centroids = LloydMaxGaussian(64, 4).centroids;
  for (auto& c : centroids) c *= 1.3f;
  const Quantizer custom_book(p, 64, 1, 16, RotationFromMatrix(haar.matrix, 64),
                              CodebookFromCentroids(centroids, 4));
  EXPECT_EQ(custom.rotation().matrix, haar.matrix);
  EXPECT_EQ(custom_book.codebook().centroids, centroids);

  std::vector<float> k(64 * 5), v(64 * 5);
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  for (auto& x : k) x = normal(rng);
  for (auto& x : v) x = normal(rng);
  const std::vector<int64_t> slots = {0, 1, 2, 3, 4};
  std::vector<uint8_t> a(built.format().block_bytes, 0), b = a, c = a;
  built.StoreCpu(Inputs(k, v, slots), {a.data(), 1, built.layout()});
  custom.StoreCpu(Inputs(k, v, slots), {b.data(), 1, custom.layout()});
  custom_book.StoreCpu(Inputs(k, v, slots), {c.data(), 1, custom_book.layout()});
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  const DequantizedSlot s = custom_book.Dequantize({c.data(), 1, custom_book.layout()}, 2, 0);
  const float norm = HalfBitsToFloat(MetaBits(custom_book, c, MetaField::kKeyNorm, 2, 0));
  for (float x : s.key_rotated) {
    EXPECT_TRUE(
        std::any_of(centroids.begin(), centroids.end(), [&](float cc) { return norm * cc == x; }));
  }
}

TEST(QuantizerTest, RejectsMismatchedParts) {
  const Preset& p = PresetByName("turboquant_4bit_nc");
  try {
    Quantizer(p, 128, 1, 16, MakeRotation(RotationKind::kHadamard, 64, 0));
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("rotation.head_dim = 64"));
  }
  try {
    Quantizer(p, 64, 1, 16, MakeRotation(RotationKind::kHadamard, 64, 0), LloydMaxGaussian(64, 3));
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("codebook.bits = 3"));
  }
  EXPECT_THROW(Quantizer::Create("turboquant_5bit", 128, 1, 16), Error);
  EXPECT_THROW(Quantizer::Create("turboquant_4bit_nc", 96, 1, 16, RotationKind::kHaar), Error);
  EXPECT_THROW(Quantizer::Create("turboquant_4bit_nc", 128, 1, 24), Error);
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 64, 1, 16);
  std::vector<uint8_t> cache(q.format().block_bytes);
  EXPECT_THROW(q.Dequantize({cache.data(), 1, q.layout()}, 16, 0), Error);
  EXPECT_THROW(q.Dequantize({cache.data(), 1, q.layout()}, 0, 1), Error);
  EXPECT_THAT(
      [&] {
        q.Dequantize({cache.data(), 1, MakeBf16BlockFormat(64, 1, 16).layout()}, 0, 0);
      },
      ::testing::ThrowsMessage<Error>(
          HasSubstr("Quantizer::Dequantize: invalid cache.layout = (bf16, head_dim 64")));
}

// A Rotation or Codebook filled or changed by hand: the CUDA store would apply the Hadamard its
// kind names instead of the matrix, or read past the centroid table; each is refused by name.
TEST(QuantizerTest, RejectsHandMadeRotationsAndCodebooks) {
  const Preset& p = PresetByName("turboquant_4bit_nc");
  auto expect_error = [&](const Rotation& r, const std::optional<Codebook>& book,
                          const std::string& piece) {
    try {
      Quantizer(p, 64, 1, 16, r, book);
      ADD_FAILURE() << "no throw for " << piece;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), AllOf(HasSubstr("Quantizer"), HasSubstr(piece)));
    }
  };
  std::vector<float> identity(64 * 64, 0.0f);
  for (int i = 0; i < 64; ++i) identity[i * 64 + i] = 1.0f;
  Rotation custom = RotationFromMatrix(identity, 64);
  Quantizer(p, 64, 1, 16, custom);  // as built: fine

  Rotation wrong_kind = custom;  // an identity that claims to be a Hadamard
  wrong_kind.kind = RotationKind::kHadamard;
  expect_error(wrong_kind, std::nullopt, "rotation.kind = hadamard");

  Rotation unset;  // kind left at its default, matrix and id filled by hand
  unset.head_dim = 64;
  unset.matrix = identity;
  expect_error(unset, std::nullopt, "rotation.id = 0");

  Rotation changed = custom;  // the matrix changed after it was checked
  changed.matrix[5] = 0.5f;
  expect_error(changed, std::nullopt, "rotation.id");

  Rotation with_nan = custom;
  with_nan.matrix[70] = std::nanf("");
  expect_error(with_nan, std::nullopt, "rotation.matrix[70]");

  Rotation long_signs = MakeRotation(RotationKind::kHadamardSigns, 64, 3);
  long_signs.signs.resize(300, 1.0f);
  expect_error(long_signs, std::nullopt, "rotation.signs.size() = 300");

  Rotation flipped = MakeRotation(RotationKind::kHadamardSigns, 64, 3);
  flipped.signs[7] = -flipped.signs[7];  // no longer the signs of its matrix
  expect_error(flipped, std::nullopt, "rotation.kind = hadamard_signs");

  const Rotation h = MakeRotation(RotationKind::kHadamard, 64, 0);
  Codebook extra = LloydMaxGaussian(64, 4);
  extra.midpoints.push_back(extra.midpoints.back());  // 16 midpoints: bucket 16 of 16 centroids
  expect_error(h, extra, "codebook.midpoints.size() = 16");
  Codebook moved = LloydMaxGaussian(64, 4);
  moved.midpoints[3] += 0.01f;
  expect_error(h, moved, "codebook.midpoints[3]");
  Codebook unsorted = LloydMaxGaussian(64, 4);
  std::swap(unsorted.centroids[2], unsorted.centroids[3]);
  expect_error(h, unsorted, "codebook.centroids[3]");
  Codebook infinite = LloydMaxGaussian(64, 4);
  infinite.centroids[15] = INFINITY;
  expect_error(h, infinite, "codebook.centroids[15] = inf");

  // A non-orthogonal matrix whose id was recomputed by hand (RotationMatrixId is public): it had
  // been accepted, as had a Haar kind's.
  for (RotationKind kind : {RotationKind::kCustom, RotationKind::kHaar}) {
    Rotation scaled = kind == RotationKind::kCustom ? custom : MakeRotation(kind, 64, 2);
    for (float& x : scaled.matrix) x *= 100.0f;
    scaled.id = RotationMatrixId(64, scaled.matrix);
    expect_error(scaled, std::nullopt, "must be orthogonal");
  }
}

// A Preset that is not one of AllPresets() as defined is refused: its fields were trusted (a
// 4bit_nc with 3-bit keys and values named the real one's layout for a smaller block; 9-bit
// values were cut to 8 bits), and the quantizer kept a pointer to the caller's copy.
TEST(QuantizerTest, RejectsHandMadePresets) {
  const Rotation h = MakeRotation(RotationKind::kHadamard, 64, 0);
  Preset fake = PresetByName("turboquant_4bit_nc");
  fake.key_bits = 3;
  fake.value_bits = 3;
  Preset nine = PresetByName("turboquant_4bit_nc");
  nine.value_bits = 9;
  Preset unknown = PresetByName("turboquant_4bit_nc");
  unknown.name = "x";
  for (const auto& [preset, piece] :
       {std::pair{fake, "preset = turboquant_4bit_nc (3-bit keys, 3-bit values)"},
        std::pair{nine, "preset = turboquant_4bit_nc (4-bit keys, 9-bit values)"},
        std::pair{unknown, "preset = \"x\""}}) {
    EXPECT_THAT([&] { Quantizer(preset, 64, 1, 16, h); },
                ::testing::ThrowsMessage<Error>(HasSubstr(piece)));
  }
  // A copy of a known preset is fine, and the quantizer refers to the known one, not the copy.
  const Preset copy = PresetByName("turboquant_k3v4_nc");
  const Quantizer q(copy, 64, 1, 16, h);
  EXPECT_EQ(&q.preset(), &PresetByName("turboquant_k3v4_nc"));
}

TEST(QuantizerTest, CacheOfMoreBlocksThanBlockIdsCanAddressIsAnError) {
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 64, 1, 16);
  const std::vector<float> kv(64, 1.0f);
  const int64_t slot = 0;
  StoreInputs in;
  in.key = kv.data();
  in.value = kv.data();
  in.slot_mapping = &slot;
  in.num_tokens = 1;
  std::vector<uint8_t> cache(q.format().block_bytes);
  try {
    q.StoreCpu(in, {cache.data(), (int64_t{1} << 59) + 1, q.layout()});
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(),
                AllOf(HasSubstr("num_blocks = 576460752303423489"), HasSubstr("0 to 4294967295")));
  }
  EXPECT_THROW(q.Dequantize({cache.data(), int64_t{1} << 59, q.layout()}, 0, 0), Error);
}

}  // namespace
}  // namespace tqkv
