// Host-side parts of the CUDA store, tested without a device: the bit and lookup helpers the
// kernels share with the host (quant/store_device.h), argument validation, workspace sizes and
// path selection.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <random>

#include "quant/codebook.h"
#include "quant/numerics.h"
#include "quant/packing.h"
#include "quant/quantizer.h"
#include "quant/rotation.h"
#include "quant/store_cuda.h"
#include "quant/store_device.h"
#include "runtime/device.h"
#include "runtime/error.h"

namespace tqkv {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(StoreDeviceHelpersTest, PackMatchesReferencePacking) {
  std::mt19937 rng(std::random_device{}());
  for (int bits : {3, 4}) {
    for (int trial = 0; trial < 1000; ++trial) {
      uint32_t c[store::kLaneElems];
      uint8_t codes[store::kLaneElems];
      for (int i = 0; i < store::kLaneElems; ++i) {
        c[i] = rng() & ((1u << bits) - 1);
        codes[i] = static_cast<uint8_t>(c[i]);
      }
      uint8_t want[8] = {};
      PackCodes(codes, store::kLaneElems, bits, want);
      store::PackedCodes<4> p4;
      store::PackedCodes<3> p3;
      for (int i = 0; i < store::kLaneElems; ++i) {
        p4.Add(i, c[i]);
        p3.Add(i, c[i]);
      }
      const uint64_t got = bits == 4 ? store::Pack16x4(c) : store::Pack16x3(c);
      ASSERT_EQ(got, bits == 4 ? p4.Word() : p3.Word());
      for (int b = 0; b < 2 * bits; ++b) {
        ASSERT_EQ(static_cast<uint8_t>(got >> (8 * b)), want[b])
            << "bits " << bits << " byte " << b;
      }
      if (bits == 3) {
        ASSERT_EQ(got >> 48, 0u);
      }
    }
  }
}

// The kernels' lane layout (LaneElement) with StoreCodes' word placement, emulated for one row,
// for the narrow (16 elements per lane) and the wide (32) kernels: the bytes must be the reference
// packing of the row's codes.
template <int kElems>
void ExpectLaneLayoutCodeWordsAreTheBitStream(std::mt19937& rng) {
  constexpr int kChunks = kElems / 8;
  for (int lanes : {4, 8, 16}) {
    for (int bits : {3, 4}) {
      for (int trial = 0; trial < 200; ++trial) {
        const int d = kElems * lanes;
        std::vector<uint8_t> codes(d);
        for (auto& c : codes) c = static_cast<uint8_t>(rng() & ((1u << bits) - 1));
        std::vector<std::array<uint32_t, kChunks>> w(lanes);
        for (int q = 0; q < lanes; ++q) {
          store::LaneCodes<4, kChunks> p4;
          store::LaneCodes<3, kChunks> p3;
          store::PackedCodes<4> n4;  // the two-word form of the narrow kernel's first version
          store::PackedCodes<3> n3;
          for (int e = 0; e < kElems; ++e) {
            const uint8_t c = codes[store::LaneElement(q, e, lanes)];
            p4.Add(e, c);
            p3.Add(e, c);
            if (e < 16) {
              n4.Add(e, c);
              n3.Add(e, c);
            }
          }
          ASSERT_EQ(p4.w[0], n4.lo);
          ASSERT_EQ(p4.w[1], n4.hi);
          ASSERT_EQ(p3.w[0], n3.lo);
          ASSERT_EQ(p3.w[1], n3.hi);
          for (int j = 0; j < kChunks; ++j) w[q][j] = bits == 4 ? p4.w[j] : p3.w[j];
        }
        std::vector<uint32_t> words(d * bits / 32, 0xDEADBEEF);
        for (int q = 0; q < lanes; ++q) {
          for (int j = 0; j < kChunks; ++j) {
            if (bits == 4) {
              words[q + j * lanes] = w[q][j];
            } else if (q % 4 < 3) {  // __shfl_down_sync(..., 1): lane q + 1 of the same group of 4
              const int r = q % 4;
              words[3 * ((q + j * lanes) / 4) + r] = store::Join3Bit32(w[q][j], w[q + 1][j], r);
            }
          }
        }
        std::vector<uint8_t> want(d * bits / 8);
        PackCodes(codes.data(), d, bits, want.data());
        for (size_t b = 0; b < want.size(); ++b) {
          ASSERT_EQ(static_cast<uint8_t>(words[b / 4] >> (8 * (b % 4))), want[b])
              << "elems " << kElems << " lanes " << lanes << " bits " << bits << " byte " << b;
        }
      }
    }
  }
}

TEST(StoreDeviceHelpersTest, LaneLayoutCodeWordsAreTheBitStream) {
  std::mt19937 rng(std::random_device{}());
  ExpectLaneLayoutCodeWordsAreTheBitStream<16>(rng);
  ExpectLaneLayoutCodeWordsAreTheBitStream<32>(rng);
}

// The FWHT as the kernels run it on the lane layout (log2(E) in-register stages, log2(G)
// cross-lane stages), emulated in exact integers, is the Sylvester Hadamard transform of the row;
// and the per-lane sign bits pick the signs of the right elements. Narrow (E = 16) and wide (32).
TEST(StoreDeviceHelpersTest, LaneLayoutFwhtAndSignsMatchTheMatrix) {
  std::mt19937 rng(std::random_device{}());
  for (int elems : {16, 32}) {
    for (int lanes : {2, 4, 8, 16}) {
      const int d = elems * lanes;
      if (d < 64 || d > 256) continue;
      std::vector<int64_t> in(d);
      for (auto& v : in) v = static_cast<int64_t>(rng() % 2001) - 1000;
      std::vector<std::vector<int64_t>> x(lanes, std::vector<int64_t>(elems));
      for (int q = 0; q < lanes; ++q) {
        for (int e = 0; e < elems; ++e) x[q][e] = in[store::LaneElement(q, e, lanes)];
      }
      for (int q = 0; q < lanes; ++q) {
        for (int h = 1; h < elems; h <<= 1) {
          for (int i = 0; i < elems; ++i) {
            if ((i & h) == 0) {
              const int64_t a = x[q][i], b = x[q][i + h];
              x[q][i] = a + b;
              x[q][i + h] = a - b;
            }
          }
        }
      }
      for (int m = 1; m < lanes; m <<= 1) {
        auto next = x;
        for (int q = 0; q < lanes; ++q) {
          for (int e = 0; e < elems; ++e) {
            const int64_t other = x[q ^ m][e];
            next[q][e] = (q & m) ? other - x[q][e] : x[q][e] + other;
          }
        }
        x = next;
      }
      const Rotation signs = MakeRotation(RotationKind::kHadamardSigns, d, rng());
      uint32_t sign_words[8] = {};
      for (int i = 0; i < d; ++i) {
        if (signs.signs[i] < 0) sign_words[i / 32] |= 1u << (i % 32);
      }
      for (int q = 0; q < lanes; ++q) {
        uint32_t lane_signs = 0;  // as StoreKernel gathers them: byte c from chunk q + c·G
        for (int c = 0; c < elems / 8; ++c) {
          const int j = 8 * (q + c * lanes);
          lane_signs |= ((sign_words[j / 32] >> (j % 32)) & 0xFFu) << (8 * c);
        }
        for (int e = 0; e < elems; ++e) {
          const int j = store::LaneElement(q, e, lanes);
          int64_t want = 0;
          for (int i = 0; i < d; ++i) want += (__builtin_popcount(i & j) & 1) ? -in[i] : in[i];
          ASSERT_EQ(x[q][e], want)
              << "elems " << elems << " lanes " << lanes << " q " << q << " e " << e;
          ASSERT_EQ(((lane_signs >> e) & 1) != 0, signs.signs[j] < 0) << "q " << q << " e " << e;
        }
      }
    }
  }
}

// The wide kernel's FWHT on tensor cores (FwhtOnTensorCores), emulated from the PTX fragment
// layouts of mma.m16n8k16 (a0 / a2: row g, a1 / a3: row g + 8, columns 2t, 2t + 1 and + 8; b0 / b1:
// rows 2t, 2t + 1 and + 8 of column g; c0 / c1: row g, c2 / c3: row g + 8, columns 2t, 2t + 1) in
// exact integers: the words the helpers pick, the H16 fragments they build, the output elements
// they name and the remaining butterflies give the Sylvester transform of the signed row, and
// every lane keeps the elements it owns. D = 128 (4 lanes per row) and 256 (8).
TEST(StoreDeviceHelpersTest, TensorCoreFwhtFragmentsMatchTheMatrix) {
  std::mt19937 rng(std::random_device{}());
  constexpr int kElems = 32;
  for (int lanes : {4, 8}) {
    const int d = kElems * lanes;
    const int rows = 32 / lanes;
    for (uint32_t one : {0x3F80u, 0x3C00u}) {
      // B of n-tile j as the 32 lanes hold it: entry (k, n) must be ±1 = H16[k][n].
      int b[2][16][8] = {};
      for (int lane = 0; lane < 32; ++lane) {
        for (int j = 0; j < 2; ++j) {
          for (int reg = 0; reg < 2; ++reg) {
            const uint32_t w = store::HadamardFragment(lane, j, reg, one);
            for (int half = 0; half < 2; ++half) {
              const uint32_t bits = (w >> (16 * half)) & 0xFFFFu;
              ASSERT_EQ(bits & 0x7FFFu, one);
              const int k = 2 * (lane % 4) + half + 8 * reg, n = lane / 4;
              b[j][k][n] = (bits & 0x8000u) ? -1 : 1;
              ASSERT_EQ(b[j][k][n], (__builtin_popcount(k & (n + 8 * j)) & 1) ? -1 : 1);
            }
          }
        }
      }
      // A row per lane group, random signs, and the words of each lane (two elements each).
      std::vector<std::vector<int64_t>> in(rows, std::vector<int64_t>(d));
      for (auto& r : in) {
        for (auto& v : r) v = static_cast<int64_t>(rng() % 2001) - 1000;
      }
      const Rotation signs = MakeRotation(RotationKind::kHadamardSigns, d, rng());
      std::vector<std::array<int64_t, kElems>> x(32);
      for (int lane = 0; lane < 32; ++lane) {
        const int q = lane % lanes, row = lane / lanes;
        uint32_t lane_signs = 0;
        for (int e = 0; e < kElems; ++e) {
          if (signs.signs[store::LaneElement(q, e, lanes)] < 0) lane_signs |= 1u << e;
        }
        const uint32_t spread = store::SpreadPairSigns(lane_signs);
        // Word i of chunk c holds elements 8c + 2i (bit 15 = its flip) and 8c + 2i + 1 (bit 31).
        std::array<int64_t, kElems> e_in{};
        for (int c = 0; c < 4; ++c) {
          for (int i = 0; i < 4; ++i) {
            const uint32_t mask = store::PairSignMask(spread, 4 * c + i);
            for (int h = 0; h < 2; ++h) {
              const int e = 8 * c + 2 * i + h;
              const int64_t v = in[row][store::LaneElement(q, e, lanes)];
              e_in[e] = (mask >> (15 + 16 * h)) & 1 ? -v : v;
            }
          }
        }
        x[lane] = e_in;
      }
      // Per chunk and n-tile: A from the lanes' words, C = A · B, back to the lanes.
      std::vector<std::array<int64_t, kElems>> y(32);
      for (int c = 0; c < 4; ++c) {
        int64_t a[16][16] = {};
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, t = lane % 4;
          for (int reg = 0; reg < 4; ++reg) {
            const int word = reg;  // A register i is word i of the chunk
            const int row = g + 8 * (reg & 1), col = 2 * t + 8 * (reg >> 1);
            a[row][col] = x[lane][8 * c + 2 * word];
            a[row][col + 1] = x[lane][8 * c + 2 * word + 1];
          }
        }
        for (int j = 0; j < 2; ++j) {
          for (int lane = 0; lane < 32; ++lane) {
            const int g = lane / 4, t = lane % 4;
            for (int r = 0; r < 4; ++r) {
              const int row = g + 8 * (r >> 1), col = 2 * t + (r & 1);
              int64_t acc = 0;
              for (int k = 0; k < 16; ++k) acc += a[row][k] * b[j][k][col];
              y[lane][8 * c + store::MmaOutputElement(j, r)] = acc;
            }
          }
        }
      }
      // The remaining stages: register strides 2, 8, 16; lane strides from 4.
      for (int lane = 0; lane < 32; ++lane) {
        for (int h = 2; h < kElems; h <<= 1) {
          if (h == 4) continue;
          for (int i = 0; i < kElems; ++i) {
            if ((i & h) == 0) {
              const int64_t p = y[lane][i], s = y[lane][i + h];
              y[lane][i] = p + s;
              y[lane][i + h] = p - s;
            }
          }
        }
      }
      for (int m = 4; m < lanes; m <<= 1) {
        auto next = y;
        for (int lane = 0; lane < 32; ++lane) {
          const int q = lane % lanes;
          for (int e = 0; e < kElems; ++e) {
            const int64_t other = y[lane ^ m][e];
            next[lane][e] = (q & m) ? other - y[lane][e] : y[lane][e] + other;
          }
        }
        y = next;
      }
      for (int lane = 0; lane < 32; ++lane) {
        const int q = lane % lanes, row = lane / lanes;
        for (int e = 0; e < kElems; ++e) {
          const int jj = store::LaneElement(q, e, lanes);
          int64_t want = 0;
          for (int i = 0; i < d; ++i) {
            const int64_t v = signs.signs[i] < 0 ? -in[row][i] : in[row][i];
            want += (__builtin_popcount(i & jj) & 1) ? -v : v;
          }
          ASSERT_EQ(y[lane][e], want) << "lanes " << lanes << " lane " << lane << " e " << e;
        }
      }
    }
  }
}

