// KVCacheManager: the paged KV-cache block manager an engine calls every step.
//
// It hands out block ids and slot indices and never touches cache memory (KVCache owns the
// bytes). kvcache/README.md is the contract: states, transitions, ownership, threading,
// invariants. In short, per step:
//
//   seq = AddSequence(prompt)              once per request (hashes the prompt's full blocks)
//   Lookup(seq)                            optional: how much of the prompt is cached
//   Schedule({{seq, n, lookahead}, ...})   all-or-nothing: slots for every request, or nothing
//                                          changes and the result says what was missing
//   ... run the model on the StepBatch ...
//   Commit(seq, accepted_tokens)           the step ran: record the tokens it produced and
//                                          publish newly full blocks to the prefix cache
//   Rewind(seq, n)                         drop positions of rejected draft tokens
//   Free(seq)                              when the request ends or is preempted
//
// Positions and tokens. A sequence has `num_tokens` known token ids (prompt + committed) and
// `num_scheduled` positions that have slots (KV written by a completed step, or being written by
// the current one). Schedule writes positions [num_scheduled, num_scheduled + n); those past the
// known tokens are draft positions. Commit may bring the known tokens to at most num_scheduled + 1
// (each scheduled position yields at most one next token). The KV of position p is trusted (may be
// shared through the prefix cache) once p < min(num_scheduled, num_tokens - 1) after a Commit: the
// last committed token is the newly sampled one, every earlier committed token had its KV written
// at its position (an accepted draft). So rewind rejected draft positions before committing past
// them.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvcache/block_hash.h"
#include "kvcache/block_pool.h"
#include "kvcache/step_batch.h"

namespace tqkv {

struct KVCacheManagerOptions {
  // Rows of the per-layer cache tensors, including the reserved null block 0 (>= 2).
  int32_t num_blocks = 0;
  int32_t block_size = 16;  // tokens per block, 1 to 1024
  // The cache format, hashed into every block hash. format.block_size is 0 or block_size.
  FormatTag format;
  bool enable_prefix_caching = true;
  // Sliding-window attention: a query at position p reads positions (p - window, p]. Blocks
  // entirely before the window of a sequence's next query are released and their block-table
  // entries become the null block. 0: full attention.
  int32_t sliding_window = 0;
  // Record BlockStored / BlockRemoved / AllCleared for TakeEvents(). Off by default: nobody may be
  // draining them.
  bool record_events = false;
};

struct SequenceOptions {
  // Cache salt / adapter id: sequences with different extra keys never share cached blocks.
  std::string_view extra_key = {};
  // Eviction priority of the blocks this sequence holds, kMinPriority..kMaxPriority: when a
  // cached block must be reclaimed, lower priorities go first.
  int priority = kDefaultPriority;
};

struct PrefixMatch {
  int64_t num_tokens = 0;  // = num_blocks * block_size, at most num_tokens - 1 of the sequence
  int32_t num_blocks = 0;
};

struct SequenceInfo {
  int64_t num_tokens = 0;           // known token ids: prompt + committed
  int64_t num_scheduled = 0;        // positions with slots
  int32_t num_cached_blocks = 0;    // leading blocks with trusted KV (published to the cache)
  int32_t num_table_entries = 0;    // block-table length, lookahead reservations included
  int32_t num_released_blocks = 0;  // leading entries released by the sliding window (null)
  int priority = kDefaultPriority;
};

struct ScheduleRejection {
  int32_t request_index = 0;  // position in the requests span
  SeqId seq = -1;
  int64_t blocks_needed = 0;   // new blocks (plus one for a copy-on-write) this request needs
  int64_t blocks_missing = 0;  // admitting requests in order, what was left short for this one
  bool never_fits = false;     // needs more blocks than the whole pool: do not retry
};

struct ScheduleResult {
  bool admitted = false;
  int64_t blocks_needed = 0;     // whole batch
  int64_t blocks_available = 0;  // free + evictable (not pinned by this batch's prefix hits)
                                 // + blocks this batch's sliding windows would release
  int64_t blocks_missing = 0;    // blocks_needed - blocks_available when not admitted, else 0
  // Not admitted: the requests that did not fit when admitting in request order (a caller that
  // orders by priority preempts from the back). Empty when admitted (no allocation then).
  std::vector<ScheduleRejection> rejected;
};

// Every field is a snapshot (Stats() is O(1)).
struct KVCacheStats {
  int32_t num_blocks = 0;        // usable blocks: options.num_blocks - 1 (the null block)
  int32_t blocks_in_use = 0;     // held by at least one sequence (ref >= 1)
  int32_t blocks_free = 0;       // ref 0, no cached content; handed out first
  int32_t blocks_evictable = 0;  // ref 0, cached content: reusable by prefix hits, reclaimed
                                 // (evicted) only when no block is free
  int64_t blocks_cached = 0;     // blocks with a published hash, in use or evictable
  int64_t num_sequences = 0;     // live sequences
  double usage = 0;              // blocks_in_use / num_blocks
  // Prefix cache, counted when a sequence with no scheduled positions is scheduled (with prefix
  // caching on): its known tokens are "queried", the cached prefix it reuses is "hit".
  int64_t prefix_query_tokens = 0;
  int64_t prefix_hit_tokens = 0;
  int64_t prefix_miss_tokens = 0;   // query - hit
  int64_t evictions = 0;            // cached blocks reclaimed to satisfy allocations (cumulative)
  int64_t cow_copies = 0;           // copy-on-write copies emitted (cumulative)
  int64_t blocks_allocated = 0;     // blocks handed out by Schedule (cumulative, copies included)
  int64_t schedule_calls = 0;       // Schedule calls that returned (admitted or not)
  int64_t schedule_rejections = 0;  // Schedule calls that admitted nothing
};

class KVCacheManager {
 public:
  // Throws tqkv::Error for num_blocks < 2, block_size outside 1..1024, a negative window, or a
  // format.block_size that disagrees.
  explicit KVCacheManager(const KVCacheManagerOptions& options);
  KVCacheManager(const KVCacheManager&) = delete;
  KVCacheManager& operator=(const KVCacheManager&) = delete;

