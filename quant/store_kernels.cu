// CUDA store kernels: quantize K/V rows into the SoA blocks of quant/block_format.h.
//
// Every kernel mirrors Quantizer::EncodeSlot (quant/quantizer.cc) line for line; the README of
// quant/ lists the numeric choices they share (fp64 norm accumulation rounded to fp32 once, fp64
// norm correction, IEEE divisions, NaN/inf rules). The only intended difference is the rotation:
// the reference accumulates y = x̂ · Πᵀ in fp64, these kernels in fp32 (FWHT or cuBLAS), so an
// index may differ by one where y lies within a few ulp of a midpoint.
//
// Work split (quant/store_device.h): a row (token, head) is D/16 lanes, 16 elements per lane, so
// a warp holds 32·16/D rows and a 256-thread CTA 4096/D rows; the wide FWHT kernel (kWide, the
// default for large 16-bit stores) has 32 elements per lane and 128-thread CTAs. Each lane reads
// its 16 (32) key and value elements with 16-byte loads and writes its packed codes as 8-byte
// stores (lanes of a row write consecutive words; rows of consecutive heads of one token are
// contiguous in the block). The fp16 metadata of a CTA goes through shared memory and is written
// head-major, so that consecutive tokens of one head (consecutive positions in a block during
// prefill) are adjacent lanes. fp32 tensors of the GEMM path (y read by StoreKernel; x̂ written and
// fp32 keys read by NormalizeKernel) move as contiguous 2 KB warp tiles through shared memory
// instead ("fp32 warp tiles" below), so that every 16-byte access instruction covers whole sectors.
//
// Files: store_loads.cuh (loads, tensor-core helpers, warp tiles), store_row_math.cuh (per-row
// arithmetic), store_kernel.cuh (StoreKernel), store_dispatch.cuh with
// store_kernels_d{64,128,256}.cu (its instantiations, one unit per head_dim), store_normalize.cu
// (the GEMM path's normalize kernel); this file picks the head_dim.
#include <cstdint>

#include "quant/store_launch.h"
#include "quant/store_loads.cuh"  // kThreads

namespace tqkv::store {
namespace {

constexpr int64_t kPairCopyMinRows = 65536;

int GridFor(int64_t rows, int head_dim) {
  const int64_t rows_per_cta = kThreads / (head_dim / kLaneElems);
  return static_cast<int>((rows + rows_per_cta - 1) / rows_per_cta);
}

}  // namespace

bool LaunchStore(const StoreParams& params, StreamHandle stream) {
  const int64_t rows = params.num_tokens * params.format.num_kv_heads;
  if (rows == 0) return true;
  // Copies of the pair table cost each CTA ~0.4 µs to write (+0.4 µs per call at decode sizes,
  // measured) and pay off once a CTA stores many chunks (3 % at 65,536 tokens x 8 heads).
  StoreParams p = params;
  p.pair_copies_log2 = rows >= kPairCopyMinRows ? 4 : 0;
  const int64_t chunks = GridFor(rows, p.format.head_dim);  // kRows rows each
  switch (p.format.head_dim) {
    case 64:
      return LaunchStoreD64(p, chunks, stream);
    case 128:
      return LaunchStoreD128(p, chunks, stream);
    case 256:
      return LaunchStoreD256(p, chunks, stream);
    default:
      return false;
  }
}

bool PrepareMmaStore(const BlockFormat& f) {
  switch (f.head_dim) {
    case 64:
      return PrepareMmaStoreD64(f);
    case 128:
      return PrepareMmaStoreD128(f);
    default:
      return false;
  }
}

}  // namespace tqkv::store
