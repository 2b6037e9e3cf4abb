#include "attention/decode_cuda.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <numbers>
#include <tuple>

#include "attention/codebook_fp16.h"
#include "runtime/error.h"
#include "runtime/memory.h"

#if TQKV_HAVE_CUDA
#include "attention/decode_launch.h"
#include "runtime/cuda_check.h"
#endif

namespace tqkv {

struct CudaDecoder::State {
  bool bf16 = false;
  BlockFormat format;  // compressed
  Bf16BlockFormat bf16_format;
  CacheLayout layout;  // what the caches of its calls must be
  KeyKind key_kind = KeyKind::kMse4;
  bool rotate_query = false;     // MSE keys: q·Πᵀ
  bool fwht = false;             // Πᵀ = diag(signs)·H/√D: rotated in the split kernel
  DeviceBuffer<float> rotation;  // dense Πᵀ [D, D] (for the query prep kernel)
  DeviceBuffer<float> signs;     // hadamard_signs: [D] ±1
  DeviceBuffer<uint32_t> codebook_table;  // decode_detail::CodebookTable (MSE keys)
  int sm_count = 0;
  // By 4 · shared_o + 2 · half + staged (DecodeOptions::shared_o, ::half, ::staged) and GQA
  // group, filled on first use (0 = not yet asked) under the mutex: Plan and Run are const and may
  // run on several threads. An entry's resident count is stored last (release), so a reader that
  // sees it non-zero (acquire) sees its other two fields.
  std::mutex occupancy_mutex;
  std::atomic<int> resident_per_sm[8][33] = {};
  bool staged[8][33] = {};
  int narrow_resident_per_sm[8][33] = {};
  // MSE keys: the codebook table holds α·c as fp16 hi + lo parts (codebook_fp16.h), so scores
  // come out α times too large and the softmax scale is divided by α. codebook_hi_only: 3-bit keys
  // whose α·c lie within kMaxHiOnlyError of fp16, so the 8-warp staged kernel's hi-only twin may
  // run.
  float codebook_scale = 1.0f;
  bool codebook_hi_only = false;
};

namespace {

constexpr int64_t kAlign = 256;
int64_t AlignUp(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Workspace bytes for the query prep kernel's fp32 q·Πᵀ: only a dense Πᵀ needs that launch.
int64_t QueryPrepBytes(bool dense_rotation, int64_t rows, int head_dim) {
  return dense_rotation ? AlignUp(rows * head_dim * 4) : 0;
}

bool Misaligned(const void* p, uintptr_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment != 0;
}

int DeviceSmCount() {
  const auto devices = QueryDevices();
  return devices.empty() ? 0 : devices.front().sm_count;
}

}  // namespace

CudaDecoder::CudaDecoder(const Quantizer& q) : state_(std::make_unique<State>()) {
  RequireCudaDevice("CudaDecoder");
  State& s = *state_;
  s.format = q.format();
  s.layout = q.layout();
  const int d = s.format.head_dim;
  s.key_kind = s.format.key_kind();
  if (!s.format.fp8_keys) {
    s.rotate_query = true;
    const Rotation& r = q.rotation();
    s.fwht = r.kind == RotationKind::kHadamard || r.kind == RotationKind::kHadamardSigns;
    if (!s.fwht) {
      s.rotation = DeviceBuffer<float>(int64_t{d} * d);
      s.rotation.CopyFromHost(r.matrix);
    } else if (r.kind == RotationKind::kHadamardSigns) {
      s.signs = DeviceBuffer<float>(d);
      s.signs.CopyFromHost(r.signs);
    }
    // The codebook as fp16 hi + lo parts (α·c ≈ hi + lo to ~2^-22), laid out as the split kernel
    // reads it from shared memory. For 3-bit keys α is chosen so that the hi parts alone are
    // within kMaxHiOnlyError of α·c where possible (the hi-only 8-warp kernel reads only those);
    // otherwise, and for other keys, α = 1.
    const auto& c = q.codebook().centroids;
    Fp16Codebook parts = ScaleCodebookForFp16(c, /*search=*/s.format.key_bits == 3);
    s.codebook_hi_only = s.format.key_bits == 3 && parts.max_rel_error <= kMaxHiOnlyError;
    if (!s.codebook_hi_only) parts = ScaleCodebookForFp16(c, /*search=*/false);
    s.codebook_scale = parts.scale;
    uint16_t hi[16] = {}, lo[16] = {};
    for (size_t i = 0; i < parts.hi.size() && i < 16; ++i) {
      hi[i] = parts.hi[i];
      lo[i] = parts.lo[i];
    }
#if TQKV_HAVE_CUDA
    const std::vector<uint32_t> table = decode_detail::CodebookTable(s.format.key_bits, hi, lo);
    s.codebook_table = DeviceBuffer<uint32_t>(static_cast<int64_t>(table.size()));
    s.codebook_table.CopyFromHost(table);
#endif
  }
#if TQKV_HAVE_CUDA
  // The uploads are copies from pageable memory, which may return before the data lands; a Run
  // on a non-blocking stream is not ordered after them.
  TQKV_CUDA_CHECK(cudaDeviceSynchronize());
#endif
  s.sm_count = DeviceSmCount();
}

CudaDecoder::CudaDecoder(const Bf16BlockFormat& format) : state_(std::make_unique<State>()) {
  RequireCudaDevice("CudaDecoder");
  if (format.dtype != DType::kBF16 && format.dtype != DType::kF16) {
    throw InvalidArgument("CudaDecoder", "format.dtype", DTypeName(format.dtype), "BF16 or F16");
  }
  state_->bf16 = true;
  state_->bf16_format = CheckBf16BlockFormat("CudaDecoder", format);
  state_->layout = format.layout();
  state_->key_kind = format.key_kind();
  state_->sm_count = DeviceSmCount();
}

CudaDecoder::~CudaDecoder() = default;
CudaDecoder::CudaDecoder(CudaDecoder&&) noexcept = default;
CudaDecoder& CudaDecoder::operator=(CudaDecoder&&) noexcept = default;

int CudaDecoder::MaxGroup(const DecodeOptions& options) const {
  const int value_bits = state_->bf16 ? 16 : state_->format.value_bits;
  return decode_detail::MaxSplitGroup(state_->key_kind, value_bits, head_dim(), options.staged,
                                      options.half, options.shared_o);
}

decode_detail::MaybeSplitVariant CudaDecoder::Variant(int group, const DecodePlan& plan) const {
  return decode_detail::ChooseSplitVariant(
      state_->key_kind, state_->bf16 ? 16 : state_->format.value_bits, head_dim(), group,
      {plan.staged, plan.narrow, plan.hi_only, plan.one_cta, plan.half, plan.shared_o});
}

SplitKernelOccupancy CudaDecoder::SplitOccupancy(int group, bool staged, bool half,
                                                 bool shared_o) const {
  using decode_detail::KeyKind;
  const int k = 4 * int{shared_o} + 2 * int{half} + int{staged};
  std::atomic<int>& resident_entry = state_->resident_per_sm[k][group];
  int resident = resident_entry.load(std::memory_order_acquire);
  if (resident == 0) {
    const std::lock_guard<std::mutex> lock(state_->occupancy_mutex);
    resident = resident_entry.load(std::memory_order_relaxed);
    if (resident == 0) {
      int fit = 1, narrow_fit = 0;
      const int value_bits = state_->bf16 ? 16 : state_->format.value_bits;
      // The hi-only and exact twins of 3-bit keys' 8-warp kernel have the same occupancy; the
      // narrow layout's is counted in 4-warp units: 3-bit keys' 4-warp kernel's CTAs (four per SM:
      // their paired CTAs hold the same four units), 4-bit keys' paired CTAs times their two units.
      const decode_detail::MaybeSplitVariant wide =
          decode_detail::ChooseSplitVariant(state_->key_kind, value_bits, head_dim(), group,
                                            {staged, false, true, false, half, shared_o});
      // (The shared-output kernel has no narrow layout: where it serves the group, none.)
      [[maybe_unused]] const decode_detail::MaybeSplitVariant narrow =
          wide.variant.shared_o
              ? decode_detail::MaybeSplitVariant{}
              : decode_detail::ChooseSplitVariant(state_->key_kind, value_bits, head_dim(), group,
                                                  {staged, true, false, false, half});
      TQKV_CHECK(wide.ok);
#if TQKV_HAVE_CUDA
      TQKV_CUDA_CHECK(decode_detail::DecodeSplitCtasPerSm(wide.variant, &fit));
      if (narrow.ok)
        TQKV_CUDA_CHECK(decode_detail::DecodeSplitCtasPerSm(narrow.variant, &narrow_fit));
#endif
      state_->staged[k][group] = wide.variant.staged();
      state_->narrow_resident_per_sm[k][group] = narrow_fit;
      resident = std::max(fit, 1);
      resident_entry.store(resident, std::memory_order_release);
    }
  }
  SplitKernelOccupancy o{resident, state_->staged[k][group], state_->bf16,
                         state_->narrow_resident_per_sm[k][group]};
  o.narrow_half = half && o.narrow_resident_per_sm > 0;
  // The 8-warp staged kernel of 3-bit keys and its hi-only twin (SplitVariant::hi_only), for a
  // codebook close enough to fp16.
  // (Packed kernels only: GQA groups up to 4; larger groups' staged kernels, half precision or at
  // D = 64 exact, have no twins.)
  const bool packed = !state_->bf16 && group <= 4;
  o.hi_only = packed && state_->key_kind == KeyKind::kMse3 && o.staged && state_->codebook_hi_only;
  // Its paired CTAs for the narrow layout: two KV heads per CTA (every group the narrow kernel
  // serves, 1-4; decode_cuda_test's NarrowK3v4 runs groups 1, 2, 3 and 4 on them). At D = 64
  // there is no narrow layout of these groups (narrow_resident_per_sm = 0), so neither.
  o.narrow_hi_only = o.hi_only && o.narrow_resident_per_sm > 0 && num_kv_heads() % 2 == 0;
  // 4-bit keys' narrow layout runs on paired exact CTAs alone (no 4-warp kernel): an even number
  // of KV heads, and only for sequences of at most 4,096 tokens whose 8-warp grid would need two
  // rounds of CTA pairs (narrow_max_len; ChooseSplitLayout says why).
  if (!state_->bf16 && state_->key_kind == KeyKind::kMse4 && packed) {
    if (num_kv_heads() % 2 != 0) o.narrow_resident_per_sm = 0;
    o.narrow_max_len = 4096;
    // Its 8-warp staged kernel's twin compiled for one CTA per SM (SplitVariant::one_cta).
    // (D = 128 only: at 64 the packed kernel takes 102 registers either way.)
    o.one_cta_twin = o.staged && packed && head_dim() == 128;
  }
  return o;
}

const CacheLayout& CudaDecoder::layout() const { return state_->layout; }

int CudaDecoder::head_dim() const {
  return state_->bf16 ? state_->bf16_format.head_dim : state_->format.head_dim;
}
int CudaDecoder::num_kv_heads() const {
  return state_->bf16 ? state_->bf16_format.num_kv_heads : state_->format.num_kv_heads;
}
int CudaDecoder::block_size() const {
  return state_->bf16 ? state_->bf16_format.block_size : state_->format.block_size;
}

namespace {
// Split limits (ChooseSplitLayout says why): at most this many splits per sequence, and
// tokens per split (decode_launch.h's too).
constexpr int64_t kMaxSplits = CudaDecoder::kMaxSplits;
constexpr int64_t kMaxSplitTokens = CudaDecoder::kMaxSplitTokens;
#if TQKV_HAVE_CUDA
static_assert(kMaxSplitTokens == decode_detail::kMaxSplitTokens);
#endif
}  // namespace

SplitLayout ChooseSplitLayout(int64_t max_len, int64_t seq_heads, int sm_count,
                              const SplitKernelOccupancy& occupancy, int64_t tokens_per_split,
                              DecodeOptions::Narrow narrow) {
  // Split layout: choose the number of splits s that minimizes the estimated time, in tokens of
  // one warp's streaming:
  //   rounds(s) · (tokens per split + per-CTA fixed cost) + merge cost(s).
  // - The 4-warp kernels are latency-bound and gain from every CTA an SM holds (at two per SM,
  //   planned at one, bf16 16 × 16k was 8 % and k8v4 64 × 4k 11 % slower): rounds = ⌈CTAs /
  //   (CTAs that fit per SM · SMs)⌉; a CTA's fixed work (prologue, its warps' merge, the first
  //   loads' latency) counts as kFixedTokens = 256 and each split as kSplitTokens = 16 more (the
  //   merge's per-row work and the partials it reads; e.g. bf16 1 × 4k took 14.6 µs at 16 splits,
  //   15.2 at 32, 19.9 at 64, all in one wave).
  // - The staged bf16 kernel: the same terms at one CTA per SM (v7l). The pair model below made
  //   its mid-batch plans 1-3 % slower (bf16 16 × 8k 2 × 4,096 tokens 128.7 µs vs
  //   1 × 8,192 124.5; 8 × 16k 128.4 vs 126.3).
  // - The 8-warp staged kernels (4bit_nc, k3v4_nc; two CTAs fit per SM) run near their issue
  //   limit: rounds = 1 while no SM holds a second CTA, kPairCost = 1.6 per pair of CTAs on an SM
  //   beyond that; a CTA's fixed work counts as kStagedFixedTokens = 1,024 and a merge kernel
  //   (s > 1) as kMergeTokens = 500 once, besides kSplitTokens. The three were fitted to every
  //   pairwise preference of the 4bit_nc split sweeps (tools/bench/NOTES.md at commit 1664e39,
  //   11, graph µs; e.g. 4 × 32k: 8 × 4,096 tokens 50.3 vs 4 × 8,192 55.3; 16 × 4k: 1 × 4,096
  //   31.0 vs 2 × 2,048 33.5; 1 × 32k: 16 × 2,048 20.6 vs 32 × 1,024 21.3; 256 × 32k: 4 × 8,192
  //   3,059 vs 5 × 6,592 3,100; 1 × 1k: 8 × 128 8.9 vs 4 × 256 9.4), which a range of values meets
  //   (fixed 736-2,048, merge 150-750, pair 1.4-1.65). The half-precision kernels (groups 5-16,
  //   verify passes) take the same terms, not fitted to them (64 × 4k with 16 columns gets one
  //   split, as measured: 1, 2 and 4 splits of the 8-warp kernel 122.9, 168.2 and 222.7 µs), and
  //   so does k8v4's staged kernel (on an H100 its plans measured 3-12 % faster than the register
  //   kernel's at batch 1 to 64 × 4k and 1 × 32k, and within 0.4 % at 16 × 32k and 64 × 32k:
  //   commit 8ec4670, tools/bench/README.md).
  // - The narrow variant (4-warp units of one KV head, up to four per SM: the same 16 warps;
  // k3v4_nc
  //   as 4-warp CTAs or paired in 8-warp CTAs, 4bit_nc paired only): a unit of tps tokens gives
  //   each warp the chunks of an 8-warp CTA of 2·tps, so it costs as that one,
  //   rounds = ⌈CTAs / (4 · SMs)⌉, with kPairCost where its fullest SM holds more than 8 warps.
  //   It wins where the 8-warp kernel needs a second round of pairs (64 × 4k: one round of 512
  //   narrow CTAs instead of two of 264 wide ones, each paying the fixed prologue and epilogue).
  // Short contexts at small batch get enough CTAs to fill the SMs; large batches avoid a nearly
  // empty last round. No split is shorter than 64 tokens, none longer than kMaxSplitTokens: a
  // warp's P·V accumulator is a chain of tensor-core fp32 additions whose rounding grows with its
  // length (measured: 8,192 tokens per warp gave 1.9e-3 relative output error, 1,024 gave
  // ≤ 3e-4).
  constexpr int64_t kFixedTokens = 256, kStagedFixedTokens = 1024, kSplitTokens = 16,
                    kMergeTokens = 500, kMinSplit = 64;
  constexpr double kPairCost = 1.6;
  // The hi-only kernels cost this much of their exact twins' time where the plan takes them: the
  // narrow layout on paired hi-only CTAs (SplitKernelOccupancy::narrow_hi_only) measured 0.91-0.97
  // of the 4-warp kernel's at the narrow shapes (v21), the 8-warp hi-only
  // twin at one CTA per SM 0.85-0.95 (v20). 0.95 moves 16 × 16k, 16 × 8k, 8 × 32k and 4 × 32k to
  // the paired CTAs (7-18 % faster there than the 8-warp pairs), 4 × 16k, 8 × 8k and 2 × 32k from
  // two 8-warp CTAs per SM to one hi-only CTA of twice the tokens (15-18 % faster), and keeps
  // 32 × 4k, 16 × 4k and batch 1 on the 8-warp kernel (3-20 % faster there than the pairs), as
  // measured (decode_plan_test).
  constexpr double kHiOnlyCost = 0.95;
  // ... for paired CTAs over splits of at least 2,048 tokens: the shorter ones the model would then
  // pick were slower (16 × 4k, 4 × 1,024 tokens: 27.1 µs against the 8-warp kernel's 22.0).
  constexpr int64_t kPairedMinSplit = 2048;
  // 4bit_nc's one-CTA-per-SM twin only for splits of at least this many tokens (v23, graph µs:
  // 1 × 32k 16.2 -> 15.7, 1 × 16k 11.8 -> 11.4, 16 × 1k 9.8 -> 9.3, 16 × 4k 23.3 -> 22.4; but
  // 1 × 4k, splits of 256 tokens, 7.4 -> 7.6) ...
  constexpr int64_t kOneCtaMinSplit = 1024;
  // ... whose tokens cost this fraction of the two-per-SM kernel's (its fixed part the same).
  // Session 24, graph µs, two rounds per call, two calls; the old plan's CTAs (two per SM) -> one
  // twin CTA per SM over twice the tokens: 4 × 16k 25.1 -> 24.5-24.6, 8 × 8k 25.3-25.4 ->
  // 24.8-25.0, 2 × 32k 25.0-25.5 -> 24.5-24.7, 4 × 32k 42.0-43.5 -> 41.3-42.0, 8 × 16k 42.2 ->
  // 41.6-41.7, 2 × 64k 43.2-43.4 -> 41.8, 1 × 128k (33 × 4,032 tokens) 45.0-45.2 -> 41.8 (16 ×
  // 8,192), 16 × 8k (2 × 4,096) 43.8-43.9 -> 39.4-39.6 (one split); but 4 × 1k (4 × 256 tokens,
  // 128 CTAs) 7.4-7.5 -> 8.4 (one split of 1,024 on 32 SMs). 4 × 32k and 2 × 64k move below
  // 0.883, 4 × 1k would move above 0.785; the shapes that ran the twin before keep their splits.
  constexpr double kOneCtaCost = 0.84;
  // The half-precision kernels' narrow twin (4-warp CTAs, two per SM) streams its tokens at this
  // cost of the 8-warp kernel's: at 1 × 128k, 8 new tokens (two passes of 16 columns), 264 narrow
  // CTAs of 4,032 tokens took 125.3-125.9 µs where 128 8-warp CTAs of 8,192 took 114.0-114.6, the
  // same tokens per SM. It wins where the 8-warp grid needs several rounds, as each round's CTAs'
  // prologue and merge then run beside the other CTA's chunks (64 × 4k, 4 new tokens: 512 CTAs,
  // 122.7-122.9 -> 117.5-118.2 µs; same call).
  constexpr double kHalfNarrowCost = 1.1;
  const int64_t sms = std::max(sm_count, 1);
  auto cost = [&](int64_t tps, bool narrow) {
    const int64_t splits = (max_len + tps - 1) / tps;
    const int64_t ctas = seq_heads * splits;
    const double split_terms =
        double(splits * kSplitTokens) +
        (occupancy.staged && !occupancy.bf16 && splits > 1 ? double(kMergeTokens) : 0.0);
    if (narrow) {
      const int64_t per_sm = occupancy.narrow_resident_per_sm;
      const int64_t fullest = std::min(per_sm, (ctas + sms - 1) / sms);
      const double rounds = double((ctas + per_sm * sms - 1) / (per_sm * sms));
      const double tokens = double(2 * tps) * (occupancy.narrow_half ? kHalfNarrowCost : 1.0);
      return rounds * (fullest > 2 ? kPairCost : 1.0) * (tokens + double(kStagedFixedTokens)) *
                 (occupancy.narrow_hi_only && tps >= kPairedMinSplit ? kHiOnlyCost : 1.0) +
             split_terms;
    }
    if (occupancy.staged && !occupancy.bf16) {
      const bool pairs = occupancy.resident_per_sm >= 2 && ctas > sms;
      const double rounds = pairs ? kPairCost * double((ctas + 2 * sms - 1) / (2 * sms))
                                  : double((ctas + sms - 1) / sms);
      const bool hi_only = occupancy.hi_only && ctas <= sms;  // with_scores below
      const bool one_cta = occupancy.one_cta_twin && ctas <= sms && tps >= kOneCtaMinSplit;
      return rounds * (double(tps) * (one_cta ? kOneCtaCost : 1.0) + kStagedFixedTokens) *
                 (hi_only ? kHiOnlyCost : 1.0) +
             split_terms;
    }
    const int64_t capacity = sms * (occupancy.staged ? 1 : occupancy.resident_per_sm);
    return double((ctas + capacity - 1) / capacity) * double(tps + kFixedTokens) + split_terms;
  };
  // - 4bit_nc's narrow layout (paired exact CTAs, narrow_max_len): measured against the 8-warp
  //   kernel's plan (paired4 and v22) it gained 2-11 % where a sequence
  //   is one split of at most 4,096 tokens and the 8-warp grid needs two rounds of CTA pairs
  //   (64 × 1k −11 %, 256 × 1k −9 %, 64 × 4k −2 %), lost where that grid is one round (32 × 1k
  //   +11 %: one paired CTA per SM against two 8-warp ones) and over 8,192-token splits
  //   (64 × 16k +2-7 %); the model takes it only where it gained.
  const bool can_narrow =
      occupancy.narrow_resident_per_sm > 0 && narrow != DecodeOptions::Narrow::kNever;
  auto variant = [&](int64_t tps) {
    if (!can_narrow) return false;
    if (narrow == DecodeOptions::Narrow::kAlways) return true;
    if (occupancy.narrow_max_len > 0 &&
        (max_len > occupancy.narrow_max_len ||
         seq_heads * ((max_len + tps - 1) / tps) <= occupancy.resident_per_sm * sms)) {
      return false;
    }
    return cost(tps, true) < cost(tps, false);
  };
  // The hi-only twin of the 8-warp kernel where it holds at most one CTA per SM, and its paired
  // CTAs for every narrow layout (SplitLayout).
  auto with_scores = [&](SplitLayout layout) {
    const int64_t ctas =
        seq_heads * ((max_len + layout.tokens_per_split - 1) / layout.tokens_per_split);
    layout.hi_only = layout.narrow ? occupancy.narrow_hi_only : (occupancy.hi_only && ctas <= sms);
    layout.one_cta = !layout.narrow && occupancy.one_cta_twin && ctas <= sms &&
                     layout.tokens_per_split >= kOneCtaMinSplit;
    return layout;
  };
  if (tokens_per_split != 0) {
    return with_scores({tokens_per_split, variant(tokens_per_split)});
  }
  const int64_t max_s = std::clamp<int64_t>(max_len / kMinSplit, 1, kMaxSplits);
  const int64_t min_s = std::min(max_s, (max_len + kMaxSplitTokens - 1) / kMaxSplitTokens);
  SplitLayout best;
  double best_cost = 0;
  for (int64_t s = min_s; s <= max_s; ++s) {
    const int64_t tps = std::max<int64_t>(64, ((max_len + s - 1) / s + 63) / 64 * 64);
    const bool narrow = variant(tps);
    const double c = cost(tps, narrow);
    if (best.tokens_per_split == 0 || c < best_cost) {
      best_cost = c;
      best = {tps, narrow};
    }
  }
  return with_scores(best);
}

void CheckRowAlignment(std::string_view where, const void* query, DType query_dtype,
                       const void* output, DType output_dtype, const float* lse) {
  for (const auto& [name, pointer, alignment] :
       {std::tuple{"query", query, std::max<int64_t>(1, DTypeSize(query_dtype))},
        std::tuple{"output", output, std::max<int64_t>(1, DTypeSize(output_dtype))},
        std::tuple{"lse", static_cast<const void*>(lse), int64_t{4}}}) {
    if (Misaligned(pointer, alignment)) {
      throw InvalidArgument(where, name, fmt::format("{}", pointer),
                            fmt::format("a {}-byte aligned device pointer", alignment));
    }
  }
}

void CudaDecoder::CheckScale(std::string_view where, std::optional<float> scale) const {
  const float x = scale ? *scale : 1.0f / std::sqrt(static_cast<float>(head_dim()));
  const float score_scale = x * static_cast<float>(std::numbers::log2e) / state_->codebook_scale;
  if (!std::isfinite(score_scale)) {
    throw InvalidArgument(
        where, "scale", x,
        fmt::format("at most {:g} (scale · log2(e) / {:g}, the kernels' fp32 score scale, finite)",
                    std::numeric_limits<float>::max() / static_cast<float>(std::numbers::log2e) *
                        std::min(1.0f, state_->codebook_scale),
                    state_->codebook_scale));
  }
}

DecodePlan CudaDecoder::Plan(int num_seqs, int num_q_heads, int max_blocks_per_seq,
                             const DecodeOptions& options) const {
  constexpr const char* kWhere = "CudaDecoder::Plan";
  const int hk = num_kv_heads();
  if (num_seqs < 1 || num_seqs > 65535) {
    throw InvalidArgument(kWhere, "num_seqs", num_seqs, "1 to 65535");
  }
  const int max_group = MaxGroup(options);
  if (num_q_heads < hk || num_q_heads % hk != 0 || num_q_heads / hk > max_group) {
    throw InvalidArgument(kWhere, "num_q_heads", num_q_heads,
                          fmt::format("a multiple of num_kv_heads = {} with a group of at most {}",
                                      hk, max_group));
  }
  if (max_blocks_per_seq < 1 || int64_t{max_blocks_per_seq} * block_size() > kMaxContextTokens) {
    throw InvalidArgument(
        kWhere, "max_blocks_per_seq", max_blocks_per_seq,
        fmt::format("1 to {} ({} tokens at block size {})", kMaxContextTokens / block_size(),
                    kMaxContextTokens, block_size()));
  }
  if (options.narrow != DecodeOptions::Narrow::kAuto &&
      options.narrow != DecodeOptions::Narrow::kNever &&
      options.narrow != DecodeOptions::Narrow::kAlways) {
    throw InvalidArgument(kWhere, "narrow", static_cast<int>(options.narrow),
                          "Narrow::kAuto (0), kNever (1) or kAlways (2)");
  }
  if (options.sliding_window < 0) {
    throw InvalidArgument(kWhere, "sliding_window", options.sliding_window, ">= 0 (0: none)");
  }
  // The most tokens a sequence's splits hold (a window's: from the block boundary at or after its
  // first position; the chunks before that boundary run in split 0 besides).
  const int64_t max_len =
      std::min<int64_t>(int64_t{max_blocks_per_seq} * block_size(),
                        options.sliding_window > 0 ? options.sliding_window : kMaxContextTokens);
  const int tokens_per_split = options.tokens_per_split;
  if (tokens_per_split != 0) {
    if (tokens_per_split < 64 || tokens_per_split > kMaxSplitTokens || tokens_per_split % 64 != 0 ||
        (max_len + tokens_per_split - 1) / tokens_per_split > kMaxSplits) {
      throw InvalidArgument(
          kWhere, "tokens_per_split", tokens_per_split,
          fmt::format(
              "0 (automatic) or a multiple of 64 from {} to {} (at most {} splits of {} "
              "tokens)",
              std::max<int64_t>(64, ((max_len + kMaxSplits - 1) / kMaxSplits + 63) / 64 * 64),
              kMaxSplitTokens, kMaxSplits, max_len));
    }
  }
  SplitKernelOccupancy occupancy =
      SplitOccupancy(num_q_heads / hk, options.staged, options.half, options.shared_o);
  occupancy.one_cta_twin = occupancy.one_cta_twin && options.one_cta_twin;
  const SplitLayout layout = ChooseSplitLayout(max_len, int64_t{num_seqs} * hk, state_->sm_count,
                                               occupancy, tokens_per_split, options.narrow);
  const int64_t tps = layout.tokens_per_split;
  DecodePlan plan;
  plan.num_seqs = num_seqs;
  plan.num_q_heads = num_q_heads;
  plan.max_blocks_per_seq = max_blocks_per_seq;
  plan.tokens_per_split = static_cast<int>(tps);
  plan.max_splits = static_cast<int>((max_len + tps - 1) / tps);
  plan.narrow = layout.narrow;
  plan.hi_only = layout.hi_only;
  plan.one_cta = layout.one_cta;
  plan.staged = options.staged;
  plan.half = options.half;
  plan.shared_o = options.shared_o;
  plan.dependent_launch = options.dependent_launch;
  plan.sliding_window = options.sliding_window;
  const decode_detail::MaybeSplitVariant variant = Variant(num_q_heads / hk, plan);
  TQKV_CHECK(variant.ok);  // the layouts come from this cache's occupancy
  plan.variant = variant.variant;
  plan.workspace_bytes = WorkspaceBytes(plan);
  return plan;
}

// [q·Πᵀ for a dense Πᵀ,] partial outputs, partial LSEs: Run carves the same sections.
int64_t CudaDecoder::WorkspaceBytes(const DecodePlan& plan) const {
  const int64_t rows = int64_t{plan.num_seqs} * plan.num_q_heads;
  const int64_t q_bytes = QueryPrepBytes(state_->rotate_query && !state_->fwht, rows, head_dim());
  return q_bytes + AlignUp(rows * plan.max_splits * head_dim() * 4) +
         AlignUp(rows * plan.max_splits * 4);
}

void CudaDecoder::Run(const DecodePlan& plan, const CudaDecodeArgs& a, StreamHandle stream) const {
  // What the call writes (output, lse, workspace) must not overlap what it reads or other writes
  // (its CTAs race; an output over the cache would change the cache). Sized by the plan's shape (a
  // plan out of range is left to RunColumns, which refuses it).
  const int64_t rows = int64_t{std::max(plan.num_seqs, 0)} * std::max(plan.num_q_heads, 0);
  const int64_t d = head_dim();
  if (plan.num_seqs >= 1 && plan.num_seqs <= 65535 && plan.max_blocks_per_seq >= 1) {
    // (Another layout, or a block count out of range: refused by RunColumns, naming it.)
    const int64_t cache_bytes = a.cache.layout == state_->layout && a.cache.num_blocks >= 0 &&
                                        a.cache.num_blocks <= kMaxCacheBlocks
                                    ? a.cache.num_blocks * BlockBytesOf(state_->layout)
                                    : 0;
    CheckDisjoint("CudaDecoder::Run", {{"output", a.output, rows * d * DTypeSize(a.output_dtype)},
                                       {"lse", a.lse, rows * 4},
                                       {"cache", a.cache.data, cache_bytes},
                                       {"workspace", a.workspace, a.workspace_bytes},
                                       {"query", a.query, rows * d * DTypeSize(a.query_dtype)},
                                       {"seq_lens", a.seq_lens, int64_t{plan.num_seqs} * 4},
                                       {"block_tables", a.block_tables,
                                        int64_t{plan.num_seqs} * plan.max_blocks_per_seq * 4}});
  }
  RunColumns(plan, a, nullptr, stream);
}

SplitKernelOccupancy CudaDecoder::CheckPlan(std::string_view where, const DecodePlan& plan) const {
  // A plan carries its shape; one made by another decoder of a different cache shape, or edited,
  // must not index the tables below or size a launch past the workspace.
  const int group = plan.num_q_heads / num_kv_heads();
  DecodeOptions plan_options;
  plan_options.staged = plan.staged;
  plan_options.half = plan.half;
  plan_options.shared_o = plan.shared_o;
  const int64_t plan_len =
      std::min<int64_t>(int64_t{plan.max_blocks_per_seq} * block_size(),
                        plan.sliding_window > 0 ? plan.sliding_window : kMaxContextTokens);
  if (plan.num_seqs < 1 || plan.num_seqs > 65535 || plan.tokens_per_split < 64 ||
      plan.tokens_per_split > kMaxSplitTokens || plan.max_splits < 1 ||
      plan.max_splits > kMaxSplits || plan.max_blocks_per_seq < 1 || plan.sliding_window < 0 ||
      plan_len > int64_t{plan.max_splits} * plan.tokens_per_split ||
      plan.num_q_heads % num_kv_heads() != 0 || group < 1 || group > MaxGroup(plan_options)) {
    throw Error(fmt::format("{}: the plan was not made by this decoder's Plan", where));
  }
  const SplitKernelOccupancy variants =
      SplitOccupancy(plan.num_q_heads / num_kv_heads(), plan.staged, plan.half, plan.shared_o);
  if (plan.narrow && variants.narrow_resident_per_sm == 0) {
    throw InvalidArgument(where, "plan.narrow", "true",
                          "false for this cache and group (the narrow split kernels serve "
                          "3-bit keys and 4-bit keys with 4-bit values: GQA groups up to 4 at "
                          "D = 128, and for 4-bit keys at D = 64, 4-bit keys only with an even "
                          "number of KV heads; groups above 8 on the staged kernels, 3-bit keys' "
                          "at D = 64 in half precision only)");
  }
  if (plan.one_cta && (plan.narrow || !variants.one_cta_twin)) {
    throw InvalidArgument(where, "plan.one_cta", "true",
                          "false for this cache, group and variant (only 4-bit keys' 8-warp "
                          "staged kernel, D = 128 and GQA groups up to 4, has a one-CTA-per-SM "
                          "twin)");
  }
  if (plan.hi_only && (plan.narrow ? !variants.narrow_hi_only : !variants.hi_only)) {
    throw InvalidArgument(where, "plan.hi_only", "true",
                          "false for this cache, group, codebook and variant (only 3-bit keys' "
                          "8-warp staged kernel, GQA groups up to 4, has a hi-only twin, only "
                          "for a codebook within kMaxHiOnlyError of fp16, and its paired CTAs "
                          "for the narrow variant only at D = 128 with an even number of KV "
                          "heads)");
  }
  const decode_detail::MaybeSplitVariant variant = Variant(plan.num_q_heads / num_kv_heads(), plan);
  if (!variant.ok || !(variant.variant == plan.variant)) {
    throw Error(
        fmt::format("{}: the plan's variant does not match its choices (narrow {}, "
                    "hi_only {}, one_cta {}, staged {}, half {}); make plans with "
                    "CudaDecoder::Plan",
                    where, plan.narrow, plan.hi_only, plan.one_cta, plan.staged, plan.half));
  }
  return variants;
}

void CudaDecoder::RunColumns(const DecodePlan& plan, const CudaDecodeArgs& a,
                             const decode_detail::VerifyColumns* verify, StreamHandle stream,
                             [[maybe_unused]] Launch launch) const {
  constexpr const char* kWhere = "CudaDecoder::Run";
  const State& s = *state_;
  const SplitKernelOccupancy variants = CheckPlan(kWhere, plan);
  CheckCacheLayout(kWhere, s.layout, a.cache.layout);
  if (a.query_dtype != DType::kF32 && a.query_dtype != DType::kF16 &&
      a.query_dtype != DType::kBF16) {
    throw InvalidArgument(kWhere, "query_dtype", DTypeName(a.query_dtype), "F32, F16, BF16");
  }
  if (a.output_dtype != DType::kF32 && a.output_dtype != DType::kF16 &&
      a.output_dtype != DType::kBF16) {
    throw InvalidArgument(kWhere, "output_dtype", DTypeName(a.output_dtype), "F32, F16, BF16");
  }
  if (a.query == nullptr || a.cache.data == nullptr || a.block_tables == nullptr ||
      a.seq_lens == nullptr || a.output == nullptr || a.lse == nullptr || a.workspace == nullptr) {
    throw Error(
        fmt::format("{}: query, cache, block_tables, seq_lens, output, lse and workspace "
                    "must be device pointers, not null",
                    kWhere));
  }
  const int64_t workspace_bytes = std::max(plan.workspace_bytes, WorkspaceBytes(plan));
  if (a.workspace_bytes < workspace_bytes) {
    throw InvalidArgument(kWhere, "workspace_bytes", a.workspace_bytes,
                          fmt::format(">= {} (DecodePlan::workspace_bytes)", workspace_bytes));
  }
  if (reinterpret_cast<uintptr_t>(a.workspace) % 16 != 0) {  // float4 partial outputs
    throw InvalidArgument(kWhere, "workspace", fmt::format("{}", a.workspace),
                          "a 16-byte aligned device pointer");
  }
  if (a.cache.num_blocks < 1 || a.cache.num_blocks > kMaxCacheBlocks) {
    throw InvalidArgument(kWhere, "cache.num_blocks", a.cache.num_blocks,
                          fmt::format("1 to {} (32-bit block ids)", kMaxCacheBlocks));
  }
  if (reinterpret_cast<uintptr_t>(a.cache.data) % 16 != 0) {  // slots are read in 16-byte copies
    throw InvalidArgument(kWhere, "cache.data",
                          fmt::format("{}", static_cast<const void*>(a.cache.data)),
                          "a 16-byte aligned device pointer");
  }
  CheckRowAlignment(kWhere, a.query, a.query_dtype, a.output, a.output_dtype, a.lse);
  if (a.scale && !(std::isfinite(*a.scale) && *a.scale > 0.0f)) {
    throw InvalidArgument(kWhere, "scale", *a.scale, "finite and > 0");
  }
  CheckScale(kWhere, a.scale);
  if (a.sliding_window < 0) {
    throw InvalidArgument(kWhere, "sliding_window", a.sliding_window, ">= 0 (0: none)");
  }
  if (plan.sliding_window > 0 && (a.sliding_window < 1 || a.sliding_window > plan.sliding_window)) {
    throw InvalidArgument(kWhere, "sliding_window", a.sliding_window,
                          fmt::format("1 to {} (DecodePlan::sliding_window: the plan's splits "
                                      "hold that many tokens)",
                                      plan.sliding_window));
  }
#if TQKV_HAVE_CUDA
  using namespace decode_detail;
  const int d = head_dim();
  const int64_t rows = int64_t{plan.num_seqs} * plan.num_q_heads;
  uint8_t* ws = static_cast<uint8_t*>(a.workspace);
  const bool dense = s.rotate_query && !s.fwht;
  if (verify != nullptr && dense && a.query_dtype != DType::kF32) {
    throw InvalidArgument(kWhere, "query_dtype", DTypeName(a.query_dtype),
                          "F32 (a verify pass's q·Πᵀ) for a dense Πᵀ");
  }
  const int64_t q_bytes = QueryPrepBytes(dense, rows, d);
  auto* qbuf = reinterpret_cast<float*>(ws);
  auto* partial_out = reinterpret_cast<float*>(ws + q_bytes);
  auto* partial_lse =
      reinterpret_cast<float*>(ws + q_bytes + AlignUp(rows * plan.max_splits * d * 4));

  SplitParams sp;
  // A dense Πᵀ is applied by the query prep kernel (fp32 q·Πᵀ into the workspace); a Hadamard Πᵀ
  // (and no rotation) by each split CTA for its own heads, with no launch before it.
  const bool query_prep = q_bytes > 0 && verify == nullptr;
  if (verify != nullptr && dense) {  // q·Πᵀ already
    sp.query = a.query;
    sp.query_dtype = DType::kF32;
  } else if (query_prep) {
    QueryPrepParams qp;
    qp.query = a.query;
    qp.in_dtype = a.query_dtype;
    qp.rotation = s.rotation.data();
    qp.out = qbuf;
    qp.rows = static_cast<int>(rows);
    qp.head_dim = d;
    if (launch != Launch::kMerge) TQKV_CUDA_CHECK(LaunchQueryPrep(qp, stream));
    sp.query = qbuf;
    sp.query_dtype = DType::kF32;
  } else {
    sp.query = a.query;
    sp.query_dtype = a.query_dtype;
    sp.query_fwht = s.fwht ? 1 : 0;
    sp.query_signs = s.signs.data();
    sp.query_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  }
  sp.cache = a.cache.data;
  sp.block_tables = a.block_tables;
  sp.seq_lens = a.seq_lens;
  sp.partial_out = partial_out;
  sp.partial_lse = partial_lse;
  sp.codebook_table = reinterpret_cast<const uint2*>(s.codebook_table.data());
  sp.num_seqs = plan.num_seqs;
  sp.num_q_heads = plan.num_q_heads;
  sp.num_kv_heads = num_kv_heads();
  sp.block_size = block_size();
  sp.max_blocks_per_seq = plan.max_blocks_per_seq;
  if (s.bf16) {
    sp.block_bytes = s.bf16_format.block_bytes;
    sp.meta_offset = s.bf16_format.value_offset;
  } else {
    sp.block_bytes = s.format.block_bytes;
    sp.meta_offset = s.format.meta_offset;
    sp.data_per_slot = s.format.data_per_slot;
    sp.key_data_bytes = s.format.key_data_bytes;
    sp.num_meta = s.format.num_meta;
  }
  sp.tokens_per_split = plan.tokens_per_split;
  sp.max_splits = plan.max_splits;
  VerifyColumns columns;
  if (verify != nullptr) {
    columns = *verify;
    // (NewTokenOfColumn's range: a pass's columns, rows x group, are at most MaxGroup <= 32.)
    TQKV_CHECK(columns.group >= 1 && columns.group <= plan.num_q_heads / num_kv_heads());
    columns.group_reciprocal = decode_detail::GroupReciprocal(columns.group);
  }
  sp.verify = columns;
  sp.window = a.sliding_window;
  const float scale = a.scale ? *a.scale : 1.0f / std::sqrt(static_cast<float>(d));
  sp.score_scale = scale * static_cast<float>(std::numbers::log2e) / s.codebook_scale;
  const DType out_dtype = a.output_dtype;
  if (plan.max_splits == 1) {  // the split kernel writes the output; no merge launch
    sp.output = a.output;
    sp.lse = a.lse;
    sp.out_dtype = out_dtype;
  }
  // Without a query prep the split kernel is still a programmatic dependent of whatever kernel
  // precedes it (an engine's store, the previous step's merge), and waits for it at its start.
  const bool programmatic = query_prep || plan.dependent_launch;
  sp.wait_at_start = query_prep ? 0 : 1;
  // Without a merge the next kernel may be this decoder's next step: let it launch early only
  // when this grid fills every SM's room for split CTAs (then the next one's CTAs take the room
  // as it frees, evenly); a smaller grid's successor waits for all of its CTAs to exit.
  const int64_t ctas = int64_t{plan.max_splits} * num_kv_heads() * plan.num_seqs;
  sp.trigger_dependents =
      plan.max_splits > 1 ||
      ctas >= int64_t{s.sm_count} *
                  (plan.narrow ? variants.narrow_resident_per_sm : variants.resident_per_sm);
  const bool overlap_next = plan.overlap_next && plan.dependent_launch && !query_prep;
  // With the merge left for later, the kernel right after the split grid is the caller's.
  sp.trigger_at_start = overlap_next && (plan.max_splits == 1 || launch == Launch::kSplits) ? 1 : 0;
  if (launch != Launch::kMerge) {
    // Under a window the shared-output kernel's window twin (the same layout and occupancy).
    SplitVariant variant = plan.variant;
    variant.window = variant.shared_o && a.sliding_window > 0;
    TQKV_CUDA_CHECK(LaunchDecodeSplits(sp, variant, programmatic, stream));
  }
  if (plan.max_splits == 1 || launch == Launch::kSplits) return;

  MergeParams mp;
  mp.partial_out = partial_out;
  mp.partial_lse = partial_lse;
  mp.seq_lens = a.seq_lens;
  mp.output = a.output;
  mp.lse = a.lse;
  mp.out_dtype = out_dtype;
  mp.num_seqs = plan.num_seqs;
  mp.num_q_heads = plan.num_q_heads;
  mp.head_dim = d;
  mp.tokens_per_split = plan.tokens_per_split;
  mp.max_splits = plan.max_splits;
  mp.num_kv_heads = num_kv_heads();
  mp.verify = columns;
  mp.window = a.sliding_window;
  mp.block_size = block_size();
  mp.trigger_at_start = overlap_next && launch == Launch::kAll ? 1 : 0;
  TQKV_CUDA_CHECK(LaunchDecodeMerge(mp, stream));
#else
  (void)s;
  (void)verify;
  (void)stream;
  throw Error(fmt::format("{}: this build of tqkv has no CUDA support", kWhere));
#endif
}

}  // namespace tqkv
