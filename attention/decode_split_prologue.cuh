// SplitCta's prologue: Start (before and across the wait for the kernel ahead), FinishPrologue
// (query rotation, codebook replicas, block ids into shared memory, query fragments), InitState,
// and Load (a chunk from global memory into registers).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/decode_split_cta.cuh"

namespace tqkv::decode_detail {

template <SplitVariant V>
__device__ __forceinline__ bool SplitCta<V>::Start() {
  lane = threadIdx.x & 31, cta_warp = threadIdx.x >> 5;
  // warp: the warp's index among its KV head's kW warps; unit: which of the CTA's KV heads.
  unit = kPaired ? cta_warp / kW : 0, warp = kPaired ? cta_warp % kW : cta_warp;
  split = blockIdx.x, h0 = blockIdx.y * kUnits, h = h0 + unit, b = blockIdx.z;
  group = p.num_q_heads / p.num_kv_heads;

  // Key codebook table, one replica per lane of a half-warp (entry e of lane l at byte 256·e +
  // 8·(l mod 16)), from the decoder's prebuilt table (decode_launch.h, CodebookTable; 2 KB for
  // 4-bit keys): each thread loads its entries here and writes their 16 replicas in
  // FinishPrologue, after the first chunk's loads are out. (Copying the replicated table from L2
  // per CTA moved 24 MB through L2 at batch 1 × 32k, 100 MB at 64 × 4k.)
  if constexpr (kCodebook) {
    const uint32_t window = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    if ((window & 0x00FFFFFFu) != kSmemStart) __trap();  // the lookups assume this layout
#pragma unroll
    for (int k = 0; k < kEntriesPerThread; ++k) {
      const int e = threadIdx.x + k * kT;
      if (e < Traits::kLutEntries) entries[k] = __ldg(p.codebook_table + e);
    }
    lane_word = (window & 0xFF000000u) | (kHiOnly ? 4u * lane : 8u * (lane & 15));
  }
  // The random signs of the query rotation are the decoder's constants: read before the wait.
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    q_sign[e] = p.query_signs != nullptr && warp < Config::kQueryHeads
                    ? __ldg(p.query_signs + kE * lane + e)
                    : 1.0f;
  }
  // Launched as a programmatic dependent of whatever kernel precedes it in the stream (the
  // default without a query prep: CudaDecoder::Run), the CTA may be resident before that kernel
  // has finished; everything below reads inputs it may have written (query, seq_lens, tables,
  // cache) or writes what it may still read (workspace, output), so it waits here. Only the
  // launch and the table and sign loads above (decoder-owned constants) overlap the kernel before.
  if (p.wait_at_start) GridDependencyWait();
  // The first query row this warp rotates in FinishPrologue (head = warp), for 16-bit queries:
  // its load is issued here, beside the sequence length's, so that its latency overlaps the
  // seq_len -> block table -> first copies chain instead of following it (ncu, 4bit_nc 64 x 1k:
  // the warps waited as long for the query as for the first block ids).
  q_prefetched =
      p.wait_at_start && p.query_dtype != 0 && warp < group && warp < Config::kQueryHeads;
  if (q_prefetched) {
    const int64_t row = static_cast<int64_t>(b) * p.num_q_heads + h * group + warp;
    const uint32_t* src = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p.query) +
                                                            row * kD + kE * lane);
#pragma unroll
    for (int w = 0; w < kE / 2; ++w) q_pre[w] = src[w];
  }
  // The block ids of this warp's first chunks, read beside the sequence length instead of after
  // it (one memory round trip less before the first copies): where they lie past the sequence's
  // blocks they are still inside the table's row (max_blocks_per_seq entries) and are dropped by
  // FirstBlock below.
  begin = split * p.tokens_per_split;
  table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks_per_seq;
  block_shift = 31 - __clz(p.block_size);
#pragma unroll
  for (int k = 0; k < kStages; ++k) {
    const int at = (begin + (warp + k * kW) * kChunk) >> block_shift;
    first_block_ids[k] = at < p.max_blocks_per_seq ? __ldg(table + at) : 0;
  }
  // The 8-warp staged compressed kernels read the block ids of their later chunks from shared
  // memory (ids_s, written in FinishPrologue) instead of from global memory one chunk ahead of
  // each copy: 10 instructions less per chunk; 1-12 % faster from batch 16 or 32k tokens up
  // (16 × 4k the most), 0.1-0.2 µs slower at batch 1 × 1k-4k.
  // Loaded here into registers, beside the first ids; entries past the sequence as above
  // (Config::kMaxIds: none in the other kernels).
  id0 = begin >> block_shift;
  num_ids = min(((begin + p.tokens_per_split - 1) >> block_shift) + 1, p.max_blocks_per_seq) - id0;
