// model::Server's parts that need no model file (the sanitizer pass runs them): prompt lookup,
// speculative sampling, speculative decoding on a random-weight model, and bad input. The serving
// loop on SmolLM2 is engine_test's.
#include "model/server.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "kvcache/address_space_limit.h"
#include "kvcache/manager.h"
#include "model/engine.h"
#include "model/llama.h"
#include "runtime/error.h"

namespace tqkv::model {
namespace {

// Prompt lookup: the continuation of the most recent earlier occurrence of the longest suffix
// (up to max_ngram tokens) that recurs.
TEST(ServerTest, ProposeDraftsLooksUpTheContext) {
  using V = std::vector<int32_t>;
  EXPECT_EQ(ProposeDrafts(V{1, 2, 3, 4, 1, 2}, 3, 3), (V{3, 4, 1}));  // {4, 1, 2} never; {1, 2}
  EXPECT_EQ(ProposeDrafts(V{5, 6, 9, 5, 6, 7, 5, 6}, 2, 3), (V{7, 5, 6}));  // the latest {5, 6}
  // Past the context's end with the period of the match (3 here, then 1 and 2).
  EXPECT_EQ(ProposeDrafts(V{5, 6, 9, 5, 6, 7, 5, 6}, 2, 8), (V{7, 5, 6, 7, 5, 6, 7, 5}));
  EXPECT_EQ(ProposeDrafts(V{8, 1, 9, 2, 1}, 3, 4), (V{9, 2, 1, 9}));  // down to one token
  EXPECT_EQ(ProposeDrafts(V{7, 7}, 3, 4), (V{7, 7, 7, 7}));
  EXPECT_EQ(ProposeDrafts(V{3, 7, 7, 7}, 3, 5), (V{7, 7, 7, 7, 7}));
  EXPECT_EQ(ProposeDrafts(V{1, 4, 1, 4}, 3, 5), (V{1, 4, 1, 4, 1}));
  EXPECT_EQ(ProposeDrafts(V{1, 4, 1, 4}, 3, 1), (V{1}));
  EXPECT_EQ(ProposeDrafts(V{1, 2, 3}, 3, 4), V{});  // nothing recurs
  EXPECT_EQ(ProposeDrafts(V{4}, 3, 4), V{});
  EXPECT_EQ(ProposeDrafts(V{1, 2, 1, 2}, 3, 0), V{});
}

// A draft is kept with the model's probability of it and otherwise replaced by a draw from the
// rest, so that the token has the model's distribution; greedy keeps exactly the argmax. The
// token is the one SampleToken draws from the same random stream, whatever the draft.
TEST(ServerTest, AcceptDraftKeepsTheDistribution) {
  const std::vector<float> logits = {0.5f, 2.0f, 1.0f, -1.0f, 0.0f};
  const int vocab = static_cast<int>(logits.size());
  const float temperature = 0.7f;
  std::vector<double> p(vocab);
  double sum = 0.0;
  for (int v = 0; v < vocab; ++v) sum += p[v] = std::exp((logits[v] - 2.0f) / temperature);
  for (double& x : p) x /= sum;
  std::mt19937_64 rng(11);
  for (int32_t draft : {1, 2, 3}) {
    constexpr int kDraws = 200000;
    std::vector<int> count(vocab, 0);
    int kept_count = 0;
    for (int i = 0; i < kDraws; ++i) {
      bool kept = false;
      const int32_t t = AcceptDraft(logits.data(), vocab, temperature, 1, draft, rng, &kept);
      ASSERT_TRUE(t >= 0 && t < vocab);
      ASSERT_EQ(kept, t == draft);  // a replacement is never the draft
      ++count[t];
      kept_count += kept;
    }
    EXPECT_NEAR(static_cast<double>(kept_count) / kDraws, p[draft], 0.005) << draft;
    for (int v = 0; v < vocab; ++v) {
      EXPECT_NEAR(static_cast<double>(count[v]) / kDraws, p[v], 0.005) << draft << " " << v;
    }
  }
  for (int i = 0; i < 1000; ++i) {
    std::mt19937_64 a(500 + i), b(500 + i);
    bool kept = false;
    const int32_t t = AcceptDraft(logits.data(), vocab, temperature, 1, i % vocab, a, &kept);
    ASSERT_EQ(t, SampleToken(logits.data(), vocab, temperature, 1, b));
    ASSERT_EQ(a(), b());  // the same draws
  }
  bool kept = true;
  EXPECT_EQ(AcceptDraft(nullptr, vocab, 0.0f, 1, 2, rng, &kept), 1);
  EXPECT_FALSE(kept);
  EXPECT_EQ(AcceptDraft(nullptr, vocab, 0.0f, 1, 1, rng, &kept), 1);
  EXPECT_TRUE(kept);
}

// Speculative decoding (ServerOptions::spec_tokens) on a random-weight model (engine_test's
// SpeculativeDecodingKeepsTheTokens runs SmolLM2; cuda_engine_test's ServesSpeculatively this test
// on the CUDA engine), which repeats a prompt's last token a: a greedy request's prompt
// holds "a a" earlier, followed by other tokens, so that once the model has answered a, the
// drafts continue the prompt after that pair where the model does not (rejected, rewound);
// later drafts follow its output (kept). Every request, greedy or sampled, keeps its tokens, with
// and without preemption.
LlamaModel RepeatingModel(int context = 4096) {
  LlamaConfig config;
  config.num_layers = 4;
  config.hidden = 384;
  config.ffn = 1024;
  config.num_heads = 6;
  config.num_kv_heads = 2;
  config.head_dim = 64;
  config.vocab = 1000;
  config.context = context;
  config.rope_base = 10000.0f;
  return LlamaModel::RandomInit(config, 9);
}

TEST(ServerTest, SpeculativeDecodingRewindsRejectedDrafts) {
  const LlamaModel model = RepeatingModel();
  auto serve = [&](int spec, int32_t num_blocks) {
    CpuEngine engine(model, {"turboquant_4bit_nc", 0, 16, num_blocks});
    ServerOptions options{8, 48};
    options.spec_tokens = spec;
    Server server(engine, options);
    for (int i = 0; i < 6; ++i) {
      std::mt19937_64 rng(200 + i);
      Request r;
      for (int j = 0; j < 40 + 7 * i; ++j) r.prompt.push_back(static_cast<int32_t>(rng() % 900));
      if (i % 2 == 0) {
        const int32_t a = r.prompt.back();
        const int32_t pair[] = {a, a, 901, 902, 903, 904};
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
      EXPECT_TRUE(server.completion(i).finished);
      EXPECT_EQ(server.completion(i).error, "");
      EXPECT_EQ(server.completion(i).tokens.size(), 20u);
      tokens.push_back(server.completion(i).tokens);
    }
    return std::pair{tokens, server.stats()};
  };
  const auto [plain, plain_stats] = serve(0, 64);
  const auto [spec, spec_stats] = serve(4, 64);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(spec[i], plain[i]) << "request " << i;
  EXPECT_LT(spec_stats.steps, plain_stats.steps);
  EXPECT_GT(spec_stats.accepted_drafts, 0);
  EXPECT_LE(spec_stats.accepted_drafts, spec_stats.draft_tokens - 3);  // a rejection per greedy
  const auto [tight, tight_stats] = serve(4, 12);
  EXPECT_GT(tight_stats.preemptions, 0);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(tight[i], plain[i]) << "request " << i;
}

// A sequence that repeats one token drafts spec_tokens copies of it every step (ProposeDrafts
// continues the match past the context's end), all kept: 4 drafts and one more token per step,
// where drafts of what followed the token's last occurrence alone would be one token long.
TEST(ServerTest, SpeculativeDecodingDraftsARepeatedTokenWhole) {
  const LlamaModel model = RepeatingModel();
  auto serve = [&](int spec) {
    CpuEngine engine(model, {"turboquant_4bit_nc", 0, 16, 64});
    ServerOptions options{1, 48};
    options.spec_tokens = spec;
    Server server(engine, options);
    Request r;
    std::mt19937_64 rng(300);
    for (int j = 0; j < 40; ++j) r.prompt.push_back(static_cast<int32_t>(rng() % 900));
    r.max_new_tokens = 21;
    server.Submit(r);
    server.RunToCompletion();
    return std::pair{server.completion(0).tokens, server.stats()};
  };
  const auto [plain, plain_stats] = serve(0);
  const auto [spec, spec_stats] = serve(4);
  ASSERT_EQ(plain.size(), 21u);
  // The premise: this model repeats the prompt's last token.
  ASSERT_EQ(std::count(plain.begin(), plain.end(), plain[0]), 21);
  EXPECT_EQ(spec, plain);
  EXPECT_EQ(plain_stats.steps, 21);
  // The prompt's step gives the first token; then 4 steps of 4 kept drafts and one more.
  EXPECT_EQ(spec_stats.steps, 5);
  EXPECT_EQ(spec_stats.draft_tokens, 16);
  EXPECT_EQ(spec_stats.accepted_drafts, 16);
}

// Generation ends after the first token that is any of the request's stop tokens (an end of
// turn, an end of text), with drafts too. The random model repeats its last token unless the
// temperature is high; at 35 it repeats some and moves on at others.
TEST(ServerTest, AnyStopTokenEndsARequest) {
  const LlamaModel model = RepeatingModel();
  auto run = [&](std::vector<int32_t> stops, int spec) {
    CpuEngine engine(model, {"turboquant_4bit_nc", 0, 16, 64});
    ServerOptions options{2, 48};
    options.spec_tokens = spec;
    Server server(engine, options);
    Request r;
    std::mt19937_64 rng(77);
    for (int j = 0; j < 30; ++j) r.prompt.push_back(static_cast<int32_t>(rng() % 900));
    r.max_new_tokens = 16;
    r.sampling = {35.0f, 3};
    r.stop_tokens = std::move(stops);
    server.Submit(std::move(r));
    server.RunToCompletion();
    return std::pair{server.completion(0).tokens, server.stats()};
  };
  const std::vector<int32_t> plain = run({}, 0).first;
  ASSERT_EQ(plain.size(), 16u);
  const int32_t late = plain[12], early = plain[5];
  const auto first_of = [&](int32_t x) {
    return static_cast<size_t>(std::find(plain.begin(), plain.end(), x) - plain.begin());
  };
  ASSERT_LT(first_of(early), first_of(late));  // the premise: two tokens, one before the other
  const std::vector<int32_t> to_early(plain.begin(), plain.begin() + first_of(early) + 1);
  EXPECT_EQ(run({late, early}, 0).first, to_early);
  const auto [drafted, stats] = run({late, early}, 4);
  EXPECT_EQ(drafted, to_early);
  EXPECT_GT(stats.draft_tokens, 0);
  EXPECT_EQ(run({late}, 0).first,
            std::vector<int32_t>(plain.begin(), plain.begin() + first_of(late) + 1));
}

// Cancel ends a running request (its blocks leave use at once) and a waiting one (never
// computed); the other requests produce the tokens they produce without the cancellations, and
// the cancelled running request keeps the tokens it had, the start of its uncancelled ones.
TEST(ServerTest, CancelEndsARequestAndLeavesTheOthersAlone) {
  const LlamaModel model = RepeatingModel();
  constexpr int kRequests = 5;
  auto submit_all = [](Server& server) {
    for (int i = 0; i < kRequests; ++i) {
      std::mt19937_64 rng(400 + i);
      Request r;
      for (int j = 0; j < 30 + 5 * i; ++j) r.prompt.push_back(static_cast<int32_t>(rng() % 900));
      r.max_new_tokens = 12;
      // (At 35 the random model's sampled tokens follow its logits: some repeat, some move on.)
      r.sampling = {i % 2 == 0 ? 0.0f : 35.0f, static_cast<uint64_t>(i)};
      server.Submit(std::move(r));
    }
  };
  std::vector<std::vector<int32_t>> reference;
  {
    CpuEngine engine(model, {"turboquant_4bit_nc", 0, 16, 64});
    Server server(engine, ServerOptions{3, 48});
    submit_all(server);
    server.RunToCompletion();
    for (int i = 0; i < kRequests; ++i) reference.push_back(server.completion(i).tokens);
  }
  ASSERT_GT(std::set<int32_t>(reference[3].begin(), reference[3].end()).size(), 3u);
  CpuEngine engine(model, {"turboquant_4bit_nc", 0, 16, 64});
  Server server(engine, ServerOptions{3, 48});  // requests 3 and 4 wait for a place
  submit_all(server);
  while (server.completion(1).tokens.size() < 3) ASSERT_TRUE(server.Step());
  for (int i = 0; i < kRequests; ++i) ASSERT_FALSE(server.completion(i).finished) << i;
  ASSERT_TRUE(server.completion(4).tokens.empty());
  const size_t had = server.completion(1).tokens.size();
  const int64_t in_use = engine.manager().Stats().blocks_in_use;
  EXPECT_TRUE(server.Cancel(1));  // running
  EXPECT_LT(engine.manager().Stats().blocks_in_use, in_use);
  EXPECT_TRUE(server.Cancel(4));  // waiting
  EXPECT_EQ(engine.manager().FindInvariantViolation(), "");
  for (int id : {1, 4}) {
    EXPECT_TRUE(server.completion(id).finished) << id;
    EXPECT_TRUE(server.completion(id).cancelled) << id;
    EXPECT_EQ(server.completion(id).error, "") << id;
  }
  server.RunToCompletion();
  EXPECT_EQ(server.completion(1).tokens,
            std::vector<int32_t>(reference[1].begin(), reference[1].begin() + had));
  EXPECT_TRUE(server.completion(4).tokens.empty());
  for (int id : {0, 2, 3}) {
    EXPECT_EQ(server.completion(id).tokens, reference[id]) << id;
    EXPECT_FALSE(server.completion(id).cancelled) << id;
  }
  EXPECT_EQ(engine.manager().Stats().blocks_in_use, 0);
  EXPECT_EQ(engine.manager().FindInvariantViolation(), "");
  // Finished requests (cancelled or not) stay as they are; an unknown id is refused.
  const int64_t finish_step = server.completion(0).finish_step;
  EXPECT_FALSE(server.Cancel(0));
  EXPECT_FALSE(server.Cancel(1));
  EXPECT_FALSE(server.completion(0).cancelled);
  EXPECT_EQ(server.completion(0).finish_step, finish_step);
  for (int id : {-1, kRequests}) {
    try {
      server.Cancel(id);
      ADD_FAILURE() << "Cancel(" << id << ") did not throw";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr(fmt::format(
                                "Server::Cancel: invalid id = {}; allowed: 0 to 4", id)));
    }
  }
}

// Bad options and requests are refused, naming the field and what is allowed, with nothing
// queued: a step budget below the running sequences (each needs its decode row), a stop token
// outside the vocabulary, a prompt longer than the whole block pool holds (while one that fits,
// and a request whose generated tokens may outgrow the pool, are accepted), an unknown id.
TEST(ServerTest, RefusesBadOptionsAndRequestsBeforeAnythingChanges) {
  const LlamaModel model = RepeatingModel();
  CpuEngine engine(model, {"turboquant_4bit_nc", 0, 16, 9});  // 8 usable blocks: 128 tokens
  auto error = [](const auto& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(error([&] {
                Server(engine, ServerOptions{4, 3});
              }),
              ::testing::HasSubstr("options.step_tokens = 3; allowed: >= options.max_running = 4"));
  Server server(engine, ServerOptions{4, 16});
  EXPECT_THAT(error([&] { (void)server.completion(0); }),
              ::testing::HasSubstr("id = 0; allowed: none"));
  Request r;
  r.prompt.assign(128, 7);
  r.max_new_tokens = 200;  // past the pool: accepted (a stop token may end it first)
  EXPECT_EQ(error([&] { server.Check(r); }), "no error");
  for (int32_t stop : {-1, 1000}) {
    Request bad = r;
    bad.stop_tokens = {5, stop};
    EXPECT_THAT(
        error([&] { server.Submit(bad); }),
        ::testing::HasSubstr(fmt::format("stop_tokens[1] = {}; allowed: a token, 0 to 999", stop)));
  }
  Request longer = r;
  longer.prompt.push_back(7);
  EXPECT_THAT(error([&] { server.Submit(longer); }),
              ::testing::HasSubstr("prompt.size() = 129; allowed: at most 128 tokens"));
  EXPECT_TRUE(server.idle());
  EXPECT_EQ(server.Submit(r), 0);
  EXPECT_THAT(error([&] { (void)server.completion(1); }),
              ::testing::HasSubstr("id = 1; allowed: 0 to 0"));
}

// The engine's step API (what a server drives) refuses misuse before anything changes: a second
// Schedule of an uncomputed step replaced its batch, leaving positions the manager counts as
// stored unwritten and then published to the prefix cache; a row computed from another token than
// its sequence's put that token's K/V under the known tokens' block hashes.
TEST(ServerTest, EngineStepRefusesMisuseBeforeAnythingChanges) {
  const LlamaModel model = RepeatingModel();
  CpuEngine engine(model, {"turboquant_4bit_nc", 0, 16, 9});
  KVCacheManager& m = engine.manager();
  EXPECT_FALSE(engine.IsBf16Layer(3));
  EXPECT_THAT([&] { (void)engine.IsBf16Layer(4); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("layer = 4; allowed: 0 to 3")));
  std::vector<int32_t> prompt(40);
  for (int i = 0; i < 40; ++i) prompt[i] = 10 + i;
  const SeqId seq = m.AddSequence(prompt);
  auto schedule = [&](int32_t n) {
    const StepRequest r{seq, n, 0};
    return engine.Schedule(std::span<const StepRequest>(&r, 1));
  };
  const std::string fresh = m.DebugString();
  EXPECT_THAT([&] { schedule(0); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr(
                  "requests = 1 requests of 0 new tokens; allowed: at least one new token")));
  EXPECT_EQ(m.DebugString(), fresh);
  ASSERT_TRUE(schedule(32).admitted);
  const std::string scheduled = m.DebugString();
  EXPECT_THAT([&] { schedule(8); }, ::testing::ThrowsMessage<Error>(::testing::HasSubstr(
                                        "the scheduled step is not computed yet")));
  EXPECT_EQ(m.DebugString(), scheduled);
  // Rows 0-31 are positions 0-31, whose tokens the sequence knows.
  std::vector<int32_t> tokens(prompt.begin(), prompt.begin() + 32);
  std::vector<int32_t> wrong = tokens;
  wrong[17] = 999;
  const std::vector<int32_t> rows = {31};
  std::vector<int32_t> next(1);
  EXPECT_THAT([&] { engine.Compute(wrong, rows, nullptr, next.data()); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr(
                  "tokens[17] = 999; allowed: 27, sequence 0's token at position 17")));
  const std::vector<int32_t> too_many_rows(33, 0);
  EXPECT_THAT([&] { engine.Compute(tokens, too_many_rows, nullptr, nullptr); },
              ::testing::ThrowsMessage<Error>(
                  ::testing::HasSubstr("logit_rows.size() = 33; allowed: at most the step's 32")));
  engine.Compute(tokens, rows, nullptr, next.data());  // the step is still there to compute
  m.Commit(seq, {});
  // The rest of the prompt, then a draft past the known tokens: any token.
  ASSERT_TRUE(schedule(9).admitted);
  tokens.assign(prompt.begin() + 32, prompt.end());
  tokens.push_back(5);
  const std::vector<int32_t> last = {8};
  engine.Compute(tokens, last, nullptr, next.data());
  EXPECT_EQ(m.FindInvariantViolation(), "");
}

// Engine::Forward through the base class's step, Compute of every row (as on the CUDA engine),
// in other chunks: CpuEngine's logits bit for bit; layer errors asked of an engine without them
// are refused before anything changes.
struct ComputeOnlyEngine : CpuEngine {
  using CpuEngine::CpuEngine;
  bool MeasuresLayerErrors() const override { return false; }
  void ForwardStep(std::span<const int32_t> tokens, std::span<const int32_t> rows, float* logits,
                   LayerErrors* errors, int first, int n) override {
    Engine::ForwardStep(tokens, rows, logits, errors, first, n);
  }
};

TEST(ServerTest, ForwardThroughComputeIsTheCpuEnginesForward) {
  const LlamaModel model = RepeatingModel();
  std::vector<int32_t> ids(70);
  for (int i = 0; i < 70; ++i) ids[i] = (37 * i + 11) % 1000;
  CpuEngine cpu(model, {"turboquant_4bit_nc", 0, 16, 0});
  ComputeOnlyEngine generic(model, {"turboquant_4bit_nc", 0, 16, 0});
  LayerErrors errors;
  EXPECT_THAT(
      [&] { generic.Forward(ids, 16, &errors); },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr(
          "Engine::Forward: invalid errors = a LayerErrors; allowed: null on this engine")));
  EXPECT_TRUE(errors.outputs.empty());
  const std::vector<float> a = cpu.Forward(ids, 16);
  const std::vector<float> b = generic.Forward(ids, 24);
  ASSERT_EQ(a.size(), size_t{70} * 1000);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  EXPECT_EQ(generic.manager().Stats().num_sequences, 0);
  EXPECT_EQ(generic.manager().FindInvariantViolation(), "");
}

// Positions past the model's context_length are not served by the engine either (Server::Submit
// refuses such requests; an engine driven directly ran them): a step reaching past it is refused
// before anything changes, a step up to its last position runs, and so does Forward.
TEST(ServerTest, EngineRefusesPositionsPastTheContext) {
  const LlamaModel model = RepeatingModel(48);
  CpuEngine engine(model, {"turboquant_4bit_nc", 0, 16, 9});
  KVCacheManager& m = engine.manager();
  std::vector<int32_t> prompt(40);
  for (int i = 0; i < 40; ++i) prompt[i] = 10 + i;
  const std::vector<int32_t> too_long(49, 7);
  EXPECT_THAT([&] { engine.Forward(too_long, 16); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr(
                  "tokens.size() = 49; allowed: at most the model's context_length = 48")));
  EXPECT_EQ(engine.Forward(std::span(too_long).first(48), 16).size(), size_t{48} * 1000);
  const SeqId seq = m.AddSequence(prompt);
  auto schedule = [&](int32_t n) {
    const StepRequest r{seq, n, 0};
    return engine.Schedule(std::span<const StepRequest>(&r, 1));
  };
  const std::string fresh = m.DebugString();
  EXPECT_THAT([&] { schedule(49); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr(
                  "requests[0].num_new_tokens = 49; allowed: at most 48: the model's "
                  "context_length = 48 less the sequence's 0 tokens before this step")));
  EXPECT_EQ(m.DebugString(), fresh);
  ASSERT_TRUE(schedule(40).admitted);
  std::vector<int32_t> next(1);
  const std::vector<int32_t> last = {39};
  engine.Compute(prompt, last, nullptr, next.data());
  m.Commit(seq, next);
  // The committed token at position 40 and drafts up to position 47, the last one served.
  const std::string committed = m.DebugString();
  EXPECT_THAT([&] { schedule(9); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr(
                  "requests[0].num_new_tokens = 9; allowed: at most 8: the model's "
                  "context_length = 48 less the sequence's 40 tokens before this step")));
  EXPECT_EQ(m.DebugString(), committed);
  ASSERT_TRUE(schedule(8).admitted);
  std::vector<int32_t> tokens(8, 3);
  tokens[0] = next[0];
  const std::vector<int32_t> rows = {0, 7};
  std::vector<int32_t> argmax(2);
  engine.Compute(tokens, rows, nullptr, argmax.data());
  EXPECT_EQ(m.FindInvariantViolation(), "");
}

// A sequence that holds only a lookahead reservation (a step gave it 0 new tokens and a reserved
// block) is not fresh: the manager starts its first step at position 0 even where another
// sequence has since published its prefix, and so does the engine's context check (it took the
// prefix hit as the start and refused a step that reaches exactly the last position).
TEST(ServerTest, EngineStartsALookaheadOnlySequenceAtZero) {
  const LlamaModel model = RepeatingModel(48);
  CpuEngine engine(model, {"turboquant_4bit_nc", 0, 16, 12});
  KVCacheManager& m = engine.manager();
  std::vector<int32_t> prompt(40);
  for (int i = 0; i < 40; ++i) prompt[i] = 10 + i;
  const SeqId a = m.AddSequence(prompt), b = m.AddSequence(prompt);
  const std::vector<StepRequest> first = {{a, 0, 16}, {b, 40, 0}};
  ASSERT_TRUE(engine.Schedule(first).admitted);
  std::vector<int32_t> next(1);
  const std::vector<int32_t> last = {39};
  engine.Compute(prompt, last, nullptr, next.data());
  m.Commit(b, next);  // b's two full blocks go to the prefix cache
  ASSERT_EQ(m.GetSequenceInfo(a).num_scheduled, 0);
  ASSERT_GT(m.GetSequenceInfo(a).num_table_entries, 0);
  ASSERT_EQ(m.Lookup(a).num_tokens, 32);
  const StepRequest whole{a, 48, 0};  // positions 0-47: the prompt and 8 drafts
  ASSERT_TRUE(engine.Schedule(std::span<const StepRequest>(&whole, 1)).admitted);
  std::vector<int32_t> tokens = prompt;
  tokens.resize(48, 3);
  const std::vector<int32_t> rows = {47};
  engine.Compute(tokens, rows, nullptr, next.data());
  EXPECT_EQ(m.GetSequenceInfo(a).num_scheduled, 48);
  EXPECT_EQ(m.FindInvariantViolation(), "");
}

// AbandonStep undoes an admitted step (what Server::Step does when its Compute throws): the
// sequence is as before it, and scheduling it again computes what a fresh engine computes.
TEST(ServerTest, EngineAbandonStepUndoesTheStep) {
  const LlamaModel model = RepeatingModel();
  std::vector<int32_t> prompt(40);
  for (int i = 0; i < 40; ++i) prompt[i] = 10 + i;
  const std::vector<int32_t> tokens(prompt.begin(), prompt.begin() + 32), rows = {31};
  auto first_step = [&](CpuEngine& engine, SeqId seq) {
    const StepRequest r{seq, 32, 0};
    EXPECT_TRUE(engine.Schedule(std::span<const StepRequest>(&r, 1)).admitted);
    std::vector<int32_t> next(1);
    engine.Compute(tokens, rows, nullptr, next.data());
    return next[0];
  };
  CpuEngine fresh(model, {"turboquant_4bit_nc", 0, 16, 9});
  const int32_t expected = first_step(fresh, fresh.manager().AddSequence(prompt));

  CpuEngine engine(model, {"turboquant_4bit_nc", 0, 16, 9});
  KVCacheManager& m = engine.manager();
  EXPECT_THAT(
      [&] { engine.AbandonStep(); },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("no scheduled step to abandon")));
  const SeqId seq = m.AddSequence(prompt);
  const StepRequest r{seq, 32, 0};
  ASSERT_TRUE(engine.Schedule(std::span<const StepRequest>(&r, 1)).admitted);
  EXPECT_EQ(m.Stats().blocks_in_use, 2);
  std::vector<int32_t> wrong = tokens;
  wrong[0] = 999;
  EXPECT_THROW(engine.Compute(wrong, rows, nullptr, nullptr), Error);  // (still pending)
  engine.AbandonStep();
  EXPECT_EQ(m.GetSequenceInfo(seq).num_scheduled, 0);
  EXPECT_EQ(m.Stats().blocks_in_use, 0);
  EXPECT_EQ(m.FindInvariantViolation(), "");
  EXPECT_THAT([&] { engine.Compute(tokens, rows, nullptr, nullptr); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("no scheduled step")));
  EXPECT_EQ(first_step(engine, seq), expected);
}

// Options past what the engine can run in one step (CudaEngine: 65,535 sequences, rows · query
// heads within int32) are refused when the server is built, not at the step that reaches them.
TEST(ServerTest, RefusesOptionsPastTheEnginesStep) {
  struct SmallStepEngine : CpuEngine {
    using CpuEngine::CpuEngine;
    int MaxStepSequences() const override { return 4; }
    int MaxStepTokens() const override { return 32; }
  };
  const LlamaModel model = RepeatingModel();
  SmallStepEngine engine(model, {"turboquant_4bit_nc", 0, 16, 9});
  EXPECT_THAT(
      [&] {
        Server(engine, ServerOptions{5, 32});
      },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr(
          "options.max_running = 5; allowed: 1 to 4 (the engine's most sequences")));
  EXPECT_THAT(
      [&] {
        Server(engine, ServerOptions{4, 33});
      },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr(
          "options.step_tokens = 33; allowed: at most 32 (the engine's most rows")));
  EXPECT_NO_THROW(Server(engine, ServerOptions{4, 32}));
}

// A Forward whose cache cannot be allocated leaves the engine unsized: it kept the size, and every
// later call failed on the same allocation.
TEST(ServerTest, EngineWhosePoolCannotBeAllocatedStaysUnsized) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reserves more address space than the limit allows";
#endif
  const LlamaModel model = RepeatingModel(1 << 22);
  CpuEngine engine(model, {"turboquant_4bit_nc", 0, 16, 0});  // sized by the first Forward
  const std::vector<int32_t> huge(size_t{1} << 22, 5);        // a 2.3 GB cache
  {
    const tqkv::testing::AddressSpaceLimit limit(int64_t{64} << 20);
    EXPECT_THROW(engine.Forward(huge, 4096), std::bad_alloc);
    EXPECT_EQ(engine.Forward(std::vector<int32_t>{1, 2, 3}, 3).size(), 3u * 1000);
  }
}

}  // namespace
}  // namespace tqkv::model
