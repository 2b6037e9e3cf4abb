#include "model/llama.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>

#include "runtime/error.h"

namespace tqkv::model {
namespace {

constexpr const char* kWhere = "LlamaModel::FromGguf";

std::vector<float> Load(const GgufFile& f, const std::string& name,
                        std::initializer_list<int64_t> dims) {
  const GgufTensor& t = f.Tensor(name);
  if (!std::equal(t.dims.begin(), t.dims.end(), dims.begin(), dims.end())) {
    throw Error(fmt::format("{}: tensor '{}' has dims [{}]; expected [{}]", kWhere, name,
                            fmt::join(t.dims, ", "), fmt::join(dims, ", ")));
  }
  return f.Dequantize(t);
}

int PositiveInt(const GgufFile& f, const std::string& key) {
  const int64_t v = f.GetInt(key);
  if (v <= 0 || v > (int64_t{1} << 24)) {
    throw InvalidArgument(kWhere, key, v, "1 to 2^24");
  }
  return static_cast<int>(v);
}

void RmsNorm(const float* x, const float* w, int n, float eps, float* y) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += double{x[i]} * x[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / n) + eps);
  for (int i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
}

// Rotates adjacent pairs of each head of x [heads · d] by pos · base^(-2i / d).
void Rope(float* x, int heads, int d, int pos, float base) {
  for (int i = 0; i < d / 2; ++i) {
    const double theta = pos * std::pow(static_cast<double>(base), -2.0 * i / d);
    const auto c = static_cast<float>(std::cos(theta)), s = static_cast<float>(std::sin(theta));
    for (int h = 0; h < heads; ++h) {
      float* p = x + h * d + 2 * i;
      const float a = p[0], b = p[1];
      p[0] = a * c - b * s;
      p[1] = a * s + b * c;
    }
  }
}

}  // namespace

void MatMul(const float* w, const float* x, int n, int in, int out, float* y) {
  for (int o = 0; o < out; ++o) {
    const float* row = w + static_cast<int64_t>(o) * in;
    for (int t = 0; t < n; ++t) {
      const float* xt = x + static_cast<int64_t>(t) * in;
      float acc[8] = {};
      int i = 0;
      for (; i + 8 <= in; i += 8) {
        for (int k = 0; k < 8; ++k) acc[k] += row[i + k] * xt[i + k];
      }
      float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (; i < in; ++i) sum += row[i] * xt[i];
      y[static_cast<int64_t>(t) * out + o] = sum;
    }
  }
}

