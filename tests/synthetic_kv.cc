#include "tests/synthetic_kv.h"

#include <cmath>

namespace tqkv::testing {

SyntheticKv::SyntheticKv(const SyntheticKvOptions& o) : options_(o), rng_(o.seed) {
  const int d = o.head_dim;
  channel_scale_.assign(size_t(o.num_kv_heads) * d, 1.0f);
  channel_mean_.assign(size_t(o.num_kv_heads) * d, 0.0f);
  head_scale_.resize(o.num_kv_heads);
  rope_freq_.resize(d / 2);
  for (int i = 0; i < d / 2; ++i) rope_freq_[i] = std::pow(double(o.rope_base), -2.0 * i / d);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::uniform_int_distribution<int> channel(0, d - 1);
  for (int h = 0; h < o.num_kv_heads; ++h) {
    head_scale_[h] = 0.5f + 1.5f * unit(rng_);
    for (int i = 0; i < o.outlier_channels; ++i) {
      const int c = channel(rng_);
      channel_scale_[size_t(h) * d + c] = o.outlier_scale * (0.5f + unit(rng_));
      channel_mean_[size_t(h) * d + c] = o.outlier_scale * (unit(rng_) - 0.5f);
    }
  }
}

void SyntheticKv::RopeAngles(int64_t pos, std::vector<double>& cs) const {
  cs.resize(rope_freq_.size() * 2);
  for (size_t i = 0; i < rope_freq_.size(); ++i) {
    const double angle = double(pos) * rope_freq_[i];
    cs[2 * i] = std::cos(angle);
    cs[2 * i + 1] = std::sin(angle);
  }
}

void SyntheticKv::Rope(float* x, const std::vector<double>& cs) const {
  const int half = options_.head_dim / 2;
  for (int i = 0; i < half; ++i) {  // pairs (i, i + d/2), as in Llama's rotate_half
    const double c = cs[2 * i], s = cs[2 * i + 1];
    const double a = x[i], b = x[i + half];
    x[i] = static_cast<float>(a * c - b * s);
    x[i + half] = static_cast<float>(a * s + b * c);
  }
}

void SyntheticKv::Generate(int64_t first_pos, int64_t count, std::vector<float>& keys,
                           std::vector<float>& values) {
  const int d = options_.head_dim;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<double> cs;
  for (int64_t t = 0; t < count; ++t) {
    RopeAngles(first_pos + t, cs);
    for (int h = 0; h < options_.num_kv_heads; ++h) {
      const size_t k0 = keys.size();
      for (int i = 0; i < d; ++i) {
        const size_t c = size_t(h) * d + i;
        keys.push_back(head_scale_[h] * (channel_mean_[c] + channel_scale_[c] * normal(rng_)));
      }
      Rope(keys.data() + k0, cs);
      for (int i = 0; i < d; ++i) values.push_back(head_scale_[h] * normal(rng_));
    }
  }
}

void SyntheticKv::GenerateQuery(int64_t pos, std::vector<float>& queries) {
  const int d = options_.head_dim;
  const int group = options_.num_q_heads / options_.num_kv_heads;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<double> cs;
  RopeAngles(pos, cs);
  for (int hq = 0; hq < options_.num_q_heads; ++hq) {
    const int h = hq / group;
    // Queries lean on the keys' large channels (weight ∝ the channel's scale), scaled so that the
    // logits q·k/√D have a standard deviation τ ∈ [1.5, 4], as attention logits of real models do:
    // E[(q·k)²] = Σ_c q_c² E[k_c²] with E[k_c²] = head_scale² (mean_c² + scale_c²).
    const size_t q0 = queries.size();
    double energy = 0.0;
    for (int i = 0; i < d; ++i) {
      const size_t c = size_t(h) * d + i;
      const float q = channel_scale_[c] * normal(rng_);
      queries.push_back(q);
      energy += double(q) * q * head_scale_[h] * head_scale_[h] *
                (channel_mean_[c] * channel_mean_[c] + channel_scale_[c] * channel_scale_[c]);
    }
    const double tau = 1.5 + 2.5 * unit(rng_);
    const double factor = tau * std::sqrt(double(d)) / std::sqrt(energy);
    for (int i = 0; i < d; ++i) queries[q0 + i] = static_cast<float>(queries[q0 + i] * factor);
    Rope(queries.data() + q0, cs);
  }
}

}  // namespace tqkv::testing
