// Chained block hashes for prefix caching, and the open-addressing table that maps them to blocks.
//
// A full block's hash is XXH3-128 of (parent hash, the block's token ids). The parent of block 0
// is the chain root: XXH3-128 of the cache-format tag (preset, head_dim, block size, rotation id)
// and the sequence's extra key (cache salt, adapter id). The root enters every block's hash through
// the chain, so two formats or two tenants never share a block, and equal hashes mean equal token
// prefixes (up to an accidental collision, about n^2 / 2^129 for n cached blocks: a hit never
// compares tokens). XXH3 is not a cryptographic hash and its secret is public: where tenants are
// adversarial (one could craft a prompt whose blocks collide with another's), give each tenant
// its own extra key that the others cannot guess. The functions are public so that a router can
// compute the same hashes from token ids and match them against the manager's events.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tqkv {

struct BlockHash {
  uint64_t low = 0;
  uint64_t high = 0;
  friend bool operator==(const BlockHash&, const BlockHash&) = default;
};

// "0123456789abcdef0123456789abcdef" (high then low, 32 hex digits).
std::string ToHex(const BlockHash& hash);

// What makes cached bytes of one format unusable by another. The block size is the manager's.
struct FormatTag {
  std::string preset;  // a TurboQuant preset name, "bf16" or "fp16"
  int head_dim = 0;
  int block_size = 0;        // tokens per block
  uint64_t rotation_id = 0;  // identifies the rotation (kind + seed); 0 for formats without one
};

// The root of every chain of this format: the parent hash of block 0 when there is no extra key.
BlockHash HashFormatTag(const FormatTag& tag);

// The parent hash of block 0 for a sequence with this extra key (empty: the format root itself).
BlockHash HashChainRoot(const BlockHash& format_root, std::string_view extra_key);

// The hash of one full block: XXH3-128 over the 16 bytes of `parent` (low then high,
// little-endian) followed by the token ids as little-endian int32. tokens.size() <= 1024.
BlockHash HashBlockTokens(const BlockHash& parent, std::span<const int32_t> tokens);

// Maps block hashes to block ids: open addressing with linear probing and backward-shift deletion
// (no tombstones, so probe chains never degrade). The capacity is fixed at construction: at least
// twice the most entries it will hold, so the load factor stays <= 1/2 and a lookup costs one or
// two cache lines. No allocation after construction.
class BlockHashTable {
 public:
  explicit BlockHashTable(int64_t max_entries);

  // The block stored under `hash`, or -1.
  int32_t Find(const BlockHash& hash) const;
  // Stores hash -> block. Precondition: `hash` is absent and size() < max_entries.
  void Insert(const BlockHash& hash, int32_t block);
  // Removes `hash`. Precondition: present.
  void Erase(const BlockHash& hash);
  void Clear();

  int64_t size() const { return size_; }
  int64_t capacity() const { return static_cast<int64_t>(slots_.size()); }

  // For invariant checks: calls f(hash, block) for every entry.
  template <typename F>
  void ForEach(F&& f) const {
    for (const Slot& s : slots_) {
      if (s.block >= 0) f(s.hash, s.block);
    }
  }
  // Empty if every entry is reachable from its home slot and size() matches; else a description.
  std::string Verify() const;

 private:
  struct Slot {
    BlockHash hash;
    int32_t block = -1;  // -1: empty
  };
  uint64_t Home(const BlockHash& hash) const { return hash.low & mask_; }

  std::vector<Slot> slots_;  // [capacity], capacity a power of two
  uint64_t mask_ = 0;
  int64_t size_ = 0;
};

}  // namespace tqkv
