// The block pool: metadata of a fixed number of KV-cache blocks (ids, reference counts, states,
// prefix-cache hashes) and the lists that make allocation, release and eviction O(1).
// Blocks are metadata only; the bytes live in KVCache, indexed by the same ids.
//
// States and transitions (kvcache/README.md has the full contract):
//
//   null       block 0, reserved: pads block-table entries, never allocated, never written.
//   free       ref 0, no hash, on the free list (LIFO: the most recently freed block is reused
//              first, it is the likeliest to be warm in any cache).
//   in use     ref >= 1, on no list; may carry a hash ("cached and in use").
//   evictable  ref 0, carries a hash, on the LRU list of its eviction priority: its bytes are a
//              valid cached prefix block that a later sequence may reuse.
//
//   Allocate  : free -> in use            (if no block is free: evict the least recently used
//                                          evictable block of the lowest priority, then as free)
//   Acquire   : in use -> in use (ref+1) | evictable -> in use (a prefix-cache hit)
//   Release   : in use -> in use (ref-1) | -> evictable (ref 0, hashed) | -> free (ref 0)
//   Register  : in use, no hash -> in use, hashed          (BlockStored event)
//   Unregister: in use, hashed -> in use, no hash          (BlockRemoved event)
//   Clear     : every hash dropped; evictable -> free      (AllCleared event)
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvcache/block_hash.h"

namespace tqkv {

inline constexpr int32_t kNullBlock = 0;

// Eviction priorities: when a cached block must be reclaimed, the lowest priority level goes
// first, least recently released first within a level.
inline constexpr int kMinPriority = 0;
inline constexpr int kMaxPriority = 7;
inline constexpr int kDefaultPriority = 4;
inline constexpr int kNumPriorities = kMaxPriority + 1;

enum class BlockState : uint8_t { kNull, kFree, kInUse, kEvictable };
const char* BlockStateName(BlockState state);

enum class KVEventType : uint8_t {
  kBlockStored,   // a full block's bytes became reusable under `hash` (parent: `parent_hash`)
  kBlockRemoved,  // `hash` is no longer served by this pool (evicted or overwritten)
  kAllCleared,    // every hash was dropped (ClearPrefixCache)
};
const char* KVEventTypeName(KVEventType type);

struct KVEvent {
  KVEventType type;
  BlockHash hash;         // BlockStored, BlockRemoved
  BlockHash parent_hash;  // BlockStored: the previous block's hash, or the chain root
  int32_t block_id = -1;  // BlockStored, BlockRemoved
};

struct BlockMeta {
  BlockHash hash;         // valid when `hashed`
  int32_t ref_count = 0;  // block-table entries of live sequences that point here
  int32_t prev = -1;      // intrusive links of the free list or an evictable list; -1: none
  int32_t next = -1;
  BlockState state = BlockState::kFree;
  uint8_t priority = 0;  // max priority of its holders since it last entered "in use"
  bool hashed = false;   // registered in the hash table under `hash`
};

class BlockPool {
 public:
  // num_blocks counts the null block: ids 1 .. num_blocks - 1 are usable. Throws tqkv::Error
  // unless 2 <= num_blocks <= 2^31 - 1.
  BlockPool(int32_t num_blocks, bool record_events);

  int32_t num_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  int32_t num_usable() const { return num_blocks() - 1; }
  int32_t num_free() const { return lists_[kFreeList].size; }
  int32_t num_evictable() const { return num_evictable_; }
  int32_t num_in_use() const { return num_usable() - num_free() - num_evictable_; }
  // Blocks Allocate can hand out now: free plus evictable.
  int32_t num_available() const { return num_free() + num_evictable_; }
  int64_t num_cached() const { return table_.size(); }  // hashed blocks, in use or evictable
  int64_t evictions() const { return evictions_; }

  const BlockMeta& block(int32_t id) const { return blocks_[static_cast<size_t>(id)]; }

  // free -> in use with ref 1 (evicting if needed). Precondition: num_available() > 0.
  int32_t Allocate(int priority);
  // ref + 1; an evictable block leaves its LRU list (cache hit). Precondition: in use or evictable.
  void Acquire(int32_t id, int priority);
  // ref - 1. Precondition: in use.
  void Release(int32_t id);

  // The block cached under `hash` (in use or evictable), or -1.
  int32_t FindCached(const BlockHash& hash) const { return table_.Find(hash); }
  // Gives in-use, unhashed block `id` the hash. Returns false and changes nothing when another
  // block already holds that hash (the duplicate stays unhashed and is freed when released).
  bool Register(int32_t id, const BlockHash& hash, const BlockHash& parent);
  // Drops the hash of in-use block `id` (its bytes are about to change).
  void Unregister(int32_t id);
  // Drops every hash; evictable blocks become free. Returns how many hashes were dropped.
  int64_t ClearCache();

  // Events since the last call (empty unless constructed with record_events).
  std::vector<KVEvent> TakeEvents();
  bool record_events() const { return record_events_; }
  // Room for n more events (when recording), so that the state changes that emit them cannot
  // fail halfway on an allocation.
  void ReserveEvents(int64_t n);

  // Empty when the lists, states, counts and hash table agree; else the first disagreement.
  // `ref_counts[id]`, if not empty, is the expected ref count of every block (from the tables).
  std::string FindInvariantViolation(std::span<const int32_t> ref_counts) const;

 private:
  struct List {
    int32_t head = -1;
    int32_t tail = -1;
    int32_t size = 0;
  };
  static constexpr int kFreeList = kNumPriorities;  // lists_[0..7]: evictable by priority

  void PushFront(int list, int32_t id);
  void PushBack(int list, int32_t id);
  void Unlink(int list, int32_t id);
  void DropHash(int32_t id);  // BlockRemoved
  void Emit(KVEventType type, int32_t id, const BlockHash& hash, const BlockHash& parent);

  std::vector<BlockMeta> blocks_;  // [num_blocks]
  List lists_[kNumPriorities + 1];
  uint32_t nonempty_evictable_ = 0;  // bit p: lists_[p] is not empty
  int32_t num_evictable_ = 0;
  BlockHashTable table_;
  int64_t evictions_ = 0;
  bool record_events_ = false;
  std::vector<KVEvent> events_;
};

}  // namespace tqkv
