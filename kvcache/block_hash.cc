#include "kvcache/block_hash.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <bit>
#include <cstring>

#include "runtime/error.h"

namespace tqkv {
namespace {

static_assert(std::endian::native == std::endian::little,
              "block hashes are defined over little-endian bytes");

// Longest block the stack buffer of HashBlockTokens holds; the manager enforces it.
constexpr size_t kMaxHashedTokens = 1024;

BlockHash FromXxh(XXH128_hash_t h) { return BlockHash{h.low64, h.high64}; }

void AppendBytes(std::string& out, const void* p, size_t n) {
  out.append(static_cast<const char*>(p), n);
}

}  // namespace

std::string ToHex(const BlockHash& hash) {
  return fmt::format("{:016x}{:016x}", hash.high, hash.low);
}

BlockHash HashFormatTag(const FormatTag& tag) {
  // A versioned domain string, then every field at a fixed width, so no two tags serialize alike.
  std::string bytes = "tqkv.block_hash.v1";
  bytes.push_back('\0');
  AppendBytes(bytes, tag.preset.data(), tag.preset.size());
  bytes.push_back('\0');
  const int32_t head_dim = tag.head_dim;
  const int32_t block_size = tag.block_size;
  AppendBytes(bytes, &head_dim, sizeof(head_dim));
  AppendBytes(bytes, &block_size, sizeof(block_size));
  AppendBytes(bytes, &tag.rotation_id, sizeof(tag.rotation_id));
  return FromXxh(XXH3_128bits(bytes.data(), bytes.size()));
}

BlockHash HashChainRoot(const BlockHash& format_root, std::string_view extra_key) {
  if (extra_key.empty()) return format_root;
  std::string bytes;
  bytes.reserve(sizeof(BlockHash) + extra_key.size());
  AppendBytes(bytes, &format_root.low, sizeof(uint64_t));
  AppendBytes(bytes, &format_root.high, sizeof(uint64_t));
  bytes.append(extra_key);
  return FromXxh(XXH3_128bits(bytes.data(), bytes.size()));
}

BlockHash HashBlockTokens(const BlockHash& parent, std::span<const int32_t> tokens) {
  if (tokens.size() > kMaxHashedTokens) {
    throw InvalidArgument("HashBlockTokens", "tokens.size()", tokens.size(),
                          fmt::format("at most {}", kMaxHashedTokens));
  }
  // One contiguous buffer and the one-shot XXH3 (about 3x cheaper than the streaming state for
  // inputs this small).
  alignas(16) unsigned char buffer[sizeof(BlockHash) + kMaxHashedTokens * sizeof(int32_t)];
  std::memcpy(buffer, &parent.low, sizeof(uint64_t));
  std::memcpy(buffer + sizeof(uint64_t), &parent.high, sizeof(uint64_t));
  const size_t token_bytes = tokens.size() * sizeof(int32_t);
  // Fixed 16-byte moves: a variable-length memcpy of 64 bytes compiles to `rep movsq`, whose
  // start-up cost was a third of the hash (perf, 32k-token AddSequence).
  const auto* src = reinterpret_cast<const unsigned char*>(tokens.data());
  unsigned char* dst = buffer + sizeof(BlockHash);
  size_t i = 0;
  for (; i + 16 <= token_bytes; i += 16) std::memcpy(dst + i, src + i, 16);
  for (; i < token_bytes; i += 4) std::memcpy(dst + i, src + i, 4);
  return FromXxh(XXH3_128bits(buffer, sizeof(BlockHash) + token_bytes));
}

// ---------------------------------------------------------------------------------------------
// BlockHashTable

BlockHashTable::BlockHashTable(int64_t max_entries) {
  if (max_entries < 0) throw InvalidArgument("BlockHashTable", "max_entries", max_entries, ">= 0");
  uint64_t capacity = 16;
  while (capacity < 2 * static_cast<uint64_t>(max_entries)) capacity *= 2;
  slots_.resize(capacity);
  mask_ = capacity - 1;
}

int32_t BlockHashTable::Find(const BlockHash& hash) const {
  for (uint64_t i = Home(hash);; i = (i + 1) & mask_) {
    const Slot& s = slots_[i];
    if (s.block < 0) return -1;
    if (s.hash == hash) return s.block;
  }
}

void BlockHashTable::Insert(const BlockHash& hash, int32_t block) {
  TQKV_CHECK_GE(block, 0);
  TQKV_CHECK_LT(2 * size_, capacity());
  for (uint64_t i = Home(hash);; i = (i + 1) & mask_) {
    Slot& s = slots_[i];
    if (s.block < 0) {
      s.hash = hash;
      s.block = block;
      ++size_;
      return;
    }
    TQKV_CHECK(!(s.hash == hash));
  }
}

void BlockHashTable::Erase(const BlockHash& hash) {
  uint64_t i = Home(hash);
  while (true) {
    TQKV_CHECK_GE(slots_[i].block, 0);  // absent: a caller bug
    if (slots_[i].hash == hash) break;
    i = (i + 1) & mask_;
  }
  // Backward shift: move later members of the probe run into the hole when their home slot does
  // not lie cyclically in (hole, j], so every entry stays reachable from its home.
  uint64_t hole = i;
  for (uint64_t j = (hole + 1) & mask_; slots_[j].block >= 0; j = (j + 1) & mask_) {
    const uint64_t home = Home(slots_[j].hash);
    const bool home_in_gap = ((j - home) & mask_) < ((j - hole) & mask_);
    if (!home_in_gap) {
      slots_[hole] = slots_[j];
      hole = j;
    }
  }
  slots_[hole] = Slot{};
  --size_;
}

void BlockHashTable::Clear() {
  for (Slot& s : slots_) s = Slot{};
  size_ = 0;
}

std::string BlockHashTable::Verify() const {
  int64_t count = 0;
  for (uint64_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].block < 0) continue;
    ++count;
    // Walk from home to i: every slot on the way must be occupied.
    for (uint64_t j = Home(slots_[i].hash); j != i; j = (j + 1) & mask_) {
      if (slots_[j].block < 0) {
        return fmt::format("hash table: entry {} at slot {} unreachable from home {} (hole at {})",
                           ToHex(slots_[i].hash), i, Home(slots_[i].hash), j);
      }
    }
  }
  if (count != size_) return fmt::format("hash table: {} entries but size {}", count, size_);
  return {};
}

}  // namespace tqkv
