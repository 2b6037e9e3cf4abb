// The store kernels of head_dim 256 (one instantiation unit per head_dim, built in parallel).
#include "quant/store_dispatch.cuh"

namespace tqkv::store {

bool LaunchStoreD256(const StoreParams& p, int64_t chunks, StreamHandle stream) {
  return LaunchStoreDim<256>(p, chunks, stream);
}

}  // namespace tqkv::store
