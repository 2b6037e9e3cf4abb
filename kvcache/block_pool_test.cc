#include "kvcache/block_pool.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kvcache/address_space_limit.h"
#include "runtime/error.h"

namespace tqkv {
namespace {

using ::testing::HasSubstr;

BlockHash H(uint64_t v) { return BlockHash{v * 0x9e3779b97f4a7c15ULL, v}; }

void ExpectConsistent(const BlockPool& pool) { EXPECT_EQ(pool.FindInvariantViolation({}), ""); }

TEST(BlockPoolTest, PoolWithoutUsableBlocksThrows) {
  for (int32_t n : {-1, 0, 1}) {
    try {
      BlockPool pool(n, false);
      FAIL() << "no throw for " << n;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(fmt::format("num_blocks = {}", n)));
      EXPECT_THAT(e.what(), HasSubstr("null block"));
    }
  }
}

TEST(BlockPoolTest, FreshPoolHandsOutAscendingIdsAndNeverTheNullBlock) {
  BlockPool pool(4, false);
  EXPECT_EQ(pool.num_usable(), 3);
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_EQ(pool.block(kNullBlock).state, BlockState::kNull);
  EXPECT_EQ(pool.Allocate(0), 1);
  EXPECT_EQ(pool.Allocate(0), 2);
  EXPECT_EQ(pool.Allocate(0), 3);
  EXPECT_EQ(pool.num_available(), 0);
  EXPECT_EQ(pool.num_in_use(), 3);
  ExpectConsistent(pool);
}

TEST(BlockPoolTest, ReleasedUnhashedBlockIsFreeAndReusedFirst) {
  BlockPool pool(5, false);
  const int32_t a = pool.Allocate(0);
  const int32_t b = pool.Allocate(0);
  pool.Release(a);
  EXPECT_EQ(pool.block(a).state, BlockState::kFree);
  EXPECT_EQ(pool.Allocate(0), a);  // LIFO
  pool.Acquire(b, 0);
  EXPECT_EQ(pool.block(b).ref_count, 2);
  pool.Release(b);
  EXPECT_EQ(pool.block(b).state, BlockState::kInUse);
  ExpectConsistent(pool);
}

TEST(BlockPoolTest, HashedBlockBecomesEvictableAndCanBeHit) {
  BlockPool pool(4, true);
  const int32_t a = pool.Allocate(2);
  EXPECT_TRUE(pool.Register(a, H(1), H(0)));
  EXPECT_EQ(pool.FindCached(H(1)), a);
  pool.Release(a);
  EXPECT_EQ(pool.block(a).state, BlockState::kEvictable);
  EXPECT_EQ(pool.num_evictable(), 1);
  EXPECT_EQ(pool.num_available(), 3);
  ExpectConsistent(pool);
  pool.Acquire(a, 5);  // a hit: evictable -> in use
  EXPECT_EQ(pool.block(a).state, BlockState::kInUse);
  EXPECT_EQ(pool.block(a).ref_count, 1);
  EXPECT_EQ(pool.block(a).priority, 5);
  EXPECT_EQ(pool.num_evictable(), 0);
  ExpectConsistent(pool);
  const auto events = pool.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].type, KVEventType::kBlockStored);
  EXPECT_EQ(events[0].hash, H(1));
  EXPECT_EQ(events[0].parent_hash, H(0));
  EXPECT_EQ(events[0].block_id, a);
  EXPECT_TRUE(pool.TakeEvents().empty());
}

TEST(BlockPoolTest, DuplicateHashIsNotRegistered) {
  BlockPool pool(4, false);
  const int32_t a = pool.Allocate(0);
  const int32_t b = pool.Allocate(0);
  EXPECT_TRUE(pool.Register(a, H(1), H(0)));
  EXPECT_FALSE(pool.Register(b, H(1), H(0)));
  EXPECT_FALSE(pool.block(b).hashed);
  pool.Release(b);
  EXPECT_EQ(pool.block(b).state, BlockState::kFree);
  ExpectConsistent(pool);
}

TEST(BlockPoolTest, FreeBlocksGoBeforeAnyEviction) {
  BlockPool pool(4, false);
  const int32_t a = pool.Allocate(0);
  pool.Register(a, H(1), H(0));
  pool.Release(a);
  const int32_t b = pool.Allocate(0);
  EXPECT_NE(b, a);
  EXPECT_EQ(pool.evictions(), 0);
  EXPECT_EQ(pool.FindCached(H(1)), a);
}

