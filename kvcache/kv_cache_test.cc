// KVCache on the host (the CUDA path: kv_cache_cuda_test.cc).
#include "kvcache/kv_cache.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>
#include <utility>
#include <vector>

#include "kvcache/manager.h"
#include "quant/quantizer.h"
#include "runtime/device.h"
#include "runtime/error.h"

namespace tqkv {
namespace {

using ::testing::HasSubstr;

std::vector<uint8_t> Pattern(int64_t n, uint8_t seed) {
  std::vector<uint8_t> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(seed * 31 + i * 7);
  return v;
}

TEST(KVCacheTest, SizesFollowTheFormat) {
  const CacheFormat f = MakeCacheFormat("turboquant_4bit_nc", 128, 8, 16);
  KVCache cache(f, 3, 10, CacheDevice::kCpu);
  EXPECT_EQ(cache.num_layers(), 3);
  EXPECT_EQ(cache.num_blocks(), 10);
  EXPECT_EQ(cache.block_bytes(), 17152);
  EXPECT_EQ(cache.layer_bytes(), 171520);
  EXPECT_EQ(cache.total_bytes(), 3 * 171520);
  EXPECT_EQ(cache.BlockOffset(4), 4 * 17152);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(cache.layer_data(0)) % 64, 0u);
  EXPECT_NE(cache.layer_data(0), cache.layer_data(1));
  const uint8_t* p = cache.layer_data(2);
  for (int64_t i = 0; i < cache.layer_bytes(); ++i) ASSERT_EQ(p[i], 0);
  EXPECT_THROW(cache.layer_data(3), Error);

  KVCache bf16(MakeCacheFormat("bf16", 64, 2, 16), 1, 2, CacheDevice::kCpu);
  EXPECT_EQ(bf16.block_bytes(), 16 * 2 * 2 * 64 * 2);
}

// layer() is the reference stores and attention take: the layer's bytes, the block count and the
// format's layout, which a store of another format refuses.
TEST(KVCacheTest, LayerReferencesNameTheFormatsLayout) {
  KVCache cache(MakeCacheFormat("turboquant_4bit_nc", 128, 2, 16), 2, 10, CacheDevice::kCpu);
  const CacheRef r = cache.layer(1);
  EXPECT_EQ(r.data, cache.layer_data(1));
  EXPECT_EQ(r.num_blocks, 10);
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 128, 2, 16);
  EXPECT_EQ(r.layout, q.layout());
  EXPECT_THROW(cache.layer(2), Error);

  // The uncompressed layouts are named by their element type; a moved cache names it still (the
  // name is static, not the moved format's string).
  KVCache fp16(MakeCacheFormat("fp16", 64, 2, 32), 1, 2, CacheDevice::kCpu);
  const KVCache moved = std::move(fp16);
  EXPECT_EQ(moved.layer(0).layout, MakeBf16BlockFormat(64, 2, 32, DType::kF16).layout());
  EXPECT_EQ(moved.layer(0).layout.format, "fp16");

  // An engine that hands a 4-bit store a layer of its bf16 cache (same head_dim, heads and
  // block size) gets an error naming both layouts, and the layer is left as it was.
  KVCache bf16(MakeCacheFormat("bf16", 128, 2, 16), 1, 10, CacheDevice::kCpu);
  std::vector<float> k(2 * 128, 0.5f), v(k.size(), 0.25f);
  const int64_t slot = 3;
  StoreInputs in;
  in.key = k.data();
  in.value = v.data();
  in.slot_mapping = &slot;
  in.num_tokens = 1;
  EXPECT_THAT([&] { q.StoreCpu(in, bf16.layer(0)); },
              ::testing::ThrowsMessage<Error>(
                  HasSubstr("invalid cache.layout = (bf16, head_dim 128, 2 KV heads, block 16); "
                            "allowed: the layout this call was made for (turboquant_4bit_nc, "
                            "head_dim 128, 2 KV heads, block 16)")));
  const uint8_t* p = bf16.layer_data(0);
  for (int64_t i = 0; i < bf16.layer_bytes(); ++i) ASSERT_EQ(p[i], 0);
  q.StoreCpu(in, cache.layer(0));  // its own layout
  EXPECT_NE(q.Dequantize(cache.layer(0), slot, 1).value[0], 0.0f);