// Every y the lookup sees: random, around every midpoint and cell edge (ulp by ulp), specials.
void ExpectLookupMatchesBucketize(const Codebook& book, const store::BucketLutTable& lut) {
  ASSERT_GT(lut.grid.cells, 0);
  std::vector<float> ys = {0.0f,
                           -0.0f,
                           std::numeric_limits<float>::quiet_NaN(),
                           -std::numeric_limits<float>::quiet_NaN(),
                           INFINITY,
                           -INFINITY,
                           std::numeric_limits<float>::max(),
                           std::numeric_limits<float>::lowest(),
                           std::numeric_limits<float>::denorm_min(),
                           -std::numeric_limits<float>::denorm_min(),
                           1e30f,
                           -1e30f,
                           1.0f,
                           -1.0f};
  for (float m : book.midpoints) {
    float y = m;
    for (int k = 0; k < 200; ++k) y = std::nextafter(y, -INFINITY);
    for (int k = 0; k < 400; ++k, y = std::nextafter(y, INFINITY)) ys.push_back(y);
  }
  std::mt19937 rng(std::random_device{}());
  const float spread = 3.0f * (book.centroids.back() - book.centroids.front());
  std::normal_distribution<float> normal(0.0f, spread);
  for (int i = 0; i < 200000; ++i) ys.push_back(normal(rng));
  std::uniform_real_distribution<float> uniform(-store::kLutRange, store::kLutRange);
  for (int i = 0; i < 200000; ++i) ys.push_back(uniform(rng));
  ys.push_back(store::kLutRange);
  ys.push_back(-store::kLutRange);
  for (float y : ys) {
    if (std::abs(y) <= store::kLutRange) {  // the lookup's domain (the kernels send NaN elsewhere)
      ASSERT_EQ(store::LutBucketize(y, lut.entries.data(), lut.grid), book.Bucketize(y))
          << "y = " << y;
    }
    ASSERT_EQ(store::SearchBucketize(y, book.midpoints.data(), book.bits), book.Bucketize(y))
        << "y = " << y;
  }
}

