// Property tests: long random sequences of AddSequence / Schedule / Commit / Rewind / Fork / Free
// (and invalid calls) against a small model, with CheckInvariants after every step.
//
// The model is deliberately simple: per sequence, its known tokens, the token at every scheduled
// position (known or draft), its block-table length and released count, each computed from the
// operations alone. A fake device (one 64-bit "KV" per slot) is written through the slot
// mapping and copied through the copy lists exactly as an engine would; the KV of position p is
// an id of the token prefix [0, p] (KV depends on the whole prefix). After every step every live
// sequence must read, through its block table, exactly its own prefix ids. That one check
// covers slot mapping, copy-on-write, prefix-cache hits (a hit must bring the right bytes),
// eviction (an evicted block must never be read again), rewind and the sliding window.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "kvcache/manager.h"
#include "runtime/error.h"

namespace tqkv {
namespace {

struct Config {
  bool prefix_caching = true;
  int32_t window = 0;
};

using Action = std::tuple<int, int, int, int, int, int>;

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h *= 0xff51afd7ed558ccdULL;
  return h ^ (h >> 33);
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct ModelSeq {
  SeqId id = -1;
  std::string extra_key;
  int priority = kDefaultPriority;
  std::vector<int32_t> tokens;   // known tokens
  std::vector<int32_t> content;  // token whose KV sits at each scheduled position
  int64_t table_len = 0;         // block-table entries
  int64_t released = 0;          // leading null entries

  int64_t scheduled() const { return static_cast<int64_t>(content.size()); }
  bool fresh() const { return content.empty() && table_len == 0; }
  // The KV id of every scheduled position.
  std::vector<uint64_t> PrefixIds() const {
    std::vector<uint64_t> ids;
    uint64_t h = std::hash<std::string>{}(extra_key) | 1;
    for (int32_t t : content) ids.push_back(h = Mix(h, static_cast<uint64_t>(t) + 1));
    return ids;
  }
};

class Harness {
 public:
  Harness(const Config& config, int32_t num_blocks, int32_t block_size)
      : config_(config),
        bs_(block_size),
        m_(MakeOptions(config, num_blocks, block_size)),
        device_(static_cast<size_t>(num_blocks) * block_size, 0) {}

  // Coverage: the features a run exercised, for rapidcheck's distribution report.
  void Classify() const {
    const KVCacheStats st = m_.Stats();
    RC_CLASSIFY(st.prefix_hit_tokens > 0, "prefix hit");
    RC_CLASSIFY(st.cow_copies > 0, "copy-on-write");
    RC_CLASSIFY(st.evictions > 0, "eviction");
    RC_CLASSIFY(st.schedule_rejections > 0, "rejected batch");
    RC_CLASSIFY(admitted_ >= 20, ">= 20 admitted batches");
  }

  void Run(const std::vector<Action>& actions) {
    for (size_t i = 0; i < actions.size(); ++i) {
      step_ = i;
      const auto [kind, a, b, c, d, e] = actions[i];
      const int k = kind % 100;
      if (k < 12 || live_.empty()) {
        Add(a, b, c);
      } else if (k < 45) {
        Schedule(a, b, c, d, e);
      } else if (k < 68) {
        Commit(a, b, c, d);
      } else if (k < 76) {
        Rewind(a, b);
      } else if (k < 83) {
        Fork(a);
      } else if (k < 90) {
        Free(a);
      } else if (k < 91) {
        m_.ClearPrefixCache();
      } else {
        InvalidCall(a, b, c);
      }
      CheckAll();
    }
  }

 private:
  static KVCacheManagerOptions MakeOptions(const Config& c, int32_t n, int32_t bs) {
    KVCacheManagerOptions o;
    o.num_blocks = n;
    o.block_size = bs;
    o.format = FormatTag{"turboquant_k3v4_nc", 128, 0, 3};
    o.enable_prefix_caching = c.prefix_caching;
    o.sliding_window = c.window;
    o.record_events = true;
    return o;
  }

  ModelSeq& Pick(int a) { return live_[static_cast<size_t>(a) % live_.size()]; }

  // Tokens from a 3-letter alphabet, so prompts share prefixes (and prefix hits happen) often.
  void Add(int a, int b, int c) {
    ModelSeq s;
    const int family = a % 4;
    const int length = 1 + b % 14;
    for (int i = 0; i < length; ++i) {
      // Mostly the family's deterministic pattern, sometimes a divergent tail.
      const bool diverge = i >= (c % 16);
      s.tokens.push_back(diverge ? (a + i * 7 + c) % 3 : (family * 5 + i * (family + 1)) % 3);
    }
    s.extra_key = (c / 16) % 4 == 0 ? "salt" : "";
    s.priority = (c / 64) % (kMaxPriority + 1);
    s.id = m_.AddSequence(s.tokens, {.extra_key = s.extra_key, .priority = s.priority});
    live_.push_back(s);
  }