  // A format not made by MakeCacheFormat names no layout, so no call accepts its caches.
  CacheFormat unknown = MakeCacheFormat("turboquant_k8v4", 128, 2, 16);
  unknown.name = "turboquant_k8v5";
  EXPECT_TRUE(unknown.layout().format.empty());
}

// A KVCache of a preset's format holds what that preset's quantizer (and its attention) expects,
// for every preset, and the uncompressed formats what their Bf16BlockFormat does: an engine that
// sizes its cache with MakeCacheFormat gets references its calls accept.
TEST(KVCacheTest, EveryFormatsLayoutIsItsQuantizersOrPlainFormats) {
  for (const Preset& preset : AllPresets()) {
    const CacheFormat f = MakeCacheFormat(preset.name, 128, 4, 32);
    EXPECT_EQ(f.layout(), Quantizer::Create(preset.name, 128, 4, 32).layout()) << preset.name;
    EXPECT_NE(f.layout(), Quantizer::Create(preset.name, 128, 4, 16).layout()) << preset.name;
  }
  EXPECT_EQ(MakeCacheFormat("bf16", 64, 2, 16).layout(), MakeBf16BlockFormat(64, 2, 16).layout());
  EXPECT_EQ(MakeCacheFormat("fp16", 64, 2, 16).layout(),
            MakeBf16BlockFormat(64, 2, 16, DType::kF16).layout());
  EXPECT_NE(MakeCacheFormat("fp16", 64, 2, 16).layout(), MakeBf16BlockFormat(64, 2, 16).layout());
}

TEST(KVCacheTest, RejectsBadShapes) {
  const CacheFormat f = MakeCacheFormat("bf16", 64, 2, 16);
  EXPECT_THROW(KVCache(f, 0, 10, CacheDevice::kCpu), Error);
  try {
    KVCache cache(f, 1, 1, CacheDevice::kCpu);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("num_blocks = 1"));
  }
}

TEST(KVCacheTest, CudaCacheNeedsADevice) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a device is present: kv_cache_cuda_test covers it";
  EXPECT_THROW(KVCache(MakeCacheFormat("bf16", 64, 2, 16), 1, 4, CacheDevice::kCuda), Error);
}

TEST(KVCacheTest, UploadNeedsADevice) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a device is present: kv_cache_cuda_test covers it";
  KVCacheManagerOptions o;
  o.num_blocks = 8;
  KVCacheManager m(o);
  StepBatch batch;
  const StepRequest r{m.AddSequence(std::vector<int32_t>{1, 2, 3}), 3, 0};
  ASSERT_TRUE(m.Schedule({&r, 1}, batch).admitted);
  EXPECT_FALSE(batch.arena_pinned());
  DeviceBuffer<uint8_t> device;
  EXPECT_THROW(UploadStepBatch(batch, device, nullptr), Error);
}

// The view of the batch's own buffer reads what the batch's accessors read; a view of another
// base is the same offsets from there (what UploadStepBatch returns for its device copy).
TEST(KVCacheTest, StepBatchViewPointsAtTheSections) {
  KVCacheManagerOptions o;
  o.num_blocks = 32;
  o.block_size = 4;
  KVCacheManager m(o);
  std::vector<StepRequest> reqs;
  for (int i = 0; i < 3; ++i) {
    reqs.push_back({m.AddSequence(std::vector<int32_t>(5 + 3 * i, i + 1)), 5 + 3 * i, 0});
  }
  StepBatch batch;
  ASSERT_TRUE(
      m.Schedule(reqs, batch, {.pad_tokens_to = 40, .pad_requests_to = 5, .block_table_width = 6})
          .admitted);
  const StepBatchView v = ViewStepBatch(batch, batch.bytes().data());
  EXPECT_EQ(v.num_requests, 3);
  EXPECT_EQ(v.padded_num_requests, 5);
  EXPECT_EQ(v.num_tokens, 5 + 8 + 11);
  EXPECT_EQ(v.padded_num_tokens, 40);
  EXPECT_EQ(v.block_table_width, 6);
  EXPECT_EQ(v.block_tables, batch.block_tables().data());
  EXPECT_EQ(v.slot_mapping, batch.slot_mapping().data());
  EXPECT_EQ(v.seq_lens, batch.seq_lens().data());
  EXPECT_EQ(v.query_start_loc, batch.query_start_loc().data());
  EXPECT_EQ(v.seq_lens[2], 11);
  EXPECT_EQ(v.query_start_loc[3], 24);
  EXPECT_EQ(v.slot_mapping[24], -1);

  alignas(64) static std::byte elsewhere[4096];
  const StepBatchView w = ViewStepBatch(batch, elsewhere);
  const auto offset = [&](const void* p) { return static_cast<const std::byte*>(p) - elsewhere; };
  EXPECT_EQ(offset(w.block_tables), batch.layout().block_tables);
  EXPECT_EQ(offset(w.slot_mapping), batch.layout().slot_mapping);
  EXPECT_EQ(offset(w.seq_lens), batch.layout().seq_lens);
  EXPECT_EQ(offset(w.query_start_loc), batch.layout().query_start_loc);
}

