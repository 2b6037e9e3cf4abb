#include "tests/decode_scenario.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <functional>
#include <numeric>
#include <random>
#include <thread>

#include "tests/synthetic_kv.h"

namespace tqkv::testing {

// Runs fn(i) for i in [0, n) on up to hardware_concurrency threads (the GPU machine has 16
// cores; the CPU reference is most of a device test's time). The first exception is rethrown.
void ParallelFor(int n, const std::function<void(int)>& fn) {
  if (n <= 0) return;
  const int threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, n);
  if (threads <= 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int> next{0};
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (int i = next++; i < n && !failed; i = next++) {
        try {
          fn(i);
        } catch (...) {
          if (!failed.exchange(true)) error = std::current_exception();
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

Scenario Build(const Quantizer& q, std::vector<int32_t> seq_lens, int num_q_heads, uint64_t seed) {
  const BlockFormat& f = q.format();
  Scenario s;
  s.seq_lens = seq_lens;
  s.num_q_heads = num_q_heads;
  std::mt19937_64 rng(seed);
  for (int32_t len : seq_lens)
    s.max_blocks = std::max(s.max_blocks, (len + f.block_size - 1) / f.block_size);
  s.max_blocks += 1;  // one unused entry per row
  int total = 0;
  for (int32_t len : seq_lens) total += (len + f.block_size - 1) / f.block_size;
  s.num_blocks = total + 3;  // spare blocks hold garbage that must never be read
  std::vector<int32_t> ids(s.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  s.cache.assign(s.num_blocks * f.block_bytes, 0xFF);  // fp16 0xFFFF is NaN: leaks would show
  s.block_tables.assign(seq_lens.size() * s.max_blocks, -1);
  SyntheticKvOptions o;
  o.num_kv_heads = f.num_kv_heads;
  o.num_q_heads = num_q_heads;
  o.head_dim = f.head_dim;
  o.seed = seed;
  SyntheticKv gen(o);
  // Sequences are generated in order (one generator), then stored in parallel: each writes its
  // own blocks.
  int next = 0;
  for (size_t b = 0; b < seq_lens.size(); ++b) {
    const int32_t len = seq_lens[b];
    for (int i = 0; i < (len + f.block_size - 1) / f.block_size; ++i) {
      s.block_tables[b * s.max_blocks + i] = ids[next++];
    }
    std::vector<float> k, v;
    gen.Generate(0, len, k, v);
    s.keys.push_back(std::move(k));
    s.values.push_back(std::move(v));
    gen.GenerateQuery(len, s.queries);
  }
  ParallelFor(static_cast<int>(seq_lens.size()), [&](int b) {
    const int32_t len = seq_lens[b];
    std::vector<int64_t> slots(len);
    for (int t = 0; t < len; ++t) {
      slots[t] = int64_t{s.block_tables[b * s.max_blocks + t / f.block_size]} * f.block_size +
                 t % f.block_size;
    }
    StoreInputs in;
    in.key = s.keys[b].data();
    in.value = s.values[b].data();
    in.slot_mapping = slots.data();
    in.num_tokens = len;
    q.StoreCpu(in, {s.cache.data(), s.num_blocks, q.layout()});
  });
  return s;
}

DecodeInputs ReferenceInputs(const Scenario& s) {
  DecodeInputs in;
  in.query = s.queries.data();
  in.num_seqs = static_cast<int>(s.seq_lens.size());
  in.num_q_heads = s.num_q_heads;
  in.block_tables = s.block_tables.data();
  in.max_blocks_per_seq = s.max_blocks;
  in.seq_lens = s.seq_lens.data();
  return in;
}

void ReferenceDecode(const Quantizer& q, const Scenario& s, std::vector<float>& out,
                     std::vector<float>& lse, const float* query) {
  const int d = q.format().head_dim, hq = s.num_q_heads;
  const int num_seqs = static_cast<int>(s.seq_lens.size());
  out.assign(static_cast<size_t>(num_seqs) * hq * d, 0.0f);
  lse.assign(static_cast<size_t>(num_seqs) * hq, 0.0f);
  DecodeInputs all = ReferenceInputs(s);
  if (query != nullptr) all.query = query;
  ParallelFor(num_seqs, [&](int b) {
    DecodeInputs one = all;
    one.num_seqs = 1;
    one.query = all.query + int64_t{b} * hq * d;
    one.block_tables = all.block_tables + int64_t{b} * all.max_blocks_per_seq;
    one.seq_lens = all.seq_lens + b;
    DecodeCpu(q, {s.cache.data(), s.num_blocks, q.layout()}, one,
              {out.data() + int64_t{b} * hq * d, lse.data() + int64_t{b} * hq});
  });
}

}  // namespace tqkv::testing