  void Schedule(int a, int b, int c, int d, int e) {
    const size_t want = 1 + static_cast<size_t>(b % 4);
    std::vector<size_t> picked;
    for (size_t j = 0; j < want; ++j) {
      const size_t idx =
          (static_cast<size_t>(a) + j * (1 + static_cast<size_t>(c % 3))) % live_.size();
      if (std::find(picked.begin(), picked.end(), idx) == picked.end()) picked.push_back(idx);
    }
    std::vector<StepRequest> reqs;
    std::vector<int64_t> starts;
    for (size_t j = 0; j < picked.size(); ++j) {
      ModelSeq& s = live_[picked[j]];
      const int32_t n = (d >> (3 * j)) % 7;
      const int32_t la = ((e >> (2 * j)) % 4 == 3) ? (e >> (8 + j)) % 4 : 0;
      reqs.push_back({s.id, n, la});
      starts.push_back(s.fresh() ? m_.Lookup(s.id).num_tokens : s.scheduled());
    }
    // Bounds and (without prefix caching or a window) the exact block count, from the model.
    const KVCacheStats before_stats = m_.Stats();
    int64_t growth = 0, cow_bound = 0, cow_exact = 0, hits = 0, releases = 0;
    bool never_fits = false;
    std::map<int32_t, int64_t> tail_writers;
    for (size_t j = 0; j < picked.size(); ++j) {
      const ModelSeq& s = live_[picked[j]];
      const StepRequest& r = reqs[j];
      const int64_t start = starts[j];
      const int64_t current = s.fresh() ? start / bs_ : s.table_len;
      const int64_t after =
          std::max(current, CeilDiv(start + r.num_new_tokens + r.num_lookahead, bs_));
      growth += after - current;
      if (s.fresh()) hits += start / bs_;
      const int64_t released_after = ReleasedAfter(s, start);
      releases += released_after - (s.fresh() ? 0 : s.released);
      if (after - released_after > m_.pool().num_usable()) never_fits = true;
      if (r.num_new_tokens + r.num_lookahead > 0 && start % bs_ != 0) {
        ++cow_bound;
        ++tail_writers[m_.BlockTable(s.id)[static_cast<size_t>(start / bs_)]];
      }
    }
    // Each writer of a shared tail copies it, except the last when every holder writes.
    for (const auto& [tail, writers] : tail_writers) {
      const int64_t holders = CountReferences(tail);
      if (holders > 1) cow_exact += writers == holders ? writers - 1 : writers;
    }
    const std::string before = m_.DebugString();
    const int32_t tokens_before = batch_.num_tokens();
    // Padding as a CUDA-graph engine asks for it, sometimes.
    ScheduleOptions options;
    if ((e >> 12) % 3 == 0) {
      options.pad_tokens_to = (e >> 14) % 24;
      options.pad_requests_to = (e >> 16) % 8;
      options.block_table_width = (e >> 18) % 12;
    }
    const ScheduleResult result = m_.Schedule(reqs, batch_, options);
    const int64_t available = before_stats.blocks_free + before_stats.blocks_evictable;
    if (!config_.prefix_caching && config_.window == 0) {
      RC_ASSERT(result.admitted == (!never_fits && growth + cow_exact <= available));
    }
    if (!result.admitted) {
      RC_ASSERT(m_.DebugString() == before);
      RC_ASSERT(batch_.num_tokens() == tokens_before);
      RC_ASSERT(!result.rejected.empty());
      RC_ASSERT(never_fits || growth + cow_bound > available - hits);
      RC_ASSERT(result.blocks_missing ==
                std::max<int64_t>(0, result.blocks_needed - result.blocks_available));
      // Like an engine: preempt (free) the last request that did not fit.
      const SeqId victim = result.rejected.back().seq;
      for (size_t j = 0; j < live_.size(); ++j) {
        if (live_[j].id == victim) {
          Free(static_cast<int>(j));
          break;
        }
      }
      return;
    }
    ++admitted_;
    RC_ASSERT(!never_fits);
    RC_ASSERT(growth <= available + releases);
    RC_ASSERT(result.rejected.empty());

    // The batch, request by request.
    RC_ASSERT(batch_.num_requests() == static_cast<int32_t>(reqs.size()));
    for (const BlockCopy& copy : batch_.copies()) {
      std::copy_n(device_.begin() + copy.src * bs_, bs_, device_.begin() + copy.dst * bs_);
    }
    std::vector<int64_t> written;
    int64_t t = 0;
    for (size_t j = 0; j < picked.size(); ++j) {
      ModelSeq& s = live_[picked[j]];
      const StepRequest& r = reqs[j];
      const int64_t start = starts[j];
      RC_ASSERT(batch_.query_start_loc()[j] == t);
      RC_ASSERT(batch_.seq_lens()[j] == start + r.num_new_tokens);
      RC_ASSERT(batch_.prefix_hit_tokens()[j] == (s.fresh() ? start : 0));
      if (s.fresh()) {
        // The prefix came from the cache: its tokens are known, so its content is the tokens.
        s.content.assign(s.tokens.begin(), s.tokens.begin() + start);
      }
      s.released = ReleasedAfter(s, start);
      s.table_len = std::max(s.fresh() ? start / bs_ : s.table_len,
                             CeilDiv(start + r.num_new_tokens + r.num_lookahead, bs_));
      const auto table = m_.BlockTable(s.id);
      RC_ASSERT(static_cast<int64_t>(table.size()) == s.table_len);
      for (size_t col = 0; col < static_cast<size_t>(batch_.block_table_width()); ++col) {
        RC_ASSERT(batch_.block_table(static_cast<int32_t>(j))[col] ==
                  (col < table.size() ? table[col] : kNullBlock));
      }
      for (int64_t p = start; p < start + r.num_new_tokens; ++p, ++t) {
        const int32_t token = p < static_cast<int64_t>(s.tokens.size())
                                  ? s.tokens[static_cast<size_t>(p)]
                                  : static_cast<int32_t>(Mix(step_, static_cast<uint64_t>(p)) % 3);
        s.content.push_back(token);
        const int64_t slot = batch_.slot_mapping()[static_cast<size_t>(t)];
        const int32_t block = table[static_cast<size_t>(p / bs_)];
        RC_ASSERT(slot == int64_t{block} * bs_ + p % bs_);
        RC_ASSERT(block != kNullBlock);
        // Only a block that is this sequence's alone and not published may be written.
        RC_ASSERT(m_.pool().block(block).ref_count == 1);
        RC_ASSERT(!m_.pool().block(block).hashed);
        written.push_back(slot);
      }
      // The model's KV for the new positions (the whole prefix determines it).
      const auto ids = s.PrefixIds();
      for (int64_t p = start; p < start + r.num_new_tokens; ++p) {
        device_[static_cast<size_t>(int64_t{table[static_cast<size_t>(p / bs_)]} * bs_ + p % bs_)] =
            ids[static_cast<size_t>(p)];
      }
    }
    RC_ASSERT(batch_.query_start_loc()[reqs.size()] == t);
    RC_ASSERT(batch_.num_tokens() == t);
    RC_ASSERT(batch_.padded_num_tokens() == std::max<int64_t>(t, options.pad_tokens_to));
    for (int32_t k = static_cast<int32_t>(t); k < batch_.padded_num_tokens(); ++k) {
      RC_ASSERT(batch_.slot_mapping()[static_cast<size_t>(k)] == -1);
    }
    RC_ASSERT(batch_.padded_num_requests() ==
              std::max<int32_t>(static_cast<int32_t>(reqs.size()), options.pad_requests_to));
    RC_ASSERT(batch_.block_table_width() >= options.block_table_width);
    for (int32_t row = static_cast<int32_t>(reqs.size()); row < batch_.padded_num_requests();
         ++row) {
      RC_ASSERT(batch_.seq_lens()[static_cast<size_t>(row)] == 0);
      RC_ASSERT(batch_.query_start_loc()[static_cast<size_t>(row) + 1] == t);
      for (int32_t entry : batch_.block_table(row)) RC_ASSERT(entry == kNullBlock);
    }
    std::sort(written.begin(), written.end());
    RC_ASSERT(std::adjacent_find(written.begin(), written.end()) == written.end());
  }

