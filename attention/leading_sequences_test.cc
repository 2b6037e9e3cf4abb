// WithLeadingSequences (attention_cuda.h): the options an engine passes for a step whose decoding
// sequences come first. Host only, so it runs without a device.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "attention/attention_cuda.h"
#include "runtime/error.h"

namespace tqkv {
namespace {

TEST(WithLeadingSequencesTest, TakesTheLeadingRunOfFewNewTokens) {
  AttentionOptions given;
  given.tokens_per_split = 128;
  given.leading_decode_seqs = 7;  // (replaced)
  // q_len 1, 5, 1, 3, then a 300-token chunk and a decode after it.
  const std::vector<int32_t> loc = {0, 1, 6, 7, 10, 310, 311};
  const AttentionOptions o = WithLeadingSequences(given, loc);
  EXPECT_EQ(o.leading_decode_seqs, 4);
  EXPECT_EQ(o.leading_max_q_len, 5);
  EXPECT_EQ(o.tokens_per_split, 128);  // the others as given
  // A limit of 4 stops before the 5-token sequence.
  const AttentionOptions four = WithLeadingSequences({}, loc, 4);
  EXPECT_EQ(four.leading_decode_seqs, 1);
  EXPECT_EQ(four.leading_max_q_len, 1);
  // One-token sequences only: leading_max_q_len 1, every sequence leading.
  const std::vector<int32_t> decode = {0, 1, 2, 3};
  const AttentionOptions d = WithLeadingSequences({}, decode);
  EXPECT_EQ(d.leading_decode_seqs, 3);
  EXPECT_EQ(d.leading_max_q_len, 1);
  // A padding row (q_len 0) or a chunk first ends the run at once.
  const AttentionOptions pad = WithLeadingSequences({}, std::vector<int32_t>{0, 0, 1});
  EXPECT_EQ(pad.leading_decode_seqs, 0);
  EXPECT_EQ(pad.leading_max_q_len, 1);
  const AttentionOptions chunk = WithLeadingSequences({}, std::vector<int32_t>{0, 17, 18});
  EXPECT_EQ(chunk.leading_decode_seqs, 0);
  EXPECT_EQ(chunk.leading_max_q_len, 1);
  // No sequences.
  EXPECT_EQ(WithLeadingSequences({}, std::vector<int32_t>{0}).leading_decode_seqs, 0);
}

TEST(WithLeadingSequencesTest, RejectsBadArguments) {
  using ::testing::HasSubstr;
  const std::vector<int32_t> loc = {0, 1, 2};
  EXPECT_THAT([&] { WithLeadingSequences({}, loc, 0); },
              ::testing::ThrowsMessage<Error>(HasSubstr("max_leading_q_len")));
  EXPECT_THAT([&] { WithLeadingSequences({}, std::vector<int32_t>{}); },
              ::testing::ThrowsMessage<Error>(HasSubstr("query_start_loc")));
}

}  // namespace
}  // namespace tqkv