TEST(StoreDeviceHelpersTest, LookupBucketizeMatchesEveryBuiltInCodebook) {
  for (int d : {64, 128, 256}) {
    for (int bits : {2, 3, 4}) {
      const Codebook book = LloydMaxGaussian(d, bits);
      const store::BucketLutTable lut = store::BuildBucketLut(book.midpoints);
      ASSERT_EQ(lut.entries.size(), static_cast<size_t>(lut.grid.cells));
      EXPECT_LE(lut.grid.cells, store::kMaxLutCells) << "D " << d << " bits " << bits;
      if (d >= 128) {  // the wide kernel's smaller table (store_device.h)
        EXPECT_LE(lut.grid.cells, store::kWideLutCells) << "D " << d << " bits " << bits;
      }
      std::printf("D %d, %d bits: %d cells\n", d, bits, lut.grid.cells);
      ExpectLookupMatchesBucketize(book, lut);
    }
  }
}

TEST(StoreDeviceHelpersTest, LookupBucketizeMatchesAnUnevenCodebook) {
  // Uneven gaps and an asymmetric table, as a caller's centroids may be.
  const Codebook book = CodebookFromCentroids(
      std::vector<float>{-0.31f, -0.2f, -0.19f, -0.05f, 0.0f, 0.013f, 0.2f, 0.55f}, 3);
  ExpectLookupMatchesBucketize(book, store::BuildBucketLut(book.midpoints));
}

