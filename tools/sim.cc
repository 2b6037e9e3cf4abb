#include "tools/sim.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <thread>
#include <vector>

#include "attention/decode_cpu.h"  // ReferenceAttention
#include "kvcache/cache_format.h"
#include "kvcache/kv_cache.h"
#include "kvcache/manager.h"
#include "quant/numerics.h"
#include "quant/quantizer.h"
#include "runtime/device.h"
#include "runtime/error.h"
#include "tools/sim_backend.h"

namespace tqkv::sim {
namespace {

// The manager's and the cache's block ids are int32.
constexpr int64_t kMaxSimBlocks = std::numeric_limits<int32_t>::max();
// ComputeCapacity's limit.
constexpr int kMaxSimLayers = 4096;
constexpr int kMaxSimQHeads = 4096;
// A prompt or a generation, so that their sum (a sequence's positions) stays far inside int32.
constexpr int kMaxSimTokens = 1 << 24;

using Clock = std::chrono::steady_clock;

uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A small counter-based normal generator: the n-th normal of stream `key`.
class Normals {
 public:
  explicit Normals(uint64_t key) : state_(key) {}
  float Next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = (static_cast<double>(Mix(state_++) >> 11) + 0.5) * 0x1.0p-53;
    const double u2 = static_cast<double>(Mix(state_++) >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = static_cast<float>(r * std::sin(2.0 * M_PI * u2));
    has_spare_ = true;
    return static_cast<float>(r * std::cos(2.0 * M_PI * u2));
  }

 private:
  uint64_t state_;
  float spare_ = 0.0f;
  bool has_spare_ = false;
};

// K/V and queries with the statistics of real post-RoPE activations: per layer and KV head a few
// channels of large magnitude with a non-zero mean, per-head scales, RoPE on channel pairs; the
// query leans on the large channels with a logit standard deviation of 1.5 to 4.
class ActivationModel {
 public:
  ActivationModel(const SimConfig& c) : c_(c) {
    const int d = c.head_dim;
    for (int i = 0; i < d / 2; ++i) inv_freq_.push_back(std::pow(10000.0, -2.0 * i / d));
    for (int layer = 0; layer < c.layers; ++layer) {
      std::vector<float> scale(size_t(c.kv_heads) * d, 1.0f), mean(scale.size(), 0.0f);
      std::vector<float> head_scale(c.kv_heads);
      uint64_t s = Mix(c.seed * 1000003 + layer);
      for (int h = 0; h < c.kv_heads; ++h) {
        head_scale[h] = 0.5f + 1.5f * Unit(s++);
        for (int i = 0; i < 4; ++i) {
          const int ch = static_cast<int>(Mix(s++) % d);
          scale[size_t(h) * d + ch] = 8.0f * (0.5f + Unit(s++));
          mean[size_t(h) * d + ch] = 8.0f * (Unit(s++) - 0.5f);
        }
      }
      scale_.push_back(std::move(scale));
      mean_.push_back(std::move(mean));
      head_scale_.push_back(std::move(head_scale));
    }
  }

  // K and V of one token: [kv_heads, head_dim] each, written to k and v.
  void KeyValue(int layer, int64_t pos, uint64_t prefix_hash, float* k, float* v) const {
    const int d = c_.head_dim;
    Normals n(Mix(prefix_hash ^ (uint64_t(layer) << 56) ^ uint64_t(pos)));
    Rotation rope = RopeAt(pos);
    for (int h = 0; h < c_.kv_heads; ++h) {
      float* kh = k + size_t(h) * d;
      for (int i = 0; i < d; ++i) {
        const size_t ch = size_t(h) * d + i;
        kh[i] = head_scale_[layer][h] * (mean_[layer][ch] + scale_[layer][ch] * n.Next());
      }
      Rope(kh, rope);
      float* vh = v + size_t(h) * d;
      for (int i = 0; i < d; ++i) vh[i] = head_scale_[layer][h] * n.Next();
    }
  }
  // Appends them to k and v.
  void AppendKeyValue(int layer, int64_t pos, uint64_t prefix_hash, std::vector<float>& k,
                      std::vector<float>& v) const {
    const size_t at = k.size(), n = size_t(c_.kv_heads) * c_.head_dim;
    k.resize(at + n);
    v.resize(at + n);
    KeyValue(layer, pos, prefix_hash, k.data() + at, v.data() + at);
  }

  // The query of the token at `pos`: [q_heads, head_dim], written to q.
  void Query(int layer, int64_t pos, uint64_t key, float* q) const {
    const int d = c_.head_dim, group = c_.q_heads / c_.kv_heads;
    Normals n(Mix(key ^ 0x5151515151515151ull ^ (uint64_t(layer) << 56) ^ uint64_t(pos)));
    Rotation rope = RopeAt(pos);
    for (int hq = 0; hq < c_.q_heads; ++hq) {
      const int h = hq / group;
      float* qh = q + size_t(hq) * d;
      double energy = 0.0;
      for (int i = 0; i < d; ++i) {
        const size_t ch = size_t(h) * d + i;
        const float x = scale_[layer][ch] * n.Next();
        qh[i] = x;
        const double hs = head_scale_[layer][h];
        energy += double(x) * x * hs * hs *
                  (mean_[layer][ch] * mean_[layer][ch] + scale_[layer][ch] * scale_[layer][ch]);
      }
      const double tau = 1.5 + 2.5 * (0.5 + 0.5 * std::tanh(n.Next()));
      const double factor = tau * std::sqrt(double(d)) / std::sqrt(energy);
      for (int i = 0; i < d; ++i) qh[i] = static_cast<float>(qh[i] * factor);
      Rope(qh, rope);
    }
  }

