// Which split kernel serves a decode: the cache's key kind, its shape and the plan's choices, as
// one value (SplitVariant). The plan builds it on the host (ChooseSplitVariant); the kernels are
// instantiated for exactly the values ChooseSplitVariant can return (SplitVariantsOf), so the
// two cannot drift apart. Plain C++ (no CUDA headers): the host planner and the kernel files
// both include it.
#pragma once

#include <array>
#include <cstdint>

#include "quant/key_kind.h"

namespace tqkv::decode_detail {

using ::tqkv::IsPlain;
using ::tqkv::KeyKind;
using ::tqkv::kKeyKinds;

// How a split CTA brings its chunks to the tensor cores.
enum class SplitPipeline : uint8_t {
  kRegisters,     // 4 warps, each loads its next chunk into registers while computing one
  kStaged,        // cp.async copies some chunks ahead into shared memory: 8 warps (compressed),
                  // 4 warps (bf16/fp16)
  kStagedNarrow,  // 3-bit keys: 4-warp staged CTAs, four per SM; the half-precision kernels of
                  // GQA groups 9-32 (verify passes of 16 or 32 columns): 4-warp CTAs, two per SM
                  // (4-bit keys at D = 64, groups 9-16, exact or half precision: three)
  kStagedPaired,  // 8-warp staged CTAs whose warps 0-3 and 4-7 serve two KV heads
};

// One split kernel. Every field is a compile-time choice of the kernel template.
struct SplitVariant {
  KeyKind kind = KeyKind::kMse4;
  int value_bits = 4;  // 16 for the uncompressed kinds
  int head_dim = 128;
  // 8-head N tiles of the score MMA: 2 for GQA groups 9-16 of the unpacked kernels, 4 for the
  // half-precision kernels' groups 17-32 (verify passes of up to 32 columns), whose query
  // fragments come from shared memory (their output accumulators take 128 registers).
  int n_tiles = 1;
  // Compressed kinds, GQA group <= 4: a head's q_hi and q_lo in adjacent MMA columns (one score MMA
  // per k-step computes both; DecodeSplitKernel).
  bool packed = false;
  SplitPipeline pipeline = SplitPipeline::kRegisters;
  // 3-bit keys' 8-warp staged kernels: scores from the scaled codebook's fp16 hi parts alone
  // (attention/codebook_fp16.h); 16 MMAs per chunk instead of 24 (D = 64: 8 instead of 12).
  bool hi_only = false;
  // 4-bit keys' 8-warp staged kernel compiled for one CTA per SM (more registers).
  bool one_cta = false;
  // Unpacked staged kernels of 4-bit and 3-bit keys with 4-bit values, and of 3-bit keys with
  // 3-bit values, at D = 128 and 64 (GQA group > 4: speculative verify's passes, new tokens
  // beside the GQA heads):
  // the query, the centroids (their fp16 hi parts) and P' rounded once to fp16, one score MMA per
  // k-step and N tile over 16 tokens and one P·V MMA per m-tile, as FlashAttention rounds (a
  // third of the MMAs of the hi + lo products; ~2^-11 relative per operand).
  bool half = false;
  // The half-precision staged kernels of GQA groups 9-32 (verify passes of 9-32 columns) with
  // 8-warp CTAs of two groups of 4 warps, each group sharing one output: each warp scores its own
  // chunk and writes P' to shared memory, then computes O for a quarter of head_dim over its
  // group's 4 chunks (attention/decode_split_shared.cuh). 32 accumulator registers instead of 128,
  // so two 8-warp CTAs fit an SM where the other kernel of 17-32 columns runs two of 4 warps.
  bool shared_o = false;
  // The shared-output kernel's twin for calls under a sliding window, which CudaDecoder::Run
  // takes for them (its plan names the kernel without): each column's first position masked, and
  // split 0's chunks before the window's origin run first. A twin, so that the kernel without
  // windows keeps its code.
  bool window = false;

  constexpr bool staged() const { return pipeline != SplitPipeline::kRegisters; }
  // Warps per CTA, and KV heads per CTA.
  constexpr int cta_warps() const {
    if (pipeline == SplitPipeline::kRegisters || pipeline == SplitPipeline::kStagedNarrow) return 4;
    return pipeline == SplitPipeline::kStaged && IsPlain(kind) ? 4 : 8;
  }
  constexpr int units() const { return pipeline == SplitPipeline::kStagedPaired ? 2 : 1; }
  constexpr bool operator==(const SplitVariant&) const = default;

