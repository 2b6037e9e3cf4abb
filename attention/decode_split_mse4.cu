// The split kernels of Mse4 caches (one instantiation unit per key kind, built in parallel).
#include "attention/decode_split_kernel.cuh"

namespace tqkv::decode_detail {

template cudaError_t LaunchSplitKernelOfKind<KeyKind::kMse4>(const SplitParams&,
                                                             const SplitVariant&, bool,
                                                             cudaStream_t);
template cudaError_t SplitKernelOfKindCtasPerSm<KeyKind::kMse4>(const SplitVariant&, int*);

}  // namespace tqkv::decode_detail
