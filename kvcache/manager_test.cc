// Unit tests of KVCacheManager, one operation at a time. Randomized sequences of operations are in
// manager_property_test.cc.
#include "kvcache/manager.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>
#include <optional>
#include <vector>

#include "kvcache/address_space_limit.h"
#include "runtime/error.h"

namespace tqkv {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

KVCacheManagerOptions Options(int32_t num_blocks, int32_t block_size = 4, bool prefix = true,
                              int32_t window = 0) {
  KVCacheManagerOptions o;
  o.num_blocks = num_blocks;
  o.block_size = block_size;
  o.format = FormatTag{"turboquant_4bit_nc", 128, 0, 1};
  o.enable_prefix_caching = prefix;
  o.sliding_window = window;
  o.record_events = true;
  return o;
}

std::vector<int32_t> Range(int32_t first, int32_t count) {
  std::vector<int32_t> v(static_cast<size_t>(count));
  std::iota(v.begin(), v.end(), first);
  return v;
}

std::vector<int32_t> Row(const StepBatch& b, int32_t i) {
  const auto row = b.block_table(i);
  return {row.begin(), row.end()};
}

template <typename T>
std::vector<T> Vec(std::span<const T> s) {
  return {s.begin(), s.end()};
}

// Schedules one request and expects admission.
void Step(KVCacheManager& m, StepBatch& batch, SeqId seq, int32_t n, int32_t lookahead = 0) {
  const StepRequest r{seq, n, lookahead};
  const ScheduleResult result = m.Schedule({&r, 1}, batch);
  ASSERT_TRUE(result.admitted) << "missing " << result.blocks_missing;
  m.CheckInvariants();
}

// Runs `f`, expects a tqkv::Error whose message contains every piece, and that the manager's
// state did not change.
template <typename F>
void ExpectErrorAndUnchanged(KVCacheManager& m, F&& f, std::vector<std::string> pieces) {
  const std::string before = m.DebugString();
  try {
    f();
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    for (const auto& p : pieces) EXPECT_THAT(e.what(), HasSubstr(p));
  }
  EXPECT_EQ(m.DebugString(), before);
  EXPECT_EQ(m.FindInvariantViolation(), "");
}

// ---------------------------------------------------------------------------------------------
// Construction

TEST(ManagerTest, ZeroBlockPoolThrows) {
  for (int32_t n : {0, 1}) {
    try {
      KVCacheManager m(Options(n));
      FAIL();
    } catch (const Error& e) {
      EXPECT_THAT(e.what(),
                  AllOf(HasSubstr(fmt::format("num_blocks = {}", n)), HasSubstr("null block")));
    }
  }
}

TEST(ManagerTest, BadOptionsThrow) {
  KVCacheManagerOptions o = Options(8);
  o.block_size = 0;
  EXPECT_THROW(KVCacheManager{o}, Error);
  o.block_size = 2048;
  EXPECT_THROW(KVCacheManager{o}, Error);
  o = Options(8);
  o.sliding_window = -1;
  EXPECT_THROW(KVCacheManager{o}, Error);
  o = Options(8);
  o.format.block_size = 16;  // the manager's is 4
  try {
    KVCacheManager m(o);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("format.block_size = 16"), HasSubstr("4")));
  }
}

// ---------------------------------------------------------------------------------------------
// AddSequence, Schedule

TEST(ManagerTest, AddSequenceHoldsNoBlocks) {
  KVCacheManager m(Options(8));
  const SeqId s = m.AddSequence(Range(100, 10));
  const SequenceInfo info = m.GetSequenceInfo(s);
  EXPECT_EQ(info.num_tokens, 10);
  EXPECT_EQ(info.num_scheduled, 0);
  EXPECT_EQ(info.num_table_entries, 0);
  EXPECT_EQ(m.Stats().blocks_in_use, 0);
  EXPECT_EQ(m.Stats().num_sequences, 1);
  EXPECT_THAT(Vec(m.Tokens(s)), ElementsAreArray(Range(100, 10)));
  m.CheckInvariants();
}

TEST(ManagerTest, AddSequenceRejectsEmptyPromptAndBadPriority) {
  KVCacheManager m(Options(8));
  ExpectErrorAndUnchanged(m, [&] { m.AddSequence({}); }, {"prompt_tokens.size() = 0"});
  ExpectErrorAndUnchanged(m, [&] { m.AddSequence(Range(0, 3), {.priority = 8}); },
                          {"priority = 8", "0 to 7"});
}

TEST(ManagerTest, PrefillSlotMappingTablesAndLengths) {
  KVCacheManager m(Options(8));
  const SeqId s = m.AddSequence(Range(0, 10));
  StepBatch b;
  Step(m, b, s, 10);
  EXPECT_EQ(b.num_requests(), 1);
  EXPECT_EQ(b.num_tokens(), 10);
  EXPECT_THAT(Row(b, 0), ElementsAre(1, 2, 3));
  // slot = block * 4 + position % 4
  EXPECT_THAT(Vec(b.slot_mapping()), ElementsAre(4, 5, 6, 7, 8, 9, 10, 11, 12, 13));
  EXPECT_THAT(Vec(b.seq_lens()), ElementsAre(10));
  EXPECT_THAT(Vec(b.query_start_loc()), ElementsAre(0, 10));
  EXPECT_THAT(Vec(b.prefix_hit_tokens()), ElementsAre(0));
  EXPECT_TRUE(b.copies().empty());
  EXPECT_EQ(m.GetSequenceInfo(s).num_scheduled, 10);
  EXPECT_EQ(m.Stats().blocks_in_use, 3);
}

TEST(ManagerTest, DecodeAllocatesExactlyAtBlockBoundaries) {
  KVCacheManager m(Options(8));
  const SeqId s = m.AddSequence(Range(0, 3));
  StepBatch b;
  Step(m, b, s, 3);
  m.Commit(s, std::vector<int32_t>{50});
  for (int step = 0; step < 6; ++step) {
    const int64_t pos = 3 + step;
    const int32_t blocks_before = m.Stats().blocks_in_use;
    Step(m, b, s, 1);
    EXPECT_EQ(m.Stats().blocks_in_use, blocks_before + (pos % 4 == 0 ? 1 : 0)) << pos;
    const int32_t block = m.BlockTable(s)[static_cast<size_t>(pos / 4)];
    EXPECT_THAT(Vec(b.slot_mapping()), ElementsAre(block * 4 + pos % 4));
    EXPECT_THAT(Vec(b.seq_lens()), ElementsAre(pos + 1));
    m.Commit(s, std::vector<int32_t>{51 + step});
  }
}