  // The variant as one integer, for the kernel template's parameter (nvcc's host stubs do not
  // take class-type template arguments of a namespaced type).
  constexpr uint32_t Code() const {
    return static_cast<uint32_t>(kind) | static_cast<uint32_t>(value_bits) << 3 |
           static_cast<uint32_t>(head_dim) << 8 | static_cast<uint32_t>(n_tiles) << 17 |
           uint32_t{packed} << 20 | static_cast<uint32_t>(pipeline) << 21 |
           uint32_t{hi_only} << 23 | uint32_t{one_cta} << 24 | uint32_t{half} << 25 |
           uint32_t{shared_o} << 26 | uint32_t{window} << 27;
  }
  static constexpr SplitVariant FromCode(uint32_t c) {
    return {static_cast<KeyKind>(c & 7u),
            static_cast<int>((c >> 3) & 31u),
            static_cast<int>((c >> 8) & 511u),
            static_cast<int>((c >> 17) & 7u),
            ((c >> 20) & 1u) != 0,
            static_cast<SplitPipeline>((c >> 21) & 3u),
            ((c >> 23) & 1u) != 0,
            ((c >> 24) & 1u) != 0,
            ((c >> 25) & 1u) != 0,
            ((c >> 26) & 1u) != 0,
            ((c >> 27) & 1u) != 0};
  }
};

// The plan's choices, which ChooseSplitVariant maps to a kernel.
struct SplitChoice {
  bool staged = true;    // the staged kernels where they exist (false: the register ones)
  bool narrow = false;   // the narrow layout: 4-warp units, four per SM (3-bit and 4-bit keys;
                         // two per SM for the half-precision kernels of groups 9-16, three for
                         // 4-bit keys' kernels of groups 9-16 at D = 64)
  bool hi_only = true;   // 3-bit keys: the hi-only twin (8-warp; with narrow: its paired CTAs)
  bool one_cta = false;  // 4-bit keys: the 8-warp kernel's one-CTA-per-SM twin
  bool half = false;     // the half-precision staged kernels where they exist (GQA group > 4)
  bool shared_o = false;  // with half, groups 9-32: the kernel whose warps share the output
  bool window = false;    // with shared_o: that kernel's window twin (SplitVariant::window)
};

// A variant, or none (ok = false) where no kernel serves that combination.
struct MaybeSplitVariant {
  bool ok = false;
  SplitVariant variant;
};

// Whether a kind has staged kernels at this head_dim and value width (packed: the compressed
// kinds' packed layout, GQA group <= 4; half: their half-precision kernels, groups above 4). At
// D = 64 4-bit keys' exact unpacked kernels are staged too, 3-bit keys' are not; 3-bit keys with
// 3-bit values (3bit_nc) have the packed and half-precision kernels at D = 128 and 64 (no kernel
// of four N tiles with its own output per warp: 17-32 columns only on the shared-output kernel at
// D = 128, MaxSplitGroup and ChooseSplitVariant); FP8 keys with 4-bit values (k8v4) the packed
// kernel alone, at D = 128 (no narrow, paired or one-CTA twins).
constexpr bool HasStagedKernel(KeyKind kind, int value_bits, int head_dim, bool packed,
                               bool half = false) {
  return ((packed || half) && (head_dim == 128 || head_dim == 64) && value_bits == 4 &&
          (kind == KeyKind::kMse4 || kind == KeyKind::kMse3)) ||
         ((packed || half) && (head_dim == 128 || head_dim == 64) && value_bits == 3 &&
          kind == KeyKind::kMse3) ||
         (head_dim == 64 && value_bits == 4 && kind == KeyKind::kMse4) ||
         (packed && !half && head_dim == 128 && value_bits == 4 && kind == KeyKind::kFp8) ||
         (!packed && head_dim <= 128 && IsPlain(kind));
}

// Whether the shared-output kernel (SplitVariant::shared_o, groups 9-32) reads this cache: D =
// 128, 4-bit values, or 3-bit keys with 3-bit values (3bit_nc); FP8 keys (k8v4) too, though they
// have no other half-precision kernel (their groups 5-16 without shared_o run the exact ones).
constexpr bool HasSharedOKernel(KeyKind kind, int value_bits, int head_dim) {
  return !IsPlain(kind) && head_dim == 128 &&
         (value_bits == 4 || (value_bits == 3 && kind == KeyKind::kMse3)) &&
         (HasStagedKernel(kind, value_bits, head_dim, false, true) || kind == KeyKind::kFp8);
}

// A verify pass's column c belongs to new token c / group (decode_launch.h, VerifyColumns). The
// split kernels take that per score of their masked last chunk and per output, so they multiply by
// GroupReciprocal(group) and shift instead of dividing: exact for every c < 64 and group <= 32 (a
// pass holds at most MaxSplitGroup <= 32 columns), which the static_assert below checks.
constexpr int GroupReciprocal(int group) { return (65535 + group) / group; }
constexpr int NewTokenOfColumn(int c, int group_reciprocal) {
  return static_cast<int>((static_cast<uint32_t>(c) * static_cast<uint32_t>(group_reciprocal)) >>
                          16);
}
constexpr bool NewTokenOfColumnIsExact() {
  for (int group = 1; group <= 32; ++group) {
    for (int c = 0; c < 64; ++c) {
      if (NewTokenOfColumn(c, GroupReciprocal(group)) != c / group) return false;
    }
  }
  return true;
}
static_assert(NewTokenOfColumnIsExact());

// The largest GQA group (columns of one split grid) a split kernel serves for these choices: 32
// where the half-precision staged kernels of four N tiles exist (4-bit values at D = 128) and are
// asked for, or the shared-output one (3bit_nc at D = 128: its accumulators and 3-bit decode do
// not fit the kernel of four N tiles that keeps one output per warp), or the bf16 / fp16 caches'
// staged kernel of four N tiles at D = 64 and 128 (so that a verify pass of 8 new tokens at GQA 4
// reads the cache once), else 16.
constexpr int MaxSplitGroup(KeyKind kind, int value_bits, int head_dim, bool staged, bool half,
                            bool shared_o = false) {
  return (staged && half && !IsPlain(kind) && head_dim == 128 &&
          ((value_bits == 4 && HasStagedKernel(kind, value_bits, head_dim, false, true)) ||
           (shared_o && HasSharedOKernel(kind, value_bits, head_dim)))) ||
                 (staged && IsPlain(kind) && value_bits == 16 && head_dim <= 128)
             ? 32
             : 16;
}

// The split kernel for (kind, value_bits, head_dim, GQA group) and the plan's choices. Choices a
// variant does not have are ignored (one_cta for 3-bit keys, hi_only for 4-bit keys, ...), except
// narrow, which only 3-bit keys and 4-bit keys with 4-bit values have: groups <= 4 at D = 128 (and
// 4-bit keys' at D = 64), groups above 8 on the staged kernels at D = 128 and 64.
// Groups 17-32 have one kernel (the half-precision one of four N tiles, or with shared_o the
// shared-output one; the bf16 / fp16 caches' staged one), narrow or not.
constexpr MaybeSplitVariant ChooseSplitVariant(KeyKind kind, int value_bits, int head_dim,
                                               int group, SplitChoice c) {
  const bool valid_bits = IsPlain(kind)            ? value_bits == 16
                          : kind == KeyKind::kMse3 ? (value_bits == 3 || value_bits == 4)
                                                   : value_bits == 4;
  if (!valid_bits || group < 1 ||
      group > MaxSplitGroup(kind, value_bits, head_dim, c.staged, c.half, c.shared_o) ||
      (head_dim != 64 && head_dim != 128 && head_dim != 256)) {
    return {};
  }
  SplitVariant v{kind, value_bits, head_dim};
  // FP8 keys' groups 5-8 too: they have no other half-precision kernel, and their exact kernels
  // of one N tile run on registers.
  if (c.shared_o && c.half && c.staged && (group > 8 || (kind == KeyKind::kFp8 && group > 4)) &&
      HasSharedOKernel(kind, value_bits, head_dim)) {
    v.n_tiles = group > 16 ? 4 : 2;
    v.half = true;
    v.shared_o = true;
    v.window = c.window;
    v.pipeline = SplitPipeline::kStaged;
    return {true, v};
  }
  if (group > 16 && IsPlain(kind)) {  // 4-warp CTAs, their own outputs (128 accumulators)
    v.n_tiles = 4;
    v.pipeline = SplitPipeline::kStaged;
    return {true, v};
  }
  if (group > 16) {  // 4-warp CTAs, two per SM, like the narrow kernel of groups 9-16
    v.n_tiles = 4;
    v.half = true;
    v.pipeline = SplitPipeline::kStagedNarrow;
    return {true, v};
  }
  const bool packed_staged = HasStagedKernel(kind, value_bits, head_dim, true) && group <= 4;
  if (c.narrow && c.half && c.staged && group > 8 && !IsPlain(kind) &&
      HasStagedKernel(kind, value_bits, head_dim, false, true)) {
    // The half-precision kernel of 9-16 columns as 4-warp CTAs, two per SM, so that one CTA's
    // prologue and merge run while the other streams.
    v.n_tiles = 2;
    v.half = true;
    v.pipeline = SplitPipeline::kStagedNarrow;
    return {true, v};
  }
  if (c.narrow && !c.half && c.staged && group > 8 && head_dim == 64 && kind == KeyKind::kMse4 &&
      value_bits == 4) {
    // 4-bit keys' exact kernel of two N tiles at D = 64 as 4-warp CTAs, three per SM (168
    // registers; the 8-warp one holds one per SM).
    v.n_tiles = 2;
    v.pipeline = SplitPipeline::kStagedNarrow;
    return {true, v};
  }
  if (c.narrow) {
    // (3-bit keys at D = 64: only the 8-warp kernels of groups up to 4 are built, no narrow or
    // paired twins.)
    if (IsPlain(kind) || kind == KeyKind::kFp8 || !packed_staged || !c.staged ||
        (kind == KeyKind::kMse3 && head_dim == 64)) {
      return {};
    }
    v.packed = true;
    if (kind == KeyKind::kMse4 || c.hi_only) {
      // Paired CTAs: 3-bit keys' on the hi-only twin, 4-bit keys' (the only narrow layout they
      // have) with exact scores.
      v.pipeline = SplitPipeline::kStagedPaired;
      v.hi_only = kind == KeyKind::kMse3;
    } else {
      v.pipeline = SplitPipeline::kStagedNarrow;
    }
    return {true, v};
  }
  if (!IsPlain(kind) && group <= 4) {
    v.packed = true;
    if (packed_staged && c.staged) {
      v.pipeline = SplitPipeline::kStaged;
      v.hi_only = kind == KeyKind::kMse3 && c.hi_only;
      // (At D = 64 the twin would be the same kernel: 102 registers either way.)
      v.one_cta = kind == KeyKind::kMse4 && c.one_cta && head_dim == 128;
    }
    return {true, v};
  }
  v.n_tiles = group <= 8 ? 1 : 2;
  // The half-precision kernels exist on the staged pipeline alone: on registers (3 CTAs per SM)
  // they measured slower than the exact ones (H200, 64 × 4k, 16 columns: 4bit_nc 273.6 vs 242.0
  // µs, k8v4 296.4 vs 206.5).
  v.half = c.half && c.staged && !IsPlain(kind) &&
           HasStagedKernel(kind, value_bits, head_dim, false, true);
  if (HasStagedKernel(kind, value_bits, head_dim, false, v.half) && c.staged) {
    v.pipeline = SplitPipeline::kStaged;
  }
  return {true, v};
}

// Every variant ChooseSplitVariant returns for a kind (no duplicates): the kernels to instantiate.
inline constexpr int kMaxVariantsPerKind = 56;
struct SplitVariantList {
  std::array<SplitVariant, kMaxVariantsPerKind> items{};
  int size = 0;
};
constexpr SplitVariantList SplitVariantsOf(KeyKind kind) {
  SplitVariantList list;
  for (int bits : {3, 4, 16}) {
    for (int d : {64, 128, 256}) {
      for (int group = 1; group <= 32; ++group) {
        for (int choice = 0; choice < 64; ++choice) {
          const SplitChoice c{(choice & 1) != 0, (choice & 2) != 0,  (choice & 4) != 0,
                              (choice & 8) != 0, (choice & 16) != 0, (choice & 32) != 0};
          const MaybeSplitVariant m = ChooseSplitVariant(kind, bits, d, group, c);
          if (!m.ok) continue;
          bool seen = false;
          for (int i = 0; i < list.size; ++i) seen = seen || list.items[i] == m.variant;
          if (seen) continue;
          list.items[list.size++] = m.variant;  // overflow fails constant evaluation
          // (SplitChoice::window changes the shared-output variants alone: their twins.)
          if (m.variant.shared_o) {
            list.items[list.size] = m.variant;
            list.items[list.size++].window = true;
          }
        }
      }
    }
  }
  return list;
}

}  // namespace tqkv::decode_detail
