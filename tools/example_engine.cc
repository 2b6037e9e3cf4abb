// The smallest complete engine loop over tqkv (CPU; swap StoreCpu/AttentionCpu for
// StoreDeviceState and CudaAttention to run on a GPU, see tools/sim_backend.cc):
//
//   manager + cache → per step: Schedule → ApplyCopies → per layer Store + Attention → Commit
//
// Two requests share a system prompt (the second one hits the prefix cache), each is prefilled in
// one step and then decodes a few tokens. Built and run as a test (//tools:example_engine).
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "attention/attention_cpu.h"
#include "kvcache/cache_format.h"
#include "kvcache/kv_cache.h"
#include "kvcache/manager.h"
#include "quant/quantizer.h"

int main() {
  using namespace tqkv;
  constexpr int kLayers = 2, kQHeads = 8, kKvHeads = 2, kHeadDim = 128, kBlock = 16;

  // 1. The format, the quantizer (codebook + rotation), the manager and the cache tensors.
  const Quantizer quantizer = Quantizer::Create("turboquant_4bit_nc", kHeadDim, kKvHeads, kBlock);
  const CacheFormat format = MakeCacheFormat("turboquant_4bit_nc", kHeadDim, kKvHeads, kBlock);
  KVCacheManagerOptions options;
  options.num_blocks = 64;
  options.block_size = kBlock;
  options.format = MakeFormatTag(format, quantizer.rotation().id);
  KVCacheManager manager(options);
  KVCache cache(format, kLayers, options.num_blocks, CacheDevice::kCpu);
  StepBatch batch;  // reused every step

  // 2. Two requests with a shared 32-token system prompt.
  std::vector<int32_t> prompt_a(40), prompt_b(40);
  for (int i = 0; i < 40; ++i) {
    prompt_a[i] = i < 32 ? 100 + i : 500 + i;
    prompt_b[i] = i < 32 ? 100 + i : 900 + i;
  }
  std::vector<SeqId> seqs = {manager.AddSequence(prompt_a)};

  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  auto random_vector = [&](size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = normal(rng);
    return v;
  };

  for (int step = 0; step < 6; ++step) {
    if (step == 1) seqs.push_back(manager.AddSequence(prompt_b));  // arrives one step later

    // 3. What each sequence computes this step: the rest of its prompt, or its new token.
    std::vector<StepRequest> requests;
    for (SeqId s : seqs) {
      const SequenceInfo info = manager.GetSequenceInfo(s);
      const int64_t done =
          info.num_scheduled > 0 ? info.num_scheduled : manager.Lookup(s).num_tokens;
      requests.push_back({s, static_cast<int32_t>(info.num_tokens - done), 0});
    }
    const ScheduleResult result = manager.Schedule(requests, batch);
    if (!result.admitted) {
      std::printf("step %d: %lld blocks missing (an engine would preempt)\n", step,
                  static_cast<long long>(result.blocks_missing));
      return 1;
    }
    cache.ApplyCopies(batch.copies());  // copy-on-write, before this step's stores

    // 4. Per layer: store the new tokens' K/V (from the model), then attention for every new token
    //    (the prompt's, after its cached prefix, and the decoded ones) over the cache.
    const int num_tokens = batch.num_tokens();
    for (int layer = 0; layer < kLayers; ++layer) {
      const std::vector<float> k = random_vector(size_t(num_tokens) * kKvHeads * kHeadDim);
      const std::vector<float> v = random_vector(k.size());
      StoreInputs in;
      in.key = k.data();
      in.value = v.data();
      in.dtype = DType::kF32;
      in.slot_mapping = batch.slot_mapping().data();
      in.slot_dtype = DType::kI64;
      in.num_tokens = num_tokens;
      quantizer.StoreCpu(in, cache.layer(layer));

      const std::vector<float> q = random_vector(size_t(num_tokens) * kQHeads * kHeadDim);
      std::vector<float> out(q.size()), lse(size_t(num_tokens) * kQHeads);
      AttentionArgs a;
      a.query = q.data();
      a.num_seqs = batch.num_requests();
      a.num_tokens = num_tokens;
      a.num_q_heads = kQHeads;
      a.query_start_loc = batch.query_start_loc().data();
      a.seq_lens = batch.seq_lens().data();
      a.block_tables = batch.block_tables().data();
      a.max_blocks_per_seq = batch.block_table_width();
      a.cache = cache.layer(layer);
      a.output = out.data();
      a.lse = lse.data();
      AttentionCpu(quantizer, a);
      for (float x : out) {
        if (!std::isfinite(x)) return 1;
      }
    }

    // 5. Record the sampled tokens; the manager hashes and publishes newly full blocks.
    for (SeqId s : seqs) {
      const int32_t token = static_cast<int32_t>(rng() % 32000);
      manager.Commit(s, std::span<const int32_t>(&token, 1));
    }
    manager.CheckInvariants();
    const KVCacheStats st = manager.Stats();
    std::printf("step %d: %d tokens, %d blocks in use, prefix hits %lld tokens\n", step, num_tokens,
                st.blocks_in_use, static_cast<long long>(st.prefix_hit_tokens));
  }
  for (SeqId s : seqs) manager.Free(s);
  // The second request reused the first one's two full system-prompt blocks.
  if (manager.Stats().prefix_hit_tokens != 32) return 1;
  std::printf("ok\n");
  return 0;
}
