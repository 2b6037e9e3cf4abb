// Does compute-sanitizer's initcheck see the writes of cuBLAS's GEMM kernels?
//
// The store's GEMM path reads y = x̂ · Πᵀ, written by cublasGemmEx, in its own kernel. initcheck
// reports those reads as uninitialized although the stored bytes equal the CPU reference. This
// probe isolates the question: for each GEMM precision the store uses, cuBLAS writes every element
// of a fresh buffer (beta = 0), the host checks every element against its own product (so all of
// them were written), and a one-line kernel reads the buffer. A control buffer written by a plain
// kernel is read the same way. Run it under `compute-sanitizer --tool initcheck`: reports naming
// ReadAll on a cuBLAS-written buffer, and none on the control, mean initcheck misses cuBLAS's
// writes, not that anything is read uninitialized. The case `bf16-marked` then tells initcheck,
// through the NVTX memory API, that the GEMM initialized its output, as the store does.
//
// On the H200 with cuBLAS 13 and compute-sanitizer 2025.3.1: control, sgemm and tf32 0 reports;
// bf16 (bf16 inputs, fp32 output: the store's fp32-accurate split GEMM) 589,824, in ReadAll and
// the host copy.
//
// Usage: initcheck_cublas_probe [sgemm|tf32|bf16|control|bf16-marked] (one case per run, so each
// run's ERROR SUMMARY belongs to one case; no argument runs every case).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExtMemCudaRt.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CHECK_CUDA(x)                                                               \
  do {                                                                              \
    cudaError_t e = (x);                                                            \
    if (e != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(2);                                                                 \
    }                                                                               \
  } while (0)