#pragma unroll
  for (int k = 0; k < kIdsPerThread; ++k) {
    const int i = threadIdx.x + k * kT;
    ids_pre[k] = i < num_ids ? __ldg(table + id0 + i) : 0;
  }
  ids_s = reinterpret_cast<int*>(smem + Config::kIdsOffset);
  len = p.seq_lens[b];
  if (begin >= len) {           // the merge reads only splits that hold tokens
    if (p.output != nullptr) {  // no merge: an empty sequence's rows are 0, LSE -inf
      const int64_t row0 = static_cast<int64_t>(b) * p.num_q_heads + h0 * group;
      for (int i = threadIdx.x; i < kUnits * group * kD; i += blockDim.x) {
        StoreOutput(p.output, p.out_dtype, row0 * kD + i, 0.0f);
        if (i % kD == 0) p.lse[row0 + i / kD] = -INFINITY;
      }
    }
    return false;
  }
  end = min(begin + p.tokens_per_split, len);
  g = lane >> 2, t = lane & 3;
  return true;
}

template <SplitVariant V>
__device__ __forceinline__ void SplitCta<V>::FinishPrologue() {
  GridDependencyWait();
  // Warp w rotates rows w, w + kW, ... of the group: lane l holds elements kE·l .. kE·l + kE - 1,
  // so the transform's first log2(kE) butterfly stages are in registers and the other five
  // cross lanes (shuffles). Sylvester order: y[j] = Σ_i x[i] (-1)^popcount(i & j).
  uint16_t* q_hi = reinterpret_cast<uint16_t*>(smem + Config::kQueryOffset) +
                   unit * 2 * Config::kQueryHeads * kD;
  uint16_t* q_lo = q_hi + Config::kQueryHeads * kD;
  for (int head = warp; head < Config::kQueryHeads; head += kW) {
    float x[kE];
#pragma unroll
    for (int e = 0; e < kE; ++e) x[e] = 0.0f;
    if (head < group) {
      const int64_t row = static_cast<int64_t>(b) * p.num_q_heads + h * group + head;
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        const int64_t at = row * kD + kE * lane + e;
        if (head == warp && q_prefetched) {
          const auto bits = static_cast<uint16_t>(q_pre[e / 2] >> (16 * (e % 2)));
          x[e] = p.query_dtype == 1 ? __half2float(__ushort_as_half(bits))
                                    : __bfloat162float(__ushort_as_bfloat16(bits));
        } else if (p.query_dtype == 0) {
          x[e] = static_cast<const float*>(p.query)[at];
        } else if (p.query_dtype == 1) {
          x[e] = __half2float(static_cast<const __half*>(p.query)[at]);
        } else {
          x[e] = __bfloat162float(static_cast<const __nv_bfloat16*>(p.query)[at]);
        }
        x[e] *= q_sign[e];  // 1 without signs
      }
      if (p.query_fwht) {
#pragma unroll
        for (int m = 1; m < kE; m <<= 1) {
#pragma unroll
          for (int e = 0; e < kE; ++e) {
            if ((e & m) == 0) {
              const float u = x[e], v = x[e + m];
              x[e] = u + v;
              x[e + m] = u - v;
            }
          }
        }
#pragma unroll
        for (int m = 1; m < 32; m <<= 1) {
#pragma unroll
          for (int e = 0; e < kE; ++e) {
            const float o = __shfl_xor_sync(0xffffffffu, x[e], m);
            x[e] = (lane & m) ? o - x[e] : x[e] + o;
          }
        }
#pragma unroll
        for (int e = 0; e < kE; ++e) x[e] *= p.query_scale;
      }
    }
    // Fragment words hold element pairs (low half = even element), so the rows are stored as
    // pairs.
#pragma unroll
    for (int e = 0; e < kE; e += 2) {
      const int at = head * kD + kE * lane + e;
      if constexpr (Traits::kPlain) {  // the cache's element type
        *reinterpret_cast<uint32_t*>(q_hi + at) = PackPlain<Traits::kFp16>(x[e], x[e + 1]);
      } else {
        const __half2 hi = __floats2half2_rn(x[e], x[e + 1]);
        const float2 hf = __half22float2(hi);
        *reinterpret_cast<__half2*>(q_hi + at) = hi;
        *reinterpret_cast<__half2*>(q_lo + at) = __floats2half2_rn(x[e] - hf.x, x[e + 1] - hf.y);
      }
    }
  }
  if constexpr (kCodebook) {
    // 16-byte stores of two replicas (hi-only: four replicas of the hi pair, 32 per entry at
    // 4-byte steps, so that the 32 lanes' 4-byte lookups hit 32 distinct banks: one wavefront);
    // store c of lane l goes to 16-byte slot (c + l) mod 8 of its entry's 256-byte row, so each
    // 8-lane phase of a store covers 8 distinct bank groups.
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
#pragma unroll
    for (int k = 0; k < kEntriesPerThread; ++k) {
      const int e = threadIdx.x + k * kT;
      if (e < Traits::kLutEntries) {
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const uint32_t at = base + 256u * e + 16u * ((c + lane) & 7);
          const uint32_t second = kHiOnly ? entries[k].x : entries[k].y;
          asm volatile("st.shared.v4.u32 [%0], {%1, %2, %1, %2};\n" ::"r"(at), "r"(entries[k].x),
                       "r"(second)
                       : "memory");
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kIdsPerThread; ++k) {
    const int i = threadIdx.x + k * kT;
    if (i < num_ids) ids_s[i] = ids_pre[k];
  }
  __syncthreads();  // the rotated rows, the table replicas and the block ids
#pragma unroll
  for (int part = 0; part < kQParts; ++part) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      // Packed: column g holds part g % 2 of head g / 2.
      const int head = kPacked ? (g >> 1) : 8 * nt + g;
      const uint16_t* q = ((kPacked ? (g & 1) : part) ? q_lo : q_hi) + head * kD +
                          (kInterleavedKeys ? 8 : kD / 4) * t;
#pragma unroll
      for (int s = 0; s < kKSteps; ++s) {
        // A thread's key element i is d = (D/4)·t + i, or with interleaved keys (its units are
        // 4j + t) d = 32·(i / 8) + 8·t + i % 8.
        const int at = kInterleavedKeys ? 32 * (s / 2) + 4 * (s % 2) : 4 * s;
        qf[part][nt][s][0] = *reinterpret_cast<const uint32_t*>(q + at);
        qf[part][nt][s][1] = *reinterpret_cast<const uint32_t*>(q + at + 2);
      }
    }
  }
}