TEST(ManagerTest, BatchIsInRequestOrderWithPadding) {
  KVCacheManager m(Options(16));
  const SeqId a = m.AddSequence(Range(0, 5));
  const SeqId c = m.AddSequence(Range(0, 2));
  StepBatch b;
  const StepRequest reqs[] = {{c, 2, 0}, {a, 5, 0}};
  ScheduleOptions opts;
  opts.pad_tokens_to = 10;
  opts.pad_requests_to = 4;
  opts.block_table_width = 3;
  ASSERT_TRUE(m.Schedule(reqs, b, opts).admitted);
  EXPECT_EQ(b.num_requests(), 2);
  EXPECT_EQ(b.padded_num_requests(), 4);
  EXPECT_EQ(b.num_tokens(), 7);
  EXPECT_EQ(b.padded_num_tokens(), 10);
  EXPECT_EQ(b.block_table_width(), 3);
  // c got block 1, a got blocks 2 and 3.
  EXPECT_THAT(Vec(b.slot_mapping()), ElementsAre(4, 5, 8, 9, 10, 11, 12, -1, -1, -1));
  EXPECT_THAT(Vec(b.block_tables()), ElementsAre(1, 0, 0, 2, 3, 0, 0, 0, 0, 0, 0, 0));
  EXPECT_THAT(Vec(b.seq_lens()), ElementsAre(2, 5, 0, 0));
  EXPECT_THAT(Vec(b.query_start_loc()), ElementsAre(0, 2, 7, 7, 7));
  // The arena layout: 64-byte aligned sections in the documented order.
  const auto& l = b.layout();
  EXPECT_EQ(l.block_tables, 0);   // 4 x 3 int32
  EXPECT_EQ(l.slot_mapping, 64);  // 10 int64
  EXPECT_EQ(l.seq_lens, 192);
  EXPECT_EQ(l.query_start_loc, 256);
  EXPECT_EQ(l.total_bytes, 256 + 20);
  EXPECT_EQ(reinterpret_cast<const int32_t*>(b.bytes().data() + l.seq_lens)[1], 5);
  // A padding row is a row of null blocks; past the padding there is none.
  EXPECT_THAT(Row(b, 3), ElementsAre(0, 0, 0));
  for (int32_t row : {-1, 4}) {
    EXPECT_THAT([&] { b.block_table(row); },
                ::testing::ThrowsMessage<Error>(
                    ::testing::AllOf(::testing::HasSubstr(fmt::format("row = {}", row)),
                                     ::testing::HasSubstr("0 to padded_num_requests() - 1 = 3"))));
  }
  EXPECT_THAT([] { StepBatch().block_table(0); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("the batch has no rows")));
}

TEST(ManagerTest, WidthAndPaddingAreMinimums) {
  KVCacheManager m(Options(16));
  const SeqId a = m.AddSequence(Range(0, 9));
  StepBatch b;
  const StepRequest r{a, 9, 0};
  ASSERT_TRUE(
      m.Schedule({&r, 1}, b, {.pad_tokens_to = 4, .pad_requests_to = 0, .block_table_width = 1})
          .admitted);
  EXPECT_EQ(b.block_table_width(), 3);
  EXPECT_EQ(b.padded_num_tokens(), 9);
}

TEST(ManagerTest, ScheduleRejectsBadRequestsWithoutChangingState) {
  KVCacheManager m(Options(8));
  const SeqId a = m.AddSequence(Range(0, 5));
  const SeqId freed = m.AddSequence(Range(0, 5));
  m.Free(freed);
  StepBatch b;
  auto schedule = [&](std::vector<StepRequest> reqs, ScheduleOptions o = {}) {
    return [&m, &b, reqs, o] { m.Schedule(reqs, b, o); };
  };
  ExpectErrorAndUnchanged(m, schedule({{a, 5, 0}, {freed, 1, 0}}),
                          {"Schedule", fmt::format("sequence {} was freed", freed)});
  ExpectErrorAndUnchanged(m, schedule({{a, 5, 0}, {SeqId{999}, 1, 0}}), {"unknown sequence 999"});
  ExpectErrorAndUnchanged(m, schedule({{a, 5, 0}, {a, 1, 0}}),
                          {fmt::format("sequence {} appears more than once", a)});
  ExpectErrorAndUnchanged(m, schedule({{a, -1, 0}}), {"num_new_tokens", "= -1"});
  ExpectErrorAndUnchanged(m, schedule({{a, 1, -2}}), {"num_lookahead", "= -2"});
  ExpectErrorAndUnchanged(m, schedule({{a, 1, 0}}, {.pad_tokens_to = -1}), {"pad_tokens_to"});
  ExpectErrorAndUnchanged(m, schedule({{a, 2147483647, 1}}), {"end position", "2147483648"});
}

// ---------------------------------------------------------------------------------------------
// All-or-nothing

TEST(ManagerTest, BatchThatDoesNotFitChangesNothingAndSaysWhatIsMissing) {
  KVCacheManager m(Options(6));  // 5 usable blocks
  const SeqId a = m.AddSequence(Range(0, 8));
  const SeqId c = m.AddSequence(Range(100, 8));
  const SeqId d = m.AddSequence(Range(200, 8));
  StepBatch b;
  Step(m, b, a, 8);  // 2 blocks; 3 left
  const auto arena_before = b.bytes().data();
  const std::string before = m.DebugString();
  const StepRequest reqs[] = {{c, 8, 0}, {d, 8, 0}};  // 2 + 2 > 3
  const ScheduleResult r = m.Schedule(reqs, b);
  EXPECT_FALSE(r.admitted);
  EXPECT_EQ(r.blocks_needed, 4);
  EXPECT_EQ(r.blocks_available, 3);
  EXPECT_EQ(r.blocks_missing, 1);
  ASSERT_EQ(r.rejected.size(), 1u);
  EXPECT_EQ(r.rejected[0].request_index, 1);
  EXPECT_EQ(r.rejected[0].seq, d);
  EXPECT_EQ(r.rejected[0].blocks_needed, 2);
  EXPECT_EQ(r.rejected[0].blocks_missing, 1);
  EXPECT_FALSE(r.rejected[0].never_fits);
  EXPECT_EQ(m.DebugString(), before);
  m.CheckInvariants();
  // The previous batch is untouched.
  EXPECT_EQ(b.bytes().data(), arena_before);
  EXPECT_EQ(b.num_tokens(), 8);
  EXPECT_EQ(m.Stats().schedule_rejections, 1);
  // The engine preempts a; now both fit.
  m.Free(a);
  ASSERT_TRUE(m.Schedule(reqs, b).admitted);
  m.CheckInvariants();
}

TEST(ManagerTest, RequestLargerThanThePoolIsReportedAsNeverFitting) {
  KVCacheManager m(Options(4));  // 3 usable blocks = 12 tokens
  const SeqId a = m.AddSequence(Range(0, 13));
  StepBatch b;
  const StepRequest r{a, 13, 0};
  const std::string before = m.DebugString();
  const ScheduleResult res = m.Schedule({&r, 1}, b);
  EXPECT_FALSE(res.admitted);
  ASSERT_EQ(res.rejected.size(), 1u);
  EXPECT_TRUE(res.rejected[0].never_fits);
  EXPECT_EQ(res.rejected[0].blocks_missing, 1);
  EXPECT_EQ(m.DebugString(), before);
  // 12 tokens fit exactly.
  const SeqId c = m.AddSequence(Range(0, 12));
  const StepRequest r2{c, 12, 0};
  EXPECT_TRUE(m.Schedule({&r2, 1}, b).admitted);
}

TEST(ManagerTest, LookaheadIsBackedByBlocksWithoutSlots) {
  KVCacheManager m(Options(8));
  const SeqId s = m.AddSequence(Range(0, 3));
  StepBatch b;
  Step(m, b, s, 3, /*lookahead=*/6);  // positions 0..8 backed: 3 blocks
  EXPECT_EQ(b.num_tokens(), 3);
  EXPECT_EQ(m.GetSequenceInfo(s).num_table_entries, 3);
  EXPECT_EQ(m.GetSequenceInfo(s).num_scheduled, 3);
  EXPECT_THAT(Row(b, 0), ElementsAre(1, 2, 3));
  // Rewind(0) gives the reservation back.
  m.Rewind(s, 0);
  EXPECT_EQ(m.GetSequenceInfo(s).num_table_entries, 1);
  m.CheckInvariants();
}

// ---------------------------------------------------------------------------------------------
// Commit, prefix caching, Lookup

