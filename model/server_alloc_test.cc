// Server::Step when memory runs out: this binary replaces the global operator new, and a test can
// make the n-th allocation from a point on throw std::bad_alloc. A Step that throws must leave the
// server whole: the manager consistent, and every request finishing later with exactly the tokens
// of a run where nothing failed (CpuEngine: bit for bit whatever the batching).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "kvcache/manager.h"
#include "model/engine.h"
#include "model/llama.h"
#include "model/server.h"

// The replacements below pair malloc with free; GCC cannot see that operator new is replaced too.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

namespace {
// > 0: the allocations left until the one that fails.
std::atomic<int64_t> g_countdown{0};
std::atomic<int64_t> g_allocations{0};  // every allocation, counted
}  // namespace

void* operator new(size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (g_countdown.load(std::memory_order_relaxed) > 0 && g_countdown.fetch_sub(1) == 1) {
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n) { return operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

namespace tqkv::model {
namespace {

LlamaModel SmallModel() {
  LlamaConfig config;
  config.num_layers = 2;
  config.hidden = 256;
  config.ffn = 512;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.head_dim = 64;
  config.vocab = 300;
  config.context = 512;
  config.rope_base = 10000.0f;
  return LlamaModel::RandomInit(config, 5);
}

constexpr int kRequests = 4;

// Requests sharing a prompt prefix (prefix hits), greedy and sampled, with drafts, on a pool
// small enough to preempt: every path of Step.
struct Serving {
  CpuEngine engine;
  Server server;
  explicit Serving(const LlamaModel& model)
      : engine(model, {"turboquant_4bit_nc", 0, 16, 6}), server(engine, {3, 16, 3, 2}) {
    std::mt19937_64 rng(21);
    std::vector<int32_t> shared;
    for (int j = 0; j < 10; ++j) shared.push_back(static_cast<int32_t>(rng() % 280));
    for (int i = 0; i < kRequests; ++i) {
      Request r;
      r.prompt = shared;
      for (int j = 0; j < 2 + 3 * i; ++j) r.prompt.push_back(static_cast<int32_t>(rng() % 280));
      r.max_new_tokens = 8;
      r.sampling = {i % 2 == 0 ? 0.0f : 35.0f, static_cast<uint64_t>(i)};
      server.Submit(std::move(r));
    }
  }
  std::vector<std::vector<int32_t>> Tokens() const {
    std::vector<std::vector<int32_t>> t;
    for (int i = 0; i < kRequests; ++i) t.push_back(server.completion(i).tokens);
    return t;
  }
};

TEST(ServerAllocTest, AStepThatRunsOutOfMemoryLosesNothing) {
  const LlamaModel model = SmallModel();
  Serving reference(model);
  std::vector<int64_t> step_allocations;  // per Step of the undisturbed run
  for (;;) {
    const int64_t before = g_allocations.load();
    if (!reference.server.Step()) break;
    step_allocations.push_back(g_allocations.load() - before);
  }
  const std::vector<std::vector<int32_t>> want = reference.Tokens();
  ASSERT_GT(reference.server.stats().preemptions, 0) << "the pool must be short";
  ASSERT_GT(reference.server.stats().accepted_drafts, 0);
  // In every step: two allocations of its first three quarters (admission, scheduling, the model)
  // and each of its last eight (sampling and committing come last).
  std::mt19937_64 rng(7);
  int failures = 0;
  for (size_t s = 0; s < step_allocations.size(); ++s) {
    const int64_t count = step_allocations[s];
    ASSERT_GT(count, 12) << "step " << s;
    std::vector<int64_t> points = {1 + static_cast<int64_t>(rng() % (3 * count / 4)),
                                   1 + static_cast<int64_t>(rng() % (3 * count / 4))};
    for (int64_t i = 0; i < 8; ++i) points.push_back(count - i);
    for (const int64_t n : points) {
      Serving run(model);
      for (size_t i = 0; i < s; ++i) ASSERT_TRUE(run.server.Step());
      bool threw = false;
      g_countdown = n;
      try {
        run.server.Step();
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      g_countdown = 0;
      const std::string what = fmt::format("allocation {} of step {} ({})", n, s, count);
      failures += threw;
      ASSERT_EQ(run.engine.manager().FindInvariantViolation(), "") << what;
      for (int i = 0; i < 1000 && run.server.Step(); ++i) {
      }
      ASSERT_TRUE(run.server.idle()) << what << ": requests left after 1,000 more steps";
      ASSERT_EQ(run.Tokens(), want) << what;
      for (int i = 0; i < kRequests; ++i) {
        EXPECT_TRUE(run.server.completion(i).finished) << what << ", request " << i;
        EXPECT_EQ(run.server.completion(i).error, "") << what << ", request " << i;
      }
      EXPECT_EQ(run.engine.manager().Stats().blocks_in_use, 0) << what;
    }
  }
  // (A step of a later run may allocate less: the first run made the process's one-time
  // allocations.)
  EXPECT_GT(failures, 9 * static_cast<int>(step_allocations.size()));
}

}  // namespace
}  // namespace tqkv::model
