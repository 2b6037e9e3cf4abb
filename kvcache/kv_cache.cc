#include "kvcache/kv_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "quant/block_format.h"
#include "runtime/error.h"

#if TQKV_HAVE_CUDA
#include <cuda_runtime.h>

#include "runtime/cuda_check.h"
#endif

namespace tqkv {

void KVCache::FreeDeleter::operator()(uint8_t* p) const { std::free(p); }

KVCache::KVCache(const CacheFormat& format, int num_layers, int32_t num_blocks, CacheDevice device)
    : format_(format),
      layout_(format.layout()),
      device_(device),
      num_layers_(num_layers),
      num_blocks_(num_blocks) {
  constexpr const char* kWhere = "KVCache";
  if (num_layers < 1) throw InvalidArgument(kWhere, "num_layers", num_layers, ">= 1");
  if (num_blocks < 2) {
    throw InvalidArgument(kWhere, "num_blocks", num_blocks,
                          ">= 2 (block 0 is the reserved null block)");
  }
  // layer() hands kernels format.layout(), which follows from the name and the three sizes, and
  // the layers are sized by block_bytes: the format must be MakeCacheFormat's for those fields.
  const CacheFormat made =
      MakeCacheFormat(format.name, format.head_dim, format.num_kv_heads, format.block_size);
  if (made.bf16 != format.bf16 || made.block_bytes != format.block_bytes ||
      made.slot_bytes != format.slot_bytes ||
      (format.bf16 ? made.bf16_format.dtype != format.bf16_format.dtype ||
                         made.bf16_format.block_bytes != format.bf16_format.block_bytes
                   : made.turboquant.block_bytes != format.turboquant.block_bytes)) {
    throw InvalidArgument(
        kWhere, "format", DescribeLayout(format.layout()),
        fmt::format("MakeCacheFormat's for it ({} bytes per block, {} per slot; this one says {} "
                    "and {})",
                    made.block_bytes, made.slot_bytes, format.block_bytes, format.slot_bytes));
  }
  if (format.block_bytes < 1 || format.block_bytes > (int64_t{1} << 62) / num_blocks) {
    throw InvalidArgument(
        kWhere, "format.block_bytes", format.block_bytes,
        fmt::format("1 to {} for {} blocks", (int64_t{1} << 62) / num_blocks, num_blocks));
  }
  layer_bytes_ = int64_t{num_blocks} * format.block_bytes;
  if (device == CacheDevice::kCuda) {
    RequireCudaDevice("KVCache on CacheDevice::kCuda");
    device_layers_.reserve(static_cast<size_t>(num_layers));
    for (int l = 0; l < num_layers; ++l) {
      device_layers_.emplace_back(layer_bytes_);
      device_layers_.back().FillBytes(0);
    }
    return;
  }
  host_layers_.reserve(static_cast<size_t>(num_layers));
  for (int l = 0; l < num_layers; ++l) {
    // 64-byte alignment: whole cache lines per block for the CPU reference kernels.
    const size_t bytes = static_cast<size_t>((layer_bytes_ + 63) / 64 * 64);
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(64, bytes));
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p, 0, bytes);
    host_layers_.emplace_back(p);
  }
}

uint8_t* KVCache::layer_data(int layer) {
  return const_cast<uint8_t*>(std::as_const(*this).layer_data(layer));
}

const uint8_t* KVCache::layer_data(int layer) const {
  if (layer < 0 || layer >= num_layers_) {
    throw InvalidArgument("KVCache::layer_data", "layer", layer,
                          fmt::format("0 to {}", num_layers_ - 1));
  }
  if (device_ == CacheDevice::kCuda) return device_layers_[static_cast<size_t>(layer)].data();
  return host_layers_[static_cast<size_t>(layer)].get();
}

void KVCache::CheckBlock(std::string_view where, int layer, int32_t block, size_t size) const {
  if (layer < 0 || layer >= num_layers_) {
    throw InvalidArgument(where, "layer", layer, fmt::format("0 to {}", num_layers_ - 1));
  }
  if (block < 0 || block >= num_blocks_) {
    throw InvalidArgument(where, "block", block, fmt::format("0 to {}", num_blocks_ - 1));
  }
  if (size != static_cast<size_t>(format_.block_bytes)) {
    throw InvalidArgument(where, "bytes.size()", size,
                          fmt::format("{} (block_bytes)", format_.block_bytes));
  }
}

