// The query prep (q·Πᵀ in fp32 for a dense Πᵀ) on the device against a double-precision
// reference (GPU-tagged; skipped without a device): the tensor-core kernel (rotation_fragments)
// and the 8-row kernel, for every head dim, query dtype and row counts that leave a warp's tile
// partly empty, plus a query pointer that is not 16-byte aligned (the 8-row kernel serves it).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "quant/numerics.h"
#include "quant/rotation.h"
#include "runtime/dtype.h"
#include "runtime/memory.h"
#include "tests/gpu_test_util.h"
#if TQKV_HAVE_CUDA
#include <cuda_runtime.h>

#include "attention/decode_launch.h"
#include "runtime/cuda_check.h"
#endif

namespace tqkv {
namespace {

#if TQKV_HAVE_CUDA

struct Case {
  int head_dim;
  DType dtype;
  int rows;
  int offset_elements;  // the query starts this many elements into its buffer
};

// Worst |y - ref| / ‖q‖ over all rows and outputs (‖y‖ = ‖q‖ for an orthogonal Πᵀ).
double RunCase(const Case& c, bool fragments) {
  const int d = c.head_dim;
  const Rotation rot = MakeRotation(RotationKind::kHaar, d, 7 + d);
  std::mt19937 rng(11 + c.rows);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t n = int64_t{c.rows} * d;
  std::vector<float> q(n);
  for (float& v : q) {
    v = normal(rng);
    // The device sees the rounded value: compare against that.
    if (c.dtype == DType::kF16) v = HalfBitsToFloat(FloatToHalfBits(v));
    if (c.dtype == DType::kBF16) v = BFloat16BitsToFloat(FloatToBFloat16Bits(v));
  }
  const int elem = c.dtype == DType::kF32 ? 4 : 2;
  std::vector<uint8_t> bytes((n + c.offset_elements) * elem, 0);
  for (int64_t i = 0; i < n; ++i) {
    uint8_t* at = bytes.data() + (i + c.offset_elements) * elem;
    if (c.dtype == DType::kF32) {
      std::memcpy(at, &q[i], 4);
    } else {
      const uint16_t h = c.dtype == DType::kF16 ? FloatToHalfBits(q[i]) : FloatToBFloat16Bits(q[i]);
      std::memcpy(at, &h, 2);
    }
  }
  DeviceBuffer<uint8_t> query(static_cast<int64_t>(bytes.size()));
  query.CopyFromHost(bytes);
  DeviceBuffer<float> rotation(int64_t{d} * d), out(n);
  rotation.CopyFromHost(rot.matrix);
  const std::vector<float> frag_host = decode_detail::QueryPrepFragments(rot.matrix, d);
  DeviceBuffer<float> frag(static_cast<int64_t>(frag_host.size()));
  frag.CopyFromHost(frag_host);
  out.FillBytes(0xFF);  // NaN: every output must be written
  decode_detail::QueryPrepParams p;
  p.query = query.data() + int64_t{c.offset_elements} * elem;
  p.in_dtype = c.dtype;
  p.rotation = rotation.data();
  p.rotation_fragments = fragments ? frag.data() : nullptr;
  p.out = out.data();
  p.rows = c.rows;
  p.head_dim = d;
  TQKV_CUDA_CHECK(decode_detail::LaunchQueryPrep(p, nullptr));
  TQKV_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> y(n);
  out.CopyToHost(y);
  double worst = 0.0;
  for (int r = 0; r < c.rows; ++r) {
    double norm = 0.0;
    for (int i = 0; i < d; ++i) norm += double{q[int64_t{r} * d + i]} * q[int64_t{r} * d + i];
    norm = std::sqrt(norm);
    for (int j = 0; j < d; ++j) {
      double ref = 0.0;
      for (int i = 0; i < d; ++i) {
        ref += double{q[int64_t{r} * d + i]} * rot.matrix[static_cast<size_t>(i) * d + j];
      }
      const double err = std::abs(y[int64_t{r} * d + j] - ref) / norm;
      if (!(err <= worst)) worst = std::isnan(err) ? INFINITY : err;
    }
  }
  return worst;
}

TEST(QueryPrepCudaTest, TensorCoreAndEightRowKernelsMatchTheReference) {
  TQKV_SKIP_WITHOUT_GPU();
  for (const int d : {64, 128, 256}) {
    for (const DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (const int rows : {1, 31, 33, 1000}) {
        for (const bool fragments : {true, false}) {
          const Case c{d, dtype, rows, 0};
          const double worst = RunCase(c, fragments);
          // fp32 accumulation of D products: ~1e-7 of ‖q‖; one rounding of the query or of Πᵀ
          // to tf32 alone (what the two- and three-part products avoid) would be ~1e-4.
          EXPECT_LT(worst, 2e-6) << "head_dim " << d << " dtype " << DTypeName(dtype) << " rows "
                                 << rows << (fragments ? " tensor-core" : " 8-row");
        }
      }
    }
  }
}

TEST(QueryPrepCudaTest, UnalignedQueryFallsBackAndStaysExact) {
  TQKV_SKIP_WITHOUT_GPU();
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    const Case c{128, dtype, 70, 1};  // 2 or 4 bytes past a 256-byte boundary
    EXPECT_LT(RunCase(c, true), 2e-6) << DTypeName(dtype);
  }
}

#else

TEST(QueryPrepCudaTest, NeedsCuda) { GTEST_SKIP() << "this build has no CUDA support"; }

#endif

}  // namespace
}  // namespace tqkv