 private:
  // RoPE's cos and sin at one position, computed once for all heads of a token.
  struct Rotation {
    std::vector<double> cs, sn;
  };
  static float Unit(uint64_t s) { return (Mix(s) >> 40) * (1.0f / 16777216.0f); }
  Rotation RopeAt(int64_t pos) const {
    Rotation r;
    r.cs.resize(inv_freq_.size());
    r.sn.resize(inv_freq_.size());
    for (size_t i = 0; i < inv_freq_.size(); ++i) {
      const double angle = double(pos) * inv_freq_[i];
      r.cs[i] = std::cos(angle);
      r.sn[i] = std::sin(angle);
    }
    return r;
  }
  void Rope(float* x, const Rotation& r) const {
    const int d = c_.head_dim;
    for (int i = 0; i < d / 2; ++i) {
      const double a = x[i], b = x[i + d / 2];
      x[i] = static_cast<float>(a * r.cs[i] - b * r.sn[i]);
      x[i + d / 2] = static_cast<float>(a * r.sn[i] + b * r.cs[i]);
    }
  }

  SimConfig c_;
  std::vector<double> inv_freq_;  // 10000^(-2i/D), i < D/2
  std::vector<std::vector<float>> scale_, mean_, head_scale_;
};


// One sequence of the manager: a request's branch (branch 0, or a fork).
struct Branch {
  int request = 0;
  int branch = 0;
  SeqId seq = -1;
  int priority = 4;
  std::vector<int32_t> tokens;     // known tokens: prompt + generated
  std::vector<uint64_t> hashes;    // hash of tokens [0, p] for each position p
  int generated = 0;
  bool fork_after_prompt = false;
  std::vector<float> raw_k, raw_v;  // layer 0 K/V of positions with KV [pos, Hk, D]
};

constexpr int kVocab = 32000;
// The probability that a draft token is the one the target model samples (--spec-tokens).
constexpr double kDraftAccuracy = 0.7;

void Append(Branch& b, int32_t token) {
  b.hashes.push_back(Mix((b.hashes.empty() ? 0x1234567ull : b.hashes.back()) * 31 + token));
  b.tokens.push_back(token);
}

int32_t SampledToken(uint64_t seed, int request, int branch, size_t pos) {
  return static_cast<int32_t>(Mix(seed ^ Mix(request * 1000 + branch) ^ (pos << 20)) % kVocab);
}

void Validate(const SimConfig& c) {
  auto bad = [](std::string_view flag, auto value, std::string_view allowed) {
    throw InvalidArgument("tqkv sim", flag, value, allowed);
  };
  if (c.layers < 1 || c.layers > kMaxSimLayers) {
    bad("--layers", c.layers, fmt::format("1 to {}", kMaxSimLayers));
  }
  if (c.kv_heads < 1 || c.kv_heads > kMaxKvHeads) {
    bad("--kv-heads", c.kv_heads, fmt::format("1 to {}", kMaxKvHeads));
  }
  if (c.q_heads < c.kv_heads || c.q_heads % c.kv_heads != 0 || c.q_heads > kMaxSimQHeads) {
    bad("--q-heads", c.q_heads,
        fmt::format("a multiple of --kv-heads = {} up to {}", c.kv_heads, kMaxSimQHeads));
  }
  if (c.requests < 1) bad("--requests", c.requests, ">= 1");
  // A sequence's positions are int32; these bounds keep every count derived from them in range.
  if (c.prompt_len < 1 || c.prompt_len > kMaxSimTokens) {
    bad("--prompt-len", c.prompt_len, fmt::format("1 to {}", kMaxSimTokens));
  }
  if (c.shared_prefix < 0 || c.shared_prefix > c.prompt_len) {
    bad("--shared-prefix", c.shared_prefix, fmt::format("0 to --prompt-len = {}", c.prompt_len));
  }
  if (c.decode_len < 1 || c.decode_len > kMaxSimTokens) {
    bad("--decode-len", c.decode_len, fmt::format("1 to {}", kMaxSimTokens));
  }
  if (c.spec_tokens < 0 || c.spec_tokens > 64) bad("--spec-tokens", c.spec_tokens, "0 to 64");
  if (c.sliding_window < 0) bad("--sliding-window", c.sliding_window, ">= 0 (0: none)");
  if (c.prefill_chunk < 1) bad("--prefill-chunk", c.prefill_chunk, ">= 1");
  if (c.max_running < 1) bad("--max-running", c.max_running, ">= 1");
  if (!(c.fork_fraction >= 0 && c.fork_fraction <= 1)) {
    bad("--fork-fraction", c.fork_fraction, "0 to 1");
  }
  if (c.device != "cpu" && c.device != "cuda") bad("--device", c.device, "cpu, cuda");
  if (c.num_blocks < 0 || c.num_blocks == 1 || c.num_blocks > kMaxSimBlocks) {
    bad("--num-blocks", c.num_blocks, fmt::format("2 to {} (0: automatic)", kMaxSimBlocks));
  }
  // 2^33 GiB is 2^63 bytes; NaN fails the comparison.
  if (!(c.kv_memory_gib >= 0 && c.kv_memory_gib < 0x1p33)) {
    bad("--kv-memory", c.kv_memory_gib, "0 (unset) to 2^33 GiB");
  }
  if (c.num_blocks > 0 && c.kv_memory_gib > 0) {
    bad("--kv-memory", c.kv_memory_gib, "0 (unset) where --num-blocks is given (one or the other)");
  }
}

}  // namespace

SimReport RunSim(const SimConfig& c) {
  Validate(c);
  CacheFormat format;
  try {
    format = MakeCacheFormat(c.preset, c.head_dim, c.kv_heads, c.block_size);
  } catch (const Error& e) {
    throw Error(fmt::format("tqkv sim: --preset {} / --head-dim {} / --kv-heads {} / --block-size "
                            "{}: {}",
                            c.preset, c.head_dim, c.kv_heads, c.block_size, e.what()));
  }
  std::optional<Quantizer> quantizer;
  if (!format.bf16) quantizer.emplace(Quantizer::Create(c.preset, c.head_dim, c.kv_heads, c.block_size));

  SimReport rep;
  const int64_t blocks_per_branch =
      (int64_t{c.prompt_len} + c.decode_len + c.block_size - 1) / c.block_size;
  int64_t num_blocks = c.num_blocks;
  if (num_blocks == 0 && c.kv_memory_gib > 0) {
    num_blocks = ComputeCapacity(static_cast<int64_t>(c.kv_memory_gib * (1ull << 30)), c.preset,
                                 c.layers, c.kv_heads, c.head_dim, c.block_size)
                     .format.num_blocks;
    if (num_blocks > kMaxSimBlocks || num_blocks < 2) {
      throw Error(fmt::format(
          "tqkv sim: --kv-memory {} GiB holds {} blocks; allowed: 2 to {} (int32 block ids)",
          c.kv_memory_gib, num_blocks, kMaxSimBlocks));
    }
  } else if (num_blocks == 0) {
    // Room for about 45 % of the running set's peak demand: enough pressure to preempt.
    num_blocks = 1 + std::max<int64_t>(2 * blocks_per_branch,
                                       blocks_per_branch * std::min(c.requests, c.max_running) * 45 / 100);
    if (num_blocks > kMaxSimBlocks) {
      throw Error(fmt::format(
          "tqkv sim: the automatic pool for --prompt-len {} + --decode-len {} and --max-running "
          "{} is {} blocks; allowed: at most {} (int32 block ids): give --num-blocks or "
          "--kv-memory",
          c.prompt_len, c.decode_len, c.max_running, num_blocks, kMaxSimBlocks));
    }
  }
  if (num_blocks - 1 < blocks_per_branch) {
    throw Error(fmt::format(
        "tqkv sim: the KV cache ({} blocks of {} tokens) cannot hold one sequence of {} tokens "
        "(--prompt-len {} + --decode-len {}); raise --num-blocks or --kv-memory",
        num_blocks - 1, c.block_size, c.prompt_len + c.decode_len, c.prompt_len, c.decode_len));
  }
  rep.num_blocks = num_blocks;
  rep.capacity_tokens = (num_blocks - 1) * c.block_size;
  rep.kv_bytes_per_token = format.slot_bytes * c.kv_heads * c.layers;
  rep.bf16_bytes_per_token = int64_t{4} * c.head_dim * c.kv_heads * c.layers;
  rep.bf16_capacity_tokens = rep.capacity_tokens * rep.kv_bytes_per_token / rep.bf16_bytes_per_token;

  KVCacheManagerOptions mo;
  mo.num_blocks = static_cast<int32_t>(num_blocks);
  mo.block_size = c.block_size;
  mo.format = MakeFormatTag(format, quantizer ? quantizer->rotation().id : 0);
  mo.enable_prefix_caching = c.enable_prefix_caching;
  mo.sliding_window = c.sliding_window;
  KVCacheManager manager(mo);
  std::unique_ptr<Backend> backend =
      MakeBackend(c.device, format, quantizer ? &*quantizer : nullptr, c.layers,
                  static_cast<int32_t>(num_blocks), c.q_heads, c.sliding_window, c.kernel_timing);
  const ActivationModel model(c);

  // Requests: the shared system prompt, then tokens of their own.
  std::vector<int32_t> system_prompt(c.shared_prefix);
  for (int i = 0; i < c.shared_prefix; ++i) {
    system_prompt[i] = static_cast<int32_t>(Mix(c.seed * 7 + i) % kVocab);
  }
  std::deque<Branch> waiting;
  std::vector<Branch> running;
  int next_request = 0;
  auto make_request = [&](int r) {
    Branch b;
    b.request = r;
    b.priority = 4;
    for (int32_t t : system_prompt) Append(b, t);
    for (int i = c.shared_prefix; i < c.prompt_len; ++i) {
      Append(b, static_cast<int32_t>(Mix(c.seed * 1315423911ull + r * 100003 + i) % kVocab));
    }
    b.fork_after_prompt = (Mix(c.seed + r * 77) % 1000) < c.fork_fraction * 1000;
    return b;
  };

  StepBatch batch;
  std::vector<StepRequest> requests;
  std::vector<int> request_branch;                    // running index of each request
  std::vector<int32_t> drafts, accepted;              // per request: drafts verified, accepted
  std::vector<int32_t> sampling_rows;                 // requests that sample this step
  std::vector<std::vector<uint64_t>> step_hashes;     // per request: prefix hash of each new token
  struct Row {
    int i;          // request
    int32_t token;  // row of the step's tokens
  };
  std::vector<Row> final_rows, checked_rows;
  std::vector<std::function<void()>> tasks;           // the step's generation work
  std::vector<double> checksums, head_cos, head_rel;  // the step's checks, per row
  double manager_s = 0, generate_s = 0, check_s = 0, step_stream_s = 0;
  CallTimes store_t, attention_t;  // every layer call of the run
  // Per step with calls: the step's mean per call (host, stream, kernels), for the medians.
  std::vector<double> store_samples[3], attention_samples[3];
  std::vector<double> kind_samples[2][3];  // attention_samples by kind: decoding rows / prefill
  double cos_sum = 0, rel_sum = 0;
  const int d = c.head_dim, hk = c.kv_heads, hq = c.q_heads;
  const size_t kv_row = size_t(hk) * d, q_row = size_t(hq) * d;
  const auto start = Clock::now();
  auto timed = [](double& acc, auto&& fn) {
    const auto t0 = Clock::now();
    fn();
    acc += std::chrono::duration<double>(Clock::now() - t0).count();
  };
  auto add = [](CallTimes& acc, std::vector<double> (&samples)[3], const CallTimes& step) {
    acc.calls += step.calls;
    acc.host_s += step.host_s;
    acc.stream_s += step.stream_s;
    acc.kernels_s += step.kernels_s;
    if (step.calls > 0) {
      samples[0].push_back(step.host_s / step.calls);
      samples[1].push_back(step.stream_s / step.calls);
      samples[2].push_back(step.kernels_s / step.calls);
    }
  };

  while (next_request < c.requests || !waiting.empty() || !running.empty()) {
    ++rep.steps;
    // Arrivals: one or two requests per step (seeded).
    for (int a = 1 + static_cast<int>(Mix(c.seed * 31 + rep.steps) % 2);
         a > 0 && next_request < c.requests; --a) {
      waiting.push_back(make_request(next_request++));
    }
    // Admit waiting branches while there is room.
    while (!waiting.empty() && static_cast<int>(running.size()) < c.max_running) {
      Branch b = std::move(waiting.front());
      waiting.pop_front();
      timed(manager_s, [&] { b.seq = manager.AddSequence(b.tokens, {.priority = b.priority}); });
      b.raw_k.clear();
      b.raw_v.clear();
      rep.prompt_tokens += static_cast<int64_t>(b.tokens.size());
      running.push_back(std::move(b));
    }

    // Build the step, branch by branch in running order: a decoding branch's sampled token (with
    // up to --spec-tokens drafts to verify; a readmitted one: every token not cached), a prompt
    // branch's next chunk within the token budget.
    ScheduleResult result;
    for (;;) {
      requests.clear();
      request_branch.clear();
      drafts.clear();
      int budget = c.prefill_chunk;
      for (int i = 0; i < static_cast<int>(running.size()); ++i) {
        Branch& b = running[i];
        const SequenceInfo info = manager.GetSequenceInfo(b.seq);
        int64_t done = info.num_scheduled;
        if (done == 0) done = manager.Lookup(b.seq).num_tokens;  // fresh: its cached prefix
        const int64_t remaining = static_cast<int64_t>(b.tokens.size()) - done;
        const bool prompt_phase = b.generated == 0;
        int n = 0, k = 0;
        if (!prompt_phase) {
          n = static_cast<int>(remaining);  // the sampled token: 1
          // Drafts never run past the branch's last token.
          if (remaining == 1) k = std::min(c.spec_tokens, c.decode_len - b.generated - 1);
          n += k;
        } else if (budget > 0) {
          n = static_cast<int>(std::min<int64_t>(remaining, budget));
          budget -= n;
        }
        if (n > 0) {
          requests.push_back({b.seq, n, 0});
          request_branch.push_back(i);
          drafts.push_back(k);
        }
      }
      timed(manager_s, [&] { result = manager.Schedule(requests, batch); });
      if (result.admitted) break;
      for (const ScheduleRejection& r : result.rejected) {
        if (r.never_fits) {
          throw Error(fmt::format("tqkv sim: a sequence needs {} blocks, more than the pool's {}",
                                  r.blocks_missing + num_blocks - 1, num_blocks - 1));
        }
      }
      // Preempt the lowest-priority sequence: the one admitted last (recomputed later).
      Branch victim = std::move(running.back());
      running.pop_back();
      timed(manager_s, [&] { manager.Free(victim.seq); });
      victim.seq = -1;
      waiting.push_front(std::move(victim));
      ++rep.preemptions;
      if (running.empty()) {
        throw Error("tqkv sim: nothing fits in the KV cache; raise --num-blocks or --kv-memory");
      }
    }
    if (requests.empty()) continue;
    rep.cow_copies += static_cast<int64_t>(batch.copies().size());

    const int num_req = static_cast<int>(requests.size());
    const int32_t num_tokens = batch.num_tokens();
    // Per request: the prefix hash of every position it writes (drafts chain from the last known
    // token), how many drafts the target model accepts (a seeded draft is right with probability
    // kDraftAccuracy; the first wrong one and everything after it are rejected), and whether it
    // samples this step (its last non-draft token is the newest known token).
    sampling_rows.clear();
    step_hashes.resize(num_req);
    accepted.assign(num_req, 0);
    for (int i = 0; i < num_req; ++i) {
      const Branch& b = running[request_branch[i]];
      const int32_t end = batch.seq_lens()[i];
      const int32_t begin = end - requests[i].num_new_tokens;
      std::vector<uint64_t>& h = step_hashes[i];
      h.clear();
      for (int32_t p = begin; p < end - drafts[i]; ++p) h.push_back(b.hashes[p]);
      bool right = true;
      for (int j = 1; j <= drafts[i]; ++j) {
        const size_t pos = b.tokens.size() - 1 + j;
        const int32_t truth = SampledToken(c.seed, b.request, b.branch, pos);
        right = right && Mix(c.seed * 0x2545F4914F6CDD1Dull ^ Mix(b.request * 1000 + b.branch) ^
                             (pos << 24)) % 1000 < kDraftAccuracy * 1000;
        if (right) ++accepted[i];
        const int32_t draft = right ? truth : (truth + 1) % kVocab;
        h.push_back(Mix(h.back() * 31 + draft));
      }
      if (end - drafts[i] == static_cast<int32_t>(b.tokens.size())) sampling_rows.push_back(i);
    }
    // The step's inputs, generated once for every layer: K/V and the query of every new token in
    // request order (the slot mapping's order); and the raw layer-0 K/V that the accuracy
    // reference needs (a cached prefix is regenerated). Every value is a function of its own
    // position and key, so the work splits over threads freely.
    const StepInputs in = backend->PrepareStep(batch);
    timed(generate_s, [&] {
      tasks.clear();
      for (int i = 0; i < num_req; ++i) {
        Branch& b = running[request_branch[i]];
        const int32_t end = batch.seq_lens()[i];
        const int32_t begin = end - requests[i].num_new_tokens;
        const size_t t0 = static_cast<size_t>(batch.query_start_loc()[i]);
        const uint64_t query_key = Mix(b.request * 131 + b.branch);
        for (int layer = 0; layer < c.layers; ++layer) {
          const size_t at = size_t(layer) * num_tokens + t0;
          for (int32_t p = begin; p < end; ++p) {
            const size_t t = at + static_cast<size_t>(p - begin);
            tasks.push_back([&, i, layer, p, t, begin, query_key] {
              model.KeyValue(layer, p, step_hashes[i][p - begin], in.key + t * kv_row,
                             in.value + t * kv_row);
              model.Query(layer, p, query_key, in.query + t * q_row);
            });
          }
        }
        const int32_t have = static_cast<int32_t>(b.raw_k.size() / kv_row);
        if (have < begin) {
          b.raw_k.resize(size_t(begin) * kv_row);
          b.raw_v.resize(b.raw_k.size());
          for (int32_t p = have; p < begin; ++p) {
            tasks.push_back([&, p] {
              model.KeyValue(0, p, b.hashes[p], b.raw_k.data() + p * kv_row,
                             b.raw_v.data() + p * kv_row);
            });
          }
        }
      }
      ParallelFor(static_cast<int>(tasks.size()), [&](int t) { tasks[t](); });
      for (int i = 0; i < num_req; ++i) {  // this step's layer-0 K/V, for the reference
        Branch& b = running[request_branch[i]];
        const int32_t begin = batch.seq_lens()[i] - requests[i].num_new_tokens;
        b.raw_k.resize(size_t(begin) * kv_row);  // drop rejected drafts of earlier steps
        b.raw_v.resize(b.raw_k.size());
        const float* k = in.key + size_t(batch.query_start_loc()[i]) * kv_row;
        const float* v = in.value + size_t(batch.query_start_loc()[i]) * kv_row;
        const size_t n = size_t(requests[i].num_new_tokens) * kv_row;
        b.raw_k.insert(b.raw_k.end(), k, k + n);
        b.raw_v.insert(b.raw_v.end(), v, v + n);
      }
    });

    // The step: copies and uploads, then every layer's store and attention, then the outputs.
    backend->BeginStep(batch);
    for (int layer = 0; layer < c.layers; ++layer) {
      backend->Store(layer);
      backend->Attend(layer);
    }
    const StepResult& outputs = backend->FinishStep();
    add(store_t, store_samples, outputs.store);
    add(attention_t, attention_samples, outputs.attention);
    {
      bool prefill = false;  // some row holds prompt tokens (more than one token and its drafts)
      for (int i = 0; i < num_req; ++i) prefill |= requests[i].num_new_tokens > 1 + drafts[i];
      CallTimes unused;
      add(unused, kind_samples[prefill ? 1 : 0], outputs.attention);
    }
    step_stream_s += outputs.step_stream_s;

    // The rows whose outputs stand: every row but rejected drafts'. Checksums of every layer's
    // outputs of those rows; layer 0 of the sampling rows (the last known token and the accepted
    // drafts) against fp64 attention over the raw K/V. Computed per row on threads, then
    // accounted in row order (the same sums every run).
    timed(check_s, [&] {
      final_rows.clear();
      checked_rows.clear();
      for (int i = 0; i < num_req; ++i) {
        const int32_t t0 = batch.query_start_loc()[i];
        const int32_t kept = requests[i].num_new_tokens - drafts[i] + accepted[i];
        for (int32_t r = 0; r < kept; ++r) final_rows.push_back({i, t0 + r});
      }
      for (const int i : sampling_rows) {
        const int32_t t0 = batch.query_start_loc()[i];
        const int32_t kept = requests[i].num_new_tokens - drafts[i] + accepted[i];
        for (int32_t r = requests[i].num_new_tokens - drafts[i] - 1; r < kept; ++r) {
          checked_rows.push_back({i, t0 + r});
        }
      }
      const size_t rows = final_rows.size(), checks = checked_rows.size();
      checksums.assign(size_t(c.layers) * rows, 0.0);
      head_cos.assign(checks * hq, 0.0);
      head_rel.assign(checks * hq, 0.0);
      ParallelFor(static_cast<int>(c.layers * rows + checks), [&](int task) {
        if (static_cast<size_t>(task) < c.layers * rows) {
          const size_t r = size_t(task) % rows;
          const int layer = task / static_cast<int>(rows);
          const float* out =
              outputs.output + (size_t(layer) * num_tokens + final_rows[r].token) * q_row;
          double checksum = 0;
          for (int e = 0; e < hq * d; ++e) checksum += out[e] * double((e % 97) + 1);
          checksums[size_t(layer) * rows + r] = checksum;
          return;
        }
        const size_t r = size_t(task) - c.layers * rows;
        const auto [i, t] = checked_rows[r];
        const Branch& b = running[request_branch[i]];
        const int32_t pos = batch.seq_lens()[i] - requests[i].num_new_tokens +
                            (t - batch.query_start_loc()[i]);
        const float* out0 = outputs.output + size_t(t) * q_row;  // layer 0
        std::vector<double> ref(q_row), ref_lse(hq);
        // (Under a sliding window, positions (pos - window, pos].)
        const int32_t lo = c.sliding_window > 0 ? std::max(0, pos + 1 - c.sliding_window) : 0;
        const size_t kv_at = size_t(lo) * hk * d;
        ReferenceAttention(in.query + size_t(t) * q_row, b.raw_k.data() + kv_at,
                           b.raw_v.data() + kv_at, pos + 1 - lo, hq, hk, d,
                           1.0 / std::sqrt(double(d)), ref.data(), ref_lse.data());
        for (int h = 0; h < hq; ++h) {
          double dot = 0, na = 0, nb = 0, err = 0;
          for (int e = 0; e < d; ++e) {
            const double a = out0[size_t(h) * d + e], x = ref[size_t(h) * d + e];
            dot += a * x;
            na += a * a;
            nb += x * x;
            err += (a - x) * (a - x);
          }
          head_cos[r * hq + h] = dot / std::sqrt(na * nb);
          head_rel[r * hq + h] = std::sqrt(err / nb);
        }
      });
      for (int layer = 0; layer < c.layers; ++layer) {
        for (size_t r = 0; r < rows; ++r) {
          const auto [i, t] = final_rows[r];
          const Branch& b = running[request_branch[i]];
          const int32_t pos = batch.seq_lens()[i] - requests[i].num_new_tokens +
                              (t - batch.query_start_loc()[i]);
          const double checksum = checksums[size_t(layer) * rows + r];
          const auto [it, first] =
              rep.output_checksums.try_emplace({b.request, b.branch, pos, layer}, checksum);
          if (!first) {
            ++rep.recomputed_outputs;
            rep.recomputed_differing += it->second != checksum;
          }
        }
      }
      for (size_t r = 0; r < checks; ++r) {
        for (int h = 0; h < hq; ++h) {
          const double cs = head_cos[r * hq + h], rel = head_rel[r * hq + h];
          cos_sum += cs;
          rel_sum += rel;
          rep.cosine_worst = std::min(rep.cosine_worst, cs);
          rep.rel_error_worst = std::max(rep.rel_error_worst, rel);
          ++rep.accuracy_samples;
        }
      }
    });

    // Account the step, sample tokens (accepted drafts and one more), rewind rejected drafts,
    // fork, finish.
    for (int i = 0; i < num_req; ++i) {
      if (running[request_branch[i]].generated == 0) {
        rep.prefill_tokens += requests[i].num_new_tokens;
      } else {  // the last known token's row, its drafts, and before them any recomputed ones
        rep.recomputed_tokens += requests[i].num_new_tokens - 1 - drafts[i];
      }
      rep.draft_tokens += drafts[i];
      rep.accepted_drafts += accepted[i];
    }
    std::vector<Branch> forked;
    for (int i : sampling_rows) {
      Branch& b = running[request_branch[i]];
      if (b.generated == 0 && b.fork_after_prompt && b.branch == 0) {
        Branch child;
        timed(manager_s, [&] { child.seq = manager.Fork(b.seq); });
        child.request = b.request;
        child.branch = 1;
        child.priority = b.priority;
        child.tokens = b.tokens;
        child.hashes = b.hashes;
        child.raw_k = b.raw_k;
        child.raw_v = b.raw_v;
        b.fork_after_prompt = false;
        ++rep.forks;
        forked.push_back(std::move(child));
      }
    }
    for (Branch& child : forked) running.push_back(std::move(child));
    for (int i : sampling_rows) {
      Branch& b = running[request_branch[i]];
      // Rejected drafts first, so that their positions are no longer scheduled when the
      // accepted tokens make blocks trusted.
      if (drafts[i] > accepted[i]) {
        timed(manager_s, [&] { manager.Rewind(b.seq, drafts[i] - accepted[i]); });
      }
      std::vector<int32_t> produced;
      for (int j = 0; j <= accepted[i]; ++j) {
        produced.push_back(SampledToken(c.seed, b.request, b.branch, b.tokens.size() + j));
      }
      timed(manager_s, [&] { manager.Commit(b.seq, produced); });
      if (b.generated > 0) rep.decode_tokens += static_cast<int64_t>(produced.size());
      for (const int32_t t : produced) Append(b, t);
      b.generated += static_cast<int>(produced.size());
    }
    // Forked children sample their own first token.
    for (size_t j = running.size() - forked.size(); j < running.size(); ++j) {
      Branch& b = running[j];
      const int32_t t = SampledToken(c.seed, b.request, b.branch, b.tokens.size());
      timed(manager_s, [&] { manager.Commit(b.seq, std::span<const int32_t>(&t, 1)); });
      Append(b, t);
      ++b.generated;
    }
    for (size_t j = 0; j < running.size();) {
      if (running[j].generated >= c.decode_len) {
        timed(manager_s, [&] { manager.Free(running[j].seq); });
        ++rep.finished_branches;
        running.erase(running.begin() + static_cast<std::ptrdiff_t>(j));
      } else {
        ++j;
      }
    }
    if (c.check_invariants) manager.CheckInvariants();
    if (c.progress && rep.steps % 20 == 0) {
      const KVCacheStats s = manager.Stats();
      std::fprintf(stderr, "\r  step %5lld  running %3zu  waiting %3zu  blocks %5d/%d in use   ",
                   static_cast<long long>(rep.steps), running.size(), waiting.size(),
                   s.blocks_in_use, s.num_blocks);
      std::fflush(stderr);
    }
  }
  if (c.progress) std::fprintf(stderr, "\n");
  rep.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  const KVCacheStats s = manager.Stats();
  rep.cached_tokens = s.prefix_hit_tokens;
  rep.prefix_hit_rate =
      s.prefix_query_tokens > 0 ? double(s.prefix_hit_tokens) / s.prefix_query_tokens : 0.0;
  rep.decode_tokens_per_s = rep.decode_tokens / rep.wall_s;
  rep.manager_us_per_step = 1e6 * manager_s / rep.steps;
  rep.store_us_per_step = 1e6 * store_t.stream_s / rep.steps;
  rep.attention_us_per_step = 1e6 * attention_t.stream_s / rep.steps;
  // Medians over steps: a kernel's first launch in a process also loads its module (CUDA's lazy
  // loading, milliseconds), which the per-step totals above include and a steady state does not.
  auto median_us = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return 1e6 * v[v.size() / 2];
  };
  rep.store_calls = store_t.calls;
  rep.store_host_us_per_layer = median_us(store_samples[0]);
  rep.store_stream_us_per_layer = median_us(store_samples[1]);
  rep.store_kernels_us_per_layer = median_us(store_samples[2]);
  rep.attention_calls = attention_t.calls;
  rep.attention_host_us_per_layer = median_us(attention_samples[0]);
  rep.attention_stream_us_per_layer = median_us(attention_samples[1]);
  rep.attention_kernels_us_per_layer = median_us(attention_samples[2]);
  for (int k = 0; k < 2; ++k) {
    SimReport::StepKindTimes& t = k == 0 ? rep.attention_decode_steps : rep.attention_prefill_steps;
    t.steps = static_cast<int64_t>(kind_samples[k][0].size());
    t.host_us = median_us(kind_samples[k][0]);
    t.stream_us = median_us(kind_samples[k][1]);
    t.kernels_us = median_us(kind_samples[k][2]);
  }
  rep.step_stream_us = 1e6 * step_stream_s / rep.steps;
  rep.generate_us_per_step = 1e6 * generate_s / rep.steps;
  rep.check_us_per_step = 1e6 * check_s / rep.steps;
  if (rep.accuracy_samples > 0) {
    rep.cosine_mean = cos_sum / rep.accuracy_samples;
    rep.rel_error_mean = rel_sum / rep.accuracy_samples;
  }
  return rep;
}

