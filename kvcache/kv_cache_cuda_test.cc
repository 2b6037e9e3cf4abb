// KVCache on a CUDA device, and the StepBatch upload. Skipped without a device.
#include <gtest/gtest.h>

#include <vector>

#include "kvcache/kv_cache.h"
#include "kvcache/manager.h"
#include "runtime/memory.h"
#include "runtime/stream.h"
#include "tests/gpu_test_util.h"

namespace tqkv {
namespace {

std::vector<uint8_t> Pattern(int64_t n, int seed) {
  std::vector<uint8_t> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(seed * 37 + i * 11 + (i >> 8));
  return v;
}

TEST(KVCacheCudaTest, AllocatesZeroedLayersOnTheDevice) {
  TQKV_SKIP_WITHOUT_GPU();
  const CacheFormat f = MakeCacheFormat("turboquant_4bit_nc", 128, 8, 16);
  KVCache cache(f, 4, 64, CacheDevice::kCuda);
  EXPECT_EQ(cache.total_bytes(), 4 * 64 * f.block_bytes);
  std::vector<uint8_t> got(static_cast<size_t>(f.block_bytes), 0xff);
  for (int l = 0; l < 4; ++l) {
    cache.ReadBlock(l, 63, got);
    for (uint8_t b : got) ASSERT_EQ(b, 0);
  }
}

TEST(KVCacheCudaTest, ApplyCopiesOnAStreamAndOnTheDefaultStream) {
  TQKV_SKIP_WITHOUT_GPU();
  const CacheFormat f = MakeCacheFormat("turboquant_k8v4", 128, 4, 16);
  KVCache cache(f, 3, 16, CacheDevice::kCuda);
  for (int l = 0; l < 3; ++l) {
    for (int32_t b = 1; b < 16; ++b) cache.WriteBlock(l, b, Pattern(f.block_bytes, l * 100 + b));
  }
  Stream stream;
  const std::vector<BlockCopy> first = {{1, 9}, {2, 10}, {1, 11}};
  cache.ApplyCopies(first, stream.get());
  stream.Synchronize();
  const std::vector<BlockCopy> second = {{3, 12}};
  cache.ApplyCopies(second);  // default stream: returns when done
  const int32_t source[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 1, 3, 13, 14, 15};
  std::vector<uint8_t> got(static_cast<size_t>(f.block_bytes));
  for (int l = 0; l < 3; ++l) {
    for (int32_t b = 1; b < 16; ++b) {
      cache.ReadBlock(l, b, got);
      EXPECT_EQ(got, Pattern(f.block_bytes, l * 100 + source[b])) << l << " " << b;
    }
  }
  const std::vector<BlockCopy> bad = {{0, 3}};
  EXPECT_THROW(cache.ApplyCopies(bad, stream.get()), Error);
}

// The batch's arena is pinned when a device is present and uploads with one copy.
TEST(KVCacheCudaTest, StepBatchUploadsInOneCopy) {
  TQKV_SKIP_WITHOUT_GPU();
  KVCacheManagerOptions o;
  o.num_blocks = 64;
  o.block_size = 16;
  KVCacheManager m(o);
  std::vector<StepRequest> reqs;
  for (int i = 0; i < 8; ++i) {
    reqs.push_back({m.AddSequence(std::vector<int32_t>(20 + i, i)), 20 + i, 0});
  }
  StepBatch batch;
  ASSERT_TRUE(
      m.Schedule(reqs, batch, {.pad_tokens_to = 256, .pad_requests_to = 16, .block_table_width = 4})
          .admitted);
  EXPECT_TRUE(batch.arena_pinned());
  DeviceBuffer<uint8_t> device;
  Stream stream;
  const StepBatchView view = UploadStepBatch(batch, device, stream.get());
  const auto bytes = batch.bytes();
  ASSERT_GE(device.size(), static_cast<int64_t>(bytes.size()));
  // The returned view points into the device copy, at the batch's offsets.
  const uint8_t* base = device.data();
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(view.block_tables),
            base + batch.layout().block_tables);
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(view.slot_mapping),
            base + batch.layout().slot_mapping);
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(view.seq_lens), base + batch.layout().seq_lens);
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(view.query_start_loc),
            base + batch.layout().query_start_loc);
  EXPECT_EQ(view.padded_num_requests, 16);
  EXPECT_EQ(view.padded_num_tokens, 256);
  std::vector<uint8_t> back(bytes.size());
  device.CopyToHost(back, 0, stream.get());
  stream.Synchronize();
  EXPECT_TRUE(std::equal(back.begin(), back.end(), reinterpret_cast<const uint8_t*>(bytes.data())));
}

}  // namespace
}  // namespace tqkv