TEST(ManagerTest, CommitPublishesTrustedFullBlocksWithChainedHashes) {
  KVCacheManager m(Options(8));
  const auto prompt = Range(0, 9);
  const SeqId s = m.AddSequence(prompt);
  StepBatch b;
  Step(m, b, s, 9);
  EXPECT_TRUE(m.TakeEvents().empty());  // scheduled is not computed: nothing published yet
  m.Commit(s, std::vector<int32_t>{77});
  const auto events = m.TakeEvents();
  ASSERT_EQ(events.size(), 2u);  // blocks 0 and 1 full; block 2 holds position 8 only
  const BlockHash root = HashFormatTag(FormatTag{"turboquant_4bit_nc", 128, 4, 1});
  const BlockHash h0 = HashBlockTokens(root, Range(0, 4));
  const BlockHash h1 = HashBlockTokens(h0, Range(4, 4));
  EXPECT_EQ(events[0].type, KVEventType::kBlockStored);
  EXPECT_EQ(events[0].hash, h0);
  EXPECT_EQ(events[0].parent_hash, root);
  EXPECT_EQ(events[0].block_id, m.BlockTable(s)[0]);
  EXPECT_EQ(events[1].hash, h1);
  EXPECT_EQ(events[1].parent_hash, h0);
  EXPECT_EQ(m.GetSequenceInfo(s).num_cached_blocks, 2);
  EXPECT_EQ(m.Stats().blocks_cached, 2);
}

TEST(ManagerTest, ChunkedPrefillPublishesAsChunksComplete) {
  KVCacheManager m(Options(8));
  const SeqId s = m.AddSequence(Range(0, 12));
  StepBatch b;
  Step(m, b, s, 5);
  m.Commit(s, {});  // partial prefill: no token, but positions 0..4 are computed
  EXPECT_EQ(m.GetSequenceInfo(s).num_cached_blocks, 1);
  Step(m, b, s, 7);
  EXPECT_EQ(b.seq_lens()[0], 12);
  m.Commit(s, std::vector<int32_t>{5});
  EXPECT_EQ(m.GetSequenceInfo(s).num_cached_blocks, 3);
}

TEST(ManagerTest, FreedSequenceBlocksServeTheNextSequenceWithTheSamePrefix) {
  KVCacheManager m(Options(8));
  const auto prompt = Range(0, 10);
  const SeqId a = m.AddSequence(prompt);
  StepBatch b;
  Step(m, b, a, 10);
  m.Commit(a, std::vector<int32_t>{99});
  const std::vector<int32_t> a_blocks(m.BlockTable(a).begin(), m.BlockTable(a).end());
  m.Free(a);
  EXPECT_EQ(m.Stats().blocks_evictable, 2);
  EXPECT_EQ(m.Stats().blocks_free, 5);

  const SeqId c = m.AddSequence(prompt);
  const std::string before = m.DebugString();
  const PrefixMatch match = m.Lookup(c);
  EXPECT_EQ(m.DebugString(), before);  // no side effects
  EXPECT_EQ(match.num_blocks, 2);
  EXPECT_EQ(match.num_tokens, 8);
  Step(m, b, c, 2);  // only the 2 uncached tokens are computed
  EXPECT_THAT(Vec(b.prefix_hit_tokens()), ElementsAre(8));
  EXPECT_THAT(Vec(b.seq_lens()), ElementsAre(10));
  EXPECT_EQ(m.BlockTable(c)[0], a_blocks[0]);
  EXPECT_EQ(m.BlockTable(c)[1], a_blocks[1]);
  EXPECT_THAT(Vec(b.slot_mapping()),
              ElementsAre(m.BlockTable(c)[2] * 4 + 0, m.BlockTable(c)[2] * 4 + 1));
  const KVCacheStats st = m.Stats();
  EXPECT_EQ(st.prefix_query_tokens, 20);
  EXPECT_EQ(st.prefix_hit_tokens, 8);
  EXPECT_EQ(st.prefix_miss_tokens, 12);
  EXPECT_EQ(st.blocks_evictable, 0);
}

TEST(ManagerTest, LookupLeavesAtLeastOneTokenToCompute) {
  KVCacheManager m(Options(8));
  const auto prompt = Range(0, 8);  // exactly two blocks
  const SeqId a = m.AddSequence(prompt);
  StepBatch b;
  Step(m, b, a, 8);
  m.Commit(a, std::vector<int32_t>{1});
  EXPECT_EQ(m.GetSequenceInfo(a).num_cached_blocks, 2);
  const SeqId c = m.AddSequence(prompt);
  EXPECT_EQ(m.Lookup(c).num_tokens, 4);  // not 8: the last block is recomputed
}

TEST(ManagerTest, ExtraKeyAndPrefixCachingOffPreventSharing) {
  KVCacheManager m(Options(8));
  const auto prompt = Range(0, 9);
  const SeqId a = m.AddSequence(prompt, {.extra_key = "tenant-a"});
  StepBatch b;
  Step(m, b, a, 9);
  m.Commit(a, std::vector<int32_t>{1});
  EXPECT_EQ(m.Lookup(m.AddSequence(prompt, {.extra_key = "tenant-b"})).num_blocks, 0);
  EXPECT_EQ(m.Lookup(m.AddSequence(prompt)).num_blocks, 0);
  EXPECT_EQ(m.Lookup(m.AddSequence(prompt, {.extra_key = "tenant-a"})).num_blocks, 2);

  KVCacheManager off(Options(8, 4, /*prefix=*/false));
  const SeqId x = off.AddSequence(prompt);
  Step(off, b, x, 9);
  off.Commit(x, std::vector<int32_t>{1});
  EXPECT_EQ(off.Stats().blocks_cached, 0);
  EXPECT_EQ(off.Lookup(off.AddSequence(prompt)).num_blocks, 0);
  EXPECT_TRUE(off.TakeEvents().empty());
}

TEST(ManagerTest, DifferentFormatsNeverShareHashes) {
  KVCacheManagerOptions o1 = Options(8);
  KVCacheManagerOptions o2 = Options(8);
  o2.format.rotation_id = 2;
  KVCacheManager m1(o1), m2(o2);
  StepBatch b;
  for (KVCacheManager* m : {&m1, &m2}) {
    const SeqId s = m->AddSequence(Range(0, 5));
    Step(*m, b, s, 5);
    m->Commit(s, std::vector<int32_t>{1});
  }
  const auto e1 = m1.TakeEvents(), e2 = m2.TakeEvents();
  ASSERT_EQ(e1.size(), 1u);
  ASSERT_EQ(e2.size(), 1u);
  EXPECT_NE(e1[0].hash, e2[0].hash);
}

TEST(ManagerTest, CommittingMoreThanScheduledThrowsAndChangesNothing) {
  KVCacheManager m(Options(8));
  const SeqId s = m.AddSequence(Range(0, 6));
  ExpectErrorAndUnchanged(m, [&] { m.Commit(s, std::vector<int32_t>{1}); },
                          {fmt::format("sequence {}", s), "committing 1 tokens", "7 known tokens",
                           "only 0 positions are scheduled"});
  StepBatch b;
  Step(m, b, s, 6);
  ExpectErrorAndUnchanged(
      m,
      [&] {
        m.Commit(s, std::vector<int32_t>{1, 2});
      },
      {"committing 2 tokens", "8 known tokens", "only 6 positions", "at most 1 more"});
  m.Commit(s, std::vector<int32_t>{1});
  ExpectErrorAndUnchanged(m, [&] { m.Commit(s, std::vector<int32_t>{2}); }, {"at most 0 more"});
}

// A commit of tokens read from the sequence's own (Tokens(id), which Commit grows): the span was
// left dangling where the vector reallocated (AddressSanitizer's heap-use-after-free).
TEST(ManagerTest, CommitOfTheSequencesOwnTokens) {
  KVCacheManager m(Options(16));
  const SeqId s = m.AddSequence(Range(0, 6));
  StepBatch b;
  Step(m, b, s, 6);
  std::vector<int32_t> want = Range(0, 6);
  for (int i = 0; i < 40; ++i) {  // the token vector grows several times meanwhile
    const std::span<const int32_t> last = m.Tokens(s).last(1);
    want.push_back(last[0]);
    m.Commit(s, last);
    Step(m, b, s, 1);
  }
  EXPECT_THAT(m.Tokens(s), ::testing::ElementsAreArray(want));
  m.CheckInvariants();
}