LlamaModel LlamaModel::FromGguf(const GgufFile& f) {
  const std::string arch = f.GetString("general.architecture");
  if (arch != "llama") throw InvalidArgument(kWhere, "general.architecture", arch, "llama");
  LlamaModel m;
  LlamaConfig& c = m.c_;
  c.num_layers = PositiveInt(f, "llama.block_count");
  c.hidden = PositiveInt(f, "llama.embedding_length");
  c.ffn = PositiveInt(f, "llama.feed_forward_length");
  c.num_heads = PositiveInt(f, "llama.attention.head_count");
  c.num_kv_heads = f.Find("llama.attention.head_count_kv") != nullptr
                       ? PositiveInt(f, "llama.attention.head_count_kv")
                       : c.num_heads;
  c.context = PositiveInt(f, "llama.context_length");
  if (c.hidden % c.num_heads != 0 || c.num_heads % c.num_kv_heads != 0) {
    throw Error(fmt::format("{}: {} heads of {} KV heads over hidden {}", kWhere, c.num_heads,
                            c.num_kv_heads, c.hidden));
  }
  c.head_dim = c.hidden / c.num_heads;
  if (c.head_dim % 2 != 0) throw InvalidArgument(kWhere, "head_dim", c.head_dim, "even");
  c.rms_eps = static_cast<float>(f.GetFloat("llama.attention.layer_norm_rms_epsilon"));
  if (!(std::isfinite(c.rms_eps) && c.rms_eps > 0.0f)) {
    throw InvalidArgument(kWhere, "llama.attention.layer_norm_rms_epsilon", c.rms_eps,
                          "finite and > 0");
  }
  if (f.Find("llama.rope.freq_base") != nullptr) {
    c.rope_base = static_cast<float>(f.GetFloat("llama.rope.freq_base"));
  }
  if (!(std::isfinite(c.rope_base) && c.rope_base > 0.0f)) {
    throw InvalidArgument(kWhere, "llama.rope.freq_base", c.rope_base, "finite and > 0");
  }
  // What this forward pass does not implement is refused, not ignored: RoPE over part of the
  // head, RoPE scaling (linear, YaRN, Llama 3.1's rope_freqs), heads of another size than
  // hidden / heads.
  for (const char* key : {"llama.rope.dimension_count", "llama.attention.key_length",
                          "llama.attention.value_length"}) {
    if (f.Find(key) != nullptr && f.GetInt(key) != c.head_dim) {
      throw InvalidArgument(
          kWhere, key, f.GetInt(key),
          fmt::format("{} (hidden / heads; other sizes are not implemented)", c.head_dim));
    }
  }
  if (f.Find("llama.rope.scaling.type") != nullptr &&
      f.GetString("llama.rope.scaling.type") != "none") {
    throw InvalidArgument(kWhere, "llama.rope.scaling.type", f.GetString("llama.rope.scaling.type"),
                          "none (RoPE scaling is not implemented)");
  }
  if (f.Find("llama.rope.scaling.factor") != nullptr &&
      f.GetFloat("llama.rope.scaling.factor") != 1.0) {
    throw InvalidArgument(kWhere, "llama.rope.scaling.factor",
                          f.GetFloat("llama.rope.scaling.factor"),
                          "1 (RoPE scaling is not implemented)");
  }
  if (f.HasTensor("rope_freqs.weight")) {
    throw Error(
        fmt::format("{}: tensor rope_freqs.weight (per-frequency RoPE scaling, as in Llama "
                    "3.1) is not implemented",
                    kWhere));
  }
  const GgufTensor& emb = f.Tensor("token_embd.weight");
  if (emb.dims.size() != 2 || emb.dims[0] != c.hidden) {
    throw Error(fmt::format("{}: token_embd.weight has dims [{}]; expected [{}, vocab]", kWhere,
                            fmt::join(emb.dims, ", "), c.hidden));
  }
  if (emb.dims[1] < 1 || emb.dims[1] > (int64_t{1} << 24)) {
    throw InvalidArgument(kWhere, "token_embd.weight dims[1] (vocab)", emb.dims[1], "1 to 2^24");
  }
  c.vocab = static_cast<int>(emb.dims[1]);
  m.embedding_ = f.Dequantize(emb);
  if (f.HasTensor("output.weight")) m.output_ = Load(f, "output.weight", {c.hidden, c.vocab});
  m.output_norm_ = Load(f, "output_norm.weight", {c.hidden});
  const int64_t kv = int64_t{c.num_kv_heads} * c.head_dim;
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("blk.{}.", l);
    Layer layer;
    layer.attn_norm = Load(f, p + "attn_norm.weight", {c.hidden});
    layer.wq = Load(f, p + "attn_q.weight", {c.hidden, c.hidden});
    layer.wk = Load(f, p + "attn_k.weight", {c.hidden, kv});
    layer.wv = Load(f, p + "attn_v.weight", {c.hidden, kv});
    layer.wo = Load(f, p + "attn_output.weight", {c.hidden, c.hidden});
    layer.ffn_norm = Load(f, p + "ffn_norm.weight", {c.hidden});
    layer.gate = Load(f, p + "ffn_gate.weight", {c.hidden, c.ffn});
    layer.up = Load(f, p + "ffn_up.weight", {c.hidden, c.ffn});
    layer.down = Load(f, p + "ffn_down.weight", {c.ffn, c.hidden});
    m.layers_.push_back(std::move(layer));
  }
  return m;
}