TEST(StoreDeviceHelpersTest, MidpointsTooCloseFallBackToSearch) {
  const Codebook book = CodebookFromCentroids(
      std::vector<float>{-1.0f, -0.5f, 0.0f, 1e-5f, 2e-5f, 0.5f, 0.75f, 1.0f}, 3);
  EXPECT_EQ(store::BuildBucketLut(book.midpoints).grid.cells, 0);
  for (float y : {-2.0f, 0.0f, 5e-6f, 1.5e-5f, 1.6e-5f, 0.9f, 3.0f}) {
    EXPECT_EQ(store::SearchBucketize(y, book.midpoints.data(), 3), book.Bucketize(y));
  }
}

// ---------------------------------------------------------------------------------------------
// The tensor-core rotation's arithmetic (quant/store_device.h, MmaScaleForNorm; SplitRotationF16).

TEST(StoreMmaMathTest, RotationSplitCarriesTwentyTwoBits) {
  for (int d : {64, 128}) {
    for (RotationKind kind : {RotationKind::kHaar, RotationKind::kHadamardSigns}) {
      const Quantizer q = Quantizer::Create("turboquant_4bit_nc", d, 1, 16, kind, 11);
      const std::vector<float>& pit = q.rotation().matrix;
      const std::vector<uint16_t> split = store::SplitRotationF16(pit, d);
      ASSERT_EQ(split.size(), size_t(2) * d * d);
      for (int k = 0; k < d; ++k) {
        for (int n = 0; n < d; ++n) {
          const double want = std::ldexp(double(pit[size_t(k) * d + n]), 8);
          const double hi = HalfBitsToFloat(split[size_t(n) * d + k]);
          const double lo = HalfBitsToFloat(split[size_t(d) * d + size_t(n) * d + k]);
          // hi is the nearest fp16; lo the nearest fp16 to the rest (absolute floor: fp16's
          // subnormal spacing 2^-24, half of it).
          ASSERT_LE(std::abs(want - hi), std::ldexp(std::abs(want), -11) + 0x1p-25)
              << "d " << d << " k " << k << " n " << n;
          ASSERT_LE(std::abs(want - hi - lo), std::ldexp(std::abs(want), -22) + 0x1p-25)
              << "d " << d << " k " << k << " n " << n << " want " << want;
        }
      }
    }
  }
}