void KVCache::ReadBlock(int layer, int32_t block, std::span<uint8_t> bytes) const {
  CheckBlock("KVCache::ReadBlock", layer, block, bytes.size());
  if (device_ == CacheDevice::kCuda) {
    device_layers_[static_cast<size_t>(layer)].CopyToHost(bytes, BlockOffset(block));
  } else {
    std::memcpy(bytes.data(), host_layers_[static_cast<size_t>(layer)].get() + BlockOffset(block),
                bytes.size());
  }
}

void KVCache::WriteBlock(int layer, int32_t block, std::span<const uint8_t> bytes) {
  CheckBlock("KVCache::WriteBlock", layer, block, bytes.size());
  if (block == 0) {  // (kvcache/README.md: the null block is never written)
    throw InvalidArgument("KVCache::WriteBlock", "block", block,
                          fmt::format("1 to {} (block 0 is the null block)", num_blocks_ - 1));
  }
  if (device_ == CacheDevice::kCuda) {
    device_layers_[static_cast<size_t>(layer)].CopyFromHost(bytes, BlockOffset(block));
  } else {
    std::memcpy(host_layers_[static_cast<size_t>(layer)].get() + BlockOffset(block), bytes.data(),
                bytes.size());
  }
}

void KVCache::ApplyCopies(std::span<const BlockCopy> copies, StreamHandle stream) {
  constexpr const char* kWhere = "KVCache::ApplyCopies";
  if (copies.empty()) return;
  const std::string allowed = fmt::format("1 to {} (block 0 is the null block)", num_blocks_ - 1);
  std::vector<int32_t> sources;
  std::vector<int32_t> destinations;
  sources.reserve(copies.size());
  destinations.reserve(copies.size());
  for (size_t i = 0; i < copies.size(); ++i) {
    const BlockCopy& c = copies[i];
    if (c.src < 1 || c.src >= num_blocks_) {
      throw InvalidArgument(kWhere, fmt::format("copies[{}].src", i), c.src, allowed);
    }
    if (c.dst < 1 || c.dst >= num_blocks_) {
      throw InvalidArgument(kWhere, fmt::format("copies[{}].dst", i), c.dst, allowed);
    }
    if (c.src == c.dst) {
      throw InvalidArgument(kWhere, fmt::format("copies[{}].dst", i), c.dst,
                            fmt::format("a block other than its src {}", c.src));
    }
    sources.push_back(c.src);
    destinations.push_back(c.dst);
  }
  // The copies may run in any order (and concurrently on a device), so no block may be written
  // twice or be both written and read.
  std::sort(sources.begin(), sources.end());
  std::sort(destinations.begin(), destinations.end());
  for (size_t i = 0; i < destinations.size(); ++i) {
    const int32_t d = destinations[i];
    if ((i > 0 && destinations[i - 1] == d) ||
        std::binary_search(sources.begin(), sources.end(), d)) {
      throw InvalidArgument(kWhere, "copy destination", d,
                            "distinct destinations that are not also sources");
    }
  }

  const size_t bytes = static_cast<size_t>(format_.block_bytes);
  if (device_ == CacheDevice::kCpu) {
    for (int l = 0; l < num_layers_; ++l) {
      uint8_t* base = host_layers_[static_cast<size_t>(l)].get();
      for (const BlockCopy& c : copies) {
        std::memcpy(base + BlockOffset(c.dst), base + BlockOffset(c.src), bytes);
      }
    }
    return;
  }
#if TQKV_HAVE_CUDA
  for (int l = 0; l < num_layers_; ++l) {
    uint8_t* base = device_layers_[static_cast<size_t>(l)].data();
    for (const BlockCopy& c : copies) {
      TQKV_CUDA_CHECK(cudaMemcpyAsync(base + BlockOffset(c.dst), base + BlockOffset(c.src), bytes,
                                      cudaMemcpyDeviceToDevice, stream));
    }
  }
  if (stream == nullptr) TQKV_CUDA_CHECK(cudaStreamSynchronize(nullptr));
#else
  (void)stream;
  TQKV_CHECK(false);  // the constructor rejects kCuda without CUDA
#endif
}

StepBatchView UploadStepBatch(const StepBatch& batch, DeviceBuffer<uint8_t>& device,
                              StreamHandle stream) {
  const std::span<const std::byte> bytes = batch.bytes();
  if (device.size() < static_cast<int64_t>(bytes.size())) {
    device = DeviceBuffer<uint8_t>(
        std::max<int64_t>(static_cast<int64_t>(bytes.size()), 2 * device.size()));
  }
  device.CopyFromHost({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, 0, stream);
  return ViewStepBatch(batch, device.data());
}

}  // namespace tqkv
