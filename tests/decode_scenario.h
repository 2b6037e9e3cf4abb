// A decode test scenario: sequences of synthetic K/V stored by the CPU reference into shuffled
// blocks of a compressed cache, with one query per sequence. Shared by the CPU and CUDA decode
// tests.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "attention/decode_cpu.h"
#include "quant/quantizer.h"

namespace tqkv::testing {

// Runs fn(i) for i in [0, n) on all cores; the first exception is rethrown.
void ParallelFor(int n, const std::function<void(int)>& fn);

struct Scenario {
  std::vector<int32_t> seq_lens;
  std::vector<int32_t> block_tables;  // [B, max_blocks]; unused entries -1
  int max_blocks = 0;
  int64_t num_blocks = 0;
  std::vector<uint8_t> cache;                    // [num_blocks, block_bytes]
  std::vector<std::vector<float>> keys, values;  // per sequence [L, Hk, D]
  std::vector<float> queries;                    // [B, Hq, D]
  int num_q_heads = 0;
};

// Blocks are assigned in a shuffled order (3 spare blocks); every byte not written by the store
// is 0xFF (NaN as fp16), so reading an unused slot shows up.
Scenario Build(const Quantizer& q, std::vector<int32_t> seq_lens, int num_q_heads, uint64_t seed);

// The reference decode's inputs for the whole scenario: its queries, block tables and lengths.
DecodeInputs ReferenceInputs(const Scenario& s);

// DecodeCpu over the whole scenario (its default softmax scale) with the scenario's queries or
// `query` [B, Hq, D], one sequence per task on all cores: out [B, Hq, D] and lse [B, Hq] are
// resized.
void ReferenceDecode(const Quantizer& q, const Scenario& s, std::vector<float>& out,
                     std::vector<float>& lse, const float* query = nullptr);

}  // namespace tqkv::testing
