// The per-step request and result types of KVCacheManager::Schedule.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "runtime/memory.h"

namespace tqkv {

// Identifies a sequence of one KVCacheManager: the slot index in the low 32 bits and the slot's
// generation in the high 32 bits, so an id is never reused and a stale id is always detected.
using SeqId = int64_t;

struct StepRequest {
  SeqId seq = -1;
  // Positions written this step (the query length): slots [start, start + num_new_tokens), where
  // start is the sequence's scheduled count (after its prefix hit, on its first step).
  int32_t num_new_tokens = 0;
  // Extra positions after those to back with blocks, without slots in the mapping (speculative
  // decoding: the drafter writes its proposals' KV there).
  int32_t num_lookahead = 0;
};

// Shapes for CUDA graphs: every size here is a minimum, 0 means "no padding" (the batch they
// give must fit kMaxStepBatchBytes).
struct ScheduleOptions {
  int32_t pad_tokens_to = 0;      // slot_mapping length >= this; padding slots are -1
  int32_t pad_requests_to = 0;    // rows of block_tables / seq_lens >= this; padding rows are
                                  // null blocks, length 0, empty queries
  int32_t block_table_width = 0;  // columns >= this (and >= the longest table in the batch)
};

// Copy all bytes of block `src` to block `dst`, in every layer (copy-on-write). Within one step's
// list every dst is distinct and no dst is a src, so the copies may run in any order.
struct BlockCopy {
  int32_t src = 0;
  int32_t dst = 0;
  friend bool operator==(const BlockCopy&, const BlockCopy&) = default;
};

// The most bytes a step batch's host buffer may take (16 GiB; a step of 256 sequences of 4k
// tokens takes ~0.3 MiB): Schedule refuses larger paddings and table widths.
inline constexpr int64_t kMaxStepBatchBytes = int64_t{1} << 34;

// What one successful Schedule produced. The caller owns it and passes the same object every step:
// its memory is reused, so a step in the steady state allocates nothing.
//
// The four device-bound arrays live in one host buffer (pinned when a CUDA device is present), in
// this order, each section starting at a 64-byte boundary:
//   block_tables    [B_pad, W]   int32  row i: request i's block table, then the null block (0)
//   slot_mapping    [T_pad]      int64  slot = block_id * block_size + position % block_size, in
//                                       request order; -1 for padding
//   seq_lens        [B_pad]      int32  context length after this step (0 for padding rows)
//   query_start_loc [B_pad + 1]  int32  prefix sums of the query lengths
// so one copy of bytes() uploads a step (layout() gives the byte offsets).
//
// Block tables are the bulk of a step (256 sequences of 4k tokens: 256 KiB) and change little
// between steps, so rows persist: when row i holds the same sequence as last step and that
// sequence's table only grew, Schedule writes just the new entries. (Hence block_tables first:
// its offset does not move when the token count changes.)
class StepBatch {
 public:
  struct Layout {
    int64_t block_tables = 0;  // byte offsets into bytes()
    int64_t slot_mapping = 0;
    int64_t seq_lens = 0;
    int64_t query_start_loc = 0;
    int64_t total_bytes = 0;
  };

  StepBatch() = default;
  StepBatch(StepBatch&&) noexcept = default;
  StepBatch& operator=(StepBatch&&) noexcept = default;
  StepBatch(const StepBatch&) = delete;
  StepBatch& operator=(const StepBatch&) = delete;

  int32_t num_requests() const { return num_requests_; }                // B
  int32_t num_tokens() const { return num_tokens_; }                    // T
  int32_t padded_num_requests() const { return padded_num_requests_; }  // B_pad >= B
  int32_t padded_num_tokens() const { return padded_num_tokens_; }      // T_pad >= T
  int32_t block_table_width() const { return block_table_width_; }      // W