  // Commits as a speculative-decoding engine does: `accepted` drafts, then (maybe) a sampled
  // token; a rejected draft at the sampled token's position is rewound right away.
  void Commit(int a, int b, int c, int d) {
    ModelSeq& s = Pick(a);
    const int64_t known = static_cast<int64_t>(s.tokens.size());
    const int64_t scheduled = s.scheduled();
    if (known > scheduled) {  // a partial prefill produces no token
      m_.Commit(s.id, {});
      return;
    }
    const int64_t accepted = std::min<int64_t>(b % 4, scheduled - known);
    std::vector<int32_t> tokens(s.content.begin() + known, s.content.begin() + known + accepted);
    const bool sample = c % 4 != 0;
    const int32_t sampled = d % 3;
    if (sample) tokens.push_back(sampled);
    m_.Commit(s.id, tokens);
    s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
    const int64_t pos = known + accepted;  // the sampled token's position
    if (sample && pos < scheduled && s.content[static_cast<size_t>(pos)] != sampled) {
      DoRewind(s, scheduled - pos);
    }
  }

  void Rewind(int a, int b) {
    ModelSeq& s = Pick(a);
    const int64_t n = std::min<int64_t>(b % 6, s.scheduled());
    if (!RewindAllowed(s, n)) {
      ExpectErrorUnchanged([&] { m_.Rewind(s.id, n); });
      return;
    }
    DoRewind(s, n);
  }

