// The store kernels of head_dim 128 (one instantiation unit per head_dim, built in parallel).
#include "quant/store_dispatch.cuh"

namespace tqkv::store {

bool LaunchStoreD128(const StoreParams& p, int64_t chunks, StreamHandle stream) {
  return LaunchStoreDim<128>(p, chunks, stream);
}

bool PrepareMmaStoreD128(const BlockFormat& format) { return PrepareMmaDim<128>(format); }

}  // namespace tqkv::store