  // A new sequence with these known tokens (>= 1) and no blocks. Hashes its full blocks now, so
  // Lookup and the first Schedule only probe the table.
  SeqId AddSequence(std::span<const int32_t> prompt_tokens, const SequenceOptions& options = {});
  // Releases every block (last block first, so a chain's tail is evicted before its head; full
  // blocks with trusted KV stay cached). The id becomes invalid. Freeing twice throws.
  void Free(SeqId seq);
  // A new sequence sharing every block of `seq` that holds a scheduled position (ref counts + 1),
  // with the same tokens, extra key and priority. Lookahead reservations are not shared. The first
  // write into a shared, partially filled block gives the writer a fresh block and a copy.
  SeqId Fork(SeqId seq);

  // The longest cached prefix of the sequence's known tokens, in whole blocks, capped so at least
  // one token is computed. No side effects. Schedule takes exactly this prefix for a sequence
  // with no scheduled positions, unless something is evicted in between.
  PrefixMatch Lookup(SeqId seq) const;

  // The per-step call: all-or-nothing for the batch. Admitted: `batch` holds the step and the
  // manager state advanced. Not admitted: nothing changed (manager and `batch`), and the result
  // says how many blocks were missing and for which requests. Invalid input (unknown or freed
  // sequence, a sequence twice, negative counts or options, positions past 2^31 - 1, paddings
  // whose batch passes kMaxStepBatchBytes) throws tqkv::Error, also with nothing changed.
  ScheduleResult Schedule(std::span<const StepRequest> requests, StepBatch& batch,
                          const ScheduleOptions& options = {});