TEST(StoreMmaMathTest, RowScaleIsAPowerOfTwoAndFactorUndoesIt) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> exponent(-140.0f, 127.9f);
  for (int trial = 0; trial < 20000; ++trial) {
    const float norm =
        trial == 0 ? 0.0f : std::min(std::exp2(exponent(rng)), std::numeric_limits<float>::max());
    const store::MmaRowScale sc = store::MmaScaleForNorm(norm);
    int e = 0;
    ASSERT_EQ(std::frexp(sc.up, &e), 0.5f) << norm;  // a power of two
    if (norm >= 0x1p-120f) {                         // scaled norm in [32, 64)
      ASSERT_GE(double(norm) * sc.up, 32.0) << norm;
      ASSERT_LT(double(norm) * sc.up, 64.0) << norm;
    }
    // factor = (1 / up) · 2^-8 / (norm + 1e-8) within the two roundings of division and scale.
    const double want = 1.0 / sc.up / 256.0 / (double(float(norm + 1e-8f)));
    ASSERT_NEAR(sc.factor, want, want * 0x1p-22) << norm;
  }
  const store::MmaRowScale inf = store::MmaScaleForNorm(INFINITY);
  EXPECT_EQ(inf.factor, 0.0f);
  EXPECT_EQ(inf.up, 0x1p-123f);  // elements below 2^128 stay below 2^5
  EXPECT_TRUE(std::isnan(store::MmaScaleForNorm(NAN).factor));
}