  void DoRewind(ModelSeq& s, int64_t n) {
    RC_ASSERT(RewindAllowed(s, n));
    m_.Rewind(s.id, n);
    s.content.resize(static_cast<size_t>(s.scheduled() - n));
    s.table_len = CeilDiv(s.scheduled(), bs_);
  }

  bool RewindAllowed(const ModelSeq& s, int64_t n) const {
    if (n < 0 || n > s.scheduled()) return false;
    return s.released == 0 || s.scheduled() - n >= s.released * bs_ + config_.window - 1;
  }

  void Fork(int a) {
    ModelSeq child = Pick(a);
    child.id = m_.Fork(child.id);
    child.table_len = CeilDiv(child.scheduled(), bs_);
    live_.push_back(child);
  }

  void Free(int a) {
    const size_t idx = static_cast<size_t>(a) % live_.size();
    m_.Free(live_[idx].id);
    dead_.push_back(live_[idx].id);
    live_.erase(live_.begin() + static_cast<ptrdiff_t>(idx));
  }

  template <typename F>
  void ExpectErrorUnchanged(F&& f) {
    const std::string before = m_.DebugString();
    bool threw = false;
    try {
      f();
    } catch (const Error&) {
      threw = true;
    }
    RC_ASSERT(threw);
    RC_ASSERT(m_.DebugString() == before);
  }

  void InvalidCall(int a, int b, int c) {
    ModelSeq& s = Pick(a);
    switch (b % 6) {
      case 0:
        if (!dead_.empty()) {
          const SeqId id = dead_[static_cast<size_t>(c) % dead_.size()];
          switch (c % 5) {
            case 0:
              ExpectErrorUnchanged([&] { m_.Free(id); });
              break;
            case 1:
              ExpectErrorUnchanged([&] { m_.Commit(id, {}); });
              break;
            case 2:
              ExpectErrorUnchanged([&] { m_.Rewind(id, 0); });
              break;
            case 3:
              ExpectErrorUnchanged([&] { m_.Fork(id); });
              break;
            default: {
              const StepRequest reqs[] = {{s.id, 1, 0}, {id, 1, 0}};
              ExpectErrorUnchanged([&] { m_.Schedule(reqs, batch_); });
            }
          }
        }
        break;
      case 1: {  // one token more than the scheduled positions allow
        const int64_t count =
            std::max<int64_t>(1, s.scheduled() + 2 - static_cast<int64_t>(s.tokens.size()));
        const std::vector<int32_t> tokens(static_cast<size_t>(count), 0);
        ExpectErrorUnchanged([&] { m_.Commit(s.id, tokens); });
        break;
      }
      case 2:
        ExpectErrorUnchanged([&] { m_.Rewind(s.id, s.scheduled() + 1 + c % 3); });
        break;
      case 3: {
        const StepRequest reqs[] = {{s.id, 1, 0}, {s.id, 1, 0}};
        ExpectErrorUnchanged([&] { m_.Schedule(reqs, batch_); });
        break;
      }
      case 4: {
        const StepRequest reqs[] = {{s.id, -1 - c % 3, 0}};
        ExpectErrorUnchanged([&] { m_.Schedule(reqs, batch_); });
        break;
      }
      default:
        ExpectErrorUnchanged([&] { m_.Free(SeqId{1} << 40); });
    }
  }