LlamaModel LlamaModel::RandomInit(const LlamaConfig& config, uint64_t seed) {
  const LlamaConfig& c = config;
  if (c.num_layers < 1 || c.hidden < 1 || c.ffn < 1 || c.num_heads < 1 || c.num_kv_heads < 1 ||
      c.vocab < 1 || c.context < 1 || c.hidden % c.num_heads != 0 ||
      c.num_heads % c.num_kv_heads != 0 || c.head_dim != c.hidden / c.num_heads ||
      c.head_dim % 2 != 0) {
    throw Error(fmt::format(
        "LlamaModel::RandomInit: layers {}, hidden {}, ffn {}, heads {} / {}, head_dim {}, vocab "
        "{}, context {}: need positive sizes, heads dividing hidden into an even head_dim, KV "
        "heads dividing heads",
        c.num_layers, c.hidden, c.ffn, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab,
        c.context));
  }
  // FromGguf's bounds: its sizes at most 2^24, a finite positive epsilon and RoPE base.
  const std::pair<const char*, int> sizes[] = {{"config.num_layers", c.num_layers},
                                               {"config.hidden", c.hidden},
                                               {"config.ffn", c.ffn},
                                               {"config.num_heads", c.num_heads},
                                               {"config.vocab", c.vocab},
                                               {"config.context", c.context}};
  for (const auto& [name, v] : sizes) {
    if (v > (1 << 24)) throw InvalidArgument("LlamaModel::RandomInit", name, v, "1 to 2^24");
  }
  if (!(std::isfinite(c.rms_eps) && c.rms_eps > 0.0f)) {
    throw InvalidArgument("LlamaModel::RandomInit", "config.rms_eps", c.rms_eps, "finite and > 0");
  }
  if (!(std::isfinite(c.rope_base) && c.rope_base > 0.0f)) {
    throw InvalidArgument("LlamaModel::RandomInit", "config.rope_base", c.rope_base,
                          "finite and > 0");
  }
  LlamaModel m;
  m.c_ = c;
  std::mt19937_64 rng(seed);
  auto normal = [&](int64_t n, double stddev) {
    std::normal_distribution<float> dist(0.0f, static_cast<float>(stddev));
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = dist(rng);
    return v;
  };
  auto linear = [&](int in, int out) { return normal(int64_t{in} * out, 1.0 / std::sqrt(in)); };
  const int kv = c.num_kv_heads * c.head_dim;
  m.embedding_ = normal(int64_t{c.vocab} * c.hidden, 1.0);
  m.output_norm_.assign(static_cast<size_t>(c.hidden), 1.0f);
  for (int l = 0; l < c.num_layers; ++l) {
    Layer layer;
    layer.attn_norm.assign(static_cast<size_t>(c.hidden), 1.0f);
    layer.wq = linear(c.hidden, c.hidden);
    layer.wk = linear(c.hidden, kv);
    layer.wv = linear(c.hidden, kv);
    layer.wo = linear(c.hidden, c.hidden);
    layer.ffn_norm.assign(static_cast<size_t>(c.hidden), 1.0f);
    layer.gate = linear(c.hidden, c.ffn);
    layer.up = linear(c.hidden, c.ffn);
    layer.down = linear(c.ffn, c.hidden);
    m.layers_.push_back(std::move(layer));
  }
  return m;
}

LlamaConfig LlamaModel::SmolLm2Config() {
  LlamaConfig c;
  c.num_layers = 30;
  c.hidden = 576;
  c.ffn = 1536;
  c.num_heads = 9;
  c.num_kv_heads = 3;
  c.head_dim = 64;
  c.vocab = 49152;
  c.context = 8192;
  c.rms_eps = 1e-5f;
  c.rope_base = 100000.0f;
  return c;
}

void LlamaModel::Embed(std::span<const int32_t> tokens, float* x) const {
  for (size_t t = 0; t < tokens.size(); ++t) {
    const int32_t token = tokens[t];
    if (token < 0 || token >= c_.vocab) {
      throw InvalidArgument("LlamaModel::Embed", "token", token,
                            fmt::format("0 to {}", c_.vocab - 1));
    }
    std::copy_n(embedding_.data() + int64_t{token} * c_.hidden, c_.hidden,
                x + static_cast<int64_t>(t) * c_.hidden);
  }
}

void LlamaModel::AttentionInputs(int layer, const float* x, int n, int pos0, float* q, float* k,
                                 float* v) const {
  std::vector<int32_t> positions(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) positions[t] = pos0 + t;
  AttentionInputs(layer, x, n, positions.data(), q, k, v);
}

void LlamaModel::AttentionInputs(int layer, const float* x, int n, const int32_t* positions,
                                 float* q, float* k, float* v) const {
  const Layer& w = layers_.at(static_cast<size_t>(layer));
  const int hid = c_.hidden, kv = c_.num_kv_heads * c_.head_dim;
  std::vector<float> h(static_cast<size_t>(n) * hid);
  for (int t = 0; t < n; ++t) {
    RmsNorm(x + int64_t{t} * hid, w.attn_norm.data(), hid, c_.rms_eps, h.data() + int64_t{t} * hid);
  }
  MatMul(w.wq.data(), h.data(), n, hid, hid, q);
  MatMul(w.wk.data(), h.data(), n, hid, kv, k);
  MatMul(w.wv.data(), h.data(), n, hid, kv, v);
  for (int t = 0; t < n; ++t) {
    Rope(q + int64_t{t} * hid, c_.num_heads, c_.head_dim, positions[t], c_.rope_base);
    Rope(k + int64_t{t} * kv, c_.num_kv_heads, c_.head_dim, positions[t], c_.rope_base);
  }
}

