// "No heap allocation per step in the steady state", measured: this binary replaces the global
// operator new and counts calls while a flag is set.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <numeric>
#include <vector>

#include "kvcache/manager.h"

// The replacements below pair malloc with free; GCC cannot see that operator new is replaced too.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_allocations{0};
}  // namespace

void* operator new(size_t n) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n) { return operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

namespace tqkv {
namespace {

class CountAllocations {
 public:
  CountAllocations() {
    g_allocations = 0;
    g_counting = true;
  }
  ~CountAllocations() { g_counting = false; }
  int64_t count() const { return g_allocations.load(); }
};

// A serving loop: 64 sequences decode one token per step (staggered so some cross a block
// boundary every step); each one that reaches 96 tokens is freed and replaced by a new request
// with a 40-token prompt, which is prefilled in the same batch as the decodes.
struct Loop {
  static constexpr int kSeqs = 64;
  KVCacheManager m{[] {
    KVCacheManagerOptions o;
    o.num_blocks = 1024;
    o.block_size = 16;
    o.format = FormatTag{"turboquant_4bit_nc", 128, 0, 1};
    return o;
  }()};
  StepBatch batch;
  std::vector<SeqId> seqs;
  std::vector<int32_t> prompt = std::vector<int32_t>(40);
  std::vector<StepRequest> reqs;
  std::vector<int32_t> next_token = std::vector<int32_t>(1);
  int64_t schedule_allocations = 0;

  Loop() {
    std::iota(prompt.begin(), prompt.end(), 0);
    reqs.reserve(kSeqs);
    for (int i = 0; i < kSeqs; ++i) {
      prompt[0] = 1000 + i;  // distinct prompts: no prefix sharing, every block is computed
      seqs.push_back(m.AddSequence(prompt));
      reqs.push_back({seqs.back(), 40, 0});
    }
  }

  // Runs `steps` steps, adding the allocations made inside Schedule to schedule_allocations.
  void Run(int steps) {
    for (int step = 0; step < steps; ++step) {
      const bool counting_all = g_counting.exchange(true);
      const int64_t before = g_allocations.load();
      const ScheduleResult r = m.Schedule(
          reqs, batch, {.pad_tokens_to = 4096, .pad_requests_to = 128, .block_table_width = 8});
      schedule_allocations += g_allocations.load() - before;
      g_counting = counting_all;
      ASSERT_TRUE(r.admitted);
      for (int i = 0; i < kSeqs; ++i) {
        const size_t k = static_cast<size_t>(i);
        next_token[0] = step;
        m.Commit(seqs[k], next_token);
        if (m.GetSequenceInfo(seqs[k]).num_tokens >= 96 + i % 16) {
          m.Free(seqs[k]);
          prompt[0] = 2000 + step * kSeqs + i;
          seqs[k] = m.AddSequence(prompt);
          reqs[k] = {seqs[k], 40, 0};
        } else {
          reqs[k] = {seqs[k], 1, 0};
        }
      }
    }
  }
};

TEST(StepBatchAllocationTest, TheCounterSeesAllocations) {
  CountAllocations count;
  std::vector<int> v(10);
  EXPECT_EQ(count.count(), 1);
}

TEST(StepBatchAllocationTest, SteadyStateScheduleAllocatesNothing) {
  Loop loop;
  loop.Run(300);  // warm-up: the batch's buffers and the sequence slots grow
  EXPECT_GT(loop.schedule_allocations, 0);
  loop.schedule_allocations = 0;
  loop.Run(300);
  EXPECT_EQ(loop.schedule_allocations, 0);
  loop.m.CheckInvariants();
}

// With sequence slots reused, the whole loop (AddSequence, Schedule, Commit, Free) settles too.
TEST(StepBatchAllocationTest, SteadyStateServingLoopAllocatesNothing) {
  Loop loop;
  loop.Run(300);
  int64_t all = 0;
  {
    CountAllocations count;
    loop.Run(300);
    all = count.count();
  }
  EXPECT_EQ(all, 0);
  loop.m.CheckInvariants();
}

}  // namespace
}  // namespace tqkv