  // The step for `seq` completed: `token_ids` are the tokens it produced, in position order
  // (accepted drafts, then the sampled token; may be empty, e.g. after a partial prefill).
  // Newly trusted full blocks are published to the prefix cache. Throws (nothing changed) if the
  // known tokens would exceed num_scheduled + 1.
  void Commit(SeqId seq, std::span<const int32_t> token_ids);
  // Drops the last `num_positions` scheduled positions (rejected drafts) and releases the blocks
  // that then hold no scheduled position, lookahead reservations included. Known tokens stay:
  // positions below them are recomputed by later steps. Throws (nothing changed) when
  // num_positions is negative or exceeds num_scheduled, or when the sliding window already
  // released blocks the rewound sequence would need.
  void Rewind(SeqId seq, int64_t num_positions);

  // Drops every cached hash (evictable blocks become free; blocks in use stay with their
  // sequences but are no longer shared with new ones). Returns how many hashes were dropped.
  int64_t ClearPrefixCache();
  // Events since the last call, oldest first (needs options.record_events).
  std::vector<KVEvent> TakeEvents();

  KVCacheStats Stats() const;
  bool IsLive(SeqId seq) const;
  SequenceInfo GetSequenceInfo(SeqId seq) const;
  // The block table (null entries for window-released blocks). Valid until the next mutating call.
  std::span<const int32_t> BlockTable(SeqId seq) const;
  std::span<const int32_t> Tokens(SeqId seq) const;  // the known tokens
  const KVCacheManagerOptions& options() const { return options_; }
  const BlockPool& pool() const { return pool_; }

  // Empty when every invariant of kvcache/README.md holds, else the first violation. O(blocks +
  // tokens of live sequences): for tests and debugging, not for the step loop.
  std::string FindInvariantViolation() const;
  // Aborts through TQKV_CHECK with the violation.
  void CheckInvariants() const;
  // A deterministic dump of every block and live sequence (tests compare dumps for "unchanged").
  std::string DebugString() const;

 private:
  // Two cache lines; the first holds everything a decode step reads (Schedule touches 256 of
  // these per step, so each miss counts).
  struct alignas(64) Sequence {
    uint32_t generation = 0;
    bool live = false;
    // False guarantees that the block holding position num_scheduled (if any) is this sequence's
    // alone and unpublished, so Schedule skips the copy-on-write check (a cache miss on the
    // block's metadata). Set by Fork and Rewind, cleared once Schedule has prepared the block.
    bool tail_may_be_shared = false;
    uint8_t priority = kDefaultPriority;
    // Bumped whenever an entry of `blocks` changes or is removed (appends keep it): a StepBatch
    // row written at the same epoch needs only the entries appended since.
    uint32_t table_epoch = 0;
    uint32_t batch_mark = 0;        // == schedule epoch: already in the current batch
    int32_t num_cached_blocks = 0;  // leading entries with trusted, published-or-duplicate KV
    int32_t num_released = 0;       // leading null entries (sliding window)
    int64_t num_scheduled = 0;
    std::vector<int32_t> blocks;  // block table
    // Second line: tokens and hashes (Commit, Lookup, a fresh sequence's first step).
    std::vector<int32_t> tokens;          // [num_tokens]
    std::vector<BlockHash> token_hashes;  // [num_tokens / block_size]
    BlockHash root;                       // parent hash of block 0
  };
  static_assert(sizeof(Sequence) == 128);

  // Per-request scratch of Schedule, reused across steps.
  struct Plan {
    Sequence* seq = nullptr;
    int64_t start = 0;       // first written position
    int32_t hit_offset = 0;  // into hit_blocks_
    int32_t hit_blocks = 0;  // prefix-cache blocks taken (sequences with nothing scheduled)
    int32_t release_to = 0;  // window: entries below this are null after the step
    int32_t table_len = 0;   // entries after the step
    int32_t new_blocks = 0;  // allocations, copy-on-write excluded
    bool fresh = false;      // nothing scheduled, no reservation: takes its cached prefix
    bool cow = false;        // the block at start / block_size is shared: copy it
    bool unpublish = false;  // ... is ours alone but published: drop its hash
    bool keeper = false;     // ... is shared, and ours alone once the other writers copied it
  };

