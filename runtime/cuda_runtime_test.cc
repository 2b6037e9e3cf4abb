// GPU tests of the runtime: skipped (not passed) without a device.
#if TQKV_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#if TQKV_HAVE_CUDA
#include "runtime/cuda_check.h"
#endif
#include "runtime/device.h"
#include "runtime/memory.h"
#include "runtime/stream.h"
#include "runtime/test_kernels.h"
#include "tests/gpu_test_util.h"

namespace tqkv {
namespace {

#if TQKV_HAVE_CUDA

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(CudaRuntimeTest, DevicesAreDescribed) {
  TQKV_SKIP_WITHOUT_GPU();
  const auto devices = QueryDevices();
  ASSERT_FALSE(devices.empty());
  for (const auto& d : devices) {
    EXPECT_FALSE(d.name.empty());
    EXPECT_GT(d.sm_count, 0);
    EXPECT_GT(d.total_memory_bytes, int64_t{1} << 30);
    EXPECT_GE(d.compute_major, 7);
  }
}

TEST(CudaRuntimeTest, DeviceBufferRoundTripWithOffsetsAndStream) {
  TQKV_SKIP_WITHOUT_GPU();
  Stream stream;
  DeviceBuffer<int32_t> buffer(1000);
  EXPECT_EQ(buffer.size(), 1000);
  EXPECT_EQ(buffer.size_bytes(), 4000);
  buffer.FillBytes(0xFF, stream.get());
  std::vector<int32_t> host(300);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<int32_t>(i * 7 + 1);
  buffer.CopyFromHost(host, 600, stream.get());
  std::vector<int32_t> back(1000, 0);
  buffer.CopyToHost(back, 0, stream.get());
  stream.Synchronize();
  for (int i = 0; i < 600; ++i) ASSERT_EQ(back[i], -1) << i;
  for (int i = 600; i < 900; ++i) ASSERT_EQ(back[i], host[i - 600]) << i;
  for (int i = 900; i < 1000; ++i) ASSERT_EQ(back[i], -1) << i;
}

TEST(CudaRuntimeTest, CopyLargerThanBufferThrowsAndLeavesContents) {
  TQKV_SKIP_WITHOUT_GPU();
  DeviceBuffer<float> buffer(16);
  const std::vector<float> ones(16, 1.0f);
  buffer.CopyFromHost(ones);
  const std::vector<float> big(17, 2.0f);
  try {
    buffer.CopyFromHost(big);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("count = 17"), HasSubstr("buffer of 16 elements")));
  }
  EXPECT_THROW(buffer.CopyFromHost(std::span<const float>(ones).first(4), 13), Error);
  std::vector<float> too_many(20);
  EXPECT_THROW(buffer.CopyToHost(too_many), Error);
  std::vector<float> back(16);
  buffer.CopyToHost(back);
  EXPECT_EQ(back, ones);
}

TEST(CudaRuntimeTest, MovedBufferKeepsItsMemory) {
  TQKV_SKIP_WITHOUT_GPU();
  DeviceBuffer<float> a(8);
  const std::vector<float> v = {1, 2, 3, 4, 5, 6, 7, 8};
  a.CopyFromHost(v);
  float* ptr = a.data();
  DeviceBuffer<float> b(std::move(a));
  EXPECT_EQ(b.data(), ptr);
  EXPECT_EQ(a.size(), 0);  // NOLINT(bugprone-use-after-move): moved-from is empty
  DeviceBuffer<float> c(4);
  c = std::move(b);
  std::vector<float> back(8);
  c.CopyToHost(back);
  EXPECT_EQ(back, v);
}

TEST(CudaRuntimeTest, PinnedHostBufferIsPinnedWithADevice) {
  TQKV_SKIP_WITHOUT_GPU();
  PinnedHostBuffer<float> pinned(1024);
  EXPECT_TRUE(pinned.pinned());
}