TEST(KVCacheTest, ApplyCopiesCopiesWholeBlocksInEveryLayer) {
  const CacheFormat f = MakeCacheFormat("turboquant_k3v4_nc", 64, 2, 16);
  KVCache cache(f, 2, 8, CacheDevice::kCpu);
  for (int l = 0; l < 2; ++l) {
    for (int32_t b = 1; b < 8; ++b) {
      cache.WriteBlock(l, b, Pattern(f.block_bytes, static_cast<uint8_t>(l * 16 + b)));
    }
  }
  const BlockCopy copies[] = {{1, 5}, {3, 6}, {1, 7}};
  cache.ApplyCopies(copies);
  std::vector<uint8_t> got(static_cast<size_t>(f.block_bytes));
  for (int l = 0; l < 2; ++l) {
    const int32_t expect_source[8] = {0, 1, 2, 3, 4, 1, 3, 1};
    for (int32_t b = 1; b < 8; ++b) {
      cache.ReadBlock(l, b, got);
      EXPECT_EQ(got, Pattern(f.block_bytes, static_cast<uint8_t>(l * 16 + expect_source[b])))
          << "layer " << l << " block " << b;
    }
  }
}

TEST(KVCacheTest, InvalidCopyListsThrowBeforeCopyingAnything) {
  const CacheFormat f = MakeCacheFormat("bf16", 64, 1, 16);
  KVCache cache(f, 1, 6, CacheDevice::kCpu);
  for (int32_t b = 1; b < 6; ++b) cache.WriteBlock(0, b, Pattern(f.block_bytes, b));
  const std::vector<uint8_t> before(cache.layer_data(0), cache.layer_data(0) + cache.layer_bytes());
  const std::vector<std::vector<BlockCopy>> bad = {
      {{1, 2}, {0, 3}},  // the null block
      {{1, 2}, {3, 6}},  // out of range
      {{4, 4}},          // onto itself
      {{1, 2}, {3, 2}},  // one destination twice
      {{1, 2}, {2, 3}},  // a destination that is also a source
  };
  for (const auto& copies : bad) {
    EXPECT_THROW(cache.ApplyCopies(copies), Error);
    EXPECT_TRUE(std::equal(before.begin(), before.end(), cache.layer_data(0)));
  }
  std::vector<uint8_t> wrong_size(10);
  EXPECT_THROW(cache.ReadBlock(0, 1, wrong_size), Error);
  EXPECT_THROW(cache.WriteBlock(0, 6, Pattern(f.block_bytes, 0)), Error);
  EXPECT_THAT([&] { cache.WriteBlock(0, 0, Pattern(f.block_bytes, 0)); },  // the null block
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("block = 0; allowed: 1 to 5")));
  EXPECT_TRUE(std::equal(before.begin(), before.end(), cache.layer_data(0)));
}

