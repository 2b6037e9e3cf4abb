// Host-side parts of the CUDA store, tested without a device: the bit and lookup helpers the
// kernels share with the host (quant/store_device.h), argument validation, workspace sizes and
// path selection.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>

#include "quant/codebook.h"
#include "quant/packing.h"
#include "quant/quantizer.h"
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
      const uint64_t got = bits == 4 ? store::Pack16x4(c) : store::Pack16x3(c);
      for (int b = 0; b < 2 * bits; ++b) {
        ASSERT_EQ(static_cast<uint8_t>(got >> (8 * b)), want[b]) << "bits " << bits << " byte " << b;
      }
      if (bits == 3) {
        ASSERT_EQ(got >> 48, 0u);
      }
    }
  }
}

TEST(StoreDeviceHelpersTest, ThreeBitWordsOfFourLanesAreTheBitStream) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 1000; ++trial) {
    uint8_t codes[64];
    uint64_t lane_bits[4];
    for (int l = 0; l < 4; ++l) {
      uint32_t c[store::kLaneElems];
      for (int i = 0; i < store::kLaneElems; ++i) {
        c[i] = rng() & 7;
        codes[16 * l + i] = static_cast<uint8_t>(c[i]);
      }
      lane_bits[l] = store::Pack16x3(c);
    }
    uint8_t want[24] = {};
    PackCodes(codes, 64, 3, want);
    for (int r = 0; r < 3; ++r) {
      const uint64_t w = store::Join3BitWord(lane_bits[r], lane_bits[r + 1], r);
      for (int b = 0; b < 8; ++b) {
        ASSERT_EQ(static_cast<uint8_t>(w >> (8 * b)), want[8 * r + b]) << "word " << r;
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
// Paths, workspace sizes, argument validation (no device needed: nothing is dereferenced).

TEST(StoreHostTest, PathSelection) {
  const StoreOptions automatic;
  EXPECT_EQ(ResolveStorePath(Quantizer::Create("turboquant_k8v4", 128, 8, 16), automatic),
            StorePath::kFp8);
  EXPECT_EQ(ResolveStorePath(Quantizer::Create("turboquant_4bit_nc", 128, 8, 16), automatic),
            StorePath::kFwht);
  EXPECT_EQ(ResolveStorePath(Quantizer::Create("turboquant_3bit_nc", 64, 8, 16,
                                               RotationKind::kHadamardSigns, 5),
                             automatic),
            StorePath::kFwht);
  const Quantizer haar =
      Quantizer::Create("turboquant_k3v4_nc", 128, 8, 16, RotationKind::kHaar, 1);
  EXPECT_EQ(ResolveStorePath(haar, automatic), StorePath::kGemm);
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
  StoreOptions gemm;
  gemm.rotation_path = StoreRotationPath::kGemm;
  // status + norms + x̂ + y + cuBLAS workspace
  const int64_t rows = 1000 * 8;
  EXPECT_EQ(StoreWorkspaceBytes(mse, gemm, 1000),
            256 + rows * 4 + rows * 128 * 4 + rows * 128 * 4 + (int64_t{32} << 20));
  gemm.gemm_precision = GemmPrecision::kBf16;
  EXPECT_EQ(StoreWorkspaceBytes(mse, gemm, 1000),
            256 + rows * 4 + rows * 128 * 2 + rows * 128 * 4 + (int64_t{32} << 20));
  EXPECT_THROW(StoreWorkspaceBytes(mse, gemm, -1), Error);
}

struct FakeCall {
  // Addresses are never dereferenced by the validation; they only need the right alignment.
  alignas(256) uint8_t storage[4096];
  StoreInputs inputs;
  CacheRef cache;
  DeviceWorkspace workspace;
  FakeCall() {
    inputs.key = storage;
    inputs.value = storage + 1024;
    inputs.dtype = DType::kBF16;
    inputs.slot_mapping = storage + 2048;
    inputs.slot_dtype = DType::kI32;
    inputs.num_tokens = 10;
    cache = {storage + 3072, 4};
    workspace = {storage, 256};
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
    FakeCall c;
    c.inputs.key = c.storage + 8;
    EXPECT_THAT(ValidationError(q, options, c), HasSubstr("16-byte aligned"));
  }
  {
    FakeCall c;
    c.inputs.slot_mapping = c.storage + 2;
    EXPECT_THAT(ValidationError(q, options, c), HasSubstr("slot_mapping must be aligned"));
  }
  {
    FakeCall c;
    c.cache.data = c.storage + 3080;
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
    c.workspace.data = c.storage + 16;
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
