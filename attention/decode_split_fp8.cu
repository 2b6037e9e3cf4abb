// The split kernels of Fp8 caches (one instantiation unit per key kind, built in parallel).
#include "attention/decode_split_kernel.cuh"

namespace tqkv::decode_detail {

template cudaError_t LaunchSplitKernelOfKind<KeyKind::kFp8>(const SplitParams&, const SplitVariant&,
                                                            bool, cudaStream_t);
template cudaError_t SplitKernelOfKindCtasPerSm<KeyKind::kFp8>(const SplitVariant&, int*);

}  // namespace tqkv::decode_detail