TEST(BlockPoolTest, EvictsLeastRecentlyReleasedOfTheLowestPriority) {
  BlockPool pool(6, true);
  int32_t ids[5];
  for (int i = 0; i < 5; ++i) ids[i] = pool.Allocate(i == 2 ? 0 : 3);
  for (int i = 0; i < 5; ++i) pool.Register(ids[i], H(10 + i), H(0));
  // Release order 1, 0, 3, 4, 2; block ids[2] has priority 0, the rest 3.
  for (int i : {1, 0, 3, 4, 2}) pool.Release(ids[i]);
  pool.TakeEvents();
  EXPECT_EQ(pool.num_evictable(), 5);
  // Lowest priority first (ids[2]), then LRU within priority 3: ids[1], ids[0], ids[3], ids[4].
  for (int i : {2, 1, 0, 3, 4}) {
    EXPECT_EQ(pool.Allocate(4), ids[i]);
    EXPECT_EQ(pool.FindCached(H(10 + i)), -1);
    ExpectConsistent(pool);
  }
  EXPECT_EQ(pool.evictions(), 5);
  const auto events = pool.TakeEvents();
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[0].type, KVEventType::kBlockRemoved);
  EXPECT_EQ(events[0].hash, H(12));
}

TEST(BlockPoolTest, SharedBlockKeepsTheHighestHolderPriority) {
  BlockPool pool(3, false);
  const int32_t a = pool.Allocate(1);
  pool.Acquire(a, 6);
  pool.Acquire(a, 2);
  EXPECT_EQ(pool.block(a).priority, 6);
  pool.Register(a, H(1), H(0));
  pool.Release(a);
  pool.Release(a);
  pool.Release(a);
  EXPECT_EQ(pool.block(a).state, BlockState::kEvictable);
  EXPECT_EQ(pool.block(a).priority, 6);
  ExpectConsistent(pool);
}

TEST(BlockPoolTest, UnregisterAndClear) {
  BlockPool pool(5, true);
  const int32_t a = pool.Allocate(0);
  const int32_t b = pool.Allocate(0);
  const int32_t c = pool.Allocate(0);
  pool.Register(a, H(1), H(0));
  pool.Register(b, H(2), H(1));
  pool.Register(c, H(3), H(2));
  pool.Unregister(a);
  EXPECT_FALSE(pool.block(a).hashed);
  EXPECT_EQ(pool.FindCached(H(1)), -1);
  pool.Release(b);  // evictable
  EXPECT_EQ(pool.ClearCache(), 2);
  EXPECT_EQ(pool.block(b).state, BlockState::kFree);
  EXPECT_FALSE(pool.block(c).hashed);  // still in use, no longer shared
  EXPECT_EQ(pool.block(c).state, BlockState::kInUse);
  EXPECT_EQ(pool.num_cached(), 0);
  EXPECT_EQ(pool.num_evictable(), 0);
  ExpectConsistent(pool);
  const auto events = pool.TakeEvents();
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[3].type, KVEventType::kBlockRemoved);
  EXPECT_EQ(events[3].hash, H(1));
  EXPECT_EQ(events[4].type, KVEventType::kAllCleared);
}

TEST(BlockPoolTest, EventsAreOffByDefault) {
  BlockPool pool(3, false);
  const int32_t a = pool.Allocate(0);
  pool.Register(a, H(1), H(0));
  EXPECT_TRUE(pool.TakeEvents().empty());
}

TEST(BlockPoolTest, InvariantCheckerCatchesAWrongRefCount) {
  BlockPool pool(3, false);
  pool.Allocate(0);
  std::vector<int32_t> refs = {0, 1, 0};
  EXPECT_EQ(pool.FindInvariantViolation(refs), "");
  refs[1] = 2;
  EXPECT_THAT(pool.FindInvariantViolation(refs), HasSubstr("ref count 1 but 2"));
}

// ClearCache that cannot record its event changes nothing: it cleared every hash first. 2^20
// events fill the events' vector exactly (push_back's doubling); the next one reallocates 96 MB.
TEST(BlockPoolTest, ClearCacheThatCannotRecordItsEventChangesNothing) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reserves more address space than the limit allows";
#endif
  constexpr int32_t kBlocks = 1 << 20;
  BlockPool pool(kBlocks + 1, true);
  for (int32_t i = 0; i < kBlocks; ++i) {
    const int32_t id = pool.Allocate(0);
    ASSERT_TRUE(pool.Register(id, H(static_cast<uint64_t>(id)), BlockHash{}));
    if (i % 2 == 0) pool.Release(id);  // evictable
  }
  {
    const testing::AddressSpaceLimit limit(int64_t{1} << 20);
    EXPECT_THROW(pool.ClearCache(), std::bad_alloc);
  }
  EXPECT_EQ(pool.num_cached(), kBlocks);
  EXPECT_EQ(pool.num_evictable(), kBlocks / 2);
  EXPECT_EQ(pool.FindCached(H(1)), 1);
  ExpectConsistent(pool);
  EXPECT_EQ(pool.ClearCache(), kBlocks);
  EXPECT_EQ(pool.num_cached(), 0);
  EXPECT_EQ(pool.TakeEvents().size(), size_t{kBlocks} + 1);
}

}  // namespace
}  // namespace tqkv
