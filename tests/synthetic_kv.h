// Seeded K/V/Q with the statistics of real post-RoPE attention inputs: Gaussian entries, a few key
// channels of large magnitude (with a non-zero mean), per-head scale differences, and RoPE-rotated
// channel pairs. Used by accuracy tests, benchmarks and the sim.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace tqkv::testing {

struct SyntheticKvOptions {
  int num_kv_heads = 8;
  int num_q_heads = 32;
  int head_dim = 128;
  int outlier_channels = 4;    // per head: channels with large magnitude
  float outlier_scale = 8.0f;  // their standard deviation relative to the rest
  float rope_base = 10000.0f;
  uint64_t seed = 1;
};

class SyntheticKv {
 public:
  explicit SyntheticKv(const SyntheticKvOptions& options);

  // Keys and values of tokens at positions [first_pos, first_pos + count): each
  // [count, num_kv_heads, head_dim], appended to `keys` / `values`.
  void Generate(int64_t first_pos, int64_t count, std::vector<float>& keys,
                std::vector<float>& values);
  // One query token at `pos`: [num_q_heads, head_dim], appended to `queries`.
  void GenerateQuery(int64_t pos, std::vector<float>& queries);

  const SyntheticKvOptions& options() const { return options_; }

 private:
  // cos and sin of position `pos` for each channel pair: [head_dim / 2][2], computed once per
  // token for all of its heads.
  void RopeAngles(int64_t pos, std::vector<double>& cs) const;
  void Rope(float* x, const std::vector<double>& cs) const;

  SyntheticKvOptions options_;
  std::mt19937_64 rng_;
  std::vector<double> rope_freq_;     // [head_dim / 2]
  std::vector<float> channel_scale_;  // [num_kv_heads, head_dim]
  std::vector<float> channel_mean_;   // [num_kv_heads, head_dim]
  std::vector<float> head_scale_;     // [num_kv_heads]
};

}  // namespace tqkv::testing
