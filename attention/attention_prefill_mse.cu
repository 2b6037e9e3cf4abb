// The prefill kernels of the MSE key kinds (one unit, built beside the others).
#include "attention/attention_prefill.cuh"

namespace tqkv::attention_detail {

template <>
cudaError_t LaunchPrefillOfKind<KeyKind::kMse4>(int value_bits, int head_dim, const ChunkParams& p,
                                                cudaStream_t stream) {
  if (value_bits != 4) return cudaErrorInvalidValue;
  return LaunchPrefillOfBits<KeyKind::kMse4, 4>(head_dim, p, stream);
}

template <>
cudaError_t LaunchPrefillOfKind<KeyKind::kMse3>(int value_bits, int head_dim, const ChunkParams& p,
                                                cudaStream_t stream) {
  if (value_bits == 3) return LaunchPrefillOfBits<KeyKind::kMse3, 3>(head_dim, p, stream);
  if (value_bits == 4) return LaunchPrefillOfBits<KeyKind::kMse3, 4>(head_dim, p, stream);
  return cudaErrorInvalidValue;
}

bool PrefillRotatesQuery(KeyKind kind, int value_bits, int head_dim, const ChunkParams& p) {
  if (head_dim != 128) return false;
  bool layout = false;
  if (kind == KeyKind::kMse4 && value_bits == 4) layout = WgmmaPrefillRuns<KeyKind::kMse4, 4>(p);
  if (kind == KeyKind::kMse3 && value_bits == 3) layout = WgmmaPrefillRuns<KeyKind::kMse3, 3>(p);
  if (kind == KeyKind::kMse3 && value_bits == 4) layout = WgmmaPrefillRuns<KeyKind::kMse3, 4>(p);
  return layout && DeviceHasWgmma();
}

template <>
bool PrefillTakesTilesOfKind<KeyKind::kMse4>(int value_bits, int head_dim, const ChunkParams& p) {
  return value_bits == 4 && WgmmaRunsOfBits<KeyKind::kMse4, 4>(head_dim, p);
}

template <>
bool PrefillTakesTilesOfKind<KeyKind::kMse3>(int value_bits, int head_dim, const ChunkParams& p) {
  return (value_bits == 3 && WgmmaRunsOfBits<KeyKind::kMse3, 3>(head_dim, p)) ||
         (value_bits == 4 && WgmmaRunsOfBits<KeyKind::kMse3, 4>(head_dim, p));
}

}  // namespace tqkv::attention_detail
