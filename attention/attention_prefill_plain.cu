// The prefill kernels of FP8 keys and the uncompressed caches (one unit).
#include "attention/attention_prefill.cuh"

namespace tqkv::attention_detail {

template <>
cudaError_t LaunchPrefillOfKind<KeyKind::kFp8>(int value_bits, int head_dim,
                                               const ChunkParams& p, cudaStream_t stream) {
  if (value_bits != 4) return cudaErrorInvalidValue;
  return LaunchPrefillOfBits<KeyKind::kFp8, 4>(head_dim, p, stream);
}

template <>
cudaError_t LaunchPrefillOfKind<KeyKind::kBf16>(int value_bits, int head_dim,
                                                const ChunkParams& p, cudaStream_t stream) {
  if (value_bits != 16) return cudaErrorInvalidValue;
  return LaunchPrefillOfBits<KeyKind::kBf16, 16>(head_dim, p, stream);
}

template <>
cudaError_t LaunchPrefillOfKind<KeyKind::kF16>(int value_bits, int head_dim,
                                               const ChunkParams& p, cudaStream_t stream) {
  if (value_bits != 16) return cudaErrorInvalidValue;
  return LaunchPrefillOfBits<KeyKind::kF16, 16>(head_dim, p, stream);
}

template <>
bool PrefillTakesTilesOfKind<KeyKind::kFp8>(int value_bits, int head_dim, const ChunkParams& p) {
  return value_bits == 4 && WgmmaRunsOfBits<KeyKind::kFp8, 4>(head_dim, p);
}

template <>
bool PrefillTakesTilesOfKind<KeyKind::kBf16>(int value_bits, int head_dim, const ChunkParams& p) {
  return value_bits == 16 && WgmmaRunsOfBits<KeyKind::kBf16, 16>(head_dim, p);
}

template <>
bool PrefillTakesTilesOfKind<KeyKind::kF16>(int value_bits, int head_dim, const ChunkParams& p) {
  return value_bits == 16 && WgmmaRunsOfBits<KeyKind::kF16, 16>(head_dim, p);
}

}  // namespace tqkv::attention_detail
