// KVCache: the cache tensors, one [num_blocks, block_bytes] uint8 tensor per layer, on the host or
// on a CUDA device. Block ids are KVCacheManager's: block b of every layer holds the KV of the
// same tokens. Block 0 is the manager's null block (padding entries point there; it is never
// written and never read for a real token).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "kvcache/cache_format.h"
#include "kvcache/step_batch.h"
#include "quant/cache_ref.h"
#include "runtime/device.h"
#include "runtime/memory.h"

namespace tqkv {

enum class CacheDevice { kCpu, kCuda };

class KVCache {
 public:
  // Allocates and zeroes num_layers tensors of num_blocks * format.block_bytes bytes. Throws
  // tqkv::Error for num_layers < 1 or num_blocks < 2, a layer larger than 2^62 bytes, or kCuda
  // without a CUDA build and device.
  KVCache(const CacheFormat& format, int num_layers, int32_t num_blocks, CacheDevice device);
  KVCache(KVCache&&) noexcept = default;
  KVCache& operator=(KVCache&&) noexcept = default;

  const CacheFormat& format() const { return format_; }
  CacheDevice device() const { return device_; }
  int num_layers() const { return num_layers_; }
  int32_t num_blocks() const { return num_blocks_; }
  int64_t block_bytes() const { return format_.block_bytes; }
  int64_t layer_bytes() const { return layer_bytes_; }
  int64_t total_bytes() const { return layer_bytes_ * num_layers_; }

  // [num_blocks, block_bytes] of one layer: a host pointer for kCpu, a device pointer for kCuda.
  uint8_t* layer_data(int layer);
  const uint8_t* layer_data(int layer) const;
  // The same layer as stores and attention take it: its bytes, num_blocks() and the format's
  // layout. Throws tqkv::Error for a layer outside 0..num_layers-1, as layer_data.
  CacheRef layer(int layer) { return {layer_data(layer), num_blocks_, layout_}; }
  ConstCacheRef layer(int layer) const { return {layer_data(layer), num_blocks_, layout_}; }
  // Byte offset of a block within a layer tensor (kernels add the offsets of quant/block_format.h
  // or Bf16BlockFormat to this).
  int64_t BlockOffset(int32_t block) const { return int64_t{block} * format_.block_bytes; }

  // Copies one whole block between host memory and the cache (bytes.size() == block_bytes()), for
  // tests, debugging and swapping. Synchronous on kCuda, on the legacy default stream: work the
  // caller queued on non-blocking streams (tqkv's Stream) must be synchronized first.
  void ReadBlock(int layer, int32_t block, std::span<uint8_t> bytes) const;
  void WriteBlock(int layer, int32_t block, std::span<const uint8_t> bytes);

  // Copies whole blocks src -> dst in every layer (copy-on-write lists from StepBatch::copies()).
  // Validates every pair before copying anything: ids in 1..num_blocks-1 (never the null block),
  // src != dst, destinations distinct and never a source. On kCuda the copies are enqueued on
  // `stream` (nullptr: the default stream, and the call waits for them); kCpu ignores `stream`.
  void ApplyCopies(std::span<const BlockCopy> copies, StreamHandle stream = nullptr);

 private:
  struct FreeDeleter {
    void operator()(uint8_t* p) const;
  };
  using HostBytes = std::unique_ptr<uint8_t, FreeDeleter>;
  void CheckBlock(std::string_view where, int layer, int32_t block, size_t size) const;

  CacheFormat format_;
  CacheLayout layout_;
  CacheDevice device_;
  int num_layers_ = 0;
  int32_t num_blocks_ = 0;
  int64_t layer_bytes_ = 0;
  std::vector<HostBytes> host_layers_;                // kCpu: [num_layers]
  std::vector<DeviceBuffer<uint8_t>> device_layers_;  // kCuda: [num_layers]
};

// Uploads a step: copies batch.bytes() (block tables, slot mapping, lengths; offsets in
// batch.layout()) into `device` with one asynchronous copy on `stream` (nullptr: synchronous),
// and returns the device pointers of the four sections (ViewStepBatch(batch, device.data())):
// the store's slot mapping and the decode's block tables and lengths, for every layer of the
// step. `device` grows when too small (which frees the old buffer: size it once for the largest
// padded step when capturing CUDA graphs). The batch's host buffer must not be rescheduled until
// the copy has completed: wait on the stream before the next Schedule, or alternate two
// StepBatch objects.
StepBatchView UploadStepBatch(const StepBatch& batch, DeviceBuffer<uint8_t>& device,
                              StreamHandle stream);

}  // namespace tqkv
