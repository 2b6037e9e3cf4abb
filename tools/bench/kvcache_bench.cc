// Host-side cost of KVCacheManager: the per-step Schedule for 256 decoding sequences, prefix
// lookup of a 32k-token prompt, Fork/Free. Targets on the 2-core dev machine: <= 20 us per
// 256-sequence decode step, <= 100 us per 32k-token lookup (PERFORMANCE.md; README.md has the results).
#include <benchmark/benchmark.h>
#include <time.h>

#include <numeric>
#include <vector>

#include "kvcache/manager.h"

namespace tqkv {
namespace {

constexpr int32_t kBlockSize = 16;

// This thread's CPU time in seconds. The manual timings use it rather than the wall clock: on the
// shared 2-core machine another process preempting us would otherwise count as our cost.
double ThreadSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

KVCacheManagerOptions Options(int32_t num_blocks) {
  KVCacheManagerOptions o;
  o.num_blocks = num_blocks;
  o.block_size = kBlockSize;
  o.format = FormatTag{"turboquant_4bit_nc", 128, 0, 1};
  return o;
}

std::vector<int32_t> Prompt(int64_t length, int32_t salt) {
  std::vector<int32_t> p(static_cast<size_t>(length));
  std::iota(p.begin(), p.end(), salt * 100003);
  return p;
}

// 256 sequences decoding one token per step. Sequence i's length is congruent to i mod 16, so
// every step exactly 16 of them (1 in 16) write the first position of a new block. A sequence
// that has decoded its quota (256 + 16 * (i % 17) tokens, a multiple of 16, so the phase holds) is
// freed and its prompt re-added and prefilled outside the timed region, as a new request would be;
// its cached prompt blocks are hit.
class DecodeScenario {
 public:
  static constexpr int kSeqs = 256;

  // The block-table width is fixed at max_model_len / block_size (context + 1024 tokens), as a
  // CUDA-graph engine fixes it.
  explicit DecodeScenario(int64_t context) : m_(Options(131072)), context_(context) {
    options_.block_table_width = static_cast<int32_t>((context + 1024) / kBlockSize);
    for (int i = 0; i < kSeqs; ++i) {
      prompts_.push_back(Prompt(context + i % kBlockSize, i));
      seqs_.push_back(0);
      Start(i);
    }
    reqs_.resize(kSeqs);
    for (int i = 0; i < kSeqs; ++i)
      reqs_[static_cast<size_t>(i)] = {seqs_[static_cast<size_t>(i)], 1, 0};
  }

  // One timed Schedule; returns its seconds. Commits and replacements are not timed.
  double TimedSchedule() {
    const double t0 = ThreadSeconds();
    const ScheduleResult r = m_.Schedule(reqs_, batch_, options_);
    const double t1 = ThreadSeconds();
    if (!r.admitted) std::abort();
    crossings_ += CountCrossings();
    ++steps_;
    return t1 - t0;
  }

  // Schedule plus the 256 Commits: the manager's whole cost of a decode step.
  double TimedStep() {
    const double t0 = ThreadSeconds();
    const ScheduleResult r = m_.Schedule(reqs_, batch_, options_);
    for (int i = 0; i < kSeqs; ++i) {
      token_[0] = static_cast<int32_t>(steps_);
      m_.Commit(seqs_[static_cast<size_t>(i)], token_);
    }
    const double t1 = ThreadSeconds();
    if (!r.admitted) std::abort();
    ++steps_;
    Replace();
    return t1 - t0;
  }

  void CommitAndReplace() {
    for (int i = 0; i < kSeqs; ++i) {
      token_[0] = static_cast<int32_t>(steps_);
      m_.Commit(seqs_[static_cast<size_t>(i)], token_);
    }
    Replace();
  }

  double crossings_per_step() const { return static_cast<double>(crossings_) / steps_; }
  int32_t width() const { return batch_.block_table_width(); }

 private:
  void Start(int i) {
    const size_t k = static_cast<size_t>(i);
    seqs_[k] = m_.AddSequence(prompts_[k]);
    const StepRequest prefill{seqs_[k],
                              static_cast<int32_t>(prompts_[k].size()) -
                                  static_cast<int32_t>(m_.Lookup(seqs_[k]).num_tokens),
                              0};
    StepBatch b;
    if (!m_.Schedule({&prefill, 1}, b).admitted) std::abort();
    token_[0] = 1;
    m_.Commit(seqs_[k], token_);
  }

  void Replace() {
    for (int i = 0; i < kSeqs; ++i) {
      const size_t k = static_cast<size_t>(i);
      const int64_t decoded =
          m_.GetSequenceInfo(seqs_[k]).num_tokens - 1 - static_cast<int64_t>(prompts_[k].size());
      if (decoded >= 256 + kBlockSize * (i % 17)) {
        m_.Free(seqs_[k]);
        Start(i);
        reqs_[k].seq = seqs_[k];
      }
    }
  }