template <SplitVariant V>
__device__ __forceinline__ void SplitCta<V>::InitState() {
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      m[nt][i] = -INFINITY;
      m_thr[nt][i] = -INFINITY;
      l[nt][i] = 0.0f;
      z[nt][i] = 0.0f;
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
    }
  }

  // Per-thread byte offsets within a block (block_bytes < 2^31), computed once; per chunk only the
  // block pointer and the position change.
  stride_token = Traits::kPlain ? 2 * p.num_kv_heads * kD : p.num_kv_heads * p.data_per_slot;
  head_off = Traits::kPlain ? 2 * h * kD : h * p.data_per_slot;
  value_base = Traits::kPlain ? static_cast<int>(p.meta_offset) : p.key_data_bytes;
  off_kg = head_off + (kInterleavedKeys ? 16 : Traits::kKeyBytes) * t +
           2 * g * stride_token;   // token 2g
  off_k8 = off_kg + stride_token;  // token 2g + 1
  off_v = value_base + head_off + Traits::kValueBytes * g + 4 * t * stride_token;
  off_meta = static_cast<int>(p.meta_offset) + 2 * (h * p.num_meta * p.block_size + 2 * g);
  meta_field = 2 * p.block_size;  // bytes between fields of one head
  // Full chunks in turn over the warps; the split's last, partial chunk (if any) separately, so
  // that only it pays for the end-of-sequence masks.
  num_full = (end - begin) / kChunk;
}

template <SplitVariant V>
__device__ __forceinline__ void SplitCta<V>::Load(int c, Chunk& ck, int block) const {
  const int t0 = begin + c * kChunk;
  const uint32_t pos0 = t0 & (p.block_size - 1);
  const uint8_t* base = p.cache + static_cast<int64_t>(block) * p.block_bytes;
  const uint8_t* at = base + pos0 * stride_token;
  if constexpr (kInterleavedKeys) {  // units 4j + t
#pragma unroll
    for (int j = 0; j < kKW / 4; ++j) {
      const uint4 a = __ldg(reinterpret_cast<const uint4*>(at + off_kg + 64 * j));
      const uint4 c = __ldg(reinterpret_cast<const uint4*>(at + off_k8 + 64 * j));
      ck.kg[4 * j] = a.x, ck.kg[4 * j + 1] = a.y, ck.kg[4 * j + 2] = a.z, ck.kg[4 * j + 3] = a.w;
      ck.k8[4 * j] = c.x, ck.k8[4 * j + 1] = c.y, ck.k8[4 * j + 2] = c.z, ck.k8[4 * j + 3] = c.w;
    }
  } else {
    LoadBytes<Traits::kKeyBytes, Traits::kKeyAlign>(at + off_kg, ck.kg);
    LoadBytes<Traits::kKeyBytes, Traits::kKeyAlign>(at + off_k8, ck.k8);
  }
  LoadBytes<Traits::kValueBytes, Traits::kValueAlign>(at + off_v, ck.v[0]);
  LoadBytes<Traits::kValueBytes, Traits::kValueAlign>(at + off_v + 2 * stride_token, ck.v[1]);
  LoadBytes<Traits::kValueBytes, Traits::kValueAlign>(at + off_v + stride_token, ck.v[2]);
  LoadBytes<Traits::kValueBytes, Traits::kValueAlign>(at + off_v + 3 * stride_token, ck.v[3]);
  if constexpr (!Traits::kPlain) {
    const uint8_t* meta = base + off_meta + 2 * pos0;
    constexpr int kScaleField = Traits::kHasNorm ? 1 : 0;
    ck.norm = Traits::kHasNorm ? __ldg(reinterpret_cast<const uint32_t*>(meta)) : 0u;
    ck.vscale = __ldg(reinterpret_cast<const uint32_t*>(meta + kScaleField * meta_field));
    ck.vzero = __ldg(reinterpret_cast<const uint32_t*>(meta + (kScaleField + 1) * meta_field));
  }
}

}  // namespace tqkv::decode_detail