// ---------------------------------------------------------------------------------------------
// Speculative decoding: Rewind

TEST(ManagerTest, RewindDropsRejectedDraftsAndFreesEmptiedBlocks) {
  KVCacheManager m(Options(8));
  const SeqId s = m.AddSequence(Range(0, 6));
  StepBatch b;
  Step(m, b, s, 6);
  m.Commit(s, std::vector<int32_t>{6});  // 7 known, 6 scheduled
  // Verify step: the last token plus 3 drafts -> positions 6..9 (crosses into block 2).
  Step(m, b, s, 4, /*lookahead=*/3);
  EXPECT_EQ(m.GetSequenceInfo(s).num_table_entries, 4);  // up to position 12
  // Drafts at 7, 8 accepted, 9 rejected; bonus token at 9.
  m.Commit(s, std::vector<int32_t>{7, 8, 42});
  // Position 9's KV is the rejected draft's: not trusted, so block 2 (8..11) is not published.
  EXPECT_EQ(m.GetSequenceInfo(s).num_cached_blocks, 2);
  m.Rewind(s, 1);
  EXPECT_EQ(m.GetSequenceInfo(s).num_scheduled, 9);
  EXPECT_EQ(m.GetSequenceInfo(s).num_table_entries, 3);  // lookahead block released
  EXPECT_EQ(m.Stats().blocks_in_use, 3);
  m.CheckInvariants();
  // Next step writes the bonus token at 9.
  Step(m, b, s, 1);
  EXPECT_EQ(b.slot_mapping()[0], m.BlockTable(s)[2] * 4 + 1);
  m.Commit(s, std::vector<int32_t>{43});
  m.CheckInvariants();
}

TEST(ManagerTest, RewindFreesBlocksThatBecomeEmpty) {
  KVCacheManager m(Options(8));
  const SeqId s = m.AddSequence(Range(0, 9));
  StepBatch b;
  Step(m, b, s, 9);  // 3 blocks
  m.Rewind(s, 5);    // 4 positions left: 1 block
  EXPECT_EQ(m.GetSequenceInfo(s).num_table_entries, 1);
  EXPECT_EQ(m.Stats().blocks_in_use, 1);
  EXPECT_EQ(m.Stats().blocks_free, 6);
  m.Rewind(s, 4);
  EXPECT_EQ(m.GetSequenceInfo(s).num_table_entries, 0);
  m.CheckInvariants();
  // Known tokens stay; the sequence is computed again from its (cached?) prefix.
  Step(m, b, s, 9);
  EXPECT_EQ(b.seq_lens()[0], 9);
}

TEST(ManagerTest, RewindingPastTheStartThrowsAndChangesNothing) {
  KVCacheManager m(Options(8));
  const SeqId s = m.AddSequence(Range(0, 5));
  StepBatch b;
  Step(m, b, s, 5);
  ExpectErrorAndUnchanged(
      m, [&] { m.Rewind(s, 6); },
      {fmt::format("sequence {}", s), "cannot rewind 6 positions", "5 are scheduled"});
  ExpectErrorAndUnchanged(m, [&] { m.Rewind(s, -1); }, {"cannot rewind -1"});
}

TEST(ManagerTest, RewindIntoAPublishedBlockUnpublishesItOnTheNextWrite) {
  KVCacheManager m(Options(8));
  const SeqId s = m.AddSequence(Range(0, 8));
  StepBatch b;
  Step(m, b, s, 8);
  m.Commit(s, std::vector<int32_t>{8});
  ASSERT_EQ(m.GetSequenceInfo(s).num_cached_blocks, 2);
  m.TakeEvents();
  m.Rewind(s, 2);  // positions 6, 7 of block 1 will be rewritten
  EXPECT_EQ(m.GetSequenceInfo(s).num_cached_blocks, 1);
  const int32_t block1 = m.BlockTable(s)[1];
  Step(m, b, s, 2);
  const auto events = m.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].type, KVEventType::kBlockRemoved);
  EXPECT_EQ(events[0].block_id, block1);
  EXPECT_TRUE(b.copies().empty());  // ours alone: no copy needed
}

// A rewound sequence about to rewrite a published block while a new sequence in the same batch
// takes that block as a prefix hit: the writer must copy, not unpublish, in either order.
TEST(ManagerTest, WriterCopiesABlockThatAHitInTheSameBatchTakes) {
  for (bool writer_first : {true, false}) {
    KVCacheManager m(Options(16));
    const SeqId a = m.AddSequence(Range(0, 8));
    StepBatch b;
    Step(m, b, a, 8);
    m.Commit(a, std::vector<int32_t>{8});
    m.Rewind(a, 2);  // positions 6, 7 of (published) block 1 will be rewritten
    const int32_t block1 = m.BlockTable(a)[1];
    const SeqId c = m.AddSequence(Range(0, 9));
    ASSERT_EQ(m.Lookup(c).num_blocks, 2);
    std::vector<StepRequest> reqs = {{a, 2, 0}, {c, 1, 0}};
    if (!writer_first) std::swap(reqs[0], reqs[1]);
    ASSERT_TRUE(m.Schedule(reqs, b).admitted);
    ASSERT_EQ(b.copies().size(), 1u) << writer_first;
    EXPECT_EQ(b.copies()[0].src, block1);
    EXPECT_EQ(m.BlockTable(a)[1], b.copies()[0].dst);
    EXPECT_EQ(m.BlockTable(c)[1], block1);
    EXPECT_TRUE(m.pool().block(block1).hashed);
    m.CheckInvariants();
  }
}

// ---------------------------------------------------------------------------------------------
// Fork and copy-on-write

TEST(ManagerTest, ForkSharesBlocksAndCopiesTheSharedPartialBlockOnFirstWrite) {
  KVCacheManager m(Options(16));
  const SeqId parent = m.AddSequence(Range(0, 6));
  StepBatch b;
  Step(m, b, parent, 6);  // blocks 1 (full), 2 (2 of 4)
  const SeqId child = m.Fork(parent);
  EXPECT_THAT(Vec(m.BlockTable(child)), ElementsAre(1, 2));
  EXPECT_EQ(m.pool().block(1).ref_count, 2);
  EXPECT_EQ(m.pool().block(2).ref_count, 2);
  EXPECT_EQ(m.Stats().blocks_in_use, 2);
  EXPECT_EQ(m.GetSequenceInfo(child).num_scheduled, 6);
  m.CheckInvariants();
  // Both commit their own sampled token.
  m.Commit(parent, std::vector<int32_t>{100});
  m.Commit(child, std::vector<int32_t>{200});

  // The child writes first: it gets a fresh block and a copy; the parent keeps block 2.
  Step(m, b, child, 1);
  ASSERT_EQ(b.copies().size(), 1u);
  EXPECT_EQ(b.copies()[0].src, 2);
  EXPECT_EQ(b.copies()[0].dst, 3);
  EXPECT_THAT(Vec(m.BlockTable(child)), ElementsAre(1, 3));
  EXPECT_EQ(b.slot_mapping()[0], 3 * 4 + 2);
  EXPECT_EQ(m.pool().block(2).ref_count, 1);
  EXPECT_EQ(m.Stats().cow_copies, 1);
  // The parent now owns block 2 alone: no copy.
  Step(m, b, parent, 1);
  EXPECT_TRUE(b.copies().empty());
  EXPECT_EQ(b.slot_mapping()[0], 2 * 4 + 2);
  m.CheckInvariants();
}

TEST(ManagerTest, ForkAtABlockBoundaryNeedsNoCopy) {
  KVCacheManager m(Options(16));
  const SeqId parent = m.AddSequence(Range(0, 8));
  StepBatch b;
  Step(m, b, parent, 8);
  m.Commit(parent, std::vector<int32_t>{1});
  const SeqId child = m.Fork(parent);
  m.CheckInvariants();
  const StepRequest reqs[] = {{parent, 1, 0}, {child, 1, 0}};
  ASSERT_TRUE(m.Schedule(reqs, b).admitted);
  EXPECT_TRUE(b.copies().empty());
  EXPECT_NE(b.slot_mapping()[0] / 4, b.slot_mapping()[1] / 4);
  m.CheckInvariants();
}

