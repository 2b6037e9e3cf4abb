#include "model/engine.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "model/gguf.h"
#include "model/llama.h"
#include "model/server.h"
#include "model/tokenizer.h"
#include "runtime/error.h"

namespace tqkv::model {
namespace {

struct Loaded {
  LlamaModel model;
  Tokenizer tokenizer;
};

// SmolLM2-135M (tools/test.sh fetches it), loaded once.
const Loaded* SmolLm2() {
  static const std::optional<Loaded> loaded = []() -> std::optional<Loaded> {
    const char* path = std::getenv("TQKV_SMOLLM2_GGUF");
    if (path == nullptr || *path == '\0') return std::nullopt;
    const GgufFile f = GgufFile::Open(path);
    return Loaded{LlamaModel::FromGguf(f), Tokenizer::FromGguf(f)};
  }();
  return loaded ? &*loaded : nullptr;
}

constexpr const char* kText =
    "The history of the city begins in the Roman period, when a small settlement grew up on the "
    "northern bank of the river. Over the following centuries it became an important market town.";

int Argmax(const float* x, int n) { return static_cast<int>(std::max_element(x, x + n) - x); }

// Fraction of positions whose top-1 token agrees, and the largest logit difference.
std::pair<double, float> Compare(const std::vector<float>& a, const std::vector<float>& b,
                                 int vocab) {
  const size_t n = a.size() / vocab;
  int agree = 0;
  float max_diff = 0.0f;
  for (size_t p = 0; p < n; ++p) {
    agree += Argmax(a.data() + p * vocab, vocab) == Argmax(b.data() + p * vocab, vocab);
    for (int i = 0; i < vocab; ++i) {
      max_diff = std::max(max_diff, std::fabs(a[p * vocab + i] - b[p * vocab + i]));
    }
  }
  return {static_cast<double>(agree) / n, max_diff};
}

TEST(EngineTest, ReferenceForwardContinuesAFact) {
  const Loaded* s = SmolLm2();
  if (s == nullptr) GTEST_SKIP() << "TQKV_SMOLLM2_GGUF not set";
  const std::vector<int32_t> ids = s->tokenizer.Encode("The capital of France is");
  const std::vector<float> logits = ReferenceForward(s->model, ids);
  const int vocab = s->model.config().vocab;
  const int next = Argmax(logits.data() + (ids.size() - 1) * vocab, vocab);
  EXPECT_EQ(s->tokenizer.Decode(std::vector<int32_t>{next}), " Paris");
}

// A bf16 cache differs from the exact fp32 reference only by rounding K and V to bf16.
TEST(EngineTest, Bf16CacheMatchesTheReference) {
  const Loaded* s = SmolLm2();
  if (s == nullptr) GTEST_SKIP() << "TQKV_SMOLLM2_GGUF not set";
  const std::vector<int32_t> ids = s->tokenizer.Encode(kText);
  const std::vector<float> ref = ReferenceForward(s->model, ids);
  CpuEngine bf16(s->model, {"bf16", 0, 16, 0});
  const auto [agree, diff] = Compare(bf16.Forward(ids, 16), ref, s->model.config().vocab);
  EXPECT_EQ(agree, 1.0);
  EXPECT_LT(diff, 0.25f);
  EXPECT_EQ(bf16.kv_bytes_per_token(), 30 * 3 * 4 * 64);
}

// Through TurboQuant 4bit_nc: the chunking of the prefill does not change a bit, a prefix hit
// gives the same logits for the positions it computes, and the top-1 token mostly agrees with
// the reference.
TEST(EngineTest, FourBitCacheIsChunkAndPrefixInvariant) {
  const Loaded* s = SmolLm2();
  if (s == nullptr) GTEST_SKIP() << "TQKV_SMOLLM2_GGUF not set";
  const int vocab = s->model.config().vocab;
  const std::vector<int32_t> ids = s->tokenizer.Encode(kText);
  CpuEngine a(s->model, {"turboquant_4bit_nc", 0, 16, 0});
  const std::vector<float> whole = a.Forward(ids, 64);
  CpuEngine b(s->model, {"turboquant_4bit_nc", 0, 16, 0});
  EXPECT_EQ(b.Forward(ids, 5), whole);
  // The second run of the same tokens starts after the full blocks the first one published.
  const std::vector<float> again = b.Forward(ids, 64);
  const int64_t hit = b.prefix_hit_tokens();
  EXPECT_EQ(hit, static_cast<int64_t>(ids.size() - 1) / 16 * 16);
  for (size_t p = 0; p < ids.size(); ++p) {
    const bool cached = static_cast<int64_t>(p) < hit;
    for (int i = 0; i < vocab; i += 997) {
      if (cached) {
        EXPECT_TRUE(std::isnan(again[p * vocab + i])) << p;
      } else {
        ASSERT_EQ(again[p * vocab + i], whole[p * vocab + i]) << p;
      }
    }
  }
  const auto [agree, diff] = Compare(whole, ReferenceForward(s->model, ids), vocab);
  EXPECT_GE(agree, 0.85);
  EXPECT_EQ(a.kv_bytes_per_token(), 30 * 3 * (32 + 32 + 3 * 2));
}

// The real model's keys through 4bit_nc: each layer's relative key MSE near TurboQuant's D_mse
// for 4 bits (0.0095; measured 0.0082-0.0090 over 512 tokens), values' 4-bit min-max error
// (0.010 on average over 512 tokens, up to 0.021 in a layer on this short text); bf16's only
// rounding.
TEST(EngineTest, LayerErrorsMatchTheFormat) {
  const Loaded* s = SmolLm2();
  if (s == nullptr) GTEST_SKIP() << "TQKV_SMOLLM2_GGUF not set";
  const std::vector<int32_t> ids = s->tokenizer.Encode(kText);
  CpuEngine four(s->model, {"turboquant_4bit_nc", 0, 16, 0});
  LayerErrors e;
  four.Forward(ids, 16, &e);
  CpuEngine bf16(s->model, {"bf16", 0, 16, 0});
  LayerErrors b;
  bf16.Forward(ids, 16, &b);
  for (int l = 0; l < 30; ++l) {
    EXPECT_GT(e.key_mse(l), 0.005) << l;
    EXPECT_LT(e.key_mse(l), 0.0115) << l;
    EXPECT_LT(e.value_mse(l), 0.04) << l;
    EXPECT_GT(e.mean_cosine(l), 0.95) << l;
    EXPECT_LT(b.key_mse(l), 1e-4) << l;
    EXPECT_GT(b.mean_cosine(l), 0.9999) << l;
    EXPECT_EQ(e.outputs[l], static_cast<int64_t>(ids.size()) * 9);
  }
  // Layer errors need every position computed: not after a prefix hit.
  four.Forward(ids, 16);
  EXPECT_THAT([&] { four.Forward(ids, 16, &e); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("came from the prefix cache")));
}

Request Req(std::vector<int32_t> prompt, int max_new, Sampling sampling = {}) {
  Request r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = max_new;
  r.sampling = sampling;
  return r;
}

// One request through a Server of its own on `engine` (prefill in chunks of `chunk`).
Completion GenerateOne(CpuEngine& engine, const std::vector<int32_t>& prompt, int max_new,
                       int chunk, Sampling sampling = {}, int32_t stop = -1) {
  Server server(engine, {1, chunk});
  Request r = Req(prompt, max_new, sampling);
  if (stop >= 0) r.stop_tokens = {stop};
  const int id = server.Submit(std::move(r));
  server.RunToCompletion();
  return server.completion(id);
}

// Generation one token per decode step through the cache: greedy through a bf16 cache is the
// fp32 reference's greedy continuation; a prefix hit does not change the tokens; sampling is
// reproducible by seed.
TEST(EngineTest, GeneratesThroughTheCache) {
  const Loaded* s = SmolLm2();
  if (s == nullptr) GTEST_SKIP() << "TQKV_SMOLLM2_GGUF not set";
  const int vocab = s->model.config().vocab;
  std::vector<int32_t> ids = s->tokenizer.Encode("The capital of France is");
  std::vector<int32_t> greedy;  // by recomputing the whole reference each token
  for (int i = 0; i < 6; ++i) {
    const std::vector<float> logits = ReferenceForward(s->model, ids);
    greedy.push_back(Argmax(logits.data() + (ids.size() - 1) * vocab, vocab));
    ids.push_back(greedy.back());
  }
  ids.resize(ids.size() - 6);
  CpuEngine bf16(s->model, {"bf16", 0, 16, 64});
  const Completion g = GenerateOne(bf16, ids, 6, 4);
  EXPECT_TRUE(g.finished);
  EXPECT_EQ(g.tokens, greedy);
  EXPECT_EQ(s->tokenizer.Decode(std::vector<int32_t>{g.tokens[0]}), " Paris");

  CpuEngine four(s->model, {"turboquant_4bit_nc", 0, 16, 64});
  const std::vector<int32_t> prompt = s->tokenizer.Encode(kText);
  const Completion first = GenerateOne(four, prompt, 12, 16);
  const Completion again = GenerateOne(four, prompt, 12, 16);
  EXPECT_EQ(first.prefix_hit_tokens, 0);
  EXPECT_EQ(again.prefix_hit_tokens, static_cast<int64_t>(prompt.size() - 1) / 16 * 16);
  EXPECT_EQ(again.tokens, first.tokens);
  const Completion a = GenerateOne(four, prompt, 12, 16, {0.8f, 7});
  const Completion b = GenerateOne(four, prompt, 12, 16, {0.8f, 7});
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_NE(a.tokens, first.tokens);
  EXPECT_EQ(GenerateOne(four, prompt, 12, 16, {}, first.tokens[2]).tokens.size(), 3u);  // stop
}

// The serving loop: requests arriving over several steps, batched together, sharing a chat system
// prompt through the prefix cache, and (with a small pool) preempted and recomputed, generate
// exactly the tokens each request generates alone on a fresh engine. A request longer than the
// pool fails alone.
TEST(EngineTest, ServerBatchesLikeOneAtATime) {
  const Loaded* s = SmolLm2();
  if (s == nullptr) GTEST_SKIP() << "TQKV_SMOLLM2_GGUF not set";
  const std::string system =
      "<|im_start|>system\nYou are a helpful assistant running inside a small test. Answer every "
      "question in one short sentence, be precise, and do not add any explanation.<|im_end|>\n";
  std::vector<Request> requests;
  for (const char* q : {"What is the capital of France?", "Name a large ocean.",
                        "What color is the sky on a clear day?"}) {
    requests.push_back(
        Req(s->tokenizer.Encode(
                system + "<|im_start|>user\n" + q + "<|im_end|>\n<|im_start|>assistant\n", true),
            8));
  }
  requests.push_back(Req(s->tokenizer.Encode(kText), 8, {0.8f, 3}));
  ASSERT_GE(requests[0].prompt.size(), 48u);

  std::vector<std::vector<int32_t>> alone;
  for (const Request& r : requests) {
    CpuEngine engine(s->model, {"turboquant_4bit_nc", 0, 16, 64});
    const Completion c = GenerateOne(engine, r.prompt, r.max_new_tokens, 32, r.sampling);
    ASSERT_EQ(c.tokens.size(), 8u);
    alone.push_back(c.tokens);
  }

  // Arrivals at steps 0, 0, 2 and 5; 16-token steps, so prompts take several chunks.
  auto serve = [&](int32_t num_blocks, int max_running) {
    CpuEngine engine(s->model, {"turboquant_4bit_nc", 0, 16, num_blocks});
    Server server(engine, {max_running, 16});
    const int arrive[] = {0, 0, 2, 5};
    for (int step = 0, next = 0; next < 4 || !server.idle(); ++step) {
      for (; next < 4 && arrive[next] <= step; ++next) {
        EXPECT_EQ(server.Submit(requests[next]), next);
      }
      server.Step();
    }
    for (int i = 0; i < 4; ++i) {
      EXPECT_TRUE(server.completion(i).finished);
      EXPECT_EQ(server.completion(i).tokens, alone[i]) << "request " << i;
    }
    EXPECT_EQ(engine.manager().FindInvariantViolation(), "");
    return server.stats();
  };
  const ServerStats roomy = serve(64, 4);
  EXPECT_GE(roomy.max_batch_sequences, 3);
  EXPECT_GE(roomy.prefix_hit_tokens, 2 * 32);  // two later requests reuse the system prompt
  EXPECT_EQ(roomy.preemptions, 0);
  EXPECT_EQ(roomy.generated_tokens, 32);
  const ServerStats tight = serve(9, 4);  // 8 usable blocks of 16: about two requests at once
  EXPECT_GT(tight.preemptions, 0);

  // A prompt longer than the pool is refused at Submit; one that fits but whose tokens outgrow
  // the pool runs, then fails alone, and the other request keeps its tokens.
  CpuEngine engine(s->model, {"turboquant_4bit_nc", 0, 16, 9});
  Server server(engine, {4, 64});
  std::vector<int32_t> huge;
  for (int i = 0; i < 8; ++i)
    huge.insert(huge.end(), requests[3].prompt.begin(), requests[3].prompt.end());
  ASSERT_GT(huge.size(), 128u);
  EXPECT_THAT([&] { server.Submit(Req(huge, 4)); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("at most 128 tokens")));
  EXPECT_TRUE(server.idle());
  const int bad = server.Submit(Req(requests[3].prompt, 128));
  const int good = server.Submit(requests[1]);
  server.RunToCompletion();
  EXPECT_THAT(server.completion(bad).error, ::testing::HasSubstr("more than the pool"));
  EXPECT_EQ(server.completion(good).tokens, alone[1]);
}

// Speculative decoding by prompt lookup (ServerOptions::spec_tokens): the drafts are verified as
// extra rows of their sequence over the compressed cache and the rejected positions rewound, so
// requests generate exactly the tokens they generate without drafts, greedy or sampled, in fewer
// steps where the text repeats the prompt; also with stop tokens, max_new_tokens below the
// drafts, drafts past what the pool holds, several requests arriving while others decode (verify
// rows beside prompt chunks) and preemption.
TEST(EngineTest, SpeculativeDecodingKeepsTheTokens) {
  const Loaded* s = SmolLm2();
  if (s == nullptr) GTEST_SKIP() << "TQKV_SMOLLM2_GGUF not set";
  // Asked to repeat a text, the model copies it: prompt lookup drafts the copy.
  const std::vector<int32_t> copy =
      s->tokenizer.Encode(std::string("<|im_start|>user\nRepeat this text exactly: ") + kText +
                              "<|im_end|>\n<|im_start|>assistant\n",
                          true);
  const std::vector<int32_t> copy2 =
      s->tokenizer.Encode(std::string("<|im_start|>user\nCopy this text word for word: ") + kText +
                              "<|im_end|>\n<|im_start|>assistant\n",
                          true);
  const std::vector<int32_t> other = s->tokenizer.Encode("The capital of France is");
  struct Run {
    std::vector<std::vector<int32_t>> tokens;
    ServerStats stats;
  };
  auto serve = [&](int spec, std::vector<Request> requests, int32_t num_blocks = 64,
                   int step_tokens = 16) {
    CpuEngine engine(s->model, {"turboquant_4bit_nc", 0, 16, num_blocks});
    ServerOptions options{4, step_tokens};
    options.spec_tokens = spec;
    Server server(engine, options);
    for (int step = 0, next = 0; next < static_cast<int>(requests.size()) || !server.idle();
         ++step) {
      // One arrival every third step, so that later prompts are prefilled beside decodes.
      if (next < static_cast<int>(requests.size()) && step % 3 == 0)
        server.Submit(requests[next++]);
      server.Step();
    }
    EXPECT_EQ(engine.manager().FindInvariantViolation(), "");
    Run run;
    for (int i = 0; i < static_cast<int>(requests.size()); ++i) {
      EXPECT_TRUE(server.completion(i).finished);
      EXPECT_EQ(server.completion(i).error, "");
      run.tokens.push_back(server.completion(i).tokens);
    }
    run.stats = server.stats();
    return run;
  };
  const Run plain = serve(0, {Req(copy, 24)});
  const Run spec = serve(4, {Req(copy, 24)});
  ASSERT_EQ(plain.tokens[0].size(), 24u);
  EXPECT_EQ(spec.tokens, plain.tokens);
  EXPECT_EQ(plain.stats.draft_tokens, 0);
  EXPECT_GT(spec.stats.accepted_drafts, 8);
  EXPECT_LE(spec.stats.accepted_drafts, spec.stats.draft_tokens);
  EXPECT_LT(spec.stats.steps, plain.stats.steps - 4);
  EXPECT_EQ(spec.stats.generated_tokens, 24);

  // A stop token within the drafts, and max_new_tokens below a step's drafts.
  Request stop = Req(copy, 24);
  stop.stop_tokens = {plain.tokens[0][9]};
  const size_t stop_at =
      std::find(plain.tokens[0].begin(), plain.tokens[0].end(), plain.tokens[0][9]) -
      plain.tokens[0].begin();
  const Run stopped = serve(4, {stop, Req(copy, 3)});
  EXPECT_EQ(stopped.tokens[0],
            std::vector<int32_t>(plain.tokens[0].begin(), plain.tokens[0].begin() + stop_at + 1));
  EXPECT_EQ(stopped.tokens[1],
            std::vector<int32_t>(plain.tokens[0].begin(), plain.tokens[0].begin() + 3));

  // Drafts reach past what a small pool holds (they are capped by max_new_tokens only) where the
  // request ends at its stop token first: the step runs without them, nothing fails.
  Request near = Req(copy, 40);
  near.stop_tokens = {plain.tokens[0][10]};
  const Run edge_plain = serve(0, {near}, 5);
  const Run edge = serve(8, {near}, 5);
  EXPECT_LE(edge_plain.tokens[0].size(), 11u);
  EXPECT_EQ(edge.tokens, edge_plain.tokens);
  EXPECT_EQ(edge.stats.preemptions, 0);

  // Several requests, arriving while others decode, two of them sampled (one copying: it drafts
  // and keeps drafts); a pool tight enough to preempt. Every request's tokens, sampled ones too,
  // are the same with drafts, beside others and preempted.
  const std::vector<Request> mixed = {Req(copy, 16), Req(other, 12), Req(copy2, 20),
                                      Req(other, 8, {0.8f, 5}), Req(copy, 20, {0.5f, 7})};
  const Run alone = serve(0, mixed);
  const Run together = serve(4, mixed);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(together.tokens[i], alone.tokens[i]) << "request " << i;
  EXPECT_GT(together.stats.accepted_drafts, 0);
  const Run sampled_alone = serve(6, {mixed[4]});
  EXPECT_EQ(sampled_alone.tokens[0], alone.tokens[4]);
  EXPECT_GT(sampled_alone.stats.accepted_drafts, 0);
  const Run tight = serve(4, mixed, 9);
  EXPECT_GT(tight.stats.preemptions, 0);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(tight.tokens[i], alone.tokens[i]) << "request " << i;
  EXPECT_EQ(tight.tokens[3].size(), 8u);
}

// Bad requests and options are refused, naming the field, and leave the server as it was.
TEST(EngineTest, ServerRejectsBadInput) {
  const Loaded* s = SmolLm2();
  if (s == nullptr) GTEST_SKIP() << "TQKV_SMOLLM2_GGUF not set";
  CpuEngine sized(s->model, {"turboquant_4bit_nc", 0, 16, 0});
  EXPECT_THROW((void)Server(sized, ServerOptions{}), Error);  // the pool must be sized
  CpuEngine engine(s->model, {"turboquant_4bit_nc", 0, 16, 16});
  EXPECT_THROW((void)Server(engine, ServerOptions{0, 16}), Error);
  EXPECT_THROW((void)Server(engine, ServerOptions{4, 0}), Error);
  for (const auto& [spec, ngram, name] :
       {std::tuple{-1, 3, "options.spec_tokens"}, std::tuple{65, 3, "options.spec_tokens"},
        std::tuple{4, 0, "options.spec_ngram"}}) {
    ServerOptions o;
    o.spec_tokens = spec;
    o.spec_ngram = ngram;
    try {
      (void)Server(engine, o);
      ADD_FAILURE() << name << " accepted";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr(name));
    }
  }
  Server server(engine, {});
  auto message = [&](Request r) {
    try {
      server.Submit(std::move(r));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(message(Req({}, 4)), ::testing::HasSubstr("prompt.size()"));
  EXPECT_THAT(message(Req({1, 49152}, 4)), ::testing::HasSubstr("49152"));
  EXPECT_THAT(message(Req({1, 2}, 0)), ::testing::HasSubstr("max_new_tokens"));
  EXPECT_THAT(message(Req({1, 2}, 4, {-1.0f, 0})), ::testing::HasSubstr("temperature"));
  // SmolLM2's context_length is 8,192: a request past it is refused, as vLLM refuses one past
  // max_model_len.
  EXPECT_THAT(message(Req({1, 2}, 8191)),
              ::testing::HasSubstr("prompt.size() + max_new_tokens = 8193"));
  EXPECT_TRUE(server.idle());
  // A step is computed once (again after its Commit it overwrote committed K/V).
  const SeqId seq = engine.manager().AddSequence(std::vector<int32_t>{1, 2, 3});
  const StepRequest step{seq, 3, 0};
  ASSERT_TRUE(engine.Schedule(std::span<const StepRequest>(&step, 1)).admitted);
  const std::vector<int32_t> tokens = {1, 2, 3}, rows = {2};
  std::vector<int32_t> next(1);
  engine.Compute(tokens, rows, nullptr, next.data());
  engine.manager().Commit(seq, next);
  EXPECT_THAT([&] { engine.Compute(tokens, rows, nullptr, next.data()); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("no scheduled step")));
  engine.manager().Free(seq);
  // A token outside the vocabulary is refused before anything changes; a Forward that throws
  // later (layer errors over a prefix hit) frees its sequence: it stayed live, holding the pool's
  // 15 blocks, and the next call failed with "blocks missing".
  EXPECT_THAT(
      [&] {
        engine.Forward(std::vector<int32_t>{5, 49152, 7}, 2);
      },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("tokens[1] = 49152")));
  std::vector<int32_t> prompt(15 * 16);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(i + 1);
  EXPECT_EQ(engine.Forward(prompt, 64).size(), prompt.size() * 49152);
  LayerErrors errors;
  EXPECT_THAT([&] { engine.Forward(prompt, 64, &errors); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("from the prefix cache")));
  EXPECT_EQ(engine.manager().Stats().num_sequences, 0);
  // ... and leaves no step of its freed sequence to compute.
  EXPECT_THAT([&] { engine.Compute(tokens, rows, nullptr, next.data()); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("no scheduled step")));
  for (int32_t& t : prompt) t += 1000;
  EXPECT_EQ(engine.Forward(prompt, 64).size(), prompt.size() * 49152);
  EXPECT_TRUE(server.idle());
  EXPECT_FALSE(server.Step());
  EXPECT_EQ(server.Submit(Req({1, 2}, 2)), 0);  // ids start at 0: nothing was queued before
}

TEST(EngineTest, BoundaryLayersAreBf16) {
  const Loaded* s = SmolLm2();
  if (s == nullptr) GTEST_SKIP() << "TQKV_SMOLLM2_GGUF not set";
  CpuEngine e(s->model, {"turboquant_4bit_nc", 2, 16, 0});
  for (int l = 0; l < 30; ++l) EXPECT_EQ(e.IsBf16Layer(l), l < 2 || l >= 28) << l;
  EXPECT_EQ(e.kv_bytes_per_token(), 4 * 3 * 4 * 64 + 26 * 3 * 70);
  EXPECT_THAT(
      [&] {
        CpuEngine(s->model, {"turboquant_4bit_nc", 16, 16, 0});
      },
      ::testing::ThrowsMessage<Error>(
          ::testing::HasSubstr("policy.boundary_layers = 16; allowed: 0 to 15")));
  EXPECT_THAT(  // (2 · boundary_layers wrapped past int32 and passed)
      [&] {
        CpuEngine(s->model, {"turboquant_4bit_nc", 1 << 30, 16, 0});
      },
      ::testing::ThrowsMessage<Error>(
          ::testing::HasSubstr("policy.boundary_layers = 1073741824; allowed: 0 to 15")));
  const std::vector<int32_t> ids = s->tokenizer.Encode("The capital of France is");
  const std::vector<float> logits = e.Forward(ids, 4);
  const int vocab = s->model.config().vocab;
  EXPECT_EQ(s->tokenizer.Decode(
                std::vector<int32_t>{Argmax(logits.data() + (ids.size() - 1) * vocab, vocab)}),
            " Paris");
}

}  // namespace
}  // namespace tqkv::model