std::string FormatReport(const SimConfig& c, const SimReport& r) {
  std::string s;
  auto row = [&](std::string_view what, const std::string& value) {
    s += fmt::format("  {:<38} {}\n", what, value);
  };
  s += fmt::format("tqkv sim: {} on {}, {} layers, Hq {} / Hk {}, D {}, block {}{}\n", c.preset,
                   c.device, c.layers, c.q_heads, c.kv_heads, c.head_dim, c.block_size,
                   c.sliding_window > 0 ? fmt::format(", window {}", c.sliding_window) : "");
  row("steps", fmt::format("{}", r.steps));
  row("tokens processed (prefill + decode)",
      fmt::format("{} + {} (cached prefix tokens skipped: {})", r.prefill_tokens,
                  r.decode_tokens, r.cached_tokens));
  if (r.recomputed_tokens > 0) {
    row("recomputed after preemption", fmt::format("{} tokens", r.recomputed_tokens));
  }
  row("decode tokens/s (wall)", fmt::format("{:.0f}", r.decode_tokens_per_s));
  if (c.spec_tokens > 0) {
    row("draft tokens verified / accepted",
        fmt::format("{} / {} ({:.1f} %)", r.draft_tokens, r.accepted_drafts,
                    r.draft_tokens > 0 ? 100.0 * r.accepted_drafts / r.draft_tokens : 0.0));
  }
  row("KV bytes per token (all layers)",
      fmt::format("{} vs bf16 {} ({:.2f}x smaller)", r.kv_bytes_per_token, r.bf16_bytes_per_token,
                  double(r.bf16_bytes_per_token) / r.kv_bytes_per_token));
  row("capacity in tokens", fmt::format("{} in {} blocks (bf16 in the same memory: {})",
                                        r.capacity_tokens, r.num_blocks, r.bf16_capacity_tokens));
  row("prefix hit rate", fmt::format("{:.1f} %", 100 * r.prefix_hit_rate));
  row("preemptions / forks / copy-on-write copies",
      fmt::format("{} / {} / {}", r.preemptions, r.forks, r.cow_copies));
  row("manager time per step", fmt::format("{:.1f} us", r.manager_us_per_step));
  row("store time per step (all layers)", fmt::format("{:.1f} us", r.store_us_per_step));
  row("attention time per step (all layers)", fmt::format("{:.1f} us", r.attention_us_per_step));
  // What one layer's call costs the host, takes on the stream, and what its kernels alone take.
  auto times = [&](double host, double stream, double kernels) {
    if (c.device != "cuda") return fmt::format("{:.1f} us", host);  // the call is the work
    return c.kernel_timing ? fmt::format("{:.1f} / {:.1f} / {:.1f} us", host, stream, kernels)
                           : fmt::format("{:.1f} / {:.1f} / - us", host, stream);
  };
  if (c.device == "cuda") {
    row("store per layer (median): host / stream / kernels",
        times(r.store_host_us_per_layer, r.store_stream_us_per_layer,
              r.store_kernels_us_per_layer));
    row("attention per layer (median): host / stream / kernels",
        times(r.attention_host_us_per_layer, r.attention_stream_us_per_layer,
              r.attention_kernels_us_per_layer));
    row("step on the stream (uploads to outputs)", fmt::format("{:.1f} us", r.step_stream_us));
  } else {
    row("store per layer call (CPU)", fmt::format("{:.1f} us", r.store_host_us_per_layer));
    row("attention per layer call (CPU)", fmt::format("{:.1f} us", r.attention_host_us_per_layer));
  }
  for (const auto& [what, t] : {std::pair{"decoding steps", &r.attention_decode_steps},
                                std::pair{"steps with prefill", &r.attention_prefill_steps}}) {
    if (t->steps == 0) continue;
    row(fmt::format("  {} ({})", what, t->steps), times(t->host_us, t->stream_us, t->kernels_us));
  }
  row("sim's own work per step (host)",
      fmt::format("K/V/Q generation {:.1f} us, accuracy checks {:.1f} us", r.generate_us_per_step,
                  r.check_us_per_step));
  row("attention vs fp64 on raw K/V: cosine",
      fmt::format("mean {:.5f}, worst {:.5f} ({} head outputs, layer 0)", r.cosine_mean,
                  r.cosine_worst, r.accuracy_samples));
  row("attention vs fp64 on raw K/V: rel. error",
      fmt::format("mean {:.4f}, worst {:.4f}", r.rel_error_mean, r.rel_error_worst));
  row("wall time", fmt::format("{:.2f} s", r.wall_s));
  return s;
}