TEST(ManagerTest, TwoSharersWritingInOneBatchCopyOnceBetweenThem) {
  KVCacheManager m(Options(16));
  const SeqId parent = m.AddSequence(Range(0, 6));
  StepBatch b;
  Step(m, b, parent, 6);
  m.Commit(parent, std::vector<int32_t>{6});
  const SeqId child = m.Fork(parent);
  const StepRequest reqs[] = {{parent, 1, 0}, {child, 1, 0}};
  const ScheduleResult r = m.Schedule(reqs, b);
  ASSERT_TRUE(r.admitted);
  EXPECT_EQ(r.blocks_needed, 1);  // the first copies away, the second owns it by then
  ASSERT_EQ(b.copies().size(), 1u);
  EXPECT_EQ(m.Stats().blocks_in_use, 3);
  m.CheckInvariants();
}

// Parallel sampling: four forks decode side by side from one partial block. Three copy it away
// and the last writes in place, so the batch fits a pool with three free blocks.
TEST(ManagerTest, AllSharersWritingInOneBatchNeedOneCopyFewerThanWriters) {
  KVCacheManager m(Options(6));  // 5 usable blocks
  const SeqId parent = m.AddSequence(Range(0, 6));
  StepBatch b;
  Step(m, b, parent, 6);  // blocks 1 (full), 2 (2 of 4)
  m.Commit(parent, std::vector<int32_t>{6});
  std::vector<StepRequest> reqs = {{parent, 1, 0}};
  for (int i = 0; i < 3; ++i) reqs.push_back({m.Fork(parent), 1, 0});
  ASSERT_EQ(m.pool().block(2).ref_count, 4);
  const ScheduleResult r = m.Schedule(reqs, b);
  ASSERT_TRUE(r.admitted) << "missing " << r.blocks_missing;
  EXPECT_EQ(r.blocks_needed, 3);
  ASSERT_EQ(b.copies().size(), 3u);
  for (const BlockCopy& c : b.copies()) EXPECT_EQ(c.src, 2);
  EXPECT_EQ(m.BlockTable(reqs[3].seq)[1], 2);  // the last writer keeps it
  EXPECT_EQ(m.pool().block(2).ref_count, 1);
  EXPECT_EQ(m.Stats().blocks_in_use, 5);
  EXPECT_EQ(m.Stats().cow_copies, 3);
  m.CheckInvariants();
}

// Four forks share a partial block and two blocks are free: the last writer would keep the block
// only if the writers before it were admitted, so where one of them is not, it copies too.
TEST(ManagerTest, RejectionCountsTheLastWritersCopyWhenAnEarlierWriterDoesNotFit) {
  KVCacheManager m(Options(5));  // 4 usable: 2 in use, 2 free
  const SeqId parent = m.AddSequence(Range(0, 6));
  StepBatch b;
  Step(m, b, parent, 6);
  m.Commit(parent, std::vector<int32_t>{6});
  std::vector<StepRequest> reqs = {{parent, 1, 0}};
  for (int i = 0; i < 3; ++i) reqs.push_back({m.Fork(parent), 1, 0});
  const ScheduleResult r = m.Schedule(reqs, b);
  ASSERT_FALSE(r.admitted);
  EXPECT_EQ(r.blocks_needed, 3);
  ASSERT_EQ(r.rejected.size(), 2u);
  EXPECT_EQ(r.rejected[0].request_index, 2);
  EXPECT_EQ(r.rejected[1].request_index, 3);  // it still shares the block with request 2
  EXPECT_EQ(r.rejected[1].blocks_needed, 1);
}

// A holder outside the batch keeps the block: every writer copies.
TEST(ManagerTest, SharersWritingBesideAnIdleHolderEachCopy) {
  KVCacheManager m(Options(6));  // 5 usable: 2 in use, 3 free
  const SeqId parent = m.AddSequence(Range(0, 6));
  StepBatch b;
  Step(m, b, parent, 6);
  m.Commit(parent, std::vector<int32_t>{6});
  std::vector<StepRequest> reqs;
  for (int i = 0; i < 4; ++i) reqs.push_back({m.Fork(parent), 1, 0});
  const std::string before = m.DebugString();
  const ScheduleResult r = m.Schedule(reqs, b);
  EXPECT_FALSE(r.admitted);
  EXPECT_EQ(r.blocks_needed, 4);
  EXPECT_EQ(r.blocks_missing, 1);
  EXPECT_EQ(m.DebugString(), before);
  reqs.pop_back();
  ASSERT_TRUE(m.Schedule(reqs, b).admitted);
  EXPECT_EQ(b.copies().size(), 3u);
  EXPECT_EQ(m.BlockTable(parent)[1], 2);
  EXPECT_EQ(m.pool().block(2).ref_count, 2);  // the parent and the fork that did not write
  m.CheckInvariants();
}

// Every holder of a published block rewrites it while a new sequence in the same batch takes it
// as a prefix hit: that sequence is one more holder, so both writers copy.
TEST(ManagerTest, SharersRewritingABlockThatAHitInTheSameBatchTakesBothCopy) {
  KVCacheManager m(Options(16));
  const SeqId a = m.AddSequence(Range(0, 8));
  StepBatch b;
  Step(m, b, a, 8);
  m.Commit(a, std::vector<int32_t>{8});
  const SeqId f = m.Fork(a);
  m.Rewind(a, 2);  // positions 6, 7 of (published) block 1 will be rewritten
  m.Rewind(f, 2);
  const int32_t block1 = m.BlockTable(a)[1];
  ASSERT_EQ(m.pool().block(block1).ref_count, 2);
  const SeqId c = m.AddSequence(Range(0, 9));
  ASSERT_EQ(m.Lookup(c).num_blocks, 2);
  const std::vector<StepRequest> reqs = {{a, 2, 0}, {f, 2, 0}, {c, 1, 0}};
  const ScheduleResult r = m.Schedule(reqs, b);
  ASSERT_TRUE(r.admitted);
  ASSERT_EQ(b.copies().size(), 2u);
  EXPECT_NE(m.BlockTable(a)[1], block1);
  EXPECT_NE(m.BlockTable(f)[1], block1);
  EXPECT_EQ(m.BlockTable(c)[1], block1);
  EXPECT_TRUE(m.pool().block(block1).hashed);
  m.CheckInvariants();
}

TEST(ManagerTest, ForkOfUnknownSequenceThrows) {
  KVCacheManager m(Options(8));
  ExpectErrorAndUnchanged(m, [&] { m.Fork(12345); }, {"Fork", "unknown sequence 12345"});
}

// ---------------------------------------------------------------------------------------------
// Free, errors on ids

TEST(ManagerTest, DoubleFreeAndUseAfterFreeThrowNamingTheSequence) {
  KVCacheManager m(Options(8));
  const SeqId s = m.AddSequence(Range(0, 5));
  StepBatch b;
  Step(m, b, s, 5);
  m.Free(s);
  EXPECT_FALSE(m.IsLive(s));
  EXPECT_EQ(m.Stats().blocks_in_use, 0);
  ExpectErrorAndUnchanged(m, [&] { m.Free(s); },
                          {fmt::format("Free: sequence {} was freed already (double free)", s)});
  ExpectErrorAndUnchanged(m, [&] { m.Commit(s, {}); }, {"Commit", "was freed"});
  ExpectErrorAndUnchanged(m, [&] { m.Rewind(s, 1); }, {"Rewind", "was freed"});
  ExpectErrorAndUnchanged(m, [&] { m.Lookup(s); }, {"Lookup", "was freed"});
  ExpectErrorAndUnchanged(m, [&] { m.Free(-3); }, {"unknown sequence -3"});
  // The slot is reused under a new id; the old id stays dead.
  const SeqId t = m.AddSequence(Range(0, 2));
  EXPECT_NE(t, s);
  EXPECT_EQ(t & 0xffffffff, s & 0xffffffff);
  EXPECT_THROW(m.GetSequenceInfo(s), Error);
  EXPECT_TRUE(m.IsLive(t));
  // An id of the right slot but a future generation was never issued.
  ExpectErrorAndUnchanged(m, [&] { m.Free(t + (SeqId{1} << 32)); }, {"never issued"});
}

