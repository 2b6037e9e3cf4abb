#include "kvcache/manager.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <functional>
#include <limits>

#include "runtime/error.h"

namespace tqkv {
namespace {

constexpr int32_t kMaxBlockSize = 1024;
// seq_lens and query_start_loc are int32: positions stay below this.
constexpr int64_t kMaxPositions = std::numeric_limits<int32_t>::max();

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

const KVCacheManagerOptions& Validated(const KVCacheManagerOptions& o) {
  constexpr const char* kWhere = "KVCacheManager";
  if (o.num_blocks < 2) {
    throw InvalidArgument(kWhere, "num_blocks", o.num_blocks,
                          ">= 2 (block 0 is the reserved null block; at least one usable block)");
  }
  if (o.block_size < 1 || o.block_size > kMaxBlockSize) {
    throw InvalidArgument(kWhere, "block_size", o.block_size,
                          fmt::format("1 to {}", kMaxBlockSize));
  }
  if (o.format.block_size != 0 && o.format.block_size != o.block_size) {
    throw InvalidArgument(kWhere, "format.block_size", o.format.block_size,
                          fmt::format("0 or the manager's block_size {}", o.block_size));
  }
  if (o.sliding_window < 0) {
    throw InvalidArgument(kWhere, "sliding_window", o.sliding_window, ">= 0 (0: full attention)");
  }
  return o;
}

FormatTag WithBlockSize(FormatTag tag, int32_t block_size) {
  tag.block_size = block_size;
  return tag;
}

uint64_t NextInstanceId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

KVCacheManager::KVCacheManager(const KVCacheManagerOptions& options)
    : options_(Validated(options)),
      instance_id_(NextInstanceId()),
      block_size_(options.block_size),
      shift_(std::has_single_bit(static_cast<uint32_t>(options.block_size))
                 ? std::countr_zero(static_cast<uint32_t>(options.block_size))
                 : -1),
      pool_(options.num_blocks, options.record_events),
      format_root_(HashFormatTag(WithBlockSize(options.format, options.block_size))),
      block_mark_(static_cast<size_t>(options.num_blocks), 0) {
  options_.format.block_size = block_size_;
}

// ---------------------------------------------------------------------------------------------
// Sequence ids

SeqId KVCacheManager::IdOf(size_t slot) const {
  return static_cast<SeqId>((static_cast<uint64_t>(sequences_[slot].generation) << 32) |
                            static_cast<uint64_t>(slot));
}

const KVCacheManager::Sequence& KVCacheManager::Live(std::string_view where, SeqId id) const {
  const uint64_t slot = static_cast<uint64_t>(id) & 0xffffffffu;
  const uint64_t generation = static_cast<uint64_t>(id) >> 32;
  if (id >= 0 && slot < sequences_.size()) {
    const Sequence& s = sequences_[slot];
    if (generation == s.generation && s.live) return s;
    if (generation < s.generation) {
      throw Error(fmt::format("{}: sequence {} was freed{}", where, id,
                              where == "Free" ? " already (double free)" : ""));
    }
  }
  throw Error(fmt::format("{}: unknown sequence {} (never issued by this manager)", where, id));
}

KVCacheManager::Sequence& KVCacheManager::Live(std::string_view where, SeqId id) {
  return const_cast<Sequence&>(std::as_const(*this).Live(where, id));
}

bool KVCacheManager::IsLive(SeqId id) const {
  const uint64_t slot = static_cast<uint64_t>(id) & 0xffffffffu;
  if (id < 0 || slot >= sequences_.size()) return false;
  const Sequence& s = sequences_[slot];
  return s.live && s.generation == (static_cast<uint64_t>(id) >> 32);
}

size_t KVCacheManager::ReserveSlot(size_t tokens, size_t blocks) {
  const bool reuse = !free_slots_.empty();
  if (!reuse && sequences_.size() >= (size_t{1} << 31)) {
    throw Error("KVCacheManager: more than 2^31 sequence slots");
  }
  if (!reuse) sequences_.emplace_back();  // may throw, changing nothing
  const size_t slot = reuse ? free_slots_.back() : sequences_.size() - 1;
  Sequence& s = sequences_[slot];
  try {
    s.tokens.reserve(tokens);
    s.token_hashes.reserve(tokens / static_cast<size_t>(block_size_));
    s.blocks.reserve(blocks);
  } catch (...) {
    if (!reuse) sequences_.pop_back();
    throw;
  }
  if (reuse) free_slots_.pop_back();
  return slot;
}

// ---------------------------------------------------------------------------------------------
// Tokens and hashes

void KVCacheManager::AppendTokens(Sequence& s, std::span<const int32_t> tokens) {
  // Tokens from the sequence's own (Tokens(id)): copied first, since growing the vector would
  // free what the span reads.
  std::vector<int32_t> own;
  const auto* const begin = s.tokens.data();
  if (!tokens.empty() && !s.tokens.empty() && std::less_equal<>()(begin, tokens.data()) &&
      std::less<>()(tokens.data(), begin + s.tokens.size())) {
    own.assign(tokens.begin(), tokens.end());
    tokens = own;
  }
  const size_t bs = static_cast<size_t>(block_size_);
  // Both vectors grown first (their only allocations), so that a std::bad_alloc leaves the
  // sequence as it was; geometrically, as insert would.
  const size_t n = s.tokens.size() + tokens.size();
  if (n > s.tokens.capacity()) s.tokens.reserve(std::max(n, 2 * s.tokens.capacity()));
  if (n / bs > s.token_hashes.capacity()) {
    s.token_hashes.reserve(std::max(n / bs, 2 * s.token_hashes.capacity()));
  }
  s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
  for (size_t i = s.token_hashes.size(); (i + 1) * bs <= s.tokens.size(); ++i) {
    const BlockHash& parent = i == 0 ? s.root : s.token_hashes[i - 1];
    s.token_hashes.push_back(
        HashBlockTokens(parent, std::span<const int32_t>(s.tokens.data() + i * bs, bs)));
  }
}

void KVCacheManager::PublishTrustedBlocks(Sequence& s) {
  const int64_t trusted =
      std::min<int64_t>(s.num_scheduled, static_cast<int64_t>(s.tokens.size()) - 1);
  const int32_t full = static_cast<int32_t>(BlockOf(trusted));
  if (full <= s.num_cached_blocks) return;
  if (options_.enable_prefix_caching) {
    for (int32_t i = s.num_cached_blocks; i < full; ++i) {
      const int32_t b = s.blocks[static_cast<size_t>(i)];
      if (b == kNullBlock || pool_.block(b).hashed) continue;
      const BlockHash& parent = i == 0 ? s.root : s.token_hashes[static_cast<size_t>(i) - 1];
      // A duplicate of an already cached block stays unpublished; it is freed when released.
      pool_.Register(b, s.token_hashes[static_cast<size_t>(i)], parent);
    }
  }
  s.num_cached_blocks = full;
}

int32_t KVCacheManager::FirstKeptBlock(const Sequence& s, int64_t start) const {
  const int32_t window = options_.sliding_window;
  if (window == 0) return 0;
  // The window of the first query, but never past a position a Rewind may return to: positions
  // from the last known token on may be drafts, and their rejection rewinds to them.
  const int64_t anchor = std::min<int64_t>(start, static_cast<int64_t>(s.tokens.size()) - 1);
  return static_cast<int32_t>(std::max<int64_t>(0, anchor - window + 1) / block_size_);
}

int32_t KVCacheManager::MatchPrefix(const Sequence& s) const {
  if (!options_.enable_prefix_caching) return 0;
  // At least one token must be computed: the model needs a query to produce the next token.
  const size_t cap = (s.tokens.size() - 1) / static_cast<size_t>(block_size_);
  size_t n = 0;
  while (n < cap && pool_.FindCached(s.token_hashes[n]) >= 0) ++n;
  return static_cast<int32_t>(n);
}

// ---------------------------------------------------------------------------------------------
// Sequences

SeqId KVCacheManager::AddSequence(std::span<const int32_t> prompt_tokens,
                                  const SequenceOptions& options) {
  constexpr const char* kWhere = "AddSequence";
  if (prompt_tokens.empty()) {
    throw InvalidArgument(kWhere, "prompt_tokens.size()", 0, ">= 1");
  }
  if (prompt_tokens.size() > static_cast<size_t>(kMaxPositions)) {
    throw InvalidArgument(kWhere, "prompt_tokens.size()", prompt_tokens.size(),
                          fmt::format("at most {}", kMaxPositions));
  }
  if (options.priority < kMinPriority || options.priority > kMaxPriority) {
    throw InvalidArgument(kWhere, "priority", options.priority,
                          fmt::format("{} to {}", kMinPriority, kMaxPriority));
  }
  // The slot's vectors are reserved before it is taken: nothing changes if they cannot be.
  const size_t slot = ReserveSlot(prompt_tokens.size(), 0);
  Sequence& s = sequences_[slot];
  s.live = true;
  s.tail_may_be_shared = false;
  s.priority = static_cast<uint8_t>(options.priority);
  s.num_scheduled = 0;
  s.num_cached_blocks = 0;
  s.num_released = 0;
  s.root = HashChainRoot(format_root_, options.extra_key);
  AppendTokens(s, prompt_tokens);
  ++num_live_;
  return IdOf(slot);
}

void KVCacheManager::ReleaseTail(Sequence& s, size_t keep) {
  if (s.blocks.size() > keep) ++s.table_epoch;
  while (s.blocks.size() > keep) {
    const int32_t b = s.blocks.back();
    if (b != kNullBlock) pool_.Release(b);
    s.blocks.pop_back();
  }
}

void KVCacheManager::Free(SeqId id) {
  Sequence& s = Live("Free", id);
  // The one allocation, before any change (geometric, as push_back's).
  if (free_slots_.size() == free_slots_.capacity()) {
    free_slots_.reserve(std::max<size_t>(16, 2 * free_slots_.capacity()));
  }
  ReleaseTail(s, 0);
  s.live = false;
  ++s.generation;
  // Keep the vectors' capacity for the next sequence in this slot.
  s.tokens.clear();
  s.token_hashes.clear();
  s.num_scheduled = 0;
  s.num_cached_blocks = 0;
  s.num_released = 0;
  // A slot whose next generation would make ids negative (2^31 sequences in it: free slots are
  // reused last-in first-out, so at low concurrency one slot takes nearly every request) is
  // retired rather than reused, so that every id ever issued stays unique and >= 0.
  if (s.generation < (uint32_t{1} << 31))
    free_slots_.push_back(static_cast<uint32_t>(id & 0xffffffff));
  --num_live_;
}

SeqId KVCacheManager::Fork(SeqId id) {
  const Sequence& original = Live("Fork", id);  // validate before taking a slot
  // The child's vectors reserved before the slot is taken (nothing changes if they cannot be);
  // may move sequences_.
  const size_t slot =
      ReserveSlot(original.tokens.size(), static_cast<size_t>(BlocksFor(original.num_scheduled)));
  const Sequence& parent = Live("Fork", id);
  Sequence& child = sequences_[slot];
  child.live = true;
  child.tail_may_be_shared = true;
  child.priority = parent.priority;
  child.num_scheduled = parent.num_scheduled;
  child.num_cached_blocks = parent.num_cached_blocks;
  child.num_released = parent.num_released;
  child.root = parent.root;
  child.tokens.assign(parent.tokens.begin(), parent.tokens.end());
  child.token_hashes.assign(parent.token_hashes.begin(), parent.token_hashes.end());
  const size_t shared = static_cast<size_t>(BlocksFor(parent.num_scheduled));
  child.blocks.assign(parent.blocks.begin(),
                      parent.blocks.begin() + static_cast<ptrdiff_t>(shared));
  for (const int32_t b : child.blocks) {
    if (b != kNullBlock) pool_.Acquire(b, child.priority);
  }
  sequences_[static_cast<size_t>(id & 0xffffffff)].tail_may_be_shared = true;
  ++num_live_;
  return IdOf(slot);
}

PrefixMatch KVCacheManager::Lookup(SeqId id) const {
  const Sequence& s = Live("Lookup", id);
  const int32_t n = MatchPrefix(s);
  return PrefixMatch{static_cast<int64_t>(n) * block_size_, n};
}

// ---------------------------------------------------------------------------------------------
// Schedule

// Phases 1 and 2 change nothing that a caller can observe (they may throw, and may end in a
// rejection); then the containers phase 3 grows are reserved and the batch is reshaped (which
// may throw: a huge padding), and phase 3 changes the state.
ScheduleResult KVCacheManager::Schedule(std::span<const StepRequest> requests, StepBatch& batch,
                                        const ScheduleOptions& options) {
  const int64_t total_tokens = ValidateRequests(requests, options);  // phase 1
  const int64_t pinned = PlanPrefixHits();                           // phase 2a
  const BlockDemand demand = PlanBlocks(requests, options);          // phase 2b

  const int64_t available = int64_t{pool_.num_available()} - pinned + demand.reclaimable;
  ScheduleResult result;
  result.blocks_needed = demand.needed;
  result.blocks_available = available;
  if (demand.needed > available || demand.never_fits) {
    ++schedule_calls_;
    Reject(requests, available, result);
    return result;
  }
  result.admitted = true;

  // What may still throw (the batch's buffers, the tables' and the copy list's growth) before the
  // first change, so that a failing call leaves the manager as it was.
  const int32_t padded_requests =
      std::max<int32_t>(static_cast<int32_t>(requests.size()), options.pad_requests_to);
  const int32_t padded_tokens =
      std::max<int32_t>(static_cast<int32_t>(total_tokens), options.pad_tokens_to);
  // The batch's host arena (int32 tables [padded requests, width], int64 slots, int32 lengths and
  // starts) within kMaxStepBatchBytes: larger paddings had wrapped its size in int64
  // (pad_requests_to = block_table_width = 2^31 − 1 gave 128 bytes) or failed as std::bad_alloc.
  const int64_t table_entries = int64_t{padded_requests} * demand.width;  // < 2^62
  if (table_entries > kMaxStepBatchBytes / 4 ||
      4 * table_entries + 8 * int64_t{padded_tokens} + 8 * int64_t{padded_requests} + 4 >
          kMaxStepBatchBytes) {
    throw InvalidArgument(
        "Schedule", "options",
        fmt::format("pad_requests_to {}, pad_tokens_to {}, block_table_width {}",
                    options.pad_requests_to, options.pad_tokens_to, options.block_table_width),
        fmt::format("a step batch of at most {} bytes ({} rows of {} block ids, {} tokens)",
                    kMaxStepBatchBytes, padded_requests, demand.width, padded_tokens));
  }
  // (Geometric growth, as push_back's: an exact reserve would reallocate at every new block.)
  size_t copies = 0;
  for (const Plan& p : plans_) {
    copies += p.cow ? 1 : 0;
    std::vector<int32_t>& blocks = p.seq->blocks;  // a fresh sequence's is empty
    const size_t needed = blocks.size() + static_cast<size_t>(p.hit_blocks + p.new_blocks);
    if (needed > blocks.capacity()) blocks.reserve(std::max(needed, 2 * blocks.capacity()));
  }
  batch.copies_.reserve(copies);
  // Events of phase 3: a BlockRemoved per eviction (at most one per allocation) and per
  // unpublished block (at most one per request).
  pool_.ReserveEvents(demand.needed + static_cast<int64_t>(requests.size()));
  // Last: the batch's reshape (all or nothing itself), so that a reserve above that throws leaves
  // the batch as it was too.
  batch.Reshape(static_cast<int32_t>(requests.size()), padded_requests,
                static_cast<int32_t>(total_tokens), padded_tokens, demand.width);
  ++schedule_calls_;

  // Phase 3: hits, then window releases (so their blocks serve this batch), then copies and
  // allocations, then the batch.
  TakePrefixHits();
  if (options_.sliding_window > 0) ReleaseWindowBlocks();
  WriteBatch(requests, demand.width, batch);
  return result;
}

int64_t KVCacheManager::ValidateRequests(std::span<const StepRequest> requests,
                                         const ScheduleOptions& options) {
  constexpr const char* kWhere = "Schedule";
  if (options.pad_tokens_to < 0) {
    throw InvalidArgument(kWhere, "options.pad_tokens_to", options.pad_tokens_to, ">= 0");
  }
  if (options.pad_requests_to < 0) {
    throw InvalidArgument(kWhere, "options.pad_requests_to", options.pad_requests_to, ">= 0");
  }
  if (options.block_table_width < 0) {
    throw InvalidArgument(kWhere, "options.block_table_width", options.block_table_width, ">= 0");
  }
  if (requests.size() > static_cast<size_t>(kMaxPositions)) {
    throw InvalidArgument(kWhere, "requests.size()", requests.size(),
                          fmt::format("at most {}", kMaxPositions));
  }
  if (++epoch_ == 0) {  // wrapped: forget every old mark
    std::fill(block_mark_.begin(), block_mark_.end(), 0u);
    for (Sequence& s : sequences_) s.batch_mark = 0;
    epoch_ = 1;
  }

  plans_.resize(requests.size());
  int64_t total_tokens = 0;
  constexpr size_t kAhead = 8;  // prefetch distance, in requests
  for (size_t i = 0; i < requests.size(); ++i) {
    const StepRequest& r = requests[i];
    if (i + kAhead < requests.size()) {
      const uint64_t slot = static_cast<uint64_t>(requests[i + kAhead].seq) & 0xffffffffu;
      if (slot < sequences_.size()) __builtin_prefetch(&sequences_[slot]);
    }
    Sequence& s = Live(kWhere, r.seq);
    if (r.num_new_tokens < 0) {
      throw InvalidArgument(kWhere,
                            fmt::format("requests[{}].num_new_tokens (sequence {})", i, r.seq),
                            r.num_new_tokens, ">= 0");
    }
    if (r.num_lookahead < 0) {
      throw InvalidArgument(kWhere,
                            fmt::format("requests[{}].num_lookahead (sequence {})", i, r.seq),
                            r.num_lookahead, ">= 0");
    }
    if (s.batch_mark == epoch_) {
      throw Error(
          fmt::format("{}: sequence {} appears more than once in the batch (again at "
                      "requests[{}])",
                      kWhere, r.seq, i));
    }
    s.batch_mark = epoch_;
    // Phase 3 reads the table's last entries (slots, new row entries): start that cache miss now,
    // so the misses of a 256-request batch overlap instead of queueing.
    if (!s.blocks.empty()) __builtin_prefetch(&s.blocks.back());
    total_tokens += r.num_new_tokens;
    plans_[i] = Plan{};
    plans_[i].seq = &s;
  }
  if (total_tokens > kMaxPositions) {
    throw InvalidArgument(kWhere, "total num_new_tokens", total_tokens,
                          fmt::format("at most {}", kMaxPositions));
  }
  return total_tokens;
}

// Hit blocks are marked so that they count once, are not counted as available, and make a
// partially filled block they also appear in count as shared.
int64_t KVCacheManager::PlanPrefixHits() {
  const int32_t bs = block_size_;
  hit_blocks_.clear();
  int64_t pinned = 0;
  for (Plan& p : plans_) {
    const Sequence& s = *p.seq;
    // Fresh: nothing scheduled and no lookahead reservation; its prefix comes from the cache.
    p.fresh = s.num_scheduled == 0 && s.blocks.empty();
    if (!p.fresh) {
      p.start = s.num_scheduled;
      continue;
    }
    p.hit_offset = static_cast<int32_t>(hit_blocks_.size());
    p.hit_blocks = MatchPrefix(s);
    p.start = static_cast<int64_t>(p.hit_blocks) * bs;
    const int32_t first_kept = FirstKeptBlock(s, p.start);
    for (int32_t j = 0; j < p.hit_blocks; ++j) {
      const int32_t b = pool_.FindCached(s.token_hashes[static_cast<size_t>(j)]);
      hit_blocks_.push_back(b);
      if (j < first_kept || block_mark_[b] == epoch_) continue;
      block_mark_[b] = epoch_;
      if (pool_.block(b).state == BlockState::kEvictable) ++pinned;
    }
  }
  return pinned;
}

KVCacheManager::BlockDemand KVCacheManager::PlanBlocks(std::span<const StepRequest> requests,
                                                       const ScheduleOptions& options) {
  constexpr const char* kWhere = "Schedule";
  const int32_t window = options_.sliding_window;
  const int32_t usable = pool_.num_usable();
  BlockDemand demand;
  demand.width = std::max<int32_t>(options.block_table_width, 1);
  cow_writers_.clear();
  for (size_t i = 0; i < requests.size(); ++i) {
    Plan& p = plans_[i];
    const Sequence& s = *p.seq;
    const StepRequest& r = requests[i];
    const bool fresh = p.fresh;
    const int64_t end = p.start + r.num_new_tokens + r.num_lookahead;
    if (end > kMaxPositions) {
      throw InvalidArgument(kWhere,
                            fmt::format("end position of requests[{}] (sequence {})", i, r.seq),
                            end, fmt::format("at most {}", kMaxPositions));
    }
    const int32_t current = fresh ? p.hit_blocks : static_cast<int32_t>(s.blocks.size());
    p.table_len = std::max<int32_t>(current, static_cast<int32_t>(BlocksFor(end)));
    p.new_blocks = p.table_len - current;
    p.release_to = fresh ? 0 : s.num_released;
    if (window > 0) {
      p.release_to = std::max<int32_t>(p.release_to, FirstKeptBlock(s, p.start));
      if (!fresh) {
        for (int32_t j = s.num_released; j < p.release_to; ++j) {
          const int32_t b = s.blocks[static_cast<size_t>(j)];
          if (pool_.block(b).ref_count == 1 && block_mark_[b] != epoch_) ++demand.reclaimable;
        }
      }
    }
    // Copy-on-write: only a partially filled block can hold positions of others; fresh
    // sequences start on a block boundary.
    if (r.num_new_tokens + r.num_lookahead > 0 && s.tail_may_be_shared && OffsetOf(p.start) != 0) {
      const int32_t b = s.blocks[static_cast<size_t>(BlockOf(p.start))];
      const bool shared = pool_.block(b).ref_count > 1 || block_mark_[b] == epoch_;
      p.cow = shared;
      p.unpublish = !shared && pool_.block(b).hashed;
      if (shared) cow_writers_.emplace_back(b, static_cast<int32_t>(i));
    }
    demand.needed += p.new_blocks + (p.cow ? 1 : 0);
    if (p.table_len - p.release_to > usable) demand.never_fits = true;
    demand.width = std::max(demand.width, p.table_len);
  }
  demand.needed -= KeepLastWriters();
  return demand;
}

// When every holder of a shared partial block writes into it in this batch (forks decoding side
// by side), the writers before the last copy it away, and the last finds it its own: one copy
// fewer than writers. Returns the copies saved.
int32_t KVCacheManager::KeepLastWriters() {
  if (cow_writers_.size() < 2) return 0;
  std::sort(cow_writers_.begin(), cow_writers_.end());
  int32_t saved = 0;
  for (size_t first = 0; first < cow_writers_.size();) {
    const int32_t b = cow_writers_[first].first;
    size_t last = first;
    while (last + 1 < cow_writers_.size() && cow_writers_[last + 1].first == b) ++last;
    const BlockMeta& block = pool_.block(b);
    // A prefix hit of this batch is one more holder, and it does not write.
    if (static_cast<size_t>(block.ref_count) == last - first + 1 && block_mark_[b] != epoch_) {
      Plan& keeper = plans_[static_cast<size_t>(cow_writers_[last].second)];
      keeper.cow = false;
      keeper.keeper = true;
      keeper.unpublish = block.hashed;
      ++saved;
    }
    first = last + 1;
  }
  return saved;
}

void KVCacheManager::Reject(std::span<const StepRequest> requests, int64_t available,
                            ScheduleResult& result) {
  ++schedule_rejections_;
  const int32_t usable = pool_.num_usable();
  result.blocks_missing = std::max<int64_t>(0, result.blocks_needed - available);
  int64_t remaining = available;
  std::vector<int32_t> copied_blocks_rejected;  // shared blocks of writers that did not fit
  // The shared block a copy-on-write plan writes (nothing has changed yet).
  auto shared_block = [&](const Plan& p) {
    return p.seq->blocks[static_cast<size_t>(BlockOf(p.start))];
  };
  for (size_t i = 0; i < requests.size(); ++i) {
    const Plan& p = plans_[i];
    ScheduleRejection rej;
    rej.request_index = static_cast<int32_t>(i);
    rej.seq = requests[i].seq;
    // A keeper copies after all when a co-writer before it is not admitted (it still holds it).
    const bool copies =
        p.cow ||
        (p.keeper && std::find(copied_blocks_rejected.begin(), copied_blocks_rejected.end(),
                               shared_block(p)) != copied_blocks_rejected.end());
    rej.blocks_needed = p.new_blocks + (copies ? 1 : 0);
    if (p.table_len - p.release_to > usable) {
      rej.never_fits = true;
      rej.blocks_missing = p.table_len - p.release_to - usable;
    } else if (rej.blocks_needed <= remaining) {
      remaining -= rej.blocks_needed;
      continue;
    } else {
      rej.blocks_missing = rej.blocks_needed - remaining;
    }
    if (p.cow) copied_blocks_rejected.push_back(shared_block(p));
    result.rejected.push_back(rej);
  }
}

void KVCacheManager::TakePrefixHits() {
  for (Plan& p : plans_) {
    Sequence& s = *p.seq;
    if (!p.fresh) continue;
    const int32_t first_kept = FirstKeptBlock(s, p.start);
    // Counted once, at the schedule that ends the sequence's fresh state (gives it a table): a
    // schedule of no tokens and no hit leaves it fresh, and its next one counts it.
    if (options_.enable_prefix_caching && p.table_len > 0) {
      prefix_query_tokens_ += static_cast<int64_t>(s.tokens.size());
      prefix_hit_tokens_ += p.start;
    }
    for (int32_t j = 0; j < p.hit_blocks; ++j) {
      if (j < first_kept) {
        s.blocks.push_back(kNullBlock);
      } else {
        const int32_t b = hit_blocks_[static_cast<size_t>(p.hit_offset + j)];
        pool_.Acquire(b, s.priority);
        s.blocks.push_back(b);
      }
    }
    s.num_released = std::min(first_kept, p.hit_blocks);
    s.num_cached_blocks = p.hit_blocks;
  }
}

void KVCacheManager::ReleaseWindowBlocks() {
  for (Plan& p : plans_) {
    Sequence& s = *p.seq;
    if (p.release_to > s.num_released) ++s.table_epoch;
    for (int32_t j = s.num_released; j < p.release_to; ++j) {
      int32_t& entry = s.blocks[static_cast<size_t>(j)];
      if (entry != kNullBlock) pool_.Release(entry);
      entry = kNullBlock;
    }
    s.num_released = std::max(s.num_released, p.release_to);
  }
}

void KVCacheManager::WriteBatch(std::span<const StepRequest> requests, int32_t width,
                                StepBatch& batch) {
  const int32_t bs = block_size_;
  // Schedule reshaped the batch to these.
  const int32_t padded_requests = batch.padded_num_requests();
  const int32_t padded_tokens = batch.padded_num_tokens();
  int64_t* slots = batch.MutableSection<int64_t>(batch.layout_.slot_mapping);
  int32_t* tables = batch.MutableSection<int32_t>(batch.layout_.block_tables);
  int32_t* seq_lens = batch.MutableSection<int32_t>(batch.layout_.seq_lens);
  int32_t* query_start = batch.MutableSection<int32_t>(batch.layout_.query_start_loc);

  int64_t t = 0;
  query_start[0] = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    Plan& p = plans_[i];
    Sequence& s = *p.seq;
    const StepRequest& r = requests[i];
    batch.prefix_hit_tokens_[i] = p.fresh ? static_cast<int32_t>(p.start) : 0;
    if (p.cow || p.unpublish) {
      int32_t& entry = s.blocks[static_cast<size_t>(BlockOf(p.start))];
      // A planned copy can turn out unneeded: a co-holder's sliding window released the block
      // earlier in this phase (KeepLastWriters planned only for co-writers).
      if (p.cow && pool_.block(entry).ref_count == 1) {
        p.cow = false;
        p.unpublish = pool_.block(entry).hashed;
      }
      if (p.cow) {
        const int32_t fresh_block = pool_.Allocate(s.priority);
        batch.copies_.push_back(BlockCopy{entry, fresh_block});
        pool_.Release(entry);  // still held by the sequences that share it
        entry = fresh_block;
        ++s.table_epoch;
        ++cow_copies_;
        ++blocks_allocated_;
      } else if (p.unpublish) {
        pool_.Unregister(entry);
      }
    }
    // The block holding the next position is now ours alone: it was copied, unpublished, was
    // exclusive already, or is newly allocated.
    if (r.num_new_tokens + r.num_lookahead > 0) s.tail_may_be_shared = false;
    for (int32_t j = 0; j < p.new_blocks; ++j) s.blocks.push_back(pool_.Allocate(s.priority));
    blocks_allocated_ += p.new_blocks;

    // Slots, one block-sized run at a time.
    const int64_t end = p.start + r.num_new_tokens;
    for (int64_t pos = p.start; pos < end;) {
      const int64_t offset = OffsetOf(pos);
      const int64_t run = std::min<int64_t>(bs - offset, end - pos);
      const int64_t base = int64_t{s.blocks[static_cast<size_t>(BlockOf(pos))]} * bs + offset;
      for (int64_t k = 0; k < run; ++k) slots[t++] = base + k;
      pos += run;
    }
    int32_t* row = tables + i * static_cast<size_t>(width);
    StepBatch::RowState& written = batch.rows_[i];
    const int32_t length = static_cast<int32_t>(s.blocks.size());
    if (written.owner == instance_id_ && written.seq == r.seq &&
        written.table_epoch == s.table_epoch && written.length <= length) {
      // Same sequence, table only appended to: the row holds the old entries and nulls after.
      // std::copy, not memcpy: a sequence may have no blocks yet, and memcpy from the null
      // data() of an empty vector is undefined even for 0 bytes.
      std::copy(s.blocks.begin() + written.length, s.blocks.end(), row + written.length);
    } else {
      std::copy(s.blocks.begin(), s.blocks.end(), row);
      std::fill(row + length, row + width, kNullBlock);
    }
    written = StepBatch::RowState{instance_id_, r.seq, s.table_epoch, length};
    seq_lens[i] = static_cast<int32_t>(end);
    query_start[i + 1] = static_cast<int32_t>(t);
    s.num_scheduled = end;
  }
  std::fill(slots + t, slots + padded_tokens, int64_t{-1});
  for (int32_t i = static_cast<int32_t>(requests.size()); i < padded_requests; ++i) {
    StepBatch::RowState& written = batch.rows_[static_cast<size_t>(i)];
    if (written.owner != instance_id_ || written.seq != StepBatch::kPaddingRow) {
      std::fill(tables + static_cast<size_t>(i) * width,
                tables + static_cast<size_t>(i + 1) * width, kNullBlock);
      written = StepBatch::RowState{instance_id_, StepBatch::kPaddingRow, 0, 0};
    }
    seq_lens[i] = 0;
    query_start[i + 1] = static_cast<int32_t>(t);
  }
}

// ---------------------------------------------------------------------------------------------
// Commit, Rewind

void KVCacheManager::Commit(SeqId id, std::span<const int32_t> token_ids) {
  Sequence& s = Live("Commit", id);
  const int64_t known = static_cast<int64_t>(s.tokens.size());
  const int64_t count = static_cast<int64_t>(token_ids.size());
  // An empty commit is always allowed: a partial prefill produces no token.
  if (count > 0 && known + count > s.num_scheduled + 1) {
    throw Error(fmt::format(
        "Commit: sequence {}: committing {} tokens would make {} known tokens, but only {} "
        "positions are scheduled (at most {} more tokens can be committed now)",
        id, count, known + count, s.num_scheduled,
        std::max<int64_t>(0, s.num_scheduled + 1 - known)));
  }
  // Room for the events of the blocks this commit publishes first: an allocation that fails while
  // publishing would leave the tokens appended and some blocks registered, with the call failed.
  if (options_.enable_prefix_caching) {
    const int64_t trusted = std::min<int64_t>(s.num_scheduled, known + count - 1);
    pool_.ReserveEvents(std::max<int64_t>(0, BlockOf(trusted) - s.num_cached_blocks));
  }
  AppendTokens(s, token_ids);
  PublishTrustedBlocks(s);
}

void KVCacheManager::Rewind(SeqId id, int64_t num_positions) {
  Sequence& s = Live("Rewind", id);
  if (num_positions < 0 || num_positions > s.num_scheduled) {
    throw Error(
        fmt::format("Rewind: sequence {}: cannot rewind {} positions; {} are scheduled "
                    "(allowed: 0 to {})",
                    id, num_positions, s.num_scheduled, s.num_scheduled));
  }
  const int64_t target = s.num_scheduled - num_positions;
  if (s.num_released > 0) {
    // The next query (at `target`) reads from target - window + 1, which must not be released.
    const int64_t lowest = int64_t{s.num_released} * block_size_ + options_.sliding_window - 1;
    if (target < lowest) {
      throw Error(fmt::format(
          "Rewind: sequence {}: rewinding {} of {} positions would need positions from {}, but "
          "the sliding window of {} tokens already released the blocks before position {} "
          "(rewind at most {})",
          id, num_positions, s.num_scheduled,
          std::max<int64_t>(0, target - options_.sliding_window + 1), options_.sliding_window,
          int64_t{s.num_released} * block_size_, s.num_scheduled - lowest));
    }
  }
  s.num_scheduled = target;
  ReleaseTail(s, static_cast<size_t>(BlocksFor(target)));
  s.num_cached_blocks =
      std::min<int32_t>(s.num_cached_blocks, static_cast<int32_t>(BlockOf(target)));
  // The block now holding position `target` may be shared (Fork) or published.
  s.tail_may_be_shared = true;
}

// ---------------------------------------------------------------------------------------------
// Cache-wide operations and queries

int64_t KVCacheManager::ClearPrefixCache() {
  // Sequences keep num_cached_blocks: their blocks' KV is still trusted, only no longer shared.
  return pool_.ClearCache();
}

std::vector<KVEvent> KVCacheManager::TakeEvents() { return pool_.TakeEvents(); }

KVCacheStats KVCacheManager::Stats() const {
  KVCacheStats st;
  st.num_blocks = pool_.num_usable();
  st.blocks_in_use = pool_.num_in_use();
  st.blocks_free = pool_.num_free();
  st.blocks_evictable = pool_.num_evictable();
  st.blocks_cached = pool_.num_cached();
  st.num_sequences = num_live_;
  st.usage = static_cast<double>(st.blocks_in_use) / st.num_blocks;
  st.prefix_query_tokens = prefix_query_tokens_;
  st.prefix_hit_tokens = prefix_hit_tokens_;
  st.prefix_miss_tokens = prefix_query_tokens_ - prefix_hit_tokens_;
  st.evictions = pool_.evictions();
  st.cow_copies = cow_copies_;
  st.blocks_allocated = blocks_allocated_;
  st.schedule_calls = schedule_calls_;
  st.schedule_rejections = schedule_rejections_;
  return st;
}

SequenceInfo KVCacheManager::GetSequenceInfo(SeqId id) const {
  const Sequence& s = Live("GetSequenceInfo", id);
  SequenceInfo info;
  info.num_tokens = static_cast<int64_t>(s.tokens.size());
  info.num_scheduled = s.num_scheduled;
  info.num_cached_blocks = s.num_cached_blocks;
  info.num_table_entries = static_cast<int32_t>(s.blocks.size());
  info.num_released_blocks = s.num_released;
  info.priority = s.priority;
  return info;
}

std::span<const int32_t> KVCacheManager::BlockTable(SeqId id) const {
  return Live("BlockTable", id).blocks;
}

std::span<const int32_t> KVCacheManager::Tokens(SeqId id) const {
  return Live("Tokens", id).tokens;
}

// ---------------------------------------------------------------------------------------------
// Invariants

std::string KVCacheManager::FindInvariantViolation() const {
  const int32_t n = pool_.num_blocks();
  const int32_t bs = block_size_;
  std::vector<int32_t> refs(static_cast<size_t>(n), 0);
  int64_t live = 0;
  for (size_t slot = 0; slot < sequences_.size(); ++slot) {
    const Sequence& s = sequences_[slot];
    if (!s.live) {
      if (!s.blocks.empty()) return fmt::format("free slot {} holds blocks", slot);
      continue;
    }
    ++live;
    const SeqId id = IdOf(slot);
    const int64_t known = static_cast<int64_t>(s.tokens.size());
    if (known < 1) return fmt::format("sequence {} has no tokens", id);
    if (s.token_hashes.size() != static_cast<size_t>(known / bs)) {
      return fmt::format("sequence {}: {} block hashes for {} tokens", id, s.token_hashes.size(),
                         known);
    }
    for (size_t i = 0; i < s.token_hashes.size(); ++i) {
      const BlockHash& parent = i == 0 ? s.root : s.token_hashes[i - 1];
      const BlockHash expect =
          HashBlockTokens(parent, std::span<const int32_t>(s.tokens.data() + i * bs, bs));
      if (!(expect == s.token_hashes[i])) {
        return fmt::format("sequence {}: hash of block {} does not match its tokens", id, i);
      }
    }
    if (s.num_scheduled < 0 ||
        static_cast<int64_t>(s.blocks.size()) < CeilDiv(s.num_scheduled, bs)) {
      return fmt::format("sequence {}: {} table entries for {} scheduled positions", id,
                         s.blocks.size(), s.num_scheduled);
    }
    if (s.num_cached_blocks < 0 ||
        int64_t{s.num_cached_blocks} * bs > std::min<int64_t>(s.num_scheduled, known - 1)) {
      return fmt::format("sequence {}: {} cached blocks but {} scheduled, {} known", id,
                         s.num_cached_blocks, s.num_scheduled, known);
    }
    const int32_t window = options_.sliding_window;
    if (s.num_released < 0 || static_cast<size_t>(s.num_released) > s.blocks.size() ||
        (window == 0 && s.num_released != 0) ||
        (s.num_released > 0 && int64_t{s.num_released} * bs > s.num_scheduled - window + 1)) {
      return fmt::format("sequence {}: {} released entries, {} scheduled, window {}", id,
                         s.num_released, s.num_scheduled, window);
    }
    for (size_t i = 0; i < s.blocks.size(); ++i) {
      const int32_t b = s.blocks[i];
      const bool should_be_null = i < static_cast<size_t>(s.num_released);
      if (should_be_null != (b == kNullBlock)) {
        return fmt::format("sequence {}: entry {} is block {} ({} released entries)", id, i, b,
                           s.num_released);
      }
      if (b == kNullBlock) continue;
      if (b < 0 || b >= n) return fmt::format("sequence {}: entry {} = {} out of range", id, i, b);
      ++refs[static_cast<size_t>(b)];
      const BlockMeta& m = pool_.block(b);
      if (m.state != BlockState::kInUse) {
        return fmt::format("sequence {}: entry {} = block {} is {}", id, i, b,
                           BlockStateName(m.state));
      }
      // A trusted block that is published carries the hash of this sequence's tokens. (Past the
      // trusted blocks a published block may hold KV of a sharer's accepted drafts that this
      // sequence rejected: it is copied or unpublished before this sequence writes into it.)
      if (m.hashed && i < static_cast<size_t>(s.num_cached_blocks) &&
          !(m.hash == s.token_hashes[i])) {
        return fmt::format("sequence {}: entry {} = block {} carries a hash of other tokens", id, i,
                           b);
      }
      // The flag that lets Schedule skip the copy-on-write check must not lie.
      if (!s.tail_may_be_shared && static_cast<int64_t>(i) == s.num_scheduled / bs &&
          s.num_scheduled % bs != 0 && (m.ref_count != 1 || m.hashed)) {
        return fmt::format("sequence {}: tail entry {} = block {} has ref {}{} but is not flagged",
                           id, i, b, m.ref_count, m.hashed ? " and a hash" : "");
      }
      // Lookahead reservations are this sequence's alone and unpublished.
      if (static_cast<int64_t>(i) >= CeilDiv(s.num_scheduled, bs) &&
          (m.ref_count != 1 || m.hashed)) {
        return fmt::format("sequence {}: reserved entry {} = block {} has ref {}{}", id, i, b,
                           m.ref_count, m.hashed ? " and a hash" : "");
      }
      if (m.priority < s.priority) {
        return fmt::format("sequence {}: block {} has priority {} < the sequence's {}", id, b,
                           m.priority, s.priority);
      }
    }
  }
  if (live != num_live_) return fmt::format("{} live sequences but count {}", live, num_live_);
  for (const uint32_t slot : free_slots_) {
    if (slot >= sequences_.size() || sequences_[slot].live) {
      return fmt::format("free slot list holds live or bad slot {}", slot);
    }
  }
  if (free_slots_.size() + static_cast<size_t>(num_live_) != sequences_.size()) {
    return fmt::format("{} free slots + {} live != {} slots", free_slots_.size(), num_live_,
                       sequences_.size());
  }
  return pool_.FindInvariantViolation(refs);
}

void KVCacheManager::CheckInvariants() const {
  const std::string violation = FindInvariantViolation();
  if (!violation.empty()) {
    detail::CheckFailed("KVCacheManager::CheckInvariants()", violation, __FILE__, __LINE__);
  }
}

std::string KVCacheManager::DebugString() const {
  std::string out =
      fmt::format("pool: {} blocks, {} free, {} evictable, {} cached\n", pool_.num_blocks(),
                  pool_.num_free(), pool_.num_evictable(), pool_.num_cached());
  for (int32_t b = 0; b < pool_.num_blocks(); ++b) {
    const BlockMeta& m = pool_.block(b);
    out += fmt::format("  block {}: {} ref {} prio {} prev {} next {}{}\n", b,
                       BlockStateName(m.state), m.ref_count, m.priority, m.prev, m.next,
                       m.hashed ? " hash " + ToHex(m.hash) : "");
  }
  for (size_t slot = 0; slot < sequences_.size(); ++slot) {
    const Sequence& s = sequences_[slot];
    if (!s.live) {
      out += fmt::format("slot {}: free, generation {}\n", slot, s.generation);
      continue;
    }
    out += fmt::format(
        "seq {}: prio {} tokens {} scheduled {} cached_blocks {} released {} root {}\n"
        "  tokens [{}]\n  table [{}]\n",
        IdOf(slot), s.priority, s.tokens.size(), s.num_scheduled, s.num_cached_blocks,
        s.num_released, ToHex(s.root), fmt::join(s.tokens, " "), fmt::join(s.blocks, " "));
  }
  // Not the call counters: a rejected Schedule changes them and nothing else.
  out += fmt::format("counters: query {} hit {} cow {} allocated {} evictions {}\n",
                     prefix_query_tokens_, prefix_hit_tokens_, cow_copies_, blocks_allocated_,
                     pool_.evictions());
  return out;
}

}  // namespace tqkv
