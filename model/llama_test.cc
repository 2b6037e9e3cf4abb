#include "model/llama.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/tokenizer.h"
#include "runtime/error.h"

namespace tqkv::model {
namespace {

// The forward pass against an independent implementation of the same GGUF file: llama.cpp
// (tools/model/llama_cpp_reference.py -> model/testdata/smollm2_llama_cpp_logits.json). llama.cpp
// multiplies the Q4_1 / Q8_0 weights by activations it quantizes to 8 bits, this reference by
// fp32 activations, so logits differ by that rounding ("quantized-weight noise"); the token ids
// and the top-1 token at every position must agree (measured: 83 positions, mean top-5 logit
// difference 0.18, largest 0.89; two positions are near-ties of 0.03 and 0.07).
TEST(LlamaTest, MatchesLlamaCpp) {
  const char* path = std::getenv("TQKV_SMOLLM2_GGUF");
  if (path == nullptr || *path == '\0') GTEST_SKIP() << "TQKV_SMOLLM2_GGUF not set";
  const GgufFile f = GgufFile::Open(path);
  const LlamaModel model = LlamaModel::FromGguf(f);
  const Tokenizer tokenizer = Tokenizer::FromGguf(f);
  EXPECT_EQ(model.config().num_layers, 30);
  EXPECT_EQ(model.config().head_dim, 64);
  // The shape the GPU benchmark builds with random weights is this file's.
  const LlamaConfig c = model.config(), s = LlamaModel::SmolLm2Config();
  EXPECT_EQ(std::tie(c.num_layers, c.hidden, c.ffn, c.num_heads, c.num_kv_heads, c.head_dim,
                     c.vocab, c.context, c.rms_eps, c.rope_base),
            std::tie(s.num_layers, s.hidden, s.ffn, s.num_heads, s.num_kv_heads, s.head_dim,
                     s.vocab, s.context, s.rms_eps, s.rope_base));
  std::ifstream in("model/testdata/smollm2_llama_cpp_logits.json");
  ASSERT_TRUE(in);
  const nlohmann::json ref = nlohmann::json::parse(in);
  const int vocab = model.config().vocab;
  int positions = 0, near_ties = 0;
  double max_diff = 0.0, sum_diff = 0.0;
  for (const auto& p : ref["prompts"]) {
    const std::string prompt = p["prompt"].get<std::string>();
    SCOPED_TRACE(prompt);
    const std::vector<int32_t> ids = tokenizer.Encode(prompt);
    ASSERT_EQ(ids, p["ids"].get<std::vector<int32_t>>());
    const std::vector<float> logits = ReferenceForward(model, ids);
    for (size_t t = 0; t < ids.size(); ++t) {
      const float* row = logits.data() + t * vocab;
      const auto top_ids = p["top_ids"][t].get<std::vector<int32_t>>();
      const auto top_logits = p["top_logits"][t].get<std::vector<double>>();
      // Near-ties (llama.cpp's top two within 0.25, below the rounding noise): ours is one of
      // its top two. Everywhere else the same top-1 token.
      const int32_t ours = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
      if (top_logits[0] - top_logits[1] > 0.25) {
        EXPECT_EQ(ours, top_ids[0]) << "position " << t;
      } else {
        EXPECT_THAT(ours, ::testing::AnyOf(top_ids[0], top_ids[1])) << "position " << t;
        ++near_ties;
      }
      for (size_t k = 0; k < top_ids.size(); ++k) {
        const double diff = std::fabs(row[top_ids[k]] - top_logits[k]);
        max_diff = std::max(max_diff, diff);
        sum_diff += diff;
      }
      ++positions;
    }
  }
  const double mean_diff = sum_diff / (5.0 * positions);
  RecordProperty("max_logit_diff", std::to_string(max_diff));
  RecordProperty("mean_logit_diff", std::to_string(mean_diff));
  std::printf(
      "llama.cpp vs ReferenceForward over %d positions (%d near-ties): top-5 logits "
      "differ by %.3f on average, %.3f at most\n",
      positions, near_ties, mean_diff, max_diff);
  EXPECT_LT(mean_diff, 0.5);
  EXPECT_LT(max_diff, 2.0);
}

// A one-layer model of F32 weights (hidden 8, 2 heads of 4, 1 KV head, ffn 8, vocab 5) with the
// metadata `extra` writes (`extra_keys` entries), with `rope_freqs` that tensor too.
std::vector<uint8_t> TinyLlamaGguf(int extra_keys, const std::function<void(GgufWriter&)>& extra,
                                   bool rope_freqs = false, float eps = 1e-5f,
                                   float freq_base = 10000.0f) {
  constexpr int kHidden = 8, kKv = 4, kFfn = 8, kVocab = 5;
  std::vector<std::pair<std::string, std::vector<uint64_t>>> tensors = {
      {"token_embd.weight", {kHidden, kVocab}},
      {"output_norm.weight", {kHidden}},
      {"blk.0.attn_norm.weight", {kHidden}},
      {"blk.0.attn_q.weight", {kHidden, kHidden}},
      {"blk.0.attn_k.weight", {kHidden, kKv}},
      {"blk.0.attn_v.weight", {kHidden, kKv}},
      {"blk.0.attn_output.weight", {kHidden, kHidden}},
      {"blk.0.ffn_norm.weight", {kHidden}},
      {"blk.0.ffn_gate.weight", {kHidden, kFfn}},
      {"blk.0.ffn_up.weight", {kHidden, kFfn}},
      {"blk.0.ffn_down.weight", {kFfn, kHidden}}};
  if (rope_freqs) tensors.push_back({"rope_freqs.weight", {2}});
  GgufWriter w;
  w.Header(tensors.size(), 9 + extra_keys);
  w.String("general.architecture", "llama");
  w.U32("llama.block_count", 1);
  w.U32("llama.embedding_length", kHidden);
  w.U32("llama.feed_forward_length", kFfn);
  w.U32("llama.attention.head_count", 2);
  w.U32("llama.attention.head_count_kv", 1);
  w.U32("llama.context_length", 64);
  w.F32("llama.attention.layer_norm_rms_epsilon", eps);
  w.F32("llama.rope.freq_base", freq_base);
  extra(w);
  uint64_t offset = 0;
  for (const auto& [name, dims] : tensors) {
    w.Str(name).Put<uint32_t>(static_cast<uint32_t>(dims.size()));
    uint64_t n = 1;
    for (uint64_t d : dims) w.Put<uint64_t>(d), n *= d;
    w.Put<uint32_t>(0).Put<uint64_t>(offset);  // F32
    offset += (n * 4 + 31) / 32 * 32;
  }
  w.Align(32);
  for (const auto& [name, dims] : tensors) {
    uint64_t n = 1;
    for (uint64_t d : dims) n *= d;
    for (uint64_t i = 0; i < n; ++i) w.Put<float>(0.01f * static_cast<float>(i % 7));
    w.Align(32);
  }
  return w.bytes;
}

// Metadata the forward pass does not implement, or values it cannot run with, are refused by
// name (RoPE scaling and a partial RoPE were ignored; freq_base 0 or eps -1 gave NaN logits).
TEST(LlamaTest, RefusesMetadataItDoesNotImplement) {
  const LlamaModel tiny =
      LlamaModel::FromGguf(GgufFile::Parse(TinyLlamaGguf(0, [](GgufWriter&) {}), "tiny"));
  EXPECT_EQ(tiny.config().head_dim, 4);
  auto message = [](int keys, const std::function<void(GgufWriter&)>& extra,
                    bool rope_freqs = false) {
    try {
      LlamaModel::FromGguf(GgufFile::Parse(TinyLlamaGguf(keys, extra, rope_freqs), "tiny"));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  using ::testing::HasSubstr;
  EXPECT_THAT(message(1, [](GgufWriter& w) { w.String("llama.rope.scaling.type", "linear"); }),
              HasSubstr("llama.rope.scaling.type = linear"));
  EXPECT_EQ(message(1, [](GgufWriter& w) { w.String("llama.rope.scaling.type", "none"); }),
            "no error");
  EXPECT_THAT(message(1, [](GgufWriter& w) { w.F32("llama.rope.scaling.factor", 4.0f); }),
              HasSubstr("llama.rope.scaling.factor = 4"));
  EXPECT_THAT(message(1, [](GgufWriter& w) { w.U32("llama.rope.dimension_count", 2); }),
              HasSubstr("llama.rope.dimension_count = 2"));
  EXPECT_EQ(message(1, [](GgufWriter& w) { w.U32("llama.rope.dimension_count", 4); }), "no error");
  EXPECT_THAT(message(1, [](GgufWriter& w) { w.U32("llama.attention.key_length", 8); }),
              HasSubstr("llama.attention.key_length = 8"));
  EXPECT_THAT(message(
                  0, [](GgufWriter&) {}, /*rope_freqs=*/true),
              HasSubstr("rope_freqs.weight"));
  auto numbers = [](float eps, float base) {
    try {
      LlamaModel::FromGguf(GgufFile::Parse(TinyLlamaGguf(
                                               0, [](GgufWriter&) {}, false, eps, base),
                                           "tiny"));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(numbers(-1.0f, 10000.0f), HasSubstr("layer_norm_rms_epsilon = -1"));
  EXPECT_THAT(numbers(1e-5f, 0.0f), HasSubstr("llama.rope.freq_base = 0"));
  EXPECT_THAT(numbers(1e-5f, std::nanf("")), HasSubstr("llama.rope.freq_base = nan"));
}

// Random weights of a given shape: deterministic by seed, shaped as FromGguf's, refused for
// shapes FromGguf refuses; the CPU forward pass runs on them.
TEST(LlamaTest, RandomInit) {
  LlamaConfig c;
  c.num_layers = 2;
  c.hidden = 128;
  c.ffn = 256;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 32;
  c.vocab = 300;
  c.context = 64;
  const LlamaModel a = LlamaModel::RandomInit(c, 5), b = LlamaModel::RandomInit(c, 5);
  EXPECT_EQ(a.layer(1).wk, b.layer(1).wk);
  EXPECT_NE(a.layer(1).wk, LlamaModel::RandomInit(c, 6).layer(1).wk);
  EXPECT_EQ(a.layer(0).wk.size(), 128u * 64);
  EXPECT_EQ(a.layer(0).down.size(), 256u * 128);
  EXPECT_EQ(a.output().size(), 300u * 128);  // tied
  const std::vector<float> logits = ReferenceForward(a, std::vector<int32_t>{1, 2, 3});
  ASSERT_EQ(logits.size(), 3u * 300);
  for (float x : logits) ASSERT_TRUE(std::isfinite(x));
  LlamaConfig bad = c;
  bad.num_kv_heads = 3;
  EXPECT_THROW(LlamaModel::RandomInit(bad, 1), Error);
  bad = c;
  bad.head_dim = 31;
  EXPECT_THROW(LlamaModel::RandomInit(bad, 1), Error);
  bad = c;
  bad.context = 0;
  EXPECT_THROW(LlamaModel::RandomInit(bad, 1), Error);
  // FromGguf's bounds: a NaN or non-positive epsilon or RoPE base made every logit NaN.
  for (float v : {std::nanf(""), 0.0f, -1.0f}) {
    bad = c;
    bad.rms_eps = v;
    EXPECT_THAT([&] { LlamaModel::RandomInit(bad, 1); },
                ::testing::ThrowsMessage<Error>(::testing::HasSubstr("config.rms_eps")));
    bad = c;
    bad.rope_base = v;
    EXPECT_THAT([&] { LlamaModel::RandomInit(bad, 1); },
                ::testing::ThrowsMessage<Error>(::testing::HasSubstr("config.rope_base")));
  }
  bad = c;
  bad.vocab = (1 << 24) + 1;
  EXPECT_THAT([&] { LlamaModel::RandomInit(bad, 1); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("config.vocab = 16777217")));
}

}  // namespace
}  // namespace tqkv::model