// The kernel's arithmetic for one row, with the MMA's sums done exactly (fp64): the scaled key in
// fp16 (hi + lo for fp32 keys) times hi + lo of Πᵀ, times the factor, must lie within the test's
// fp32 bound of the fp64 reference y (store_cuda_test, ReferenceY).
TEST(StoreMmaMathTest, EmulatedRowMatchesTheReferenceRotation) {
  std::mt19937 rng(std::random_device{}());
  for (int d : {64, 128}) {
    const Quantizer q = Quantizer::Create("turboquant_4bit_nc", d, 1, 16, RotationKind::kHaar, 3);
    const std::vector<float>& pit = q.rotation().matrix;
    const std::vector<uint16_t> split = store::SplitRotationF16(pit, d);
    for (int trial = 0; trial < 200; ++trial) {
      const bool bf16 = trial % 2 == 0;
      const float magnitude = std::exp2(static_cast<float>(static_cast<int>(rng() % 60) - 30));
      std::normal_distribution<float> normal(0.0f, magnitude);
      std::vector<float> k(d);
      for (float& x : k)
        x = bf16 ? BFloat16BitsToFloat(FloatToBFloat16Bits(normal(rng))) : normal(rng);
      double ss = 0;
      for (float x : k) ss += double(x) * x;
      const float norm = static_cast<float>(std::sqrt(ss));
      const float denom = norm + 1e-8f;
      const store::MmaRowScale sc = store::MmaScaleForNorm(norm);
      std::vector<double> a_hi(d), a_lo(d);
      for (int i = 0; i < d; ++i) {
        const float x = k[i] * sc.up;
        a_hi[i] = HalfBitsToFloat(FloatToHalfBits(x));
        a_lo[i] = bf16 ? 0.0 : HalfBitsToFloat(FloatToHalfBits(x - float(a_hi[i])));
        // bf16 keys are exact in fp16 after the scaling, down to fp16's normal range (2^-14,
        // i.e. 2^-19 of the scaled norm); below it the fp16 subnormal spacing (2^-24) applies.
        if (bf16 && std::abs(x) >= 0x1p-14f) {
          ASSERT_EQ(a_hi[i], double(x)) << "bf16 keys are exact in fp16 after scaling";
        } else if (bf16) {
          ASSERT_LE(std::abs(a_hi[i] - double(x)), 0x1p-25) << "below fp16's normal range";
        }
      }
      for (int n = 0; n < d; ++n) {
        double sum = 0, ref = 0, mag = 0;
        for (int i = 0; i < d; ++i) {
          const double hi = HalfBitsToFloat(split[size_t(n) * d + i]);
          const double lo = HalfBitsToFloat(split[size_t(d) * d + size_t(n) * d + i]);
          sum += a_hi[i] * (hi + lo) + a_lo[i] * hi;
          const double x = double(k[i] / denom);
          ref += x * pit[size_t(i) * d + n];
          mag += std::abs(x * pit[size_t(i) * d + n]);
        }
        const double y = double(static_cast<float>(sum) * sc.factor);
        const double bound = (d + 2) * std::ldexp(mag, -24) + std::ldexp(std::abs(ref), -22);
        ASSERT_LE(std::abs(y - ref), bound)
            << "d " << d << " n " << n << " magnitude " << magnitude;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Paths, workspace sizes, argument validation (no device needed: nothing is dereferenced).

TEST(StoreHostTest, PathSelection) {
  const StoreOptions automatic;
  EXPECT_EQ(ResolveStorePath(Quantizer::Create("turboquant_k8v4", 128, 8, 16), automatic),
            StorePath::kFp8);
  EXPECT_EQ(ResolveStorePath(Quantizer::Create("turboquant_4bit_nc", 128, 8, 16), automatic),
            StorePath::kFwht);
  EXPECT_EQ(ResolveStorePath(
                Quantizer::Create("turboquant_3bit_nc", 64, 8, 16, RotationKind::kHadamardSigns, 5),
                automatic),
            StorePath::kFwht);
  const Quantizer haar =
      Quantizer::Create("turboquant_k3v4_nc", 128, 8, 16, RotationKind::kHaar, 1);
  EXPECT_EQ(ResolveStorePath(haar, automatic), StorePath::kMma);
  const Quantizer haar256 =
      Quantizer::Create("turboquant_4bit_nc", 256, 8, 16, RotationKind::kHaar, 1);
  EXPECT_EQ(ResolveStorePath(haar256, automatic), StorePath::kGemm);
  StoreOptions mma;
  mma.rotation_path = StoreRotationPath::kMma;
  EXPECT_EQ(ResolveStorePath(Quantizer::Create("turboquant_4bit_nc", 64, 8, 16), mma),
            StorePath::kMma);
  try {
    ResolveStorePath(haar256, mma);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(),
                AllOf(HasSubstr("rotation path"), HasSubstr("mma"), HasSubstr("head_dim 256")));
  }
  EXPECT_EQ(StorePathName(StorePath::kMma), "mma");
  StoreOptions gemm;
  gemm.rotation_path = StoreRotationPath::kGemm;
  EXPECT_EQ(ResolveStorePath(Quantizer::Create("turboquant_4bit_nc", 128, 8, 16), gemm),
            StorePath::kGemm);
  StoreOptions fwht;
  fwht.rotation_path = StoreRotationPath::kFwht;
  try {
    ResolveStorePath(haar, fwht);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("rotation path"), HasSubstr("haar")));
  }
}

TEST(StoreHostTest, WorkspaceBytes) {
  const Quantizer fp8 = Quantizer::Create("turboquant_k8v4", 128, 8, 16);
  const Quantizer mse = Quantizer::Create("turboquant_4bit_nc", 128, 8, 16);
  EXPECT_EQ(StoreWorkspaceBytes(fp8, {}, 65536), 256);
  EXPECT_EQ(StoreWorkspaceBytes(mse, {}, 65536), 256);  // FWHT: the status only
  const Quantizer haar = Quantizer::Create("turboquant_4bit_nc", 128, 8, 16, RotationKind::kHaar);
  EXPECT_EQ(StoreWorkspaceBytes(haar, {}, 65536), 256);  // MMA: the status only
  StoreOptions gemm;
  gemm.rotation_path = StoreRotationPath::kGemm;
  // status + norms + row factors + GEMM input (three bf16 copies of the keys, or fp32 x̂) + y +
  // cuBLAS workspace
  const int64_t rows = 1000 * 8;
  EXPECT_EQ(StoreWorkspaceBytes(mse, gemm, 1000),
            256 + 2 * rows * 4 + rows * 128 * 6 + rows * 128 * 4 + (int64_t{32} << 20));
  gemm.gemm_precision = GemmPrecision::kSgemm;
  EXPECT_EQ(StoreWorkspaceBytes(mse, gemm, 1000),
            256 + 2 * rows * 4 + rows * 128 * 4 + rows * 128 * 4 + (int64_t{32} << 20));
  gemm.gemm_precision = GemmPrecision::kBf16;
  EXPECT_EQ(StoreWorkspaceBytes(mse, gemm, 1000),
            256 + 2 * rows * 4 + rows * 128 * 2 + rows * 128 * 4 + (int64_t{32} << 20));
  EXPECT_THROW(StoreWorkspaceBytes(mse, gemm, -1), Error);
  // Past the store's token limit (the GEMM path's 2^31 rows) the layout's byte counts had wrapped
  // int64 into small, plausible sizes (INT64_MAX / 2 tokens: 33 MB).
  for (int64_t n : {int64_t{1} << 28, std::numeric_limits<int64_t>::max() / 2}) {
    EXPECT_THAT([&] { StoreWorkspaceBytes(mse, gemm, n); },
                ::testing::ThrowsMessage<Error>(HasSubstr(fmt::format("num_tokens = {}", n))));
  }
  EXPECT_GT(StoreWorkspaceBytes(mse, gemm, (int64_t{1} << 28) - 1), int64_t{1} << 40);
}

// The GEMM path's three-part bf16 Πᵀ (SplitRotationBf16): hi + mid + lo is Πᵀ to 2^-26, and a
// key row of bf16 numbers times the parts, summed in fp64 as exact products, is x · Πᵀ to the same
// relative level (what the tensor cores' fp32 sums then round).
TEST(StoreHostTest, ThreePartBf16RotationIsFp32Accurate) {
  for (int d : {64, 128, 256}) {
    const Rotation r = MakeRotation(RotationKind::kHaar, d, 17);
    const std::vector<float>& pit = r.matrix;
    const std::vector<uint16_t> split = store::SplitRotationBf16(pit);
    ASSERT_EQ(split.size(), 3 * pit.size());
    double worst = 0;
    for (size_t i = 0; i < pit.size(); ++i) {
      double sum = 0;
      for (size_t part = 0; part < 3; ++part) {
        const uint16_t b = split[part * pit.size() + i];
        EXPECT_TRUE(std::isfinite(BFloat16BitsToFloat(b)));
        sum += BFloat16BitsToFloat(b);
      }
      if (pit[i] != 0) worst = std::max(worst, std::abs(sum - pit[i]) / std::abs(pit[i]));
    }
    EXPECT_LE(worst, std::ldexp(1.0, -26)) << "D=" << d;
    // A bf16 key row: Σ_parts Σ_j k_j · part[j][i] (exact products) against Σ_j k_j · Πᵀ[j][i].
    std::mt19937 rng(d);
    std::normal_distribution<float> normal;
    std::vector<double> k(d);
    for (auto& x : k) x = BFloat16BitsToFloat(FloatToBFloat16Bits(normal(rng)));
    double err = 0, scale = 0;
    for (int i = 0; i < d; ++i) {
      double exact = 0, parts = 0;
      for (int j = 0; j < d; ++j) {
        exact += k[j] * pit[size_t(j) * d + i];
        for (size_t part = 0; part < 3; ++part) {
          parts += k[j] * BFloat16BitsToFloat(split[part * pit.size() + size_t(j) * d + i]);
        }
        scale += std::abs(k[j] * pit[size_t(j) * d + i]);
      }
      err = std::max(err, std::abs(parts - exact));
    }
    EXPECT_LE(err, std::ldexp(scale / d, -25)) << "D=" << d;
  }
}

struct FakeCall {
  // Addresses are never dereferenced by the validation; they only need the right alignment and
  // disjoint ranges (key and value 20,480 bytes each, the cache 4 blocks of 17,152).
  static constexpr size_t kBytes = 160 * 1024;
  std::unique_ptr<uint8_t[]> memory = std::make_unique<uint8_t[]>(kBytes + 256);
  uint8_t* const storage = memory.get() + (256 - reinterpret_cast<uintptr_t>(memory.get()) % 256);
  StoreInputs inputs;
  CacheRef cache;
  DeviceWorkspace workspace;
  FakeCall() {
    inputs.key = storage;
    inputs.value = storage + 32768;
    inputs.dtype = DType::kBF16;
    inputs.slot_mapping = storage + 65536;
    inputs.slot_dtype = DType::kI32;
    inputs.num_tokens = 10;
    cache = {storage + 81920, 4, {"turboquant_4bit_nc", 128, 8, 16}};  // the tests' quantizer's
    workspace = {storage + 69632, 256};
  }
};

std::string ValidationError(const Quantizer& q, const StoreOptions& options, const FakeCall& c) {
  try {
    ValidateStoreArguments(q, options, c.inputs, c.cache, c.workspace);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(StoreHostTest, ValidationAcceptsAGoodCall) {
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 128, 8, 16);
  FakeCall c;
  EXPECT_EQ(ValidationError(q, {}, c), "no error");
  c.inputs.num_tokens = 0;
  c.inputs.key = c.inputs.value = c.inputs.slot_mapping = nullptr;
  EXPECT_EQ(ValidationError(q, {}, c), "no error");  // an empty store needs no inputs
}

TEST(StoreHostTest, ValidationNamesTheBadArgument) {
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 128, 8, 16);
  const StoreOptions options;
  {
    FakeCall c;
    c.inputs.dtype = DType::kI32;
    EXPECT_THAT(ValidationError(q, options, c), AllOf(HasSubstr("dtype = I32"), HasSubstr("BF16")));
  }
  {
    FakeCall c;
    c.inputs.slot_dtype = DType::kF32;
    EXPECT_THAT(ValidationError(q, options, c), HasSubstr("slot_mapping dtype = F32"));
  }
  {
    FakeCall c;
    c.inputs.num_tokens = -3;
    EXPECT_THAT(ValidationError(q, options, c), HasSubstr("num_tokens = -3"));
  }
  {
    FakeCall c;
    c.cache.layout = Quantizer::Create("turboquant_k3v4_nc", 128, 8, 16).layout();
    EXPECT_THAT(ValidationError(q, options, c),
                HasSubstr("invalid cache.layout = (turboquant_k3v4_nc, head_dim 128, 8 KV heads, "
                          "block 16); allowed: the layout this call was made for "
                          "(turboquant_4bit_nc, head_dim 128, 8 KV heads, block 16)"));
  }
  {
    FakeCall c;
    c.inputs.value = nullptr;
    EXPECT_THAT(ValidationError(q, options, c), HasSubstr("must not be null"));
  }
  {
    FakeCall c;
    c.cache.data = nullptr;
    EXPECT_THAT(ValidationError(q, options, c), HasSubstr("must not be null"));
  }
  {
    FakeCall c;
    c.cache.num_blocks = -1;
    EXPECT_THAT(ValidationError(q, options, c), HasSubstr("num_blocks = -1"));
  }
  {
    FakeCall c;  // block ids are 32-bit on the device
    c.cache.num_blocks = int64_t{1} << 32;
    EXPECT_THAT(ValidationError(q, options, c),
                AllOf(HasSubstr("num_blocks = 4294967296"), HasSubstr("0 to 4294967295")));
  }
  {
    FakeCall c;
    c.inputs.key = c.storage + 8;
    EXPECT_THAT(ValidationError(q, options, c), HasSubstr("16-byte aligned"));
  }
  {
    FakeCall c;
    c.inputs.slot_mapping = c.storage + 65538;
    EXPECT_THAT(ValidationError(q, options, c), HasSubstr("slot_mapping must be aligned"));
  }
  {
    FakeCall c;
    c.cache.data = c.storage + 81928;
    EXPECT_THAT(ValidationError(q, options, c), HasSubstr("cache must be 16-byte aligned"));
  }
  {
    FakeCall c;
    c.workspace.size_bytes = 255;
    EXPECT_THAT(ValidationError(q, options, c),
                AllOf(HasSubstr("workspace size_bytes = 255"), HasSubstr(">= 256")));
  }
  {
    FakeCall c;
    c.workspace.data = c.storage + 69648;
    EXPECT_THAT(ValidationError(q, options, c), HasSubstr("256-byte aligned"));
  }
  {
    StoreOptions gemm;
    gemm.rotation_path = StoreRotationPath::kGemm;
    FakeCall c;  // 256 bytes are far too few for x̂ and y
    EXPECT_THAT(ValidationError(q, gemm, c), AllOf(HasSubstr("workspace size_bytes"),
                                                   HasSubstr("path gemm"), HasSubstr("10 tokens")));
  }
  {
    FakeCall c;
    c.inputs.num_tokens = std::numeric_limits<int64_t>::max() / 2;
    EXPECT_THAT(ValidationError(q, options, c), HasSubstr("num_tokens"));
  }
  {
    StoreOptions fwht;
    fwht.rotation_path = StoreRotationPath::kFwht;
    const Quantizer haar = Quantizer::Create("turboquant_4bit_nc", 128, 8, 16, RotationKind::kHaar);
    FakeCall c;
    EXPECT_THAT(ValidationError(haar, fwht, c), HasSubstr("rotation path"));
  }
}

TEST(StoreHostTest, DeviceStateNeedsADevice) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present (store_cuda_test covers it)";
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 128, 8, 16);
  try {
    StoreDeviceState state(q);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("StoreDeviceState"));
  }
}

TEST(StoreHostTest, SlotValidationDefaultFollowsTheBuildType) {
#ifdef NDEBUG
  EXPECT_FALSE(StoreOptions{}.validate_slots);
#else
  EXPECT_TRUE(StoreOptions{}.validate_slots);
#endif
}

}  // namespace
}  // namespace tqkv
