// `tqkv sim --device cuda` against --device cpu (what tools/gpu_check.sh does with the binary),
// and the CUDA path's per-layer timing. Skips without a device.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "tests/gpu_test_util.h"
#include "tools/sim.h"

namespace tqkv::sim {
namespace {

using ::testing::HasSubstr;

SimConfig Small(const char* preset) {
  SimConfig c;
  c.preset = preset;
  c.layers = 3;
  c.q_heads = 16;
  c.kv_heads = 4;
  c.head_dim = 128;
  c.requests = 10;
  c.prompt_len = 70;
  c.shared_prefix = 40;
  c.decode_len = 12;
  c.prefill_chunk = 96;  // prompt chunks beside decode rows: steps that decode some rows only
  c.max_running = 6;
  c.fork_fraction = 0.5;
  c.num_blocks = 1 + 3 * 6;  // preemption and copy-on-write copies too
  c.progress = false;
  return c;
}

// The same workload on both devices: the same steps and rows, decode outputs within the
// kernels' tolerance (checksums as tools/sim_compare.py compares them), the same accuracy.
void ExpectSameAsCpu(const char* preset, int spec_tokens = 0, int sliding_window = 0) {
  SimConfig c = Small(preset);
  c.spec_tokens = spec_tokens;
  c.sliding_window = sliding_window;
  const SimReport cpu = RunSim(c);
  c.device = "cuda";
  const SimReport gpu = RunSim(c);
  EXPECT_EQ(gpu.steps, cpu.steps);
  EXPECT_EQ(gpu.preemptions, cpu.preemptions);
  EXPECT_EQ(gpu.cow_copies, cpu.cow_copies);
  EXPECT_GT(cpu.cow_copies, 0);
  EXPECT_EQ(gpu.store_calls, cpu.store_calls);
  EXPECT_EQ(gpu.attention_calls, cpu.attention_calls);
  EXPECT_EQ(gpu.attention_decode_steps.steps, cpu.attention_decode_steps.steps);
  EXPECT_EQ(gpu.attention_prefill_steps.steps, cpu.attention_prefill_steps.steps);
  ASSERT_EQ(gpu.output_checksums.size(), cpu.output_checksums.size());
  double scale = 0, worst = 0;
  for (const auto& [key, v] : cpu.output_checksums) scale = std::max(scale, std::abs(v));
  for (const auto& [key, v] : cpu.output_checksums) {
    const auto it = gpu.output_checksums.find(key);
    ASSERT_NE(it, gpu.output_checksums.end());
    worst = std::max(worst, std::abs(it->second - v));
  }
  EXPECT_LE(worst / scale, 2e-3) << preset;
  EXPECT_NEAR(gpu.cosine_mean, cpu.cosine_mean, 1e-3) << preset;
  EXPECT_EQ(gpu.accuracy_samples, cpu.accuracy_samples);

  // Every per-layer time is there; the kernels alone take no longer than the calls on the stream
  // (launch gaps and events come on top there), with a margin for timer noise.
  EXPECT_GT(gpu.store_host_us_per_layer, 0.0);
  EXPECT_GT(gpu.store_stream_us_per_layer, 0.0);
  EXPECT_GT(gpu.store_kernels_us_per_layer, 0.0);
  EXPECT_GT(gpu.attention_host_us_per_layer, 0.0);
  EXPECT_GT(gpu.attention_stream_us_per_layer, 0.0);
  EXPECT_GT(gpu.attention_kernels_us_per_layer, 0.0);
  EXPECT_LE(gpu.attention_kernels_us_per_layer, 1.5 * gpu.attention_stream_us_per_layer + 2.0);
  for (const SimReport::StepKindTimes* t :
       {&gpu.attention_decode_steps, &gpu.attention_prefill_steps}) {
    EXPECT_GT(t->kernels_us, 0.0);
    EXPECT_LE(t->kernels_us, 1.5 * t->stream_us + 2.0);
  }
  EXPECT_GT(gpu.step_stream_us, 0.0);
  const std::string report = FormatReport(c, gpu);
  EXPECT_THAT(report, HasSubstr("store per layer (median): host / stream / kernels"));
  EXPECT_THAT(report, HasSubstr("attention per layer (median): host / stream / kernels"));
}

TEST(SimCudaTest, FourBitMatchesCpu) {
  TQKV_SKIP_WITHOUT_GPU();
  ExpectSameAsCpu("turboquant_4bit_nc");
}

TEST(SimCudaTest, K3v4MatchesCpu) {
  TQKV_SKIP_WITHOUT_GPU();
  ExpectSameAsCpu("turboquant_k3v4_nc");
}

// Speculative decoding: every decoding sequence's drafts verified in the call of its last token
// (4 new tokens beside the 4 GQA heads: one pass of 16 columns, 4bit_nc's half-precision verify
// kernel), a rejected suffix rewound, on both devices.
TEST(SimCudaTest, SpeculativeVerifyMatchesCpu) {
  TQKV_SKIP_WITHOUT_GPU();
  ExpectSameAsCpu("turboquant_4bit_nc", 3);
}

// Sliding-window attention (decode steps on the decode kernels from the window's blocks, verify
// steps of decoding sequences alone as passes on them too, the blocks before the window released
// by the manager), with and without speculative verify.
TEST(SimCudaTest, SlidingWindowMatchesCpu) {
  TQKV_SKIP_WITHOUT_GPU();
  ExpectSameAsCpu("turboquant_4bit_nc", 0, 24);
  ExpectSameAsCpu("turboquant_k3v4_nc", 2, 24);
}

TEST(SimCudaTest, Fp8KeysMatchCpu) {
  TQKV_SKIP_WITHOUT_GPU();
  ExpectSameAsCpu("turboquant_k8v4");
}

// Without the graph-replay pass the outputs are the same and the kernels-alone times are 0.
TEST(SimCudaTest, KernelTimingOffChangesNothingButTheTimes) {
  TQKV_SKIP_WITHOUT_GPU();
  SimConfig c = Small("turboquant_4bit_nc");
  c.device = "cuda";
  const SimReport on = RunSim(c);
  c.kernel_timing = false;
  const SimReport off = RunSim(c);
  EXPECT_EQ(off.output_checksums, on.output_checksums);
  EXPECT_EQ(off.store_kernels_us_per_layer, 0.0);
  EXPECT_EQ(off.attention_kernels_us_per_layer, 0.0);
  EXPECT_GT(off.attention_stream_us_per_layer, 0.0);
}

}  // namespace
}  // namespace tqkv::sim
