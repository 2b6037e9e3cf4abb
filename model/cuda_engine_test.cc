// CudaEngine against CpuEngine (GPU-tagged; skipped without a device): a random-weight Llama of
// SmolLM2's head layout (head_dim 64, GQA 3), driven step by step through both engines with the
// same schedule (prefill chunks of two sequences, a prefix hit, decode rows, a mixed step), must
// give the same logits up to the CUDA engine's bf16 weights, for a bf16 cache, TurboQuant caches
// and a per-layer mix; and a Server runs on it with preemption.
#include "model/cuda_engine.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "model/engine.h"
#include "model/llama.h"
#include "model/server.h"
#include "runtime/error.h"
#include "tests/gpu_test_util.h"

namespace tqkv::model {
namespace {

LlamaConfig SmallConfig() {
  LlamaConfig c;
  c.num_layers = 4;
  c.hidden = 384;  // 6 heads of 64
  c.ffn = 1024;
  c.num_heads = 6;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.vocab = 1000;
  c.context = 4096;
  c.rope_base = 10000.0f;
  return c;
}

std::vector<int32_t> Tokens(int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % 1000);
  return t;
}

struct Diff {
  double rel_rms = 0;  // ‖a − b‖ / ‖b‖ over every logit compared
  double agree = 0;    // argmax agreement
  int64_t rows = 0;
  bool argmax_consistent = true;  // the CUDA argmax output is its logits' argmax
};

// Drives both engines through the same steps (tokens from three sequences' lists; a sequence
// is added at its first step) and compares the logits of every row.
Diff RunBoth(const LlamaModel& model, const KvPolicy& policy) {
  CpuEngine cpu(model, policy);
  CudaEngine gpu(model, policy);
  Engine* engines[2] = {&cpu, &gpu};
  const int vocab = model.config().vocab;
  const std::vector<int32_t> a = Tokens(70, 1), b = Tokens(50, 2);
  std::vector<int32_t> c(a.begin(), a.begin() + 64);  // a's first 4 blocks: a prefix hit
  for (int32_t t : Tokens(20, 3)) c.push_back(t);
  const std::vector<int32_t>* lists[3] = {&a, &b, &c};
  std::map<int, SeqId> seqs[2];
  int64_t done[3] = {};
  double err = 0, norm = 0;
  Diff d;
  int64_t agree = 0;
  auto run = [&](const std::vector<std::pair<int, int>>& plan) {
    std::vector<int32_t> tokens;
    std::vector<StepRequest> requests[2];
    for (auto [s, n] : plan) {
      if (!seqs[0].contains(s)) {
        for (int e = 0; e < 2; ++e) seqs[e][s] = engines[e]->manager().AddSequence(*lists[s]);
        done[s] = cpu.manager().Lookup(seqs[0][s]).num_tokens;
        EXPECT_EQ(gpu.manager().Lookup(seqs[1][s]).num_tokens, done[s]);
      }
      for (int e = 0; e < 2; ++e) requests[e].push_back({seqs[e][s], n, 0});
      tokens.insert(tokens.end(), lists[s]->begin() + done[s], lists[s]->begin() + done[s] + n);
      done[s] += n;
    }
    std::vector<int32_t> rows(tokens.size());
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int32_t>(i);
    std::vector<float> logits[2];
    std::vector<int32_t> argmax[2];
    for (int e = 0; e < 2; ++e) {
      EXPECT_TRUE(engines[e]->Schedule(requests[e]).admitted);
      logits[e].assign(rows.size() * vocab, 0.0f);
      argmax[e].assign(rows.size(), -1);
      engines[e]->Compute(tokens, rows, logits[e].data(), argmax[e].data());
      for (const StepRequest& r : requests[e]) engines[e]->manager().Commit(r.seq, {});
    }
    for (size_t r = 0; r < rows.size(); ++r) {
      const float* x = logits[1].data() + r * vocab;
      const float* y = logits[0].data() + r * vocab;
      for (int i = 0; i < vocab; ++i) {
        err += (double{x[i]} - y[i]) * (double{x[i]} - y[i]);
        norm += double{y[i]} * y[i];
      }
      agree += argmax[1][r] == argmax[0][r];
      d.argmax_consistent &=
          argmax[1][r] == static_cast<int32_t>(std::max_element(x, x + vocab) - x);
      ++d.rows;
    }
  };
  run({{0, 40}, {1, 25}});  // prefill chunks of two sequences
  run({{0, 29}, {1, 19}});  // the rest of a but its last token; more of b
  run({{0, 1}, {1, 1}});    // one row each (the decode kernels)
  for (int e = 0; e < 2; ++e) engines[e]->manager().Free(seqs[e][0]);  // a's blocks stay cached
  run({{2, 19}, {1, 1}});  // c after its prefix hit beside b's one row: a mixed step
  EXPECT_EQ(done[2] - 19, 64);
  EXPECT_EQ(cpu.manager().FindInvariantViolation(), "");
  EXPECT_EQ(gpu.manager().FindInvariantViolation(), "");
  d.rel_rms = std::sqrt(err / norm);
  d.agree = static_cast<double>(agree) / static_cast<double>(d.rows);
  return d;
}

TEST(CudaEngineTest, MatchesTheCpuEngine) {
  TQKV_SKIP_WITHOUT_GPU();
  const LlamaModel model = LlamaModel::RandomInit(SmallConfig(), 7);
  // Bounds on the logits' relative RMS difference: a bf16 cache sees only the CUDA engine's
  // bf16 weights and GEMM inputs; a compressed cache also flips an index wherever the two
  // engines' keys straddle a midpoint, more often the coarser the codebook (measured on the
  // H200: k8v4 with bf16 boundary layers 0.021, 4bit_nc 0.044, 3bit_nc 0.070).
  struct Case {
    KvPolicy policy;
    double bound;
  };
  for (const Case& c : {Case{{"bf16", 0, 16, 64}, 0.02}, Case{{"turboquant_k8v4", 1, 16, 64}, 0.04},
                        Case{{"turboquant_4bit_nc", 0, 16, 64}, 0.08},
                        Case{{"turboquant_3bit_nc", 0, 16, 64}, 0.12}}) {
    SCOPED_TRACE(c.policy.preset + " boundary " + std::to_string(c.policy.boundary_layers));
    const Diff d = RunBoth(model, c.policy);
    std::printf("%s boundary %d: logits relative RMS difference %.4f, top-1 agreement %.3f\n",
                c.policy.preset.c_str(), c.policy.boundary_layers, d.rel_rms, d.agree);
    EXPECT_EQ(d.rows, 65 + 48 + 2 + 20);
    EXPECT_LT(d.rel_rms, c.bound);
    EXPECT_GE(d.agree, 0.9);
    EXPECT_TRUE(d.argmax_consistent);
  }
}

// Engine::Forward (tqkv eval's teacher forcing) runs on the CUDA engine through its Compute:
// every row's logits, within MatchesTheCpuEngine's bounds of the CPU engine's; layer errors are
// the CPU engine's alone, refused before anything changes.
TEST(CudaEngineTest, ForwardMatchesTheCpuEngine) {
  TQKV_SKIP_WITHOUT_GPU();
  const LlamaModel model = LlamaModel::RandomInit(SmallConfig(), 13);
  const std::vector<int32_t> ids = Tokens(300, 5);
  for (const char* preset : {"bf16", "turboquant_4bit_nc"}) {
    SCOPED_TRACE(preset);
    CpuEngine cpu(model, {preset, 0, 16, 0});
    CudaEngine gpu(model, {preset, 0, 16, 0});
    LayerErrors errors;
    EXPECT_THAT([&] { gpu.Forward(ids, 64, &errors); },
                ::testing::ThrowsMessage<Error>(::testing::HasSubstr("Engine::Forward")));
    const std::vector<float> a = cpu.Forward(ids, 64);
    const std::vector<float> b = gpu.Forward(ids, 100);  // (a row's logits do not depend on chunks)
    ASSERT_EQ(a.size(), b.size());
    double diff = 0, norm = 0;
    int agree = 0;
    for (size_t r = 0; r < ids.size(); ++r) {
      const float* x = a.data() + r * 1000;
      const float* y = b.data() + r * 1000;
      for (int v = 0; v < 1000; ++v) {
        diff += (double{y[v]} - x[v]) * (double{y[v]} - x[v]);
        norm += double{x[v]} * x[v];
      }
      agree += std::max_element(x, x + 1000) - x == std::max_element(y, y + 1000) - y;
    }
    const double rel_rms = std::sqrt(diff / norm);
    std::printf("%s: Forward logits relative RMS difference %.4f, top-1 agreement %.3f\n", preset,
                rel_rms, agree / 300.0);
    EXPECT_LT(rel_rms, std::string(preset) == "bf16" ? 0.02 : 0.08);
    EXPECT_GE(agree, 270);
    EXPECT_EQ(gpu.manager().Stats().num_sequences, 0);  // freed
  }
}

// Decode steps replayed from CUDA graphs give what the same steps give launched one by one, and
// a growing context keeps one graph per padded block-table width.
TEST(CudaEngineTest, DecodeGraphsMatchLaunches) {
  TQKV_SKIP_WITHOUT_GPU();
  const LlamaModel model = LlamaModel::RandomInit(SmallConfig(), 11);
  CudaEngine graphs(model, {"turboquant_4bit_nc", 0, 16, 64});
  CudaEngine launches(model, {"turboquant_4bit_nc", 0, 16, 64}, {false, 32});
  Engine* engines[2] = {&graphs, &launches};
  const int vocab = model.config().vocab;
  std::vector<std::vector<int32_t>> prompts = {Tokens(30, 21), Tokens(9, 22), Tokens(50, 23)};
  std::vector<float> logits[2];
  std::vector<SeqId> seqs[2];
  for (int e = 0; e < 2; ++e) {
    std::vector<StepRequest> req;
    std::vector<int32_t> tokens, rows;
    for (const auto& p : prompts) {
      seqs[e].push_back(engines[e]->manager().AddSequence(p));
      req.push_back({seqs[e].back(), static_cast<int32_t>(p.size()), 0});
      tokens.insert(tokens.end(), p.begin(), p.end());
      rows.push_back(static_cast<int32_t>(tokens.size()) - 1);
    }
    ASSERT_TRUE(engines[e]->Schedule(req).admitted);
    std::vector<int32_t> next(3);
    engines[e]->Compute(tokens, rows, nullptr, next.data());
    // 24 decode steps: the shortest crosses a block boundary, every one stays in 32 blocks.
    for (int step = 0; step < 24; ++step) {
      req.clear();
      for (int i = 0; i < 3; ++i) {
        engines[e]->manager().Commit(seqs[e][i], std::span<const int32_t>(&next[i], 1));
        req.push_back({seqs[e][i], 1, 0});
      }
      ASSERT_TRUE(engines[e]->Schedule(req).admitted);
      std::vector<float> l(3 * static_cast<size_t>(vocab));
      const std::vector<int32_t> step_tokens = next, all_rows = {0, 1, 2};
      engines[e]->Compute(step_tokens, all_rows, l.data(), next.data());
      logits[e].insert(logits[e].end(), l.begin(), l.end());
    }
  }
  EXPECT_EQ(graphs.graphs_captured(), 1);
  EXPECT_EQ(launches.graphs_captured(), 0);
  double err = 0, norm = 0;
  for (size_t i = 0; i < logits[0].size(); ++i) {
    err += (double{logits[0][i]} - logits[1][i]) * (double{logits[0][i]} - logits[1][i]);
    norm += double{logits[1][i]} * logits[1][i];
  }
  EXPECT_LT(std::sqrt(err / norm), 1e-5);
}

// A block-table width multiple past the attention kernels' longest context is refused when the
// engine is built (every Compute refused it, after the step was scheduled).
TEST(CudaEngineTest, RefusesAWidthMultiplePastTheKernels) {
  TQKV_SKIP_WITHOUT_GPU();
  const LlamaModel model = LlamaModel::RandomInit(SmallConfig(), 9);
  const KvPolicy policy{"turboquant_4bit_nc", 0, 16, 12};
  EXPECT_THAT([&] { CudaEngine(model, policy, {.width_multiple = (1 << 25) + 1}); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr(
                  "options.width_multiple = 33554433; allowed: 1 to 33554432")));
  EXPECT_NO_THROW(CudaEngine(model, policy, {.width_multiple = 1 << 25}));
  // Its step limits, which a Server checks its options against.
  const CudaEngine engine(model, policy);
  EXPECT_EQ(engine.MaxStepSequences(), 65535);
  EXPECT_EQ(engine.MaxStepTokens(), 2147483647 / 6);
}

// The serving loop on the CUDA engine: several requests with a pool small enough to preempt,
// every request finishing with its tokens in the vocabulary.
TEST(CudaEngineTest, ServesWithPreemption) {
  TQKV_SKIP_WITHOUT_GPU();
  const LlamaModel model = LlamaModel::RandomInit(SmallConfig(), 9);
  CudaEngine engine(model, {"turboquant_4bit_nc", 0, 16, 12});
  Server server(engine, {8, 48});
  for (int i = 0; i < 6; ++i) {
    Request r;
    r.prompt = Tokens(40 + 7 * i, 100 + i);
    r.max_new_tokens = 12;
    r.sampling = {i % 2 == 0 ? 0.0f : 0.7f, static_cast<uint64_t>(i)};
    server.Submit(std::move(r));
  }
  server.RunToCompletion();
  EXPECT_GT(server.stats().preemptions, 0);
  for (int i = 0; i < 6; ++i) {
    const Completion& c = server.completion(i);
    EXPECT_TRUE(c.finished);
    EXPECT_EQ(c.error, "");
    ASSERT_EQ(c.tokens.size(), 12u);
    for (int32_t t : c.tokens) EXPECT_TRUE(t >= 0 && t < 1000);
  }
  EXPECT_EQ(engine.manager().FindInvariantViolation(), "");
}

// Speculative decoding on the CUDA engine (ServerOptions::spec_tokens): the drafts run as verify
// rows beside decode rows and prompt chunks; greedy requests generate the tokens they generate
// without drafts, in fewer steps, and sampled ones finish; some drafts are kept and some
// rewound, and the manager stays consistent, also through preemption.
TEST(CudaEngineTest, ServesSpeculatively) {
  TQKV_SKIP_WITHOUT_GPU();
  const LlamaModel model = LlamaModel::RandomInit(SmallConfig(), 9);
  auto serve = [&](int spec, int32_t num_blocks) {
    CudaEngine engine(model, {"turboquant_4bit_nc", 0, 16, num_blocks});
    ServerOptions options{8, 48};
    options.spec_tokens = spec;
    Server server(engine, options);
    for (int i = 0; i < 6; ++i) {
      Request r;
      // As server_test's SpeculativeDecodingRewindsRejectedDrafts: "a a" and other tokens in a
      // greedy prompt ending in a, so that its first drafts are rejected.
      r.prompt = Tokens(40 + 7 * i, 200 + i);
      if (i % 2 == 0) {
        const int32_t a = r.prompt.back();
        const int32_t pair[] = {a, a, (a + 1) % 1000, (a + 2) % 1000, (a + 3) % 1000};
        r.prompt.insert(r.prompt.begin() + 20, std::begin(pair), std::end(pair));
      }
      r.max_new_tokens = 20;
      r.sampling = {i % 2 == 0 ? 0.0f : 1.5f, static_cast<uint64_t>(i)};
      server.Submit(std::move(r));
    }
    server.RunToCompletion();
    EXPECT_EQ(engine.manager().FindInvariantViolation(), "");
    std::vector<std::vector<int32_t>> tokens;
    for (int i = 0; i < 6; ++i) {
      const Completion& c = server.completion(i);
      EXPECT_TRUE(c.finished);
      EXPECT_EQ(c.error, "");
      EXPECT_EQ(c.tokens.size(), 20u);
      for (int32_t t : c.tokens) EXPECT_TRUE(t >= 0 && t < 1000);
      tokens.push_back(c.tokens);
    }
    return std::pair{tokens, server.stats()};
  };
  const auto [plain, plain_stats] = serve(0, 64);
  const auto [spec, spec_stats] = serve(4, 64);
  for (int i = 0; i < 6; i += 2) EXPECT_EQ(spec[i], plain[i]) << "greedy request " << i;
  EXPECT_LT(spec_stats.steps, plain_stats.steps);
  EXPECT_GT(spec_stats.accepted_drafts, 0);
  EXPECT_LE(spec_stats.accepted_drafts, spec_stats.draft_tokens - 3);  // a rejection per greedy
  const auto [tight, tight_stats] = serve(4, 12);
  EXPECT_GT(tight_stats.preemptions, 0);
  for (int i = 0; i < 6; i += 2) EXPECT_EQ(tight[i], plain[i]) << "greedy request " << i;
}

}  // namespace
}  // namespace tqkv::model