std::string ReportJson(const SimConfig& c, const SimReport& r) {
  auto kind_json = [](const SimReport::StepKindTimes& t) {
    return nlohmann::json{{"steps", t.steps},
                          {"host_us_per_layer", t.host_us},
                          {"stream_us_per_layer", t.stream_us},
                          {"kernels_us_per_layer", t.kernels_us}};
  };
  nlohmann::json j = {{"config",
                       {{"preset", c.preset},
                        {"device", c.device},
                        {"layers", c.layers},
                        {"q_heads", c.q_heads},
                        {"kv_heads", c.kv_heads},
                        {"head_dim", c.head_dim},
                        {"block_size", c.block_size},
                        {"requests", c.requests},
                        {"prompt_len", c.prompt_len},
                        {"shared_prefix", c.shared_prefix},
                        {"decode_len", c.decode_len},
                        {"spec_tokens", c.spec_tokens},
                        {"sliding_window", c.sliding_window},
                        {"seed", c.seed},
                        {"prefix_caching", c.enable_prefix_caching},
                        {"kernel_timing", c.kernel_timing}}},
                      {"steps", r.steps},
                      {"prefill_tokens", r.prefill_tokens},
                      {"decode_tokens", r.decode_tokens},
                      {"draft_tokens", r.draft_tokens},
                      {"accepted_drafts", r.accepted_drafts},
                      {"cached_tokens", r.cached_tokens},
                      {"decode_tokens_per_s", r.decode_tokens_per_s},
                      {"kv_bytes_per_token", r.kv_bytes_per_token},
                      {"bf16_bytes_per_token", r.bf16_bytes_per_token},
                      {"num_blocks", r.num_blocks},
                      {"capacity_tokens", r.capacity_tokens},
                      {"bf16_capacity_tokens", r.bf16_capacity_tokens},
                      {"prefix_hit_rate", r.prefix_hit_rate},
                      {"preemptions", r.preemptions},
                      {"forks", r.forks},
                      {"cow_copies", r.cow_copies},
                      {"manager_us_per_step", r.manager_us_per_step},
                      {"store_us_per_step", r.store_us_per_step},
                      {"attention_us_per_step", r.attention_us_per_step},
                      {"store_calls", r.store_calls},
                      {"store_host_us_per_layer", r.store_host_us_per_layer},
                      {"store_stream_us_per_layer", r.store_stream_us_per_layer},
                      {"store_kernels_us_per_layer", r.store_kernels_us_per_layer},
                      {"attention_calls", r.attention_calls},
                      {"attention_host_us_per_layer", r.attention_host_us_per_layer},
                      {"attention_stream_us_per_layer", r.attention_stream_us_per_layer},
                      {"attention_kernels_us_per_layer", r.attention_kernels_us_per_layer},
                      {"attention_decode_steps", kind_json(r.attention_decode_steps)},
                      {"attention_prefill_steps", kind_json(r.attention_prefill_steps)},
                      {"step_stream_us", r.step_stream_us},
                      {"generate_us_per_step", r.generate_us_per_step},
                      {"check_us_per_step", r.check_us_per_step},
                      {"cosine_mean", r.cosine_mean},
                      {"cosine_worst", r.cosine_worst},
                      {"rel_error_mean", r.rel_error_mean},
                      {"rel_error_worst", r.rel_error_worst},
                      {"accuracy_samples", r.accuracy_samples},
                      {"recomputed_tokens", r.recomputed_tokens},
                      {"recomputed_outputs", r.recomputed_outputs},
                      {"recomputed_differing", r.recomputed_differing},
                      {"wall_s", r.wall_s}};
  // Checksums of every computed output row, prefill and decode (request, branch, position, layer,
  // checksum; the first computation where a row was recomputed): two runs (devices, prefix caching
  // on and off) can be compared entry by entry.
  nlohmann::json outputs = nlohmann::json::array();
  for (const auto& [key, checksum] : r.output_checksums) {
    const auto& [request, branch, position, layer] = key;
    outputs.push_back({request, branch, position, layer, checksum});
  }
  j["output_checksums"] = std::move(outputs);
  return j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

}  // namespace tqkv::sim
