#include "kvcache/block_hash.h"

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>
#include <xxhash.h>

#include <cstring>
#include <map>
#include <vector>

#include "runtime/error.h"

namespace tqkv {
namespace {

// Pins the definition (README, block_hash.h): XXH3-128 over parent (low, high) then int32 tokens.
TEST(BlockHashTest, BlockHashIsXxh3OfParentThenTokens) {
  const BlockHash parent{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  const std::vector<int32_t> tokens = {1, -2, 300000, 7};
  unsigned char bytes[16 + 16];
  std::memcpy(bytes, &parent.low, 8);
  std::memcpy(bytes + 8, &parent.high, 8);
  std::memcpy(bytes + 16, tokens.data(), 16);
  const XXH128_hash_t expect = XXH3_128bits(bytes, sizeof(bytes));
  const BlockHash got = HashBlockTokens(parent, tokens);
  EXPECT_EQ(got.low, expect.low64);
  EXPECT_EQ(got.high, expect.high64);
}

TEST(BlockHashTest, EveryInputChangesTheHash) {
  const BlockHash root = HashFormatTag({"turboquant_4bit_nc", 128, 16, 7});
  const std::vector<int32_t> a = {1, 2, 3, 4};
  const std::vector<int32_t> b = {1, 2, 3, 5};
  EXPECT_EQ(HashBlockTokens(root, a), HashBlockTokens(root, a));
  EXPECT_NE(HashBlockTokens(root, a), HashBlockTokens(root, b));
  const BlockHash other_parent = HashBlockTokens(root, b);
  EXPECT_NE(HashBlockTokens(root, a), HashBlockTokens(other_parent, a));
}

TEST(BlockHashTest, FormatTagFieldsAllMatter) {
  const FormatTag base{"turboquant_4bit_nc", 128, 16, 7};
  const BlockHash h = HashFormatTag(base);
  FormatTag t = base;
  t.preset = "turboquant_k3v4_nc";
  EXPECT_NE(HashFormatTag(t), h);
  t = base;
  t.head_dim = 64;
  EXPECT_NE(HashFormatTag(t), h);
  t = base;
  t.block_size = 32;
  EXPECT_NE(HashFormatTag(t), h);
  t = base;
  t.rotation_id = 8;
  EXPECT_NE(HashFormatTag(t), h);
  EXPECT_EQ(HashFormatTag(base), h);
}

TEST(BlockHashTest, ExtraKeySeparatesChains) {
  const BlockHash root = HashFormatTag({"bf16", 128, 16, 0});
  EXPECT_EQ(HashChainRoot(root, ""), root);
  EXPECT_NE(HashChainRoot(root, "tenant-a"), root);
  EXPECT_NE(HashChainRoot(root, "tenant-a"), HashChainRoot(root, "tenant-b"));
  EXPECT_EQ(HashChainRoot(root, "tenant-a"), HashChainRoot(root, "tenant-a"));
}

TEST(BlockHashTest, TooManyTokensThrows) {
  const std::vector<int32_t> tokens(1025, 0);
  EXPECT_THROW(HashBlockTokens(BlockHash{}, tokens), Error);
}

TEST(BlockHashTest, HexIsHighThenLow) {
  EXPECT_EQ(ToHex(BlockHash{0x1, 0x2}), "00000000000000020000000000000001");
}

TEST(BlockHashTableTest, InsertFindErase) {
  BlockHashTable table(4);
  EXPECT_EQ(table.capacity(), 16);
  const BlockHash a{1, 1}, b{17, 2}, c{33, 3};  // same home slot (low & 15 == 1)
  table.Insert(a, 10);
  table.Insert(b, 11);
  table.Insert(c, 12);
  EXPECT_EQ(table.Find(a), 10);
  EXPECT_EQ(table.Find(b), 11);
  EXPECT_EQ(table.Find(c), 12);
  EXPECT_EQ(table.Find(BlockHash{1, 2}), -1);
  table.Erase(a);  // b and c shift back
  EXPECT_EQ(table.Find(a), -1);
  EXPECT_EQ(table.Find(b), 11);
  EXPECT_EQ(table.Find(c), 12);
  EXPECT_EQ(table.Verify(), "");
  EXPECT_EQ(table.size(), 2);
  table.Clear();
  EXPECT_EQ(table.size(), 0);
  EXPECT_EQ(table.Find(b), -1);
}

// Random inserts and erases with many colliding and wrapping home slots, against std::map.
RC_GTEST_PROP(BlockHashTableProperty, AgreesWithAMap, ()) {
  const int max_entries = *rc::gen::inRange(1, 40);
  BlockHashTable table(max_entries);
  std::map<std::pair<uint64_t, uint64_t>, int32_t> model;
  const auto ops = *rc::gen::container<std::vector<std::pair<int, int>>>(
      rc::gen::pair(rc::gen::inRange(0, 3), rc::gen::inRange(0, 4 * max_entries)));
  int32_t next_block = 0;
  for (const auto& [op, key] : ops) {
    // Few distinct low halves, so home slots collide and probe runs wrap around the end.
    const BlockHash h{static_cast<uint64_t>(key % 5) * 0x10001 + static_cast<uint64_t>(key % 3),
                      static_cast<uint64_t>(key)};
    const auto k = std::make_pair(h.low, h.high);
    const bool present = model.count(k) != 0;
    if (op == 0 && !present && static_cast<int>(model.size()) < max_entries) {
      table.Insert(h, next_block);
      model[k] = next_block++;
    } else if (op == 1 && present) {
      table.Erase(h);
      model.erase(k);
    }
    RC_ASSERT(table.Find(h) == (model.count(k) ? model[k] : -1));
    RC_ASSERT(table.Verify().empty());
  }
  RC_ASSERT(table.size() == static_cast<int64_t>(model.size()));
  for (const auto& [k, block] : model) RC_ASSERT(table.Find(BlockHash{k.first, k.second}) == block);
}

}  // namespace
}  // namespace tqkv
