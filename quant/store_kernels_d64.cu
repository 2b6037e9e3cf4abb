// The store kernels of head_dim 64 (one instantiation unit per head_dim, built in parallel).
#include "quant/store_dispatch.cuh"

namespace tqkv::store {

bool LaunchStoreD64(const StoreParams& p, int64_t chunks, StreamHandle stream) {
  return LaunchStoreDim<64>(p, chunks, stream);
}

bool PrepareMmaStoreD64(const BlockFormat& format) { return PrepareMmaDim<64>(format); }

}  // namespace tqkv::store
