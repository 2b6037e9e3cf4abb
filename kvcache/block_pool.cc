#include "kvcache/block_pool.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <limits>
#include <utility>

#include "runtime/error.h"

namespace tqkv {

const char* BlockStateName(BlockState state) {
  switch (state) {
    case BlockState::kNull:
      return "null";
    case BlockState::kFree:
      return "free";
    case BlockState::kInUse:
      return "in_use";
    case BlockState::kEvictable:
      return "evictable";
  }
  return "?";
}

const char* KVEventTypeName(KVEventType type) {
  switch (type) {
    case KVEventType::kBlockStored:
      return "BlockStored";
    case KVEventType::kBlockRemoved:
      return "BlockRemoved";
    case KVEventType::kAllCleared:
      return "AllCleared";
  }
  return "?";
}

namespace {

int32_t CheckedNumBlocks(int32_t num_blocks) {
  if (num_blocks < 2) {
    throw InvalidArgument("BlockPool", "num_blocks", num_blocks,
                          fmt::format(">= 2 (block 0 is the reserved null block) and <= {}",
                                      std::numeric_limits<int32_t>::max()));
  }
  return num_blocks;
}

}  // namespace

BlockPool::BlockPool(int32_t num_blocks, bool record_events)
    : blocks_(static_cast<size_t>(CheckedNumBlocks(num_blocks))),
      table_(num_blocks),
      record_events_(record_events) {
  blocks_[kNullBlock].state = BlockState::kNull;
  // Ascending ids, so a fresh pool hands out 1, 2, 3, ... (readable tests and dumps).
  for (int32_t id = 1; id < num_blocks; ++id) PushBack(kFreeList, id);
}

void BlockPool::PushFront(int list, int32_t id) {
  List& l = lists_[list];
  BlockMeta& b = blocks_[id];
  b.prev = -1;
  b.next = l.head;
  if (l.head >= 0) {
    blocks_[l.head].prev = id;
  } else {
    l.tail = id;
  }
  l.head = id;
  ++l.size;
}

void BlockPool::PushBack(int list, int32_t id) {
  List& l = lists_[list];
  BlockMeta& b = blocks_[id];
  b.next = -1;
  b.prev = l.tail;
  if (l.tail >= 0) {
    blocks_[l.tail].next = id;
  } else {
    l.head = id;
  }
  l.tail = id;
  ++l.size;
}

void BlockPool::Unlink(int list, int32_t id) {
  List& l = lists_[list];
  BlockMeta& b = blocks_[id];
  if (b.prev >= 0) {
    blocks_[b.prev].next = b.next;
  } else {
    l.head = b.next;
  }
  if (b.next >= 0) {
    blocks_[b.next].prev = b.prev;
  } else {
    l.tail = b.prev;
  }
  b.prev = b.next = -1;
  --l.size;
}

void BlockPool::Emit(KVEventType type, int32_t id, const BlockHash& hash, const BlockHash& parent) {
  if (record_events_) events_.push_back(KVEvent{type, hash, parent, id});
}

void BlockPool::DropHash(int32_t id) {
  BlockMeta& b = blocks_[id];
  table_.Erase(b.hash);
  b.hashed = false;
  Emit(KVEventType::kBlockRemoved, id, b.hash, BlockHash{});
  b.hash = BlockHash{};
}

void BlockPool::ReserveEvents(int64_t n) {
  if (!record_events_) return;
  const size_t needed = events_.size() + static_cast<size_t>(n);
  // Geometric, as push_back's: events accumulate until TakeEvents.
  if (needed > events_.capacity()) events_.reserve(std::max(needed, 2 * events_.capacity()));
}

int32_t BlockPool::Allocate(int priority) {
  TQKV_CHECK(priority >= 0 && priority <= kMaxPriority);
  int32_t id = lists_[kFreeList].head;
  if (id >= 0) {
    Unlink(kFreeList, id);
  } else {
    TQKV_CHECK_NE(nonempty_evictable_, 0u);  // caller checked num_available()
    const int level = std::countr_zero(nonempty_evictable_);
    id = lists_[level].head;
    Unlink(level, id);
    if (lists_[level].size == 0) nonempty_evictable_ &= ~(1u << level);
    --num_evictable_;
    DropHash(id);
    ++evictions_;
  }
  BlockMeta& b = blocks_[id];
  b.state = BlockState::kInUse;
  b.ref_count = 1;
  b.priority = static_cast<uint8_t>(priority);
  return id;
}

void BlockPool::Acquire(int32_t id, int priority) {
  TQKV_CHECK(priority >= 0 && priority <= kMaxPriority);
  BlockMeta& b = blocks_[id];
  if (b.state == BlockState::kEvictable) {
    const int level = b.priority;
    Unlink(level, id);
    if (lists_[level].size == 0) nonempty_evictable_ &= ~(1u << level);
    --num_evictable_;
    b.state = BlockState::kInUse;
    b.ref_count = 1;
    b.priority = static_cast<uint8_t>(priority);
    return;
  }
  TQKV_CHECK(b.state == BlockState::kInUse);
  ++b.ref_count;
  if (priority > b.priority) b.priority = static_cast<uint8_t>(priority);
}

void BlockPool::Release(int32_t id) {
  BlockMeta& b = blocks_[id];
  TQKV_CHECK(b.state == BlockState::kInUse);
  TQKV_CHECK_GT(b.ref_count, 0);
  if (--b.ref_count > 0) return;
  if (b.hashed) {
    b.state = BlockState::kEvictable;
    PushBack(b.priority, id);
    nonempty_evictable_ |= 1u << b.priority;
    ++num_evictable_;
  } else {
    b.state = BlockState::kFree;
    b.priority = 0;
    PushFront(kFreeList, id);
  }
}

bool BlockPool::Register(int32_t id, const BlockHash& hash, const BlockHash& parent) {
  BlockMeta& b = blocks_[id];
  TQKV_CHECK(b.state == BlockState::kInUse);
  TQKV_CHECK(!b.hashed);
  if (table_.Find(hash) >= 0) return false;
  table_.Insert(hash, id);
  b.hash = hash;
  b.hashed = true;
  Emit(KVEventType::kBlockStored, id, hash, parent);
  return true;
}

void BlockPool::Unregister(int32_t id) {
  TQKV_CHECK(blocks_[id].state == BlockState::kInUse);
  TQKV_CHECK(blocks_[id].hashed);
  DropHash(id);
}

int64_t BlockPool::ClearCache() {
  ReserveEvents(1);  // first: an event that cannot be recorded must leave the cache as it was
  const int64_t dropped = table_.size();
  for (int level = 0; level < kNumPriorities; ++level) {
    while (lists_[level].head >= 0) {
      const int32_t id = lists_[level].head;
      Unlink(level, id);
      BlockMeta& b = blocks_[id];
      b.state = BlockState::kFree;
      b.priority = 0;
      PushFront(kFreeList, id);
    }
  }
  nonempty_evictable_ = 0;
  num_evictable_ = 0;
  for (BlockMeta& b : blocks_) {
    b.hashed = false;
    b.hash = BlockHash{};
  }
  table_.Clear();
  Emit(KVEventType::kAllCleared, -1, BlockHash{}, BlockHash{});
  return dropped;
}

std::vector<KVEvent> BlockPool::TakeEvents() { return std::exchange(events_, {}); }

std::string BlockPool::FindInvariantViolation(std::span<const int32_t> ref_counts) const {
  const int32_t n = num_blocks();
  const BlockMeta& null_block = blocks_[kNullBlock];
  if (null_block.state != BlockState::kNull || null_block.ref_count != 0 || null_block.hashed ||
      null_block.prev != -1 || null_block.next != -1) {
    return "block 0 is not a pristine null block";
  }
  // Walk every list: links, states and sizes.
  std::vector<int8_t> on_list(static_cast<size_t>(n), -1);
  for (int list = 0; list <= kFreeList; ++list) {
    const List& l = lists_[list];
    int32_t count = 0;
    int32_t prev = -1;
    for (int32_t id = l.head; id >= 0; id = blocks_[id].next) {
      if (id <= 0 || id >= n) return fmt::format("list {}: bad block id {}", list, id);
      if (on_list[id] >= 0) return fmt::format("block {} is on two lists (or a cycle)", id);
      on_list[id] = static_cast<int8_t>(list);
      const BlockMeta& b = blocks_[id];
      if (b.prev != prev)
        return fmt::format("block {}: prev {} but walked from {}", id, b.prev, prev);
      if (b.ref_count != 0) return fmt::format("listed block {} has ref {}", id, b.ref_count);
      if (list == kFreeList) {
        if (b.state != BlockState::kFree || b.hashed) {
          return fmt::format("block {} on the free list is {}{}", id, BlockStateName(b.state),
                             b.hashed ? " (hashed)" : "");
        }
      } else if (b.state != BlockState::kEvictable || !b.hashed || b.priority != list) {
        return fmt::format("block {} on evictable list {} is {} (priority {}, hashed {})", id, list,
                           BlockStateName(b.state), b.priority, b.hashed);
      }
      prev = id;
      if (++count > n) return fmt::format("list {} has a cycle", list);
    }
    if (l.tail != prev)
      return fmt::format("list {}: tail {} but last walked {}", list, l.tail, prev);
    if (count != l.size) return fmt::format("list {}: size {} but {} walked", list, l.size, count);
    if (list < kFreeList && ((nonempty_evictable_ >> list) & 1u) != (count > 0 ? 1u : 0u)) {
      return fmt::format("nonempty bit of evictable list {} is wrong", list);
    }
  }
  int32_t evictable = 0;
  int64_t hashed = 0;
  for (int32_t id = 1; id < n; ++id) {
    const BlockMeta& b = blocks_[id];
    switch (b.state) {
      case BlockState::kNull:
        return fmt::format("block {} is in the null state", id);
      case BlockState::kFree:
        if (on_list[id] != kFreeList) return fmt::format("free block {} not on the free list", id);
        break;
      case BlockState::kEvictable:
        ++evictable;
        if (on_list[id] != b.priority) return fmt::format("evictable block {} not on its list", id);
        break;
      case BlockState::kInUse:
        if (b.ref_count < 1) return fmt::format("in-use block {} has ref {}", id, b.ref_count);
        if (on_list[id] >= 0 || b.prev != -1 || b.next != -1) {
          return fmt::format("in-use block {} is linked", id);
        }
        break;
    }
    if (!ref_counts.empty() && ref_counts[id] != b.ref_count) {
      return fmt::format("block {}: ref count {} but {} block-table entries point to it", id,
                         b.ref_count, ref_counts[id]);
    }
    if (b.hashed) {
      ++hashed;
      const int32_t found = table_.Find(b.hash);
      if (found != id) {
        return fmt::format("block {} has hash {} but the table maps it to {}", id, ToHex(b.hash),
                           found);
      }
    }
  }
  if (evictable != num_evictable_) {
    return fmt::format("{} evictable blocks but count {}", evictable, num_evictable_);
  }
  if (hashed != table_.size()) {
    return fmt::format("{} hashed blocks but {} table entries", hashed, table_.size());
  }
  std::string table_error = table_.Verify();
  if (!table_error.empty()) return table_error;
  std::string mismatch;
  table_.ForEach([&](const BlockHash& h, int32_t id) {
    if (mismatch.empty() &&
        (id <= 0 || id >= n || !blocks_[id].hashed || !(blocks_[id].hash == h))) {
      mismatch = fmt::format("table maps {} to block {}, which does not carry it", ToHex(h), id);
    }
  });
  return mismatch;
}

}  // namespace tqkv