#define CHECK_BLAS(x)                                                               \
  do {                                                                              \
    cublasStatus_t s = (x);                                                         \
    if (s != CUBLAS_STATUS_SUCCESS) {                                               \
      std::fprintf(stderr, "%s:%d %s: status %d\n", __FILE__, __LINE__, #x, (int)s); \
      std::exit(2);                                                                 \
    }                                                                               \
  } while (0)

__global__ void ReadAll(const float* y, long n, float* sum) {
  float s = 0.0f;
  for (long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) s += y[i];
  atomicAdd(sum, s);
}

__global__ void WriteAll(float* y, long n) {
  for (long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = 1.0f;
}

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "all";
  const int d = 128, n = 4096;  // y[n rows, d] = x[n, d] · Πᵀ, as the store computes it
  std::vector<float> a(d * d), b(static_cast<size_t>(d) * n);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>((i * 7919) % 17) / 16.0f - 0.5f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>((i * 104729) % 13) / 12.0f - 0.5f;
  std::vector<__nv_bfloat16> a16(a.size()), b16(b.size());
  for (size_t i = 0; i < a.size(); ++i) a16[i] = __float2bfloat16(a[i]);
  for (size_t i = 0; i < b.size(); ++i) b16[i] = __float2bfloat16(b[i]);

  float *da, *db, *sum;
  __nv_bfloat16 *da16, *db16;
  CHECK_CUDA(cudaMalloc(&da, a.size() * 4));
  CHECK_CUDA(cudaMalloc(&db, b.size() * 4));
  CHECK_CUDA(cudaMalloc(&da16, a.size() * 2));
  CHECK_CUDA(cudaMalloc(&db16, b.size() * 2));
  CHECK_CUDA(cudaMalloc(&sum, 4));
  CHECK_CUDA(cudaMemcpy(da, a.data(), a.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(db, b.data(), b.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(da16, a16.data(), a.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(db16, b16.data(), b.size() * 2, cudaMemcpyHostToDevice));
  cublasHandle_t h;
  CHECK_BLAS(cublasCreate(&h));

  struct Case {
    const char* name;
    cublasComputeType_t compute;
    bool bf16, mark;
  };
  const Case cases[] = {{"sgemm", CUBLAS_COMPUTE_32F_PEDANTIC, false, false},
                        {"tf32", CUBLAS_COMPUTE_32F_FAST_TF32, false, false},
                        {"bf16", CUBLAS_COMPUTE_32F, true, false},
                        {"bf16-marked", CUBLAS_COMPUTE_32F, true, true}};
  const long elems = static_cast<long>(d) * n;
  int bad = 0;
  bool known = which == "control" || which == "all";
  for (const Case& c : cases) {
    if (which != "all" && which != c.name) continue;
    known = true;
    float* y;
    CHECK_CUDA(cudaMalloc(&y, elems * 4));  // fresh: nothing written yet
    const float one = 1.0f, zero = 0.0f;
    CHECK_BLAS(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, d, n, d, &one, c.bf16 ? (void*)da16 : da,
                            c.bf16 ? CUDA_R_16BF : CUDA_R_32F, d, c.bf16 ? (void*)db16 : db,
                            c.bf16 ? CUDA_R_16BF : CUDA_R_32F, d, &zero, y, CUDA_R_32F, d,
                            c.compute, CUBLAS_GEMM_DEFAULT));
    if (c.mark) {
      const nvtxDomainHandle_t domain = nvtxDomainCreateA("initcheck_cublas_probe");
      const nvtxMemVirtualRangeDesc_t range{static_cast<size_t>(elems) * 4, y};
      nvtxMemMarkInitializedBatch_t batch{};
      batch.extCompatID = NVTX_EXT_COMPATID_MEM;
      batch.structSize = sizeof(batch);
      batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
      batch.regionDescCount = 1;
      batch.regionDescElementSize = sizeof(range);
      batch.regionDescElements = &range;
      nvtxMemCudaMarkInitialized(domain, nullptr, 0, &batch);
    }
    CHECK_CUDA(cudaMemset(sum, 0, 4));
    ReadAll<<<132, 256>>>(y, elems, sum);  // first, so that its reports come first
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<float> got(elems);
    CHECK_CUDA(cudaMemcpy(got.data(), y, elems * 4, cudaMemcpyDeviceToHost));
    long wrong = 0;
    for (int col = 0; col < n; ++col) {
      for (int row = 0; row < d; ++row) {
        double ref = 0.0;
        for (int k = 0; k < d; ++k) {
          const double x = c.bf16 ? __bfloat162float(a16[k * d + row]) : a[k * d + row];
          const double z = c.bf16 ? __bfloat162float(b16[col * d + k]) : b[col * d + k];
          ref += x * z;
        }
        if (std::fabs(got[static_cast<size_t>(col) * d + row] - ref) > 1e-2 * (1 + std::fabs(ref))) ++wrong;
      }
    }
    std::printf("cuBLAS %-26s every element written and right: %s (%ld wrong)\n", c.name,
                wrong == 0 ? "yes" : "NO", wrong);
    bad += wrong != 0;
    CHECK_CUDA(cudaFree(y));
  }
  if (!known) {
    std::fprintf(stderr, "usage: %s [sgemm|tf32|bf16|control|bf16-marked]\n", argv[0]);
    return 2;
  }
  if (which != "control" && which != "all") {
    cublasDestroy(h);
    return bad == 0 ? 0 : 1;
  }
  float* y;
  CHECK_CUDA(cudaMalloc(&y, elems * 4));
  WriteAll<<<132, 256>>>(y, elems);
  CHECK_CUDA(cudaMemset(sum, 0, 4));
  ReadAll<<<132, 256>>>(y, elems, sum);
  float s = 0.0f;
  CHECK_CUDA(cudaMemcpy(&s, sum, 4, cudaMemcpyDeviceToHost));
  std::printf("control (kernel-written) read, sum %.0f (expect %ld)\n", s, elems);
  bad += s != static_cast<float>(elems);
  CHECK_CUDA(cudaFree(y));
  cublasDestroy(h);
  return bad == 0 ? 0 : 1;
}