  std::span<const int64_t> slot_mapping() const {  // [T_pad]
    return {Section<int64_t>(layout_.slot_mapping), static_cast<size_t>(padded_num_tokens_)};
  }
  std::span<const int32_t> block_tables() const {  // [B_pad, W], row-major
    return {Section<int32_t>(layout_.block_tables),
            static_cast<size_t>(padded_num_requests_) * static_cast<size_t>(block_table_width_)};
  }
  std::span<const int32_t> block_table(int32_t row) const {  // [W]; row in [0, B_pad)
    if (row < 0 || row >= padded_num_requests_) ThrowBadRow(row);
    return block_tables().subspan(static_cast<size_t>(row) * block_table_width_,
                                  static_cast<size_t>(block_table_width_));
  }
  std::span<const int32_t> seq_lens() const {  // [B_pad]
    return {Section<int32_t>(layout_.seq_lens), static_cast<size_t>(padded_num_requests_)};
  }
  std::span<const int32_t> query_start_loc() const {  // [B_pad + 1]
    return {Section<int32_t>(layout_.query_start_loc),
            static_cast<size_t>(padded_num_requests_) + 1};
  }
  // [B] tokens of request i taken from the prefix cache this step (non-zero only on a sequence's
  // first step): its first query position is seq_lens[i] - query length.
  std::span<const int32_t> prefix_hit_tokens() const { return prefix_hit_tokens_; }
  // Copy-on-write copies to run (KVCache::ApplyCopies) before this step's stores.
  std::span<const BlockCopy> copies() const { return copies_; }

  const Layout& layout() const { return layout_; }
  std::span<const std::byte> bytes() const {  // [layout().total_bytes]
    return {static_cast<const std::byte*>(arena_.data()), static_cast<size_t>(layout_.total_bytes)};
  }
  // Bytes reserved by the arena (grows to the largest step seen, never shrinks).
  int64_t arena_capacity_bytes() const { return arena_.size_bytes(); }
  // Page-locked (a CUDA device was present when the arena was allocated): uploads can be async.
  bool arena_pinned() const { return arena_.pinned(); }

 private:
  friend class KVCacheManager;

  [[noreturn]] void ThrowBadRow(int32_t row) const;

  template <typename T>
  const T* Section(int64_t offset) const {
    return reinterpret_cast<const T*>(static_cast<const std::byte*>(arena_.data()) + offset);
  }
  template <typename T>
  T* MutableSection(int64_t offset) {
    return reinterpret_cast<T*>(static_cast<std::byte*>(arena_.data()) + offset);
  }
  // What a block-table row holds from an earlier step.
  struct RowState {
    // The manager that wrote it (KVCacheManager's instance id: a manager built where a destroyed
    // one lived has another, though its sequence ids and epochs start over).
    uint64_t owner = 0;
    SeqId seq = kUnknownRow;
    uint32_t table_epoch = 0;  // the sequence's table epoch when written
    int32_t length = 0;        // entries written; the rest of the row is null
  };
  static constexpr SeqId kUnknownRow = -2;  // contents unknown: rewrite the whole row
  static constexpr SeqId kPaddingRow = -1;  // all null

  // Sets the shapes and sizes the arena (reusing it when large enough). Block-table rows keep
  // their contents when the arena and the width stay; everything else is unspecified.
  void Reshape(int32_t num_requests, int32_t padded_requests, int32_t num_tokens,
               int32_t padded_tokens, int32_t width);

  HostAllocation arena_;
  std::vector<RowState> rows_;  // [B_pad]
  Layout layout_;
  int32_t num_requests_ = 0;
  int32_t num_tokens_ = 0;
  int32_t padded_num_requests_ = 0;
  int32_t padded_num_tokens_ = 0;
  int32_t block_table_width_ = 0;
  std::vector<int32_t> prefix_hit_tokens_;  // [B]
  std::vector<BlockCopy> copies_;
};

// Typed pointers to the four sections of a copy of StepBatch::bytes() that starts at `base`: the
// batch's own host buffer (base = batch.bytes().data()) or a device copy of it (UploadStepBatch,
// kvcache/kv_cache.h, returns the view of its upload). The shapes are the batch's at the time of
// the view; the pointers stay valid as long as the memory at `base` holds that copy.
struct StepBatchView {
  const int32_t* block_tables = nullptr;     // [padded_num_requests, block_table_width]
  const int64_t* slot_mapping = nullptr;     // [padded_num_tokens]
  const int32_t* seq_lens = nullptr;         // [padded_num_requests]
  const int32_t* query_start_loc = nullptr;  // [padded_num_requests + 1]
  int32_t num_requests = 0;
  int32_t padded_num_requests = 0;
  int32_t num_tokens = 0;
  int32_t padded_num_tokens = 0;
  int32_t block_table_width = 0;
};

// The view of batch.bytes() copied to `base` (pointer arithmetic only: base + batch.layout()).
StepBatchView ViewStepBatch(const StepBatch& batch, const void* base);

}  // namespace tqkv