void LlamaModel::AttentionOutput(int layer, const float* attn, int n, float* x) const {
  const Layer& w = layers_.at(static_cast<size_t>(layer));
  std::vector<float> o(static_cast<size_t>(n) * c_.hidden);
  MatMul(w.wo.data(), attn, n, c_.hidden, c_.hidden, o.data());
  for (size_t i = 0; i < o.size(); ++i) x[i] += o[i];
}

void LlamaModel::FeedForward(int layer, int n, float* x) const {
  const Layer& w = layers_.at(static_cast<size_t>(layer));
  const int hid = c_.hidden, ffn = c_.ffn;
  std::vector<float> h(static_cast<size_t>(n) * hid), g(static_cast<size_t>(n) * ffn), u(g.size()),
      o(h.size());
  for (int t = 0; t < n; ++t) {
    RmsNorm(x + int64_t{t} * hid, w.ffn_norm.data(), hid, c_.rms_eps, h.data() + int64_t{t} * hid);
  }
  MatMul(w.gate.data(), h.data(), n, hid, ffn, g.data());
  MatMul(w.up.data(), h.data(), n, hid, ffn, u.data());
  for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];  // SiLU · up
  MatMul(w.down.data(), g.data(), n, ffn, hid, o.data());
  for (size_t i = 0; i < o.size(); ++i) x[i] += o[i];
}

void LlamaModel::Logits(const float* x, int n, float* logits) const {
  std::vector<float> h(static_cast<size_t>(n) * c_.hidden);
  for (int t = 0; t < n; ++t) {
    RmsNorm(x + int64_t{t} * c_.hidden, output_norm_.data(), c_.hidden, c_.rms_eps,
            h.data() + int64_t{t} * c_.hidden);
  }
  MatMul(output_.empty() ? embedding_.data() : output_.data(), h.data(), n, c_.hidden, c_.vocab,
         logits);
}

std::vector<float> ReferenceForward(const LlamaModel& model, std::span<const int32_t> tokens) {
  const LlamaConfig& c = model.config();
  const int n = static_cast<int>(tokens.size());
  const int d = c.head_dim, kv = c.num_kv_heads * d, group = c.num_heads / c.num_kv_heads;
  // The whole sequence layer by layer (a prefill in one chunk): residuals x [n, hidden], this
  // layer's keys and values [n, kv], exact causal softmax attention in fp32 (fp64 sums).
  std::vector<float> x(static_cast<size_t>(n) * c.hidden), q(x.size()), attn(x.size());
  std::vector<float> keys(static_cast<size_t>(n) * kv), values(keys.size()), p(n);
  std::vector<float> logits(static_cast<size_t>(n) * c.vocab);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  model.Embed(tokens, x.data());
  for (int l = 0; l < c.num_layers; ++l) {
    model.AttentionInputs(l, x.data(), n, 0, q.data(), keys.data(), values.data());
    for (int t = 0; t < n; ++t) {
      for (int h = 0; h < c.num_heads; ++h) {
        const int g = h / group;
        const float* qh = q.data() + int64_t{t} * c.hidden + h * d;
        float mx = -INFINITY;
        for (int s = 0; s <= t; ++s) {
          const float* ks = keys.data() + int64_t{s} * kv + g * d;
          float dot = 0.0f;
          for (int i = 0; i < d; ++i) dot += qh[i] * ks[i];
          p[s] = dot * scale;
          mx = std::max(mx, p[s]);
        }
        double sum = 0.0;
        for (int s = 0; s <= t; ++s) sum += (p[s] = std::exp(p[s] - mx));
        float* out = attn.data() + int64_t{t} * c.hidden + h * d;
        std::fill_n(out, d, 0.0f);
        for (int s = 0; s <= t; ++s) {
          const float w = static_cast<float>(p[s] / sum);
          const float* vs = values.data() + int64_t{s} * kv + g * d;
          for (int i = 0; i < d; ++i) out[i] += w * vs[i];
        }
      }
    }
    model.AttentionOutput(l, attn.data(), n, x.data());
    model.FeedForward(l, n, x.data());
  }
  model.Logits(x.data(), n, logits.data());
  return logits;
}

}  // namespace tqkv::model
