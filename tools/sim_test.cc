#include "tools/sim.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "runtime/error.h"

namespace tqkv::sim {
namespace {

using ::testing::HasSubstr;

SimConfig Small() {
  SimConfig c;
  c.layers = 2;
  c.q_heads = 8;
  c.kv_heads = 2;
  c.head_dim = 64;
  c.requests = 10;
  c.prompt_len = 56;
  c.shared_prefix = 40;
  c.decode_len = 10;
  c.prefill_chunk = 96;
  c.max_running = 6;
  c.fork_fraction = 0.5;
  c.check_invariants = true;  // CheckInvariants() after every step
  c.progress = false;
  return c;
}

// Every output that both runs computed (request, branch, position, layer) has exactly the same
// checksum in both; returns how many both computed. (Which tokens a run recomputes after a
// preemption depends on its schedule, so each run may hold a few keys the other does not.)
size_t ExpectSameOutputs(const SimReport& a, const SimReport& b) {
  size_t both = 0;
  for (const auto& [key, checksum] : a.output_checksums) {
    const auto it = b.output_checksums.find(key);
    if (it == b.output_checksums.end()) continue;
    EXPECT_EQ(checksum, it->second) << "request " << std::get<0>(key) << " branch "
                                    << std::get<1>(key) << " position " << std::get<2>(key)
                                    << " layer " << std::get<3>(key);
    ++both;
  }
  return both;
}

// The whole engine loop under memory pressure (preemption), forks (copy-on-write) and prefix
// reuse; the manager's invariants hold after every step, and every output — prefill chunks
// after a prefix hit included — is exactly that of a run without prefix caching, which computes
// every prompt token (cached blocks hold the bytes a recomputation would write, and a new token's
// attention reads its context from the cache either way).
TEST(SimTest, PrefixCachingChangesNothingButTheWork) {
  for (int spec : {0, 3}) {
  SimConfig on = Small();
  on.num_blocks = 1 + 3 * 5;  // room for about three sequences: forces preemption
  on.spec_tokens = spec;
  const SimReport a = RunSim(on);
  SimConfig off = on;
  off.enable_prefix_caching = false;
  const SimReport b = RunSim(off);

  EXPECT_GT(a.preemptions, 0);
  EXPECT_GT(a.forks, 0);
  EXPECT_GT(a.cow_copies, 0);
  EXPECT_GT(a.prefix_hit_rate, 0.2);
  EXPECT_EQ(b.prefix_hit_rate, 0.0);
  EXPECT_LT(a.prefill_tokens, b.prefill_tokens);
  EXPECT_EQ(a.finished_branches, b.finished_branches);
  EXPECT_EQ(a.finished_branches, on.requests + a.forks);
  EXPECT_EQ(a.decode_tokens, b.decode_tokens);
  ASSERT_FALSE(a.output_checksums.empty());
  // Tokens computed with prefix caching on were computed without it too, with the same outputs
  // (all but some recomputations after preemptions: which tokens a run recomputes depends on its
  // schedule); without it the cached prompt tokens are computed as well. A recomputed row equals
  // its first computation.
  EXPECT_GE(ExpectSameOutputs(a, b), a.output_checksums.size() * 95 / 100);
  EXPECT_GT(b.output_checksums.size(), a.output_checksums.size());
  EXPECT_GT(a.recomputed_outputs, 0);
  EXPECT_GT(a.recomputed_tokens, 0);
  EXPECT_EQ(a.recomputed_differing, 0);
  EXPECT_GT(b.recomputed_outputs, 0);
  EXPECT_EQ(b.recomputed_differing, 0);
  }
}

// Speculative decoding: drafts verified in the same call as the last token, a rejected suffix
// rewound. The generated tokens are the same as without drafts, so every output of the run
// without drafts (prefill and decode rows) is, exactly, an output of the run with them (accepted
// drafts' rows are the decode rows of those positions), in fewer steps (all but some
// recomputations after preemptions: which tokens are recomputed differs between the two
// schedules).
TEST(SimTest, SpeculativeVerifyMatchesPlainDecoding) {
  SimConfig plain = Small();
  plain.check_invariants = true;
  SimConfig spec = plain;
  spec.spec_tokens = 4;
  const SimReport a = RunSim(plain);
  const SimReport b = RunSim(spec);
  EXPECT_GT(b.draft_tokens, 0);
  EXPECT_GT(b.accepted_drafts, 0);
  EXPECT_LT(b.accepted_drafts, b.draft_tokens);  // some rejected (and rewound)
  EXPECT_EQ(a.draft_tokens, 0);
  EXPECT_EQ(a.decode_tokens, b.decode_tokens);
  EXPECT_LT(b.steps, a.steps);
  EXPECT_GE(ExpectSameOutputs(a, b), a.output_checksums.size() * 95 / 100);
  EXPECT_EQ(a.recomputed_differing, 0);
  EXPECT_EQ(b.recomputed_differing, 0);
  EXPECT_GT(b.cosine_mean, 0.97);
}

TEST(SimTest, NumbersArePlausible) {
  SimConfig c = Small();
  const SimReport r = RunSim(c);
  // 4bit_nc at D = 64: 70 bytes per token-head vs 256 for bf16.
  EXPECT_EQ(r.kv_bytes_per_token, 70 * c.kv_heads * c.layers);
  EXPECT_EQ(r.bf16_bytes_per_token, 256 * c.kv_heads * c.layers);
  EXPECT_EQ(r.capacity_tokens, (r.num_blocks - 1) * c.block_size);
  EXPECT_GT(r.accuracy_samples, 0);
  // What the format allows (attention:decode_cpu_test): mean cosine ≈ 0.99 on such K/V.
  EXPECT_GT(r.cosine_mean, 0.97);
  EXPECT_LE(r.cosine_worst, r.cosine_mean);
  EXPECT_GT(r.manager_us_per_step, 0.0);
  // Every step with work stores every layer; decode calls only where some row decodes.
  EXPECT_GT(r.store_calls, 0);
  EXPECT_EQ(r.store_calls % c.layers, 0);
  EXPECT_GT(r.attention_calls, 0);
  EXPECT_EQ(r.attention_calls % c.layers, 0);
  EXPECT_LE(r.attention_calls, r.store_calls);
  // On the CPU the call is the work: host, stream and kernels times are the same CPU time.
  EXPECT_GT(r.store_host_us_per_layer, 0.0);
  EXPECT_GT(r.attention_host_us_per_layer, 0.0);
  EXPECT_EQ(r.store_stream_us_per_layer, r.store_host_us_per_layer);
  EXPECT_EQ(r.store_kernels_us_per_layer, r.store_host_us_per_layer);
  EXPECT_EQ(r.attention_stream_us_per_layer, r.attention_host_us_per_layer);
  EXPECT_EQ(r.attention_kernels_us_per_layer, r.attention_host_us_per_layer);
  // Every step with attention calls is counted once, as a decoding step or one with prefill;
  // this workload has both, and a prefill chunk's call costs more than a step of decode rows.
  const SimReport::StepKindTimes& dec = r.attention_decode_steps;
  const SimReport::StepKindTimes& pre = r.attention_prefill_steps;
  EXPECT_EQ(dec.steps + pre.steps, r.attention_calls / c.layers);
  EXPECT_GT(dec.steps, 0);
  EXPECT_GT(pre.steps, 0);
  EXPECT_GT(dec.host_us, 0.0);
  EXPECT_GT(pre.host_us, dec.host_us);
  EXPECT_EQ(pre.kernels_us, pre.host_us);
  EXPECT_EQ(r.step_stream_us, 0.0);
  EXPECT_GT(r.generate_us_per_step, 0.0);
  EXPECT_GT(r.check_us_per_step, 0.0);
  const std::string report = FormatReport(c, r);
  EXPECT_THAT(report, HasSubstr("store per layer call (CPU)"));
  EXPECT_THAT(report, HasSubstr("attention per layer call (CPU)"));
  const std::string json = ReportJson(c, r);
  EXPECT_THAT(json, HasSubstr("\"store_kernels_us_per_layer\""));
  EXPECT_THAT(json, HasSubstr("\"attention_stream_us_per_layer\""));
}

TEST(SimTest, Bf16IsExactToBf16Rounding) {
  SimConfig c = Small();
  c.preset = "bf16";
  const SimReport r = RunSim(c);
  EXPECT_EQ(r.kv_bytes_per_token, r.bf16_bytes_per_token);
  EXPECT_GT(r.cosine_mean, 0.9999);
}

// fp16 keeps 3 more mantissa bits than bf16: its attention outputs are closer to the unrounded
// ones (1 - cosine about 64x smaller), so a path that rounded fp16 caches to bf16 fails here.
TEST(SimTest, Fp16IsCloserThanBf16) {
  SimConfig c = Small();
  c.preset = "bf16";
  const SimReport b = RunSim(c);
  c.preset = "fp16";
  const SimReport h = RunSim(c);
  EXPECT_EQ(h.kv_bytes_per_token, h.bf16_bytes_per_token);
  EXPECT_GT(h.cosine_mean, 0.99999);
  EXPECT_LT(1.0 - h.cosine_mean, (1.0 - b.cosine_mean) / 8);
}

// Sliding-window attention: a token at position p attends to (p - window, p] (the fp64
// reference over the same positions agrees), the manager releases the blocks before the
// windows, and the rows whose context fits the window are exactly those of a run without one;
// prefix caching on and off give the same outputs, speculative verify too.
TEST(SimTest, SlidingWindowAttendsToTheWindow) {
  constexpr int kWindow = 24;
  SimConfig windowed = Small();
  windowed.sliding_window = kWindow;
  const SimReport w = RunSim(windowed);
  const SimReport whole = RunSim(Small());
  EXPECT_GT(w.cosine_mean, 0.99);
  size_t inside = 0, outside = 0, differing = 0;
  for (const auto& [key, checksum] : w.output_checksums) {
    const auto it = whole.output_checksums.find(key);
    if (it == whole.output_checksums.end()) continue;
    if (std::get<2>(key) < kWindow) {
      EXPECT_EQ(checksum, it->second) << "position " << std::get<2>(key);
      ++inside;
    } else {
      ++outside;
      differing += checksum != it->second ? 1 : 0;
    }
  }
  EXPECT_GT(inside, 0u);
  EXPECT_GT(outside, 0u);
  EXPECT_EQ(differing, outside);
  SimConfig off = windowed;
  off.enable_prefix_caching = false;
  EXPECT_GE(ExpectSameOutputs(w, RunSim(off)), w.output_checksums.size() * 95 / 100);
  SimConfig spec = windowed;
  spec.spec_tokens = 3;
  const SimReport s = RunSim(spec);
  EXPECT_GT(s.accepted_drafts, 0);
  // (Fewer rows in common than without a window, 878 of 1,077 when written: a run's prefix-cache
  // hits, and so the tokens it computes, follow its schedule, and under a window also the blocks
  // its windows have released by then.)
  EXPECT_GE(ExpectSameOutputs(w, s), w.output_checksums.size() * 3 / 4);
}

TEST(SimTest, InvalidFlagsNameTheFlag) {
  auto message = [](SimConfig c) -> std::string {
    try {
      RunSim(c);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  SimConfig c = Small();
  c.preset = "turboquant_9bit";
  EXPECT_THAT(message(c), HasSubstr("--preset turboquant_9bit"));
  c = Small();
  c.q_heads = 9;
  EXPECT_THAT(message(c), HasSubstr("--q-heads = 9"));
  c = Small();
  c.num_blocks = 3;
  EXPECT_THAT(message(c), HasSubstr("cannot hold one sequence"));
  c = Small();
  c.shared_prefix = 100;
  EXPECT_THAT(message(c), HasSubstr("--shared-prefix = 100"));
  c = Small();
  c.device = "tpu";
  EXPECT_THAT(message(c), HasSubstr("--device = tpu"));
  c = Small();
  c.spec_tokens = 65;
  EXPECT_THAT(message(c), HasSubstr("--spec-tokens = 65"));
  c.spec_tokens = -1;
  EXPECT_THAT(message(c), HasSubstr("--spec-tokens = -1"));
  c = Small();
  c.sliding_window = -2;
  EXPECT_THAT(message(c), HasSubstr("--sliding-window = -2"));
  // Block ids are int32: more blocks were cut to 32 bits (2^32 + 4 ran with 4 blocks).
  c = Small();
  c.num_blocks = (int64_t{1} << 32) + 4;
  EXPECT_THAT(message(c), HasSubstr("--num-blocks = 4294967300"));
  c = Small();
  c.kv_memory_gib = std::nan("");
  EXPECT_THAT(message(c), HasSubstr("--kv-memory = nan"));
  c.kv_memory_gib = 1e12;
  EXPECT_THAT(message(c), HasSubstr("--kv-memory = 1000000000000"));
  c.kv_memory_gib = 100000;
  c.layers = 1;
  c.kv_heads = 1;
  c.q_heads = 1;
  c.head_dim = 64;
  EXPECT_THAT(message(c), HasSubstr("(int32 block ids)"));
  // Sizes whose products had wrapped int32 (the automatic pool of long prompts went negative) or
  // had run into an allocation failure that named no flag; both pool flags at once (--kv-memory
  // was dropped); a memory that holds no block.
  for (auto [set, flag] : std::initializer_list<std::pair<void (*)(SimConfig&), const char*>>{
           {[](SimConfig& x) { x.prompt_len = (1 << 24) + 1; }, "--prompt-len = 16777217"},
           {[](SimConfig& x) { x.decode_len = 2147483647; }, "--decode-len = 2147483647"},
           {[](SimConfig& x) { x.layers = 5000; }, "--layers = 5000"},
           {[](SimConfig& x) { x.q_heads = 1 << 25; }, "--q-heads = 33554432"},
           {[](SimConfig& x) { x.kv_heads = 512; }, "--kv-heads = 512"},
           {[](SimConfig& x) { x.num_blocks = 1; }, "--num-blocks = 1"},
           {[](SimConfig& x) {
              x.num_blocks = 100;
              x.kv_memory_gib = 5;
            },
            "--kv-memory = 5; allowed: 0 (unset) where --num-blocks is given"},
           {[](SimConfig& x) { x.kv_memory_gib = 1e-30; }, "holds 0 blocks; allowed: 2 to"},
           {[](SimConfig& x) {
              x.requests = 4000;
              x.max_running = 4000;
              x.prompt_len = 1 << 24;
              x.decode_len = 1 << 24;
            },
            "the automatic pool for --prompt-len 16777216"}}) {
    c = Small();
    set(c);
    EXPECT_THAT(message(c), HasSubstr(flag));
  }
}

}  // namespace
}  // namespace tqkv::sim