TEST(ManagerTest, FreeEvictsTheTailOfAChainFirst) {
  KVCacheManager m(Options(5));  // 4 usable
  const SeqId a = m.AddSequence(Range(0, 13));
  StepBatch b;
  Step(m, b, a, 13);  // 4 blocks, 3 full
  m.Commit(a, std::vector<int32_t>{0});
  const std::vector<int32_t> blocks(m.BlockTable(a).begin(), m.BlockTable(a).end());
  m.Free(a);  // blocks 0..2 cached (evictable), block 3 free
  EXPECT_EQ(m.Stats().blocks_evictable, 3);
  // A new sequence needing 2 blocks takes the free one, then evicts the chain's last block.
  const SeqId c = m.AddSequence(Range(500, 8));
  Step(m, b, c, 8);
  EXPECT_EQ(m.Stats().evictions, 1);
  EXPECT_EQ(m.pool().block(blocks[2]).state, BlockState::kInUse);
  EXPECT_EQ(m.pool().block(blocks[0]).state, BlockState::kEvictable);
  // The surviving prefix (2 blocks) still serves a new copy of the prompt.
  EXPECT_EQ(m.Lookup(m.AddSequence(Range(0, 13))).num_blocks, 2);
}

TEST(ManagerTest, LowPriorityCachedBlocksAreEvictedFirst) {
  KVCacheManager m(Options(5));  // 4 usable
  const SeqId hi = m.AddSequence(Range(0, 5), {.priority = 7});
  const SeqId lo = m.AddSequence(Range(100, 5), {.priority = 1});
  StepBatch b;
  Step(m, b, hi, 5);
  Step(m, b, lo, 5);
  m.Commit(hi, std::vector<int32_t>{1});
  m.Commit(lo, std::vector<int32_t>{1});
  m.Free(lo);  // released first: would be evicted first by LRU alone anyway, so free hi first
  m.Free(hi);
  // Now the LRU order is lo then hi, and priority agrees; check the opposite order too.
  const SeqId hi2 = m.AddSequence(Range(0, 5), {.priority = 7});
  const SeqId lo2 = m.AddSequence(Range(100, 5), {.priority = 1});
  Step(m, b, hi2, 1);  // hits block 0 of hi's chain
  Step(m, b, lo2, 1);
  m.Free(hi2);  // hi's block released first (older) ...
  m.Free(lo2);  // ... lo's later, yet lo's goes first
  const SeqId x = m.AddSequence(Range(900, 16));
  Step(m, b, x, 16);  // needs all 4: 2 free + 2 evicted? only 2 evictable, so evicts both
  EXPECT_EQ(m.Stats().evictions, 2);
  const auto events = m.TakeEvents();
  std::vector<BlockHash> removed;
  for (const auto& e : events) {
    if (e.type == KVEventType::kBlockRemoved) removed.push_back(e.hash);
  }
  ASSERT_EQ(removed.size(), 2u);
  const BlockHash root = HashFormatTag(FormatTag{"turboquant_4bit_nc", 128, 4, 1});
  EXPECT_EQ(removed[0], HashBlockTokens(root, Range(100, 4)));  // low priority first
  EXPECT_EQ(removed[1], HashBlockTokens(root, Range(0, 4)));
}

// ---------------------------------------------------------------------------------------------
// Prefix hits inside one batch

TEST(ManagerTest, HitBlocksArePinnedBeforeAnythingIsEvicted) {
  KVCacheManager m(Options(5));  // 4 usable
  const auto prompt = Range(0, 9);
  const SeqId a = m.AddSequence(prompt);
  StepBatch b;
  Step(m, b, a, 9);
  m.Commit(a, std::vector<int32_t>{1});
  m.Free(a);                                    // 2 evictable (full blocks), 2 free
  const SeqId c = m.AddSequence(prompt);        // hits 2, needs 1
  const SeqId d = m.AddSequence(Range(50, 8));  // needs 2
  ASSERT_EQ(m.Lookup(c).num_blocks, 2);
  const StepRequest reqs[] = {{c, 1, 0}, {d, 8, 0}};
  const std::string before = m.DebugString();
  const ScheduleResult r = m.Schedule(reqs, b);
  // 4 free + evictable, but 2 of those are c's prefix: 3 needed > 2 available.
  EXPECT_FALSE(r.admitted);
  EXPECT_EQ(r.blocks_available, 2);
  EXPECT_EQ(r.blocks_needed, 3);
  EXPECT_EQ(m.DebugString(), before);
  EXPECT_EQ(m.Lookup(c).num_blocks, 2);
  // Alone, c fits and takes its prefix.
  Step(m, b, c, 1);
  EXPECT_EQ(b.prefix_hit_tokens()[0], 8);
}

TEST(ManagerTest, TwoNewSequencesWithOnePrefixCountItOnce) {
  KVCacheManager m(Options(5));  // 4 usable
  const auto prompt = Range(0, 9);
  const SeqId a = m.AddSequence(prompt);
  StepBatch b;
  Step(m, b, a, 9);
  m.Commit(a, std::vector<int32_t>{1});
  m.Free(a);
  const SeqId c = m.AddSequence(prompt);
  const SeqId d = m.AddSequence(prompt);
  const StepRequest reqs[] = {{c, 1, 0}, {d, 1, 0}};
  const ScheduleResult r = m.Schedule(reqs, b);
  ASSERT_TRUE(r.admitted);  // 2 free blocks for the two tails; the prefix is shared
  EXPECT_EQ(r.blocks_available, 2);
  EXPECT_EQ(m.pool().block(m.BlockTable(c)[0]).ref_count, 2);
  EXPECT_THAT(Vec(b.prefix_hit_tokens()), ElementsAre(8, 8));
  m.CheckInvariants();
}

// ---------------------------------------------------------------------------------------------
// Sliding window

TEST(ManagerTest, SlidingWindowReleasesBlocksOutsideTheWindow) {
  KVCacheManager m(Options(16, 4, true, /*window=*/6));
  const SeqId s = m.AddSequence(Range(0, 10));
  StepBatch b;
  Step(m, b, s, 10);  // queries 0..9; the first query reads from 0: nothing released yet
  EXPECT_THAT(Vec(m.BlockTable(s)), ElementsAre(1, 2, 3));
  m.Commit(s, std::vector<int32_t>{10});
  Step(m, b, s, 1);  // query at 10 reads 5..10: block 0 (0..3) released
  EXPECT_THAT(Vec(m.BlockTable(s)), ElementsAre(0, 2, 3));
  EXPECT_THAT(Row(b, 0), ElementsAre(0, 2, 3));
  EXPECT_EQ(m.GetSequenceInfo(s).num_released_blocks, 1);
  EXPECT_EQ(m.Stats().blocks_in_use, 2);
  EXPECT_EQ(m.Stats().blocks_evictable, 1);  // it was full and published: still cached
  m.CheckInvariants();
  m.Commit(s, std::vector<int32_t>{11});
  // Rewinding so far that the next query would need released positions throws.
  ExpectErrorAndUnchanged(m, [&] { m.Rewind(s, 3); },
                          {"sliding window of 6 tokens", "rewind at most 2"});
  m.Rewind(s, 2);
  m.CheckInvariants();
}