TEST(CudaRuntimeTest, LaunchCheckReportsBadConfiguration) {
  TQKV_SKIP_WITHOUT_GPU();
  Stream stream;
  DeviceBuffer<float> buffer(1000);
  testing::LaunchFill(buffer.data(), 1000, 3.5f, 256, stream.get());
  EXPECT_NO_THROW(TQKV_CHECK_LAUNCH("FillKernel"));
  std::vector<float> back(1000);
  buffer.CopyToHost(back, 0, stream.get());
  stream.Synchronize();
  for (float x : back) ASSERT_EQ(x, 3.5f);

  testing::LaunchFill(buffer.data(), 1000, 1.0f, 2048, stream.get());  // > 1024 threads
  try {
    TQKV_CHECK_LAUNCH("FillKernel");
    FAIL() << "no throw";
  } catch (const Error& e) {
    // CUDA 13 reports cudaErrorInvalidValue here (older runtimes: InvalidConfiguration).
    EXPECT_THAT(e.what(), AllOf(HasSubstr("launch of FillKernel"), HasSubstr("CUDA error"),
                                HasSubstr("cudaErrorInvalid")));
  }
  // A launch error is not sticky: the next good launch checks clean.
  testing::LaunchFill(buffer.data(), 1000, 2.0f, 256, stream.get());
  EXPECT_NO_THROW(TQKV_CHECK_LAUNCH("FillKernel"));
}

TEST(CudaRuntimeTest, CudaCheckThrowsWithStatusName) {
  TQKV_SKIP_WITHOUT_GPU();
  try {
    TQKV_CUDA_CHECK(cudaSetDevice(CudaDeviceCount() + 100));
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("CUDA error"), HasSubstr("cudaErrorInvalidDevice"),
                                HasSubstr("cudaSetDevice")));
  }
  (void)cudaGetLastError();
}

TEST(CudaRuntimeTest, EventsMeasureTime) {
  TQKV_SKIP_WITHOUT_GPU();
  Stream stream;
  Event start, end;
  DeviceBuffer<float> buffer(1 << 24);
  start.Record(stream.get());
  for (int i = 0; i < 10; ++i) {
    testing::LaunchFill(buffer.data(), 1 << 24, 1.0f, 256, stream.get());
  }
  TQKV_CHECK_LAUNCH("FillKernel");
  end.Record(stream.get());
  end.Synchronize();
  const float ms = Event::ElapsedMs(start, end);
  EXPECT_GT(ms, 0.0f);
  EXPECT_LT(ms, 1000.0f);
}

TEST(CudaRuntimeTest, CublasSgemmMatchesCpuProduct) {
  TQKV_SKIP_WITHOUT_GPU();
  // Row-major C[M,N] = A[M,K] · B[K,N]; cuBLAS is column-major, so compute Cᵀ = Bᵀ·Aᵀ.
  const int M = 67, N = 45, K = 129;
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> a(M * K), b(K * N);
  for (auto& x : a) x = normal(rng);
  for (auto& x : b) x = normal(rng);

  Stream stream;
  CublasHandle blas;
  blas.SetStream(stream.get());
  TQKV_CUBLAS_CHECK(cublasSetMathMode(blas.get(), CUBLAS_PEDANTIC_MATH));  // true fp32, no TF32
  DeviceBuffer<float> da(M * K), db(K * N), dc(M * N);
  da.CopyFromHost(a, 0, stream.get());
  db.CopyFromHost(b, 0, stream.get());
  dc.FillBytes(0xFF, stream.get());  // NaN poison: every element must be written
  const float alpha = 1.0f, beta = 0.0f;
  TQKV_CUBLAS_CHECK(cublasSgemm(blas.get(), CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &alpha, db.data(), N,
                                da.data(), K, &beta, dc.data(), N));
  std::vector<float> c(M * N);
  dc.CopyToHost(c, 0, stream.get());
  stream.Synchronize();

  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      double ref = 0.0, mag = 0.0;
      for (int k = 0; k < K; ++k) {
        ref += static_cast<double>(a[i * K + k]) * b[k * N + j];
        mag += std::abs(static_cast<double>(a[i * K + k]) * b[k * N + j]);
      }
      // fp32 accumulation of K terms: error ≲ K·eps·Σ|a·b|.
      ASSERT_NEAR(c[i * N + j], ref, K * 1.2e-7 * mag + 1e-6) << "C[" << i << "," << j << "]";
    }
  }
}

TEST(CudaRuntimeTest, CublasHandleMoves) {
  TQKV_SKIP_WITHOUT_GPU();
  CublasHandle a;
  BlasHandle h = a.get();
  CublasHandle b(std::move(a));
  EXPECT_EQ(b.get(), h);
  EXPECT_EQ(a.get(), nullptr);  // NOLINT(bugprone-use-after-move)
}

#else

TEST(CudaTest, NeedsCuda) { GTEST_SKIP() << "this build has no CUDA support"; }

#endif  // TQKV_HAVE_CUDA

}  // namespace
}  // namespace tqkv