  int CountCrossings() const {
    int n = 0;
    for (int64_t slot : batch_.slot_mapping()) n += slot % kBlockSize == 0;
    return n;
  }

  KVCacheManager m_;
  int64_t context_;
  std::vector<std::vector<int32_t>> prompts_;
  std::vector<SeqId> seqs_;
  std::vector<StepRequest> reqs_;
  StepBatch batch_;
  ScheduleOptions options_;
  std::vector<int32_t> token_ = std::vector<int32_t>(1);
  int64_t steps_ = 0;
  int64_t crossings_ = 0;
};

// Schedule alone, 256 decode requests.
void BM_ScheduleDecode256(benchmark::State& state) {
  DecodeScenario s(state.range(0));
  for (auto _ : state) {
    state.SetIterationTime(s.TimedSchedule());
    s.CommitAndReplace();
  }
  state.counters["new_blocks/step"] = s.crossings_per_step();
  state.counters["table_width"] = s.width();
}
BENCHMARK(BM_ScheduleDecode256)
    ->Arg(1024)
    ->Arg(4096)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

// Schedule + 256 Commits (block hashing included): everything the manager does per decode step.
void BM_DecodeStep256(benchmark::State& state) {
  DecodeScenario s(state.range(0));
  for (auto _ : state) state.SetIterationTime(s.TimedStep());
}
BENCHMARK(BM_DecodeStep256)->Arg(1024)->Arg(4096)->UseManualTime()->Unit(benchmark::kMicrosecond);

// A 32,768-token prompt whose blocks are all cached (published by an earlier request).
struct CachedPrompt {
  static constexpr int64_t kTokens = 32768;
  KVCacheManager m{Options(4096)};
  std::vector<int32_t> prompt = Prompt(kTokens, 7);

  CachedPrompt() {
    const SeqId s = m.AddSequence(prompt);
    const StepRequest r{s, static_cast<int32_t>(kTokens), 0};
    StepBatch b;
    if (!m.Schedule({&r, 1}, b).admitted) std::abort();
    m.Commit(s, std::vector<int32_t>{1});
    m.Free(s);
  }
};

// Lookup alone (the prompt's block hashes were computed by AddSequence).
void BM_Lookup32k(benchmark::State& state) {
  CachedPrompt c;
  const SeqId s = c.m.AddSequence(c.prompt);
  int64_t hit = 0;
  for (auto _ : state) {
    hit = c.m.Lookup(s).num_tokens;
    benchmark::DoNotOptimize(hit);
  }
  state.counters["hit_tokens"] = static_cast<double>(hit);
  state.SetItemsProcessed(state.iterations() * CachedPrompt::kTokens);
}
BENCHMARK(BM_Lookup32k)->Unit(benchmark::kMicrosecond);

// AddSequence (hashes 2048 blocks) + Lookup + Free: the full cost of a new 32k request's lookup.
void BM_AddLookupFree32k(benchmark::State& state) {
  CachedPrompt c;
  for (auto _ : state) {
    const SeqId s = c.m.AddSequence(c.prompt);
    benchmark::DoNotOptimize(c.m.Lookup(s).num_tokens);
    c.m.Free(s);
  }
  state.SetItemsProcessed(state.iterations() * CachedPrompt::kTokens);
}
BENCHMARK(BM_AddLookupFree32k)->Unit(benchmark::kMicrosecond);

// AddSequence + first Schedule (takes 2047 cached blocks, computes 16 tokens) + Free.
void BM_PrefillFromCache32k(benchmark::State& state) {
  CachedPrompt c;
  StepBatch b;
  for (auto _ : state) {
    const SeqId s = c.m.AddSequence(c.prompt);
    const StepRequest r{s, 16, 0};
    if (!c.m.Schedule({&r, 1}, b).admitted) std::abort();
    c.m.Free(s);
  }
  state.SetItemsProcessed(state.iterations() * CachedPrompt::kTokens);
}
BENCHMARK(BM_PrefillFromCache32k)->Unit(benchmark::kMicrosecond);

// Fork of a sequence holding range(0) tokens, then Free of the child.
void BM_ForkFree(benchmark::State& state) {
  KVCacheManager m(Options(4096));
  const int64_t tokens = state.range(0);
  const SeqId parent = m.AddSequence(Prompt(tokens, 3));
  const StepRequest r{parent, static_cast<int32_t>(tokens), 0};
  StepBatch b;
  if (!m.Schedule({&r, 1}, b).admitted) std::abort();
  m.Commit(parent, std::vector<int32_t>{1});
  for (auto _ : state) {
    const SeqId child = m.Fork(parent);
    m.Free(child);
  }
}
BENCHMARK(BM_ForkFree)->Arg(1024)->Arg(32768)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace tqkv