TEST(ManagerTest, SlidingWindowCountsReleasedBlocksAsAvailable) {
  KVCacheManager m(Options(4, 4, false, /*window=*/4));  // 3 usable
  const SeqId s = m.AddSequence(Range(0, 12));
  StepBatch b;
  Step(m, b, s, 12);  // all 3 blocks
  m.Commit(s, std::vector<int32_t>{12});
  Step(m, b, s, 1);  // query at 12 reads 9..12: blocks 0, 1 released, block 3 allocated
  // The released blocks went to the free list (LIFO): block 2 is reused at once.
  EXPECT_THAT(Vec(m.BlockTable(s)), ElementsAre(0, 0, 3, 2));
  m.CheckInvariants();
}

TEST(ManagerTest, SlidingWindowSkipsPrefixBlocksOutsideTheFirstWindow) {
  KVCacheManager m(Options(16, 4, true, /*window=*/4));
  const auto prompt = Range(0, 13);
  const SeqId a = m.AddSequence(prompt);
  StepBatch b;
  Step(m, b, a, 13);
  m.Commit(a, std::vector<int32_t>{1});
  m.Free(a);
  const SeqId c = m.AddSequence(prompt);
  ASSERT_EQ(m.Lookup(c).num_blocks, 3);
  Step(m, b, c, 1);  // query at 12 reads 9..12: hit blocks 0 and 1 are not even taken
  EXPECT_EQ(m.BlockTable(c)[0], kNullBlock);
  EXPECT_EQ(m.BlockTable(c)[1], kNullBlock);
  EXPECT_NE(m.BlockTable(c)[2], kNullBlock);
  EXPECT_EQ(m.Stats().blocks_in_use, 2);
  m.CheckInvariants();
}

// ---------------------------------------------------------------------------------------------
// Events, stats, clearing, buffers

TEST(ManagerTest, ClearPrefixCacheDropsEveryHash) {
  KVCacheManager m(Options(8));
  const auto prompt = Range(0, 9);
  const SeqId a = m.AddSequence(prompt);
  StepBatch b;
  Step(m, b, a, 9);
  m.Commit(a, std::vector<int32_t>{1});
  const SeqId c = m.AddSequence(Range(20, 5));
  Step(m, b, c, 5);
  m.Commit(c, std::vector<int32_t>{1});
  m.Free(c);
  m.TakeEvents();
  EXPECT_EQ(m.ClearPrefixCache(), 3);
  EXPECT_EQ(m.Stats().blocks_cached, 0);
  EXPECT_EQ(m.Stats().blocks_evictable, 0);
  EXPECT_EQ(m.Lookup(m.AddSequence(prompt)).num_blocks, 0);
  const auto events = m.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].type, KVEventType::kAllCleared);
  m.CheckInvariants();
}

TEST(ManagerTest, EventsNeedToBeEnabled) {
  KVCacheManagerOptions o = Options(8);
  o.record_events = false;
  KVCacheManager m(o);
  const SeqId a = m.AddSequence(Range(0, 9));
  StepBatch b;
  Step(m, b, a, 9);
  m.Commit(a, std::vector<int32_t>{1});
  EXPECT_EQ(m.Stats().blocks_cached, 2);
  EXPECT_TRUE(m.TakeEvents().empty());
}

TEST(ManagerTest, StatsAddUp) {
  KVCacheManager m(Options(10));
  const SeqId a = m.AddSequence(Range(0, 9));
  StepBatch b;
  Step(m, b, a, 9);
  m.Commit(a, std::vector<int32_t>{1});
  const SeqId c = m.Fork(a);
  Step(m, b, c, 1);  // copy of the partial block
  const KVCacheStats st = m.Stats();
  EXPECT_EQ(st.num_blocks, 9);
  EXPECT_EQ(st.blocks_in_use, 4);
  EXPECT_EQ(st.blocks_free, 5);
  EXPECT_EQ(st.blocks_evictable, 0);
  EXPECT_EQ(st.blocks_in_use + st.blocks_free + st.blocks_evictable, st.num_blocks);
  EXPECT_EQ(st.blocks_cached, 2);
  EXPECT_EQ(st.num_sequences, 2);
  EXPECT_DOUBLE_EQ(st.usage, 4.0 / 9);
  EXPECT_EQ(st.cow_copies, 1);
  EXPECT_EQ(st.blocks_allocated, 4);
  EXPECT_EQ(st.schedule_calls, 2);
  EXPECT_EQ(st.schedule_rejections, 0);
  EXPECT_EQ(st.prefix_query_tokens, 9);
  EXPECT_EQ(st.prefix_hit_tokens, 0);
  // A fresh sequence scheduled with no tokens (and no hit) stays fresh; its prompt is counted
  // once, when a schedule gives it a table.
  const SeqId e = m.AddSequence(Range(100, 5));
  Step(m, b, e, 0);
  Step(m, b, e, 0);
  Step(m, b, e, 5);
  EXPECT_EQ(m.Stats().prefix_query_tokens, 9 + 5);
}

// A Schedule that throws after its checks (a batch buffer too large to allocate: a huge padding)
// leaves the manager as it was: the prefix hits of a fresh sequence are not taken, and a retry
// takes them.
TEST(ManagerTest, ScheduleThatCannotAllocateItsBatchChangesNothing) {
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer aborts on an allocation past its maximum instead of failing it.
  GTEST_SKIP() << "the allocation must fail, not abort";
#endif
  KVCacheManager m(Options(10));
  StepBatch b;
  const SeqId a = m.AddSequence(Range(0, 9));
  Step(m, b, a, 9);
  m.Commit(a, std::vector<int32_t>{1});  // blocks 0-1 published
  const SeqId s = m.AddSequence(Range(0, 9));
  ASSERT_EQ(m.Lookup(s).num_tokens, 8);
  const std::string before = m.DebugString();
  const StepRequest r{s, 1, 0};
  EXPECT_ANY_THROW(
      m.Schedule({&r, 1}, b, {.pad_requests_to = 1 << 30, .block_table_width = 1 << 20}));
  EXPECT_EQ(m.DebugString(), before);
  EXPECT_EQ(m.FindInvariantViolation(), "");
  Step(m, b, s, 1);
  EXPECT_EQ(b.seq_lens()[0], 9);  // the cached 8 positions taken, then the new one
  EXPECT_EQ(m.GetSequenceInfo(s).num_cached_blocks, 2);
}

// Paddings whose step batch would pass kMaxStepBatchBytes are refused as invalid input, naming
// the options, with nothing changed (the largest had wrapped the batch's size in int64 to 128
// bytes; smaller ones failed as std::bad_alloc); so is a table width past it.
TEST(ManagerTest, PaddingsPastTheBatchLimitAreRefused) {
  KVCacheManager m(Options(10));
  StepBatch b;
  const SeqId a = m.AddSequence(Range(0, 9));
  const std::string before = m.DebugString();
  const StepRequest r{a, 9, 0};
  for (const ScheduleOptions& o :
       {ScheduleOptions{.pad_requests_to = 2147483647, .block_table_width = 2147483647},
        ScheduleOptions{.pad_requests_to = 1 << 16, .block_table_width = 1 << 16},
        ScheduleOptions{.pad_tokens_to = 2147483647}}) {
    EXPECT_THAT(
        [&] {
          m.Schedule({&r, 1}, b, o);
        },
        ::testing::ThrowsMessage<Error>(
            ::testing::AllOf(::testing::HasSubstr("Schedule: invalid options = pad_requests_to"),
                             ::testing::HasSubstr("a step batch of at most 17179869184 bytes"))));
    EXPECT_EQ(m.DebugString(), before);
  }
  EXPECT_EQ(b.num_requests(), 0);
  EXPECT_TRUE(
      m.Schedule({&r, 1}, b, {.pad_requests_to = 1 << 10, .block_table_width = 1 << 10}).admitted);
}