  int64_t ReleasedAfter(const ModelSeq& s, int64_t start) const {
    if (config_.window == 0) return 0;
    // Never past the last known token: positions after it may be drafts a Rewind returns to.
    const int64_t anchor = std::min<int64_t>(start, static_cast<int64_t>(s.tokens.size()) - 1);
    const int64_t first_needed = std::max<int64_t>(0, anchor - config_.window + 1);
    return std::max(s.fresh() ? 0 : s.released, first_needed / bs_);
  }

  int CountReferences(int32_t block) const {
    int count = 0;
    for (const ModelSeq& s : live_) {
      for (int32_t b : m_.BlockTable(s.id)) count += b == block;
    }
    return count;
  }

  void CheckAll() {
    const std::string violation = m_.FindInvariantViolation();
    RC_ASSERT(violation == "");
    const KVCacheStats st = m_.Stats();
    RC_ASSERT(st.num_sequences == static_cast<int64_t>(live_.size()));
    RC_ASSERT(st.blocks_in_use + st.blocks_free + st.blocks_evictable == st.num_blocks);
    for (const ModelSeq& s : live_) {
      const SequenceInfo info = m_.GetSequenceInfo(s.id);
      RC_ASSERT(info.num_tokens == static_cast<int64_t>(s.tokens.size()));
      RC_ASSERT(info.num_scheduled == s.scheduled());
      RC_ASSERT(info.num_table_entries == s.table_len);
      RC_ASSERT(info.num_released_blocks == s.released);
      const auto tokens = m_.Tokens(s.id);
      RC_ASSERT(std::equal(tokens.begin(), tokens.end(), s.tokens.begin(), s.tokens.end()));
      // Every scheduled position inside the window reads this sequence's own KV.
      const auto table = m_.BlockTable(s.id);
      const auto ids = s.PrefixIds();
      for (int64_t p = 0; p < s.scheduled(); ++p) {
        const int32_t block = table[static_cast<size_t>(p / bs_)];
        if (p < s.released * bs_) {
          RC_ASSERT(block == kNullBlock);
          continue;
        }
        RC_ASSERT(device_[static_cast<size_t>(int64_t{block} * bs_ + p % bs_)] ==
                  ids[static_cast<size_t>(p)]);
      }
    }
  }

  Config config_;
  int32_t bs_;
  KVCacheManager m_;
  std::vector<uint64_t> device_;  // [num_blocks * block_size]: the KV id in each slot
  std::vector<ModelSeq> live_;
  std::vector<SeqId> dead_;
  StepBatch batch_;
  uint64_t step_ = 0;
  int admitted_ = 0;
};

// 500 cases per property unless RC_PARAMS says otherwise (set before rapidcheck reads it).
const bool kDefaultParams = [] {
  setenv("RC_PARAMS", "max_success=500", /*overwrite=*/0);
  return true;
}();

rc::Gen<std::vector<Action>> Actions() {
  // Shrinking removes actions but leaves their numbers alone: shrinking each of 6 numbers of up to
  // 300 actions took longer than the test timeout.
  const auto any = rc::gen::noShrink(rc::gen::inRange(0, 1 << 20));
  // Up to 300 actions; the length shrinks (by removing actions) on failure.
  return rc::gen::resize(
      300, rc::gen::container<std::vector<Action>>(rc::gen::tuple(any, any, any, any, any, any)));
}

RC_GTEST_PROP(ManagerProperty, PrefixCachingForkCowEvictionAgreeWithTheModel, ()) {
  const int32_t block_size = *rc::gen::inRange(1, 5);
  const int32_t num_blocks = *rc::gen::inRange(2, 64);
  Harness h(Config{true, 0}, num_blocks, block_size);
  h.Run(*Actions());
  h.Classify();
}

RC_GTEST_PROP(ManagerProperty, WithoutPrefixCachingAdmissionIsExact, ()) {
  const int32_t block_size = *rc::gen::inRange(1, 5);
  const int32_t num_blocks = *rc::gen::inRange(2, 64);
  Harness h(Config{false, 0}, num_blocks, block_size);
  h.Run(*Actions());
  h.Classify();
}

RC_GTEST_PROP(ManagerProperty, SlidingWindowAgreesWithTheModel, ()) {
  const int32_t block_size = *rc::gen::inRange(1, 5);
  const int32_t num_blocks = *rc::gen::inRange(2, 64);
  const int32_t window = *rc::gen::inRange(1, 13);
  Harness h(Config{*rc::gen::arbitrary<bool>(), window}, num_blocks, block_size);
  h.Run(*Actions());
  h.Classify();
}

}  // namespace
}  // namespace tqkv
