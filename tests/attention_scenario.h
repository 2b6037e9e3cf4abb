// An attention test scenario: the K/V of sequences stored into shuffled blocks of a compressed
// cache (tests/decode_scenario.h) and q_lens[b] new query tokens at the end of each, as the step
// batch lays them out (query_start_loc). Shared by the CPU and CUDA attention tests.
#pragma once

#include <cstdint>
#include <vector>

#include "attention/attention.h"
#include "quant/block_format.h"
#include "quant/quantizer.h"
#include "tests/decode_scenario.h"

namespace tqkv::testing {

struct AttentionScenario {
  Scenario base;  // cache, block tables, seq_lens, the K/V as generated
  std::vector<int32_t> query_start_loc;  // [B + 1]
  std::vector<float> queries;            // [T, Hq, D]
  int num_tokens = 0;
  int num_q_heads = 0;
};

// q_lens[b] <= seq_lens[b]; the queries are the generator's query tokens at their positions.
AttentionScenario BuildAttention(const Quantizer& q, std::vector<int32_t> seq_lens,
                                 const std::vector<int32_t>& q_lens, int num_q_heads,
                                 uint64_t seed);

// The scenario's K/V rounded to f.dtype and written into an uncompressed cache with the same
// block ids (every other byte 0xFF). Rounds s.base.keys / values in place to what was stored.
std::vector<uint8_t> StorePlain(AttentionScenario& s, const Bf16BlockFormat& f);

// Host arguments over the scenario and `cache` of `layout` (F32 query; output and lse left null).
AttentionArgs HostArgs(const AttentionScenario& s, const std::vector<uint8_t>& cache,
                       const CacheLayout& layout);

// AttentionCpu of the whole scenario, pieces of up to 32 new tokens of a sequence per task on all
// cores, F32 outputs: out [T, Hq, D], lse [T, Hq].
void ReferenceAttention(const Quantizer* q, const Bf16BlockFormat* plain,
                        const AttentionScenario& s, const std::vector<uint8_t>& cache,
                        int32_t sliding_window, std::vector<float>& out, std::vector<float>& lse);

}  // namespace tqkv::testing