using testing::AddressSpaceLimit;

// A Schedule whose batch cannot be allocated leaves the batch's shape as it was: it set the new
// width first, and the next step of that width kept the rows at the old width's stride.
TEST(ManagerTest, BatchThatCannotBeReshapedKeepsItsShape) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reserves more address space than the limit allows";
#endif
  KVCacheManager m(Options(16));
  StepBatch b;
  const SeqId a = m.AddSequence(Range(0, 4)), c = m.AddSequence(Range(100, 4));
  const StepRequest first[] = {{a, 4, 0}, {c, 4, 0}};
  ASSERT_TRUE(m.Schedule(first, b).admitted);
  ASSERT_EQ(b.block_table_width(), 1);
  m.Commit(a, std::vector<int32_t>{1});
  m.Commit(c, std::vector<int32_t>{2});
  const StepRequest next[] = {{a, 1, 0}, {c, 1, 0}};
  const int64_t total_bytes = b.layout().total_bytes;
  {
    const AddressSpaceLimit limit(int64_t{256} << 20);
    // 2^27 padded tokens: 1 GiB of slots.
    EXPECT_ANY_THROW(m.Schedule(next, b, {.pad_tokens_to = 1 << 27, .block_table_width = 2}));
  }
  EXPECT_EQ(b.block_table_width(), 1);
  EXPECT_EQ(b.layout().total_bytes, total_bytes);
  ASSERT_TRUE(m.Schedule(next, b, {.block_table_width = 2}).admitted);
  EXPECT_EQ(Row(b, 0), Vec(m.BlockTable(a)));
  EXPECT_EQ(Row(b, 1), Vec(m.BlockTable(c)));
}

// AddSequence and Fork that cannot allocate the sequence's vectors change nothing: they took the
// slot and marked it live first, leaving a live sequence without tokens that no caller knew.
TEST(ManagerTest, SequencesThatCannotBeAllocatedChangeNothing) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reserves more address space than the limit allows";
#endif
  KVCacheManager m(Options(16));
  const std::vector<int32_t> prompt(size_t{1} << 25, 7);  // 128 MiB of tokens
  const SeqId big = m.AddSequence(prompt);
  const SeqId small = m.AddSequence(Range(0, 5));
  m.Free(small);  // a free slot to reuse
  const std::string before = m.DebugString();
  {
    const AddressSpaceLimit limit(int64_t{32} << 20);
    EXPECT_THROW(m.AddSequence(prompt), std::bad_alloc);  // a reused slot
    EXPECT_THROW(m.Fork(big), std::bad_alloc);
  }
  EXPECT_EQ(m.DebugString(), before);
  EXPECT_EQ(m.FindInvariantViolation(), "");
  EXPECT_EQ(m.Stats().num_sequences, 1);
  const SeqId again = m.AddSequence(Range(0, 5));
  EXPECT_EQ(m.GetSequenceInfo(again).num_tokens, 5);
}

// A commit whose prefix-cache events cannot be allocated changes nothing: it appended the tokens
// and registered blocks one by one, each event's push_back able to fail halfway. Schedule reserves
// one event per allocated block; a step that evicted cached blocks spent that room on their
// removal events.
TEST(ManagerTest, CommitThatCannotRecordItsEventsChangesNothing) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reserves more address space than the limit allows";
#endif
  // 16-token blocks; the events' reallocation to 2^20 events of 48 bytes (48 MB) is past glibc's
  // largest mmap threshold (32 MB), so it maps new memory, which the limit refuses.
  constexpr int32_t kBlocks = 1 << 19;
  KVCacheManager m(Options(kBlocks + 1, 16));
  StepBatch b;
  const SeqId x = m.AddSequence(Range(0, 16 * kBlocks + 1));
  Step(m, b, x, 16 * kBlocks);
  m.Commit(x, {});  // a partial prefill: publishes every block
  m.Free(x);        // now all cached and evictable
  ASSERT_EQ(m.TakeEvents().size(), size_t{kBlocks});
  const SeqId a = m.AddSequence(Range(1 << 24, 16 * kBlocks + 1));
  Step(m, b, a, 16 * kBlocks);  // evicts them all
  // (No DebugString: its buffers, freed, would leave the heap room for the events.)
  const SequenceInfo info = m.GetSequenceInfo(a);
  {
    const AddressSpaceLimit limit(int64_t{1} << 20);
    ASSERT_THROW(std::vector<char>(size_t{48} << 20), std::bad_alloc) << "the limit must bite";
    EXPECT_THROW(m.Commit(a, {}), std::bad_alloc);
  }
  EXPECT_EQ(m.FindInvariantViolation(), "");
  EXPECT_EQ(m.Stats().blocks_cached, 0);  // none registered
  EXPECT_EQ(m.GetSequenceInfo(a).num_tokens, info.num_tokens);
  EXPECT_EQ(m.GetSequenceInfo(a).num_cached_blocks, info.num_cached_blocks);
  m.Commit(a, {});
  EXPECT_EQ(m.TakeEvents().size(), 2 * size_t{kBlocks});  // removed, then stored
  EXPECT_EQ(m.Stats().blocks_cached, kBlocks);
}

// A batch written by a manager that was destroyed, then filled by a new manager built in the
// same place (whose sequence ids and table epochs start over): every row is rewritten.
TEST(ManagerTest, BatchRowsOfADestroyedManagerAreNotReused) {
  std::optional<KVCacheManager> m;
  m.emplace(Options(16));
  StepBatch x, y;
  const SeqId old = m->AddSequence(Range(0, 4));
  Step(*m, x, old, 4);
  ASSERT_EQ(Row(x, 0), std::vector<int32_t>{1});
  m.reset();
  m.emplace(Options(16));
  const SeqId s0 = m->AddSequence(Range(50, 4)), s1 = m->AddSequence(Range(60, 4));
  ASSERT_EQ(s0, old);  // the same id, in a manager at the same address
  Step(*m, y, s1, 4);  // takes block 1
  Step(*m, x, s0, 4);
  EXPECT_EQ(Row(x, 0), Vec(m->BlockTable(s0)));
  EXPECT_NE(Row(x, 0), std::vector<int32_t>{1});
}

// Steady-state decode: the batch's buffers keep their addresses and capacity (a counting
// allocator checks the same loop in step_batch_alloc_test).
TEST(ManagerTest, StepBatchReusesItsBuffers) {
  KVCacheManager m(Options(512, 16));
  std::vector<SeqId> seqs;
  std::vector<StepRequest> reqs;
  StepBatch b;
  for (int i = 0; i < 32; ++i) {
    seqs.push_back(m.AddSequence(Range(i * 1000, 40 + i)));
    Step(m, b, seqs.back(), 40 + i);
    m.Commit(seqs.back(), std::vector<int32_t>{7});
    reqs.push_back({seqs.back(), 1, 0});
  }
  ScheduleOptions opts{.pad_tokens_to = 64, .pad_requests_to = 64, .block_table_width = 16};
  ASSERT_TRUE(m.Schedule(reqs, b, opts).admitted);
  const std::byte* arena = b.bytes().data();
  const int64_t capacity = b.arena_capacity_bytes();
  const int32_t* hits = b.prefix_hit_tokens().data();
  for (int step = 0; step < 100; ++step) {
    for (SeqId s : seqs) m.Commit(s, std::vector<int32_t>{step});
    ASSERT_TRUE(m.Schedule(reqs, b, opts).admitted);
    ASSERT_EQ(b.bytes().data(), arena);
    ASSERT_EQ(b.arena_capacity_bytes(), capacity);
    ASSERT_EQ(b.prefix_hit_tokens().data(), hits);
  }
  m.CheckInvariants();
}

}  // namespace
}  // namespace tqkv