// A format that is not MakeCacheFormat's for its own name and sizes is refused: the layers are
// sized by block_bytes while layer() hands kernels the layout those fields give (a 4bit_nc format
// with its KV heads raised 2 -> 8 had allocated 4,288 bytes per block for a layout of 17,152).
TEST(KVCacheTest, AFormatThatContradictsItselfIsRefused) {
  CacheFormat heads = MakeCacheFormat("turboquant_4bit_nc", 128, 2, 16);
  heads.num_kv_heads = 8;
  CacheFormat bytes = MakeCacheFormat("bf16", 64, 1, 16);
  bytes.block_bytes = 1;
  CacheFormat dtype = MakeCacheFormat("bf16", 64, 1, 16);
  dtype.bf16_format.dtype = DType::kF16;
  CacheFormat name = MakeCacheFormat("turboquant_k3v4_nc", 64, 2, 16);
  name.name = "turboquant_3bit_nc";
  for (const CacheFormat& f : {heads, bytes, dtype, name}) {
    EXPECT_THAT([&] { KVCache(f, 1, 4, CacheDevice::kCpu); },
                ::testing::ThrowsMessage<Error>(::testing::HasSubstr("KVCache: invalid format")))
        << f.name;
  }
  EXPECT_NO_THROW(KVCache(MakeCacheFormat("fp16", 64, 1, 16), 1, 4, CacheDevice::kCpu));
}

// The manager's copy-on-write, executed on a real (host) cache: a forked sequence's shared
// partial block is copied before the writer's store, and both sequences then read their own KV.
TEST(KVCacheTest, ManagerCopiesExecuteOnTheCache) {
  constexpr int kBs = 16;
  const CacheFormat f = MakeCacheFormat("bf16", 64, 1, kBs);
  const Bf16BlockFormat& bf = f.bf16_format;
  KVCacheManagerOptions o;
  o.num_blocks = 8;
  o.block_size = kBs;
  o.format = MakeFormatTag(f, 0);
  KVCacheManager m(o);
  KVCache cache(f, 2, o.num_blocks, CacheDevice::kCpu);
  // Tags every byte of a token's key and value (one head).
  auto store = [&](const StepBatch& batch, uint8_t tag) {
    cache.ApplyCopies(batch.copies());
    for (int64_t slot : batch.slot_mapping()) {
      if (slot < 0) continue;
      for (int l = 0; l < 2; ++l) {
        uint8_t* block = cache.layer_data(l) + slot / kBs * f.block_bytes;
        const int pos = static_cast<int>(slot % kBs);
        std::fill_n(block + bf.KeyOffset(pos, 0), 2 * bf.head_dim, static_cast<uint8_t>(tag + l));
        std::fill_n(block + bf.ValueOffset(pos, 0), 2 * bf.head_dim, static_cast<uint8_t>(tag + l));
      }
    }
  };
  auto byte_at = [&](SeqId s, int64_t pos, int layer) {
    const int32_t block = m.BlockTable(s)[static_cast<size_t>(pos / kBs)];
    return cache.layer_data(layer)[block * f.block_bytes + bf.ValueOffset(pos % kBs, 0)];
  };
  std::vector<int32_t> prompt(kBs + 2);
  std::iota(prompt.begin(), prompt.end(), 1);
  const SeqId parent = m.AddSequence(prompt);
  StepBatch batch;
  StepRequest r{parent, kBs + 2, 0};
  ASSERT_TRUE(m.Schedule({&r, 1}, batch).admitted);
  store(batch, 10);
  m.Commit(parent, std::vector<int32_t>{7});
  const SeqId child = m.Fork(parent);
  m.Commit(child, {});
  r = {child, 1, 0};
  ASSERT_TRUE(m.Schedule({&r, 1}, batch).admitted);
  ASSERT_EQ(batch.copies().size(), 1u);  // the shared, partially filled second block
  store(batch, 50);
  for (int l = 0; l < 2; ++l) {
    for (int64_t pos = 0; pos < kBs + 2; ++pos) {
      EXPECT_EQ(byte_at(parent, pos, l), 10 + l);
      EXPECT_EQ(byte_at(child, pos, l), 10 + l);  // copied
    }
    EXPECT_EQ(byte_at(child, kBs + 2, l), 50 + l);
    EXPECT_EQ(byte_at(parent, kBs + 2, l), 0);  // the parent's block was not written
  }
}

}  // namespace
}  // namespace tqkv
