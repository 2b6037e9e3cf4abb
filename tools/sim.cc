#include "tools/sim.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <vector>

#include "attention/decode_cpu.h"
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

  // K and V of one token: [kv_heads, head_dim] each, appended.
  void KeyValue(int layer, int64_t pos, uint64_t prefix_hash, std::vector<float>& k,
                std::vector<float>& v) const {
    const int d = c_.head_dim;
    Normals n(Mix(prefix_hash ^ (uint64_t(layer) << 56) ^ uint64_t(pos)));
    for (int h = 0; h < c_.kv_heads; ++h) {
      const size_t k0 = k.size();
      for (int i = 0; i < d; ++i) {
        const size_t ch = size_t(h) * d + i;
        k.push_back(head_scale_[layer][h] * (mean_[layer][ch] + scale_[layer][ch] * n.Next()));
      }
      Rope(k.data() + k0, pos);
      for (int i = 0; i < d; ++i) v.push_back(head_scale_[layer][h] * n.Next());
    }
  }

  // The query of the token at `pos`: [q_heads, head_dim], appended.
  void Query(int layer, int64_t pos, uint64_t key, std::vector<float>& q) const {
    const int d = c_.head_dim, group = c_.q_heads / c_.kv_heads;
    Normals n(Mix(key ^ 0x5151515151515151ull ^ (uint64_t(layer) << 56) ^ uint64_t(pos)));
    for (int hq = 0; hq < c_.q_heads; ++hq) {
      const int h = hq / group;
      const size_t q0 = q.size();
      double energy = 0.0;
      for (int i = 0; i < d; ++i) {
        const size_t ch = size_t(h) * d + i;
        const float x = scale_[layer][ch] * n.Next();
        q.push_back(x);
        const double hs = head_scale_[layer][h];
        energy += double(x) * x * hs * hs *
                  (mean_[layer][ch] * mean_[layer][ch] + scale_[layer][ch] * scale_[layer][ch]);
      }
      const double tau = 1.5 + 2.5 * (0.5 + 0.5 * std::tanh(n.Next()));
      const double factor = tau * std::sqrt(double(d)) / std::sqrt(energy);
      for (int i = 0; i < d; ++i) q[q0 + i] = static_cast<float>(q[q0 + i] * factor);
      Rope(q.data() + q0, pos);
    }
  }

 private:
  static float Unit(uint64_t s) { return (Mix(s) >> 40) * (1.0f / 16777216.0f); }
  void Rope(float* x, int64_t pos) const {
    const int d = c_.head_dim;
    for (int i = 0; i < d / 2; ++i) {
      const double angle = double(pos) * std::pow(10000.0, -2.0 * i / d);
      const double cs = std::cos(angle), sn = std::sin(angle);
      const double a = x[i], b = x[i + d / 2];
      x[i] = static_cast<float>(a * cs - b * sn);
      x[i + d / 2] = static_cast<float>(a * sn + b * cs);
    }
  }

  SimConfig c_;
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
  if (c.layers < 1) bad("--layers", c.layers, ">= 1");
  if (c.kv_heads < 1) bad("--kv-heads", c.kv_heads, ">= 1");
  if (c.q_heads < c.kv_heads || c.q_heads % c.kv_heads != 0) {
    bad("--q-heads", c.q_heads, fmt::format("a multiple of --kv-heads = {}", c.kv_heads));
  }
  if (c.requests < 1) bad("--requests", c.requests, ">= 1");
  if (c.prompt_len < 1) bad("--prompt-len", c.prompt_len, ">= 1");
  if (c.shared_prefix < 0 || c.shared_prefix > c.prompt_len) {
    bad("--shared-prefix", c.shared_prefix, fmt::format("0 to --prompt-len = {}", c.prompt_len));
  }
  if (c.decode_len < 1) bad("--decode-len", c.decode_len, ">= 1");
  if (c.prefill_chunk < 1) bad("--prefill-chunk", c.prefill_chunk, ">= 1");
  if (c.max_running < 1) bad("--max-running", c.max_running, ">= 1");
  if (!(c.fork_fraction >= 0 && c.fork_fraction <= 1)) {
    bad("--fork-fraction", c.fork_fraction, "0 to 1");
  }
  if (c.device != "cpu" && c.device != "cuda") bad("--device", c.device, "cpu, cuda");
  if (c.num_blocks < 0) bad("--num-blocks", c.num_blocks, ">= 2 (0: automatic)");
  if (c.kv_memory_gib < 0) bad("--kv-memory", c.kv_memory_gib, "> 0 GiB");
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
  } else if (num_blocks == 0) {
    // Room for about 45 % of the running set's peak demand: enough pressure to preempt.
    num_blocks = 1 + std::max<int64_t>(2 * blocks_per_branch,
                                       blocks_per_branch * std::min(c.requests, c.max_running) * 45 / 100);
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
  KVCacheManager manager(mo);
  std::unique_ptr<Backend> backend =
      MakeBackend(c.device, format, quantizer ? &*quantizer : nullptr, c.layers,
                  static_cast<int32_t>(num_blocks));
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
  std::vector<int> request_branch;   // running index of each request
  std::vector<float> k, v, q, out, lse;
  double manager_s = 0, store_s = 0, decode_s = 0;
  double cos_sum = 0, rel_sum = 0;
  const int d = c.head_dim, hk = c.kv_heads, hq = c.q_heads;
  const auto start = Clock::now();
  auto timed = [](double& acc, auto&& fn) {
    const auto t0 = Clock::now();
    fn();
    acc += std::chrono::duration<double>(Clock::now() - t0).count();
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

    // Build the step: decode tokens first, then prompt chunks within the token budget.
    ScheduleResult result;
    for (;;) {
      requests.clear();
      request_branch.clear();
      int budget = c.prefill_chunk;
      for (int i = 0; i < static_cast<int>(running.size()); ++i) {
        Branch& b = running[i];
        const SequenceInfo info = manager.GetSequenceInfo(b.seq);
        int64_t done = info.num_scheduled;
        if (done == 0) done = manager.Lookup(b.seq).num_tokens;  // fresh: its cached prefix
        const int64_t remaining = static_cast<int64_t>(b.tokens.size()) - done;
        const bool prompt_phase = b.generated == 0;
        int n = 0;
        if (!prompt_phase) {
          n = static_cast<int>(remaining);  // the sampled token: 1
        } else if (budget > 0) {
          n = static_cast<int>(std::min<int64_t>(remaining, budget));
          budget -= n;
        }
        if (n > 0) {
          requests.push_back({b.seq, n, 0});
          request_branch.push_back(i);
        }
      }
      timed(manager_s, [&] { result = manager.Schedule(requests, batch); });
      if (result.admitted) break;
      for (const ScheduleRejection& r : result.rejected) {
        if (r.never_fits) {
          throw Error(fmt::format("tqkv sim: a sequence needs {} blocks, more than the pool's {}",
                                  r.blocks_needed, num_blocks - 1));
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
    backend->ApplyCopies(batch.copies());
    rep.cow_copies += static_cast<int64_t>(batch.copies().size());

    // K/V of every new token, layer by layer, in request order (the slot mapping's order).
    const int num_req = static_cast<int>(requests.size());
    std::vector<int> decode_rows;  // requests whose last token is the newest known token
    for (int i = 0; i < num_req; ++i) {
      const Branch& b = running[request_branch[i]];
      if (batch.seq_lens()[i] == static_cast<int32_t>(b.tokens.size())) decode_rows.push_back(i);
    }
    for (int layer = 0; layer < c.layers; ++layer) {
      k.clear();
      v.clear();
      for (int i = 0; i < num_req; ++i) {
        Branch& b = running[request_branch[i]];
        const int32_t end = batch.seq_lens()[i];
        const int32_t begin = end - requests[i].num_new_tokens;
        const size_t k_at = k.size();
        for (int32_t p = begin; p < end; ++p) model.KeyValue(layer, p, b.hashes[p], k, v);
        if (layer == 0) {
          // Keep raw layer-0 K/V for the accuracy reference; a cached prefix is regenerated.
          const size_t have = b.raw_k.size() / (size_t(hk) * d);
          for (int32_t p = static_cast<int32_t>(have); p < begin; ++p) {
            model.KeyValue(0, p, b.hashes[p], b.raw_k, b.raw_v);
          }
          b.raw_k.insert(b.raw_k.end(), k.begin() + k_at, k.end());
          b.raw_v.insert(b.raw_v.end(), v.begin() + k_at, v.end());
        }
      }
      timed(store_s, [&] { backend->Store(layer, k, v, batch.slot_mapping().first(k.size() / (size_t(hk) * d))); });
      if (decode_rows.empty()) continue;
      // Decode the newest token's query of each decode row.
      q.clear();
      std::vector<int32_t> tables, lens;
      const int width = batch.block_table_width();
      for (int i : decode_rows) {
        const Branch& b = running[request_branch[i]];
        model.Query(layer, static_cast<int64_t>(b.tokens.size()) - 1,
                    Mix(b.request * 131 + b.branch), q);
        const auto row = batch.block_table(i);
        tables.insert(tables.end(), row.begin(), row.end());
        lens.push_back(batch.seq_lens()[i]);
      }
      out.assign(q.size(), 0.0f);
      lse.assign(decode_rows.size() * hq, 0.0f);
      timed(decode_s, [&] { backend->Decode(layer, q, tables, width, lens, out, lse); });
      for (size_t r = 0; r < decode_rows.size(); ++r) {
        const Branch& b = running[request_branch[decode_rows[r]]];
        double checksum = 0;
        for (int i = 0; i < hq * d; ++i) checksum += out[r * hq * d + i] * double((i % 97) + 1);
        rep.output_checksums[{b.request, b.branch, static_cast<int>(b.tokens.size()) - 1, layer}] =
            checksum;
        if (layer != 0) continue;
        std::vector<double> ref(size_t(hq) * d), ref_lse(hq);
        ReferenceAttention(q.data() + r * hq * d, b.raw_k.data(), b.raw_v.data(), lens[r], hq, hk,
                           d, 1.0 / std::sqrt(double(d)), ref.data(), ref_lse.data());
        for (int h = 0; h < hq; ++h) {
          double dot = 0, na = 0, nb = 0, err = 0;
          for (int i = 0; i < d; ++i) {
            const double a = out[(r * hq + h) * d + i], x = ref[size_t(h) * d + i];
            dot += a * x;
            na += a * a;
            nb += x * x;
            err += (a - x) * (a - x);
          }
          const double cs = dot / std::sqrt(na * nb), rel = std::sqrt(err / nb);
          cos_sum += cs;
          rel_sum += rel;
          rep.cosine_worst = std::min(rep.cosine_worst, cs);
          rep.rel_error_worst = std::max(rep.rel_error_worst, rel);
          ++rep.accuracy_samples;
        }
      }
    }

    // Account the step, sample tokens, fork, finish.
    for (int i = 0; i < num_req; ++i) {
      if (running[request_branch[i]].generated == 0) {
        rep.prefill_tokens += requests[i].num_new_tokens;
      } else {
        ++rep.decode_tokens;
      }
    }
    std::vector<Branch> forked;
    for (int i : decode_rows) {
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
    for (int i : decode_rows) {
      Branch& b = running[request_branch[i]];
      const int32_t t = SampledToken(c.seed, b.request, b.branch, b.tokens.size());
      timed(manager_s, [&] { manager.Commit(b.seq, std::span<const int32_t>(&t, 1)); });
      Append(b, t);
      ++b.generated;
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
  backend->Sync();
  rep.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  const KVCacheStats s = manager.Stats();
  rep.cached_tokens = s.prefix_hit_tokens;
  rep.prefix_hit_rate =
      s.prefix_query_tokens > 0 ? double(s.prefix_hit_tokens) / s.prefix_query_tokens : 0.0;
  rep.decode_tokens_per_s = rep.decode_tokens / rep.wall_s;
  rep.manager_us_per_step = 1e6 * manager_s / rep.steps;
  rep.store_us_per_step = 1e6 * store_s / rep.steps;
  rep.decode_us_per_step = 1e6 * decode_s / rep.steps;
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
  s += fmt::format("tqkv sim: {} on {}, {} layers, Hq {} / Hk {}, D {}, block {}\n", c.preset,
                   c.device, c.layers, c.q_heads, c.kv_heads, c.head_dim, c.block_size);
  row("steps", fmt::format("{}", r.steps));
  row("tokens processed (prefill + decode)",
      fmt::format("{} + {} (cached prefix tokens skipped: {})", r.prefill_tokens,
                  r.decode_tokens, r.cached_tokens));
  row("decode tokens/s (wall)", fmt::format("{:.0f}", r.decode_tokens_per_s));
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
  row("decode time per step (all layers)", fmt::format("{:.1f} us", r.decode_us_per_step));
  row("attention vs fp64 on raw K/V: cosine",
      fmt::format("mean {:.5f}, worst {:.5f} ({} head outputs, layer 0)", r.cosine_mean,
                  r.cosine_worst, r.accuracy_samples));
  row("attention vs fp64 on raw K/V: rel. error",
      fmt::format("mean {:.4f}, worst {:.4f}", r.rel_error_mean, r.rel_error_worst));
  row("wall time", fmt::format("{:.2f} s", r.wall_s));
  return s;
}

std::string ReportJson(const SimConfig& c, const SimReport& r) {
  nlohmann::json j = {
      {"config",
       {{"preset", c.preset}, {"device", c.device}, {"layers", c.layers}, {"q_heads", c.q_heads},
        {"kv_heads", c.kv_heads}, {"head_dim", c.head_dim}, {"block_size", c.block_size},
        {"requests", c.requests}, {"prompt_len", c.prompt_len},
        {"shared_prefix", c.shared_prefix}, {"decode_len", c.decode_len}, {"seed", c.seed},
        {"prefix_caching", c.enable_prefix_caching}}},
      {"steps", r.steps},
      {"prefill_tokens", r.prefill_tokens},
      {"decode_tokens", r.decode_tokens},
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
      {"decode_us_per_step", r.decode_us_per_step},
      {"cosine_mean", r.cosine_mean},
      {"cosine_worst", r.cosine_worst},
      {"rel_error_mean", r.rel_error_mean},
      {"rel_error_worst", r.rel_error_worst},
      {"accuracy_samples", r.accuracy_samples},
      {"wall_s", r.wall_s}};
  // Checksums of every decode output row (request, branch, position, layer, checksum): two runs
  // (devices, prefix caching on and off) can be compared entry by entry.
  nlohmann::json outputs = nlohmann::json::array();
  for (const auto& [key, checksum] : r.output_checksums) {
    const auto& [request, branch, position, layer] = key;
    outputs.push_back({request, branch, position, layer, checksum});
  }
  j["output_checksums"] = std::move(outputs);
  return j.dump(1) + "\n";
}

}  // namespace tqkv::sim
