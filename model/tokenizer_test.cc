#include "model/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "runtime/error.h"

namespace tqkv::model {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// The tokenizer of the real model (tools/test.sh fetches it; see gguf_test.cc), loaded once.
const Tokenizer* SmolLm2() {
  static const std::optional<Tokenizer> tokenizer = []() -> std::optional<Tokenizer> {
    const char* path = std::getenv("TQKV_SMOLLM2_GGUF");
    if (path == nullptr || *path == '\0') return std::nullopt;
    return Tokenizer::FromGguf(GgufFile::Open(path));
  }();
  return tokenizer ? &*tokenizer : nullptr;
}

// Token ids from Hugging Face's tokenizers (tools/model/tokenizer_reference.py), built from the
// same file's vocabulary and merges: every case, then the text back from the ids.
TEST(TokenizerTest, MatchesHuggingFaceTokenizers) {
  const Tokenizer* t = SmolLm2();
  if (t == nullptr) GTEST_SKIP() << "TQKV_SMOLLM2_GGUF not set";
  std::ifstream in("model/testdata/smollm2_tokenizer_reference.json");
  ASSERT_TRUE(in);
  const nlohmann::json ref = nlohmann::json::parse(in);
  ASSERT_GE(ref["cases"].size(), 10u);
  for (const auto& c : ref["cases"]) {
    const std::string text = c["text"].get<std::string>();
    SCOPED_TRACE(text);
    const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> got = t->Encode(text, /*parse_special=*/true);
    EXPECT_EQ(got, want);
    EXPECT_EQ(t->Decode(got), text);
  }
}

TEST(TokenizerTest, SmolLmPreTokenizerSplitsDigitsAndWhitespace) {
  const Tokenizer* t = SmolLm2();
  if (t == nullptr) GTEST_SKIP() << "TQKV_SMOLLM2_GGUF not set";
  EXPECT_THAT(t->PreTokenize("In 2024, it's"),
              ElementsAre("In", " ", "2", "0", "2", "4", ",", " it", "'s"));
  // \s+(?!\S) backs off one character before a non-space: "\n\nc" is "\n", "\n", "c".
  EXPECT_THAT(t->PreTokenize("a  b\n\nc   "), ElementsAre("a", " ", " b", "\n", "\n", "c", "   "));
  EXPECT_THAT(t->PreTokenize(" !? x"), ElementsAre(" !?", " x"));
  EXPECT_EQ(t->bos_id(), 1);
  EXPECT_EQ(t->eos_id(), 2);
  EXPECT_EQ(t->vocab_size(), 49152);
  EXPECT_EQ(t->token(t->Find("Hello")), "Hello");
  EXPECT_EQ(t->Find("no such token here"), -1);
}

TEST(TokenizerTest, ControlTokensOnlyWhenAsked) {
  const Tokenizer* t = SmolLm2();
  if (t == nullptr) GTEST_SKIP() << "TQKV_SMOLLM2_GGUF not set";
  const std::string text = "<|im_start|>user";
  const std::vector<int32_t> special = t->Encode(text, true);
  ASSERT_FALSE(special.empty());
  EXPECT_EQ(special[0], t->Find("<|im_start|>"));
  const std::vector<int32_t> plain = t->Encode(text, false);
  EXPECT_GT(plain.size(), special.size());
  EXPECT_EQ(t->Decode(plain), text);
  // Bytes that are not UTF-8 survive the round trip (a cut-off euro sign, a lone continuation
  // byte); bytes that no UTF-8 text holds have no token in this vocabulary.
  const std::string bytes = "ok \xe2\x82 \x80 end";
  EXPECT_EQ(t->Decode(t->Encode(bytes)), bytes);
  EXPECT_THAT([&] { t->Encode("ok \xff"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("no token for byte 0xff")));
  EXPECT_THAT([&] { t->token(49152); }, ::testing::ThrowsMessage<Error>(HasSubstr("id = 49152")));
}

// A tiny vocabulary written here: the merges are applied by rank, not by order of appearance.
TEST(TokenizerTest, MergesByRank) {
  GgufWriter w;
  w.Header(0, 5);
  w.String("tokenizer.ggml.model", "gpt2");
  w.String("tokenizer.ggml.pre", "gpt2");
  w.Strings("tokenizer.ggml.tokens", {"a", "b", "c", "ab", "bc", "abc", "\xc4\xa0"});
  w.Strings("tokenizer.ggml.merges", {"b c", "a b", "a bc"});
  w.U32("tokenizer.ggml.bos_token_id", 0);
  const Tokenizer t = Tokenizer::FromGguf(GgufFile::Parse(w.bytes, "tiny"));
  // "abc": b c (rank 0) first, then a bc (rank 2) -> "abc"; never "ab" + "c".
  EXPECT_THAT(t.Encode("abc"), ElementsAre(5));
  EXPECT_THAT(t.Encode("ab"), ElementsAre(3));
  EXPECT_THAT(t.Encode("ab c"), ElementsAre(3, 6, 2));  // " " is "Ġ" (GPT-2's byte map)
  EXPECT_EQ(t.Decode(t.Encode("ab c")), "ab c");
  EXPECT_THAT([&] { t.Encode("d"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("no token for byte 0x64")));
}

// The encoder merges through a heap; this is the rule it must equal, written the plain way: merge
// the adjacent pair of lowest rank, leftmost first, rescanning every pair after each merge. Run on
// text whose pieces repeat letters and pairs (equal ranks at many positions), and on one piece of
// 20k letters, which the rescan took minutes for.
TEST(TokenizerTest, HeapMergesEqualTheRescanRule) {
  const Tokenizer* t = SmolLm2();
  if (t == nullptr) GTEST_SKIP() << "TQKV_SMOLLM2_GGUF not set";
  const GgufFile file = GgufFile::Open(std::getenv("TQKV_SMOLLM2_GGUF"));
  std::unordered_map<std::string, int32_t> rank;
  const std::vector<std::string> merges = file.GetStrings("tokenizer.ggml.merges");
  for (size_t i = 0; i < merges.size(); ++i) rank.emplace(merges[i], static_cast<int32_t>(i));
  auto rescan = [&](const std::string& piece) {  // piece: letters, no byte mapping needed
    std::vector<std::string> sym;
    for (char c : piece) sym.emplace_back(1, c);
    while (sym.size() > 1) {
      int32_t best = INT32_MAX;
      size_t at = 0;
      for (size_t k = 0; k + 1 < sym.size(); ++k) {
        const auto it = rank.find(sym[k] + " " + sym[k + 1]);
        if (it != rank.end() && it->second < best) best = it->second, at = k;
      }
      if (best == INT32_MAX) break;
      sym[at] += sym[at + 1];
      sym.erase(sym.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    }
    std::vector<int32_t> ids;
    for (const std::string& x : sym) ids.push_back(t->Find(x));
    return ids;
  };
  std::mt19937 rng(7);
  const std::string alphabet = "aabbnnsseeetrrl";
  for (int trial = 0; trial < 300; ++trial) {
    std::string piece(1 + rng() % 40, 'a');
    for (char& c : piece) c = alphabet[rng() % alphabet.size()];
    if (trial % 3 == 0) piece = std::string(1 + rng() % 30, "aens"[trial % 4]);  // one letter
    SCOPED_TRACE(piece);
    const std::vector<int32_t> want = rescan(piece);
    ASSERT_EQ(std::count(want.begin(), want.end(), -1), 0);  // every symbol is in the vocabulary
    EXPECT_EQ(t->Encode(piece), want);
  }
  std::string long_piece;
  for (int i = 0; i < 20000; ++i) long_piece += "ab"[(i * 7 / 3) % 2];
  const std::vector<int32_t> ids = t->Encode(long_piece);
  EXPECT_LT(ids.size(), long_piece.size() * 3 / 4);  // "aab" merges to "aa" + "b"
  EXPECT_EQ(t->Decode(ids), long_piece);
  EXPECT_EQ(t->Encode(long_piece.substr(0, 1500)), rescan(long_piece.substr(0, 1500)));
}

// A control token that is the empty string matched at every position: Encode never returned.
TEST(TokenizerTest, EmptyControlTokenIsNeverMatched) {
  GgufWriter w;
  w.Header(0, 5);
  w.String("tokenizer.ggml.model", "gpt2");
  w.String("tokenizer.ggml.pre", "gpt2");
  w.Strings("tokenizer.ggml.tokens", {"a", "b", "ab", "", "<s>"});
  w.Strings("tokenizer.ggml.merges", {"a b"});
  w.Ints("tokenizer.ggml.token_type", {1, 1, 1, 3, 3});
  const Tokenizer t = Tokenizer::FromGguf(GgufFile::Parse(w.bytes, "empty control"));
  EXPECT_THAT(t.Encode("ab<s>b", /*parse_special=*/true), ElementsAre(2, 4, 1));
}

TEST(TokenizerTest, RejectsOtherModels) {
  GgufWriter w;
  w.Header(0, 3);
  w.String("tokenizer.ggml.model", "llama");
  w.Strings("tokenizer.ggml.tokens", {"a"});
  w.Strings("tokenizer.ggml.merges", {});
  EXPECT_THAT([&] { Tokenizer::FromGguf(GgufFile::Parse(w.bytes, "spm")); },
              ::testing::ThrowsMessage<Error>(HasSubstr("tokenizer.ggml.model = llama")));
  GgufWriter p;
  p.Header(0, 3);
  p.String("tokenizer.ggml.model", "gpt2");
  p.String("tokenizer.ggml.pre", "qwen2");
  p.Strings("tokenizer.ggml.tokens", {"a"});
  EXPECT_THAT([&] { Tokenizer::FromGguf(GgufFile::Parse(p.bytes, "pre")); },
              ::testing::ThrowsMessage<Error>(HasSubstr("tokenizer.ggml.pre = qwen2")));
}

}  // namespace
}  // namespace tqkv::model