  // Block index and offset of a position: shifts for a power-of-two block size (the usual case);
  // the per-request path does several, and a 64-bit division costs ~40 cycles.
  int64_t BlockOf(int64_t pos) const { return shift_ >= 0 ? pos >> shift_ : pos / block_size_; }
  int64_t OffsetOf(int64_t pos) const {
    return shift_ >= 0 ? pos & (block_size_ - 1) : pos % block_size_;
  }
  int64_t BlocksFor(int64_t positions) const { return BlockOf(positions + block_size_ - 1); }

  Sequence& Live(std::string_view where, SeqId id);
  const Sequence& Live(std::string_view where, SeqId id) const;
  SeqId IdOf(size_t slot) const;
  // A free slot whose vectors hold `tokens` tokens (with their block hashes) and `blocks` block
  // ids without reallocating; taken only once they are reserved, so a std::bad_alloc changes
  // nothing.
  size_t ReserveSlot(size_t tokens, size_t blocks);
  int32_t MatchPrefix(const Sequence& s) const;  // cached leading blocks, capped
  // Sliding window: entries below this are not needed by a step whose first query is at start.
  int32_t FirstKeptBlock(const Sequence& s, int64_t start) const;
  void AppendTokens(Sequence& s, std::span<const int32_t> tokens);
  void PublishTrustedBlocks(Sequence& s);
  void ReleaseTail(Sequence& s, size_t keep);  // releases entries >= keep, last first

  // Schedule, one method per phase; the phases share plans_ (one Plan per request) and the
  // scratch below. Phases 1 and 2 leave the manager as it was (bar the batch marks); phase 3
  // cannot fail.
  struct BlockDemand {
    int64_t needed = 0;       // new blocks, copy-on-write copies included
    int64_t reclaimable = 0;  // blocks this batch's sliding windows release
    int32_t width = 1;        // block-table columns
    bool never_fits = false;  // some request needs more blocks than the pool holds
  };
  // Phase 1: validates the options and every request (throws), marks each request's sequence,
  // starts plans_; returns the batch's new tokens.
  int64_t ValidateRequests(std::span<const StepRequest> requests, const ScheduleOptions& options);
  // Phase 2a: the prefix hits of fresh sequences (hit_blocks_, marked in block_mark_); returns
  // how many of them are evictable (not available to this batch's allocations).
  int64_t PlanPrefixHits();
  // Phase 2b: each request's start, table length, new blocks, window release and copy-on-write
  // (throws for positions past 2^31 - 1).
  BlockDemand PlanBlocks(std::span<const StepRequest> requests, const ScheduleOptions& options);
  int32_t KeepLastWriters();  // part of 2b
  // Not admitted: counts the rejection and says which requests, admitted in order, fell short.
  void Reject(std::span<const StepRequest> requests, int64_t available, ScheduleResult& result);
  // Phase 3: takes the prefix hits, releases blocks before the sliding windows, then copies and
  // allocates blocks and writes the batch (slots, table rows, lengths, query starts, padding).
  void TakePrefixHits();
  void ReleaseWindowBlocks();
  void WriteBatch(std::span<const StepRequest> requests, int32_t width, StepBatch& batch);

  KVCacheManagerOptions options_;
  const uint64_t instance_id_;  // never 0, never reused in the process (StepBatch rows)
  int32_t block_size_;
  int shift_;  // log2(block_size_), or -1 when it is not a power of two
  BlockPool pool_;
  BlockHash format_root_;
  std::vector<Sequence> sequences_;  // slots
  std::vector<uint32_t> free_slots_;
  int64_t num_live_ = 0;

  // Schedule scratch.
  std::vector<Plan> plans_;
  std::vector<int32_t> hit_blocks_;
  std::vector<std::pair<int32_t, int32_t>> cow_writers_;  // (shared block, request index)
  std::vector<uint32_t> block_mark_;  // [num_blocks] == epoch_: a prefix hit of this batch
  uint32_t epoch_ = 0;

  int64_t prefix_query_tokens_ = 0;
  int64_t prefix_hit_tokens_ = 0;
  int64_t cow_copies_ = 0;
  int64_t blocks_allocated_ = 0;
  int64_t schedule_calls_ = 0;
  int64_t schedule_rejections_ = 0;
};

}  // namespace tqkv
