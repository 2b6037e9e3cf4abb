// GPU tests of the CUDA store: byte equality with Quantizer::StoreCpu on fresh random inputs
// (every preset × head_dim × block size × dtype, both slot types, both rotation paths, N from 1 to
// 65,536), padding and shuffled slots, a poisoned cache whose untouched bytes must stay poison,
// CUDA-graph capture and replay, slot validation, non-finite inputs. Skipped without a device.
//
// Allowed difference (quant/README.md): an MSE index one off from the reference where y lies
// within the fp32 rounding bound of a midpoint; such rows' k_norm must then equal the reference
// formula applied to the GPU's indices. Flips are counted and bounded (<= 1e-4 of indices).
#include "quant/store_cuda.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "quant/numerics.h"
#include "quant/packing.h"
#include "quant/quantizer.h"
#include "runtime/device.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "runtime/stream.h"
#include "tests/gpu_test_util.h"

#if TQKV_HAVE_CUDA
#include <cuda_runtime.h>

#include "quant/store_test_kernels.h"
#include "runtime/cuda_check.h"
#endif

namespace tqkv {
namespace {

#if !TQKV_HAVE_CUDA

TEST(StoreCudaTest, NeedsCuda) { GTEST_SKIP() << "this build has no CUDA support"; }

#else

using ::testing::HasSubstr;

const char* const kPresets[] = {"turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                                "turboquant_3bit_nc"};

uint8_t Poison(int64_t i) { return static_cast<uint8_t>((i * 131 + 7) ^ (i >> 11)); }

// ---------------------------------------------------------------------------------------------
// Inputs

struct Case {
  std::string preset = "turboquant_4bit_nc";
  int head_dim = 128, heads = 8, block_size = 16;
  DType dtype = DType::kBF16, slot_dtype = DType::kI64;
  int64_t num_tokens = 100;
  RotationKind rotation = RotationKind::kHadamard;
  StoreOptions options;
  double padding = 0.05;  // fraction of tokens with slot -1
  int extra_blocks = 3;   // blocks nobody writes (stay poison)
  std::optional<Codebook> codebook;

  std::string Name() const {
    return fmt::format("{} D={} H={} block={} {} slots {} N={} rotation {} path {}{}{}", preset,
                       head_dim, heads, block_size, DTypeName(dtype), DTypeName(slot_dtype),
                       num_tokens, RotationKindName(rotation),
                       static_cast<int>(options.rotation_path),
                       options.gemm_precision == GemmPrecision::kFp32    ? ""
                       : options.gemm_precision == GemmPrecision::kSgemm ? " SGEMM"
                                                                         : " low-precision GEMM",
                       options.fwht_kernel == StoreFwhtKernel::kAuto
                           ? ""
                           : fmt::format(" FWHT kernel {}", static_cast<int>(options.fwht_kernel)));
  }
  Quantizer MakeQuantizer() const {
    const Preset& p = PresetByName(preset);
    if (p.key_coding == KeyCoding::kFp8) {
      return Quantizer(p, head_dim, heads, block_size, Rotation{});
    }
    return Quantizer(p, head_dim, heads, block_size, MakeRotation(rotation, head_dim, 7), codebook);
  }
};

std::vector<uint8_t> Encode(const std::vector<float>& x, DType dtype) {
  std::vector<uint8_t> out(x.size() * DTypeSize(dtype));
  for (size_t i = 0; i < x.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &x[i], 4);
    } else {
      const uint16_t b = dtype == DType::kF16 ? FloatToHalfBits(x[i]) : FloatToBFloat16Bits(x[i]);
      std::memcpy(out.data() + 2 * i, &b, 2);
    }
  }
  return out;
}

struct HostInputs {
  std::vector<uint8_t> key, value;  // [N, H, D] of the case's dtype
  std::vector<int64_t> slots;       // [N]
  std::vector<uint8_t> slot_bytes;  // [N] of the slot dtype
  int64_t num_blocks = 0;
};

void SetSlots(HostInputs& in, const std::vector<int64_t>& slots, DType slot_dtype) {
  in.slots = slots;
  in.slot_bytes.resize(slots.size() * DTypeSize(slot_dtype));
  for (size_t t = 0; t < slots.size(); ++t) {
    if (slot_dtype == DType::kI64) {
      std::memcpy(in.slot_bytes.data() + 8 * t, &slots[t], 8);
    } else {
      const auto s = static_cast<int32_t>(slots[t]);
      std::memcpy(in.slot_bytes.data() + 4 * t, &s, 4);
    }
  }
}

// Keys: Gaussian rows whose scale spans e^-4 .. e^4, two large channels per head; values:
// Gaussian with a per-row offset and scale. Slots: a shuffled subset of the cache, some padding.
HostInputs MakeInputs(const Case& c, std::mt19937_64& rng) {
  const int64_t n = c.num_tokens, h = c.heads, d = c.head_dim;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(-4.0f, 4.0f);
  std::vector<float> k(n * h * d), v(n * h * d);
  for (int64_t r = 0; r < n * h; ++r) {
    const float ks = std::exp(uniform(rng)), vs = std::exp(uniform(rng)), vo = uniform(rng);
    const int outlier = static_cast<int>(rng() % d);
    for (int64_t i = 0; i < d; ++i) {
      k[r * d + i] = normal(rng) * ks * ((i == outlier || i == (outlier + 3) % d) ? 8.0f : 1.0f);
      v[r * d + i] = normal(rng) * vs + vo;
    }
  }
  HostInputs in;
  in.key = Encode(k, c.dtype);
  in.value = Encode(v, c.dtype);
  std::bernoulli_distribution pad(c.padding);
  int64_t written = 0;
  std::vector<bool> skip(n);
  for (int64_t t = 0; t < n; ++t) {
    skip[t] = n > 1 && pad(rng);
    written += !skip[t];
  }
  in.num_blocks = (written + c.block_size - 1) / c.block_size + c.extra_blocks;
  std::vector<int64_t> all(in.num_blocks * c.block_size);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<int64_t> slots(n);
  int64_t next = 0;
  for (int64_t t = 0; t < n; ++t) slots[t] = skip[t] ? -1 : all[next++];
  SetSlots(in, slots, c.slot_dtype);
  return in;
}

StoreInputs HostView(const HostInputs& in, const Case& c) {
  StoreInputs s;
  s.key = in.key.data();
  s.value = in.value.data();
  s.dtype = c.dtype;
  s.slot_mapping = in.slot_bytes.data();
  s.slot_dtype = c.slot_dtype;
  s.num_tokens = static_cast<int64_t>(in.slots.size());
  return s;
}

std::vector<uint8_t> PoisonedCache(int64_t bytes) {
  std::vector<uint8_t> cache(bytes);
  for (int64_t i = 0; i < bytes; ++i) cache[i] = Poison(i);
  return cache;
}

// StoreCpu over token ranges in parallel (distinct slots: disjoint bytes).
void ReferenceStore(const Quantizer& q, const StoreInputs& in, std::vector<uint8_t>& cache,
                    int64_t num_blocks) {
  const int threads = static_cast<int>(std::clamp<int64_t>(
      in.num_tokens / 256, 1, std::max(1u, std::thread::hardware_concurrency())));
  const int64_t row = q.format().num_kv_heads * q.format().head_dim * DTypeSize(in.dtype);
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w) {
    const int64_t t0 = in.num_tokens * w / threads, t1 = in.num_tokens * (w + 1) / threads;
    pool.emplace_back([&, t0, t1] {
      StoreInputs part = in;
      part.key = static_cast<const uint8_t*>(in.key) + t0 * row;
      part.value = static_cast<const uint8_t*>(in.value) + t0 * row;
      part.slot_mapping =
          static_cast<const uint8_t*>(in.slot_mapping) + t0 * DTypeSize(in.slot_dtype);
      part.num_tokens = t1 - t0;
      q.StoreCpu(part, {cache.data(), num_blocks, q.layout()});
    });
  }
  for (auto& t : pool) t.join();
}

// ---------------------------------------------------------------------------------------------
// The GPU side

struct DeviceCall {
  DeviceAllocation key, value, slots, cache, workspace;
  StoreInputs inputs;
  CacheRef cache_ref;
  DeviceWorkspace ws;
  int64_t cache_bytes = 0;
  static constexpr int64_t kGuardBytes = 4096;  // poisoned tail after the cache

  DeviceCall(const StoreDeviceState& state, const HostInputs& in, const Case& c,
             int64_t workspace_tokens = -1)
      : key(static_cast<int64_t>(in.key.size())),
        value(static_cast<int64_t>(in.value.size())),
        slots(static_cast<int64_t>(in.slot_bytes.size())) {
    const BlockFormat& f = state.quantizer().format();
    cache_bytes = in.num_blocks * f.block_bytes;
    cache = DeviceAllocation(cache_bytes + kGuardBytes);
    const int64_t n = static_cast<int64_t>(in.slots.size());
    workspace = DeviceAllocation(state.WorkspaceBytes(workspace_tokens < 0 ? n : workspace_tokens));
    Upload(in);
    const std::vector<uint8_t> poison = PoisonedCache(cache_bytes + kGuardBytes);
    cache.CopyFromHost(poison.data(), cache.size_bytes(), 0, nullptr);
    TQKV_CUDA_CHECK(cudaDeviceSynchronize());
    inputs.key = key.data();
    inputs.value = value.data();
    inputs.dtype = c.dtype;
    inputs.slot_mapping = slots.data();
    inputs.slot_dtype = c.slot_dtype;
    inputs.num_tokens = n;
    cache_ref = {static_cast<uint8_t*>(cache.data()), in.num_blocks, state.quantizer().layout()};
    ws = {workspace.data(), workspace.size_bytes()};
  }
  // Synchronous copies from pageable memory may return before the data lands, and the stores
  // run on non-blocking streams (not ordered after the legacy stream): wait for the device.
  void Upload(const HostInputs& in) {
    key.CopyFromHost(in.key.data(), key.size_bytes(), 0, nullptr);
    value.CopyFromHost(in.value.data(), value.size_bytes(), 0, nullptr);
    slots.CopyFromHost(in.slot_bytes.data(), slots.size_bytes(), 0, nullptr);
    TQKV_CUDA_CHECK(cudaDeviceSynchronize());
  }
  // The stores run on non-blocking streams, which the legacy stream's copy does not wait for.
  std::vector<uint8_t> Download() const {
    TQKV_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint8_t> out(cache.size_bytes());
    cache.CopyToHost(out.data(), cache.size_bytes(), 0, nullptr);
    return out;
  }
};

// ---------------------------------------------------------------------------------------------
// Comparison

struct Diff {
  int64_t indices = 0;       // MSE indices compared
  int64_t flips = 0;         // indices one off at a midpoint
  double max_flip_ulps = 0;  // largest |y − m| of a flip, in ulps of m
  int64_t bad_bytes = 0;     // bytes that differ beyond the allowance
  Diff& operator+=(const Diff& o) {
    indices += o.indices;
    flips += o.flips;
    max_flip_ulps = std::max(max_flip_ulps, o.max_flip_ulps);
    bad_bytes += o.bad_bytes;
    return *this;
  }
};

Diff g_total;  // over every fp32-rotation comparison of this test binary

// y = x̂ · Πᵀ of one row in fp64 as the reference forms x̂, and the fp32 rounding bound of each
// coordinate for any summation order: (D + 2) · 2^-24 · Σ|x̂_i Πᵀ_ij| (+ the final rounding).
void ReferenceY(const Quantizer& q, const float* k, std::vector<double>& y,
                std::vector<double>& bound) {
  const int d = q.format().head_dim;
  double ss = 0;
  for (int i = 0; i < d; ++i) ss += double(k[i]) * k[i];
  const float denom = static_cast<float>(std::sqrt(ss)) + 1e-8f;
  std::vector<float> x(d);
  for (int i = 0; i < d; ++i) x[i] = k[i] / denom;
  const std::vector<float>& m = q.rotation().matrix;
  y.assign(d, 0.0);
  bound.assign(d, 0.0);
  for (int j = 0; j < d; ++j) {
    double acc = 0, mag = 0;
    for (int i = 0; i < d; ++i) {
      acc += double(x[i]) * m[size_t(i) * d + j];
      mag += std::abs(double(x[i]) * m[size_t(i) * d + j]);
    }
    y[j] = acc;
    bound[j] = (d + 2) * std::ldexp(mag, -24) + std::ldexp(std::abs(acc), -22);
  }
}

// Compares the GPU cache with the reference cache. `max_flip_bound_scale` widens the midpoint
// allowance for the low-precision GEMM options (their products are not fp32).
Diff Compare(const Quantizer& q, const HostInputs& in, const Case& c,
             const std::vector<uint8_t>& ref, const std::vector<uint8_t>& gpu,
             double flip_bound_scale = 1.0) {
  const BlockFormat& f = q.format();
  Diff diff;
  int reported = 0;
  auto fail = [&](const std::string& what) {
    ++diff.bad_bytes;
    if (reported++ < 8) ADD_FAILURE() << c.Name() << ": " << what;
  };
  std::vector<uint8_t> owned(ref.size(), 0);
  std::vector<float> k(f.head_dim);
  std::vector<double> y, bound;
  for (size_t t = 0; t < in.slots.size(); ++t) {
    const int64_t slot = in.slots[t];
    if (slot < 0 || slot >= in.num_blocks * f.block_size) continue;
    const int64_t block = (slot / f.block_size) * f.block_bytes;
    const int pos = static_cast<int>(slot % f.block_size);
    for (int h = 0; h < f.num_kv_heads; ++h) {
      const int64_t key_at = block + f.KeyCodesOffset(pos, h);
      const int64_t val_at = block + f.ValueCodesOffset(pos, h);
      for (int b = 0; b < f.data_per_slot; ++b) owned[key_at + b] = 1;
      for (MetaField m : {MetaField::kKeyNorm, MetaField::kValueScale, MetaField::kValueZero}) {
        if (f.fp8_keys && m == MetaField::kKeyNorm) continue;
        owned[block + f.MetaOffset(m, pos, h)] = owned[block + f.MetaOffset(m, pos, h) + 1] = 1;
      }
      const std::string where = fmt::format("token {} slot {} head {}", t, slot, h);
      // Values and their metadata: exact.
      for (int b = 0; b < f.val_data_bytes; ++b) {
        if (ref[val_at + b] != gpu[val_at + b]) {
          fail(fmt::format("{}: value byte {}: {:#04x} vs reference {:#04x}", where, b,
                           gpu[val_at + b], ref[val_at + b]));
        }
      }
      for (MetaField m : {MetaField::kValueScale, MetaField::kValueZero}) {
        const int64_t at = block + f.MetaOffset(m, pos, h);
        if (LoadHalfBits(&ref[at]) != LoadHalfBits(&gpu[at])) {
          fail(fmt::format("{}: value meta {}: {:#06x} vs reference {:#06x}", where,
                           static_cast<int>(m), LoadHalfBits(&gpu[at]), LoadHalfBits(&ref[at])));
        }
      }
      if (f.fp8_keys) {
        for (int b = 0; b < f.key_data_bytes; ++b) {
          if (ref[key_at + b] != gpu[key_at + b]) {
            fail(fmt::format("{}: fp8 key byte {}: {:#04x} vs reference {:#04x}", where, b,
                             gpu[key_at + b], ref[key_at + b]));
          }
        }
        continue;
      }
      // MSE indices: equal, or one off at a midpoint.
      int row_flips = 0;
      double csum = 0;
      for (int j = 0; j < f.head_dim; ++j) {
        const int a = UnpackCode(&ref[key_at], j, f.key_bits);
        const int g = UnpackCode(&gpu[key_at], j, f.key_bits);
        ++diff.indices;
        csum += double(q.codebook().centroids[g]) * q.codebook().centroids[g];
        if (a == g) continue;
        if (row_flips++ == 0) {
          const int64_t base = (static_cast<int64_t>(t) * f.num_kv_heads + h) * f.head_dim;
          for (int i = 0; i < f.head_dim; ++i) k[i] = LoadAsFloat(in.key.data(), c.dtype, base + i);
          ReferenceY(q, k.data(), y, bound);
        }
        const double m = q.codebook().midpoints[std::min(a, g)];
        const double ulp = std::ldexp(1.0, std::ilogb(static_cast<float>(m)) - 23);
        const double dist = std::abs(y[j] - m);
        if (std::abs(a - g) != 1 || !(dist <= bound[j] * flip_bound_scale)) {
          fail(
              fmt::format("{}: index {} is {}, reference {} (y {:.9g}, midpoint {:.9g}, "
                          "{:.1f} ulp away, bound {:.1f} ulp)",
                          where, j, g, a, y[j], m, dist / ulp, bound[j] / ulp));
          continue;
        }
        ++diff.flips;
        diff.max_flip_ulps = std::max(diff.max_flip_ulps, dist / ulp);
      }
      const int64_t norm_at = block + f.MetaOffset(MetaField::kKeyNorm, pos, h);
      uint16_t want = LoadHalfBits(&ref[norm_at]);
      if (row_flips > 0) {  // the reference's formula on the GPU's indices
        double ss = 0;
        for (int i = 0; i < f.head_dim; ++i) ss += double(k[i]) * k[i];
        const float norm = static_cast<float>(std::sqrt(ss));
        float stored = q.preset().norm_correction
                           ? static_cast<float>(double(norm) / std::sqrt(csum + 1e-16))
                           : norm;
        if (std::isnan(stored)) stored = 0.0f;
        want = FloatToHalfBitsClamped(stored);
      }
      if (LoadHalfBits(&gpu[norm_at]) != want) {
        fail(fmt::format("{}: k_norm {:#06x} vs expected {:#06x} ({} flips in the row)", where,
                         LoadHalfBits(&gpu[norm_at]), want, row_flips));
      }
    }
  }
  if (diff.bad_bytes > 0) {  // say whether the GPU left the row unwritten or wrote other bytes
    int64_t owned_bytes = 0, still_poison = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      if (!owned[i]) continue;
      ++owned_bytes;
      still_poison += gpu[i] == Poison(static_cast<int64_t>(i)) && ref[i] != gpu[i];
    }
    ADD_FAILURE() << c.Name() << ": " << diff.bad_bytes << " bad fields/bytes; " << still_poison
                  << " of " << owned_bytes << " written bytes are still poison on the GPU";
  }
  for (size_t i = 0; i < ref.size(); ++i) {
    if (owned[i]) continue;
    if (gpu[i] != Poison(static_cast<int64_t>(i)) || ref[i] != Poison(static_cast<int64_t>(i))) {
      fail(
          fmt::format("byte {} of the cache belongs to no written slot but is {:#04x} "
                      "(poison {:#04x})",
                      i, gpu[i], Poison(static_cast<int64_t>(i))));
    }
  }
  return diff;
}

// Runs one case end to end: fresh inputs, GPU store, reference store, comparison.
Diff RunCase(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Quantizer q = c.MakeQuantizer();
  const StoreDeviceState state(q, c.options);
  const HostInputs in = MakeInputs(c, rng);
  DeviceCall call(state, in, c);
  Stream stream;
  state.Store(call.inputs, call.cache_ref, call.ws, stream.get());
  // Synchronizes the stream (the download below runs on the legacy stream, which a
  // non-blocking stream does not wait for), then checks the slots when validation is on.
  state.CheckStatus(call.ws, call.inputs, call.cache_ref, stream.get());
  const std::vector<uint8_t> gpu = call.Download();
  std::vector<uint8_t> ref = PoisonedCache(call.cache_bytes + DeviceCall::kGuardBytes);
  ReferenceStore(q, HostView(in, c), ref, in.num_blocks);
  const bool low_precision = (c.options.gemm_precision == GemmPrecision::kTf32 ||
                              c.options.gemm_precision == GemmPrecision::kBf16) &&
                             state.path() == StorePath::kGemm;
  Diff d = Compare(q, in, c, ref, gpu, low_precision ? 1e9 : 1.0);
  if (!low_precision) {
    g_total += d;
    // Each flip was checked to lie at a midpoint; their number must stay rare.
    EXPECT_LE(d.flips, std::max<double>(1.0, 1e-4 * d.indices)) << c.Name();
  }
  return d;
}

uint64_t Seed() { return std::random_device{}(); }

// ---------------------------------------------------------------------------------------------
// Tests

// Every preset × head_dim × block size × dtype, cycling heads, token counts, slot types and the
// rotation path: hadamard and hadamard_signs (FWHT), haar (tensor cores; cuBLAS at D = 256),
// hadamard on tensor cores (D <= 128) and on cuBLAS.
TEST(StoreCudaTest, EveryPresetShapeAndDtypeMatchesTheReference) {
  TQKV_SKIP_WITHOUT_GPU();
  const int64_t token_counts[] = {1, 2, 17, 64, 255, 300, 1000};
  const int head_counts[] = {1, 8, 3, 5, 2};
  int i = 0;
  Diff all;
  for (const char* preset : kPresets) {
    for (int d : {64, 128, 256}) {
      for (int block : {16, 32, 64, 128}) {
        for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
          Case c;
          c.preset = preset;
          c.head_dim = d;
          c.block_size = block;
          c.dtype = dtype;
          c.heads = head_counts[(i / 5) % 5];
          c.num_tokens = token_counts[i % 7];
          c.slot_dtype = i % 2 ? DType::kI32 : DType::kI64;
          switch (i % 5) {
            case 0:
              c.rotation = RotationKind::kHadamard;
              break;
            case 1:
              c.rotation = RotationKind::kHadamardSigns;
              break;
            case 2:
              c.rotation = RotationKind::kHaar;
              break;
            case 3:
              c.rotation = RotationKind::kHadamard;
              c.options.rotation_path = StoreRotationPath::kGemm;
              break;
            case 4:
              c.rotation = RotationKind::kHadamardSigns;
              c.options.rotation_path =
                  d <= 128 ? StoreRotationPath::kMma : StoreRotationPath::kGemm;
              break;
          }
          c.padding = i % 3 == 0 ? 0.0 : 0.1;
          // Half the FWHT cases on the wide kernel with its tensor-core FWHT (the default from
          // 32,768 rows; these are smaller), a quarter on the wide kernel's fp32 butterflies
          // (kWideFp32), a quarter on the narrow kernel.
          if (i % 5 == 0 || i % 5 == 1) {
            const int r = (i / 5) % 4;
            c.options.fwht_kernel = r == 0 || r == 2 ? StoreFwhtKernel::kWide
                                    : r == 1         ? StoreFwhtKernel::kWideFp32
                                                     : StoreFwhtKernel::kAuto;
          }
          all += RunCase(c, Seed());
          ++i;
        }
      }
    }
  }
  std::printf("sweep: %d cases, %lld indices, %lld flips (max %.1f ulp from the midpoint)\n", i,
              static_cast<long long>(all.indices), static_cast<long long>(all.flips),
              all.max_flip_ulps);
}

TEST(StoreCudaTest, LargeStoresMatchTheReference) {
  TQKV_SKIP_WITHOUT_GPU();
  struct Big {
    const char* preset;
    int d, heads;
    int64_t n;
    DType dtype;
    RotationKind rotation;
    StoreRotationPath path;
  };
  const Big bigs[] = {
      {"turboquant_4bit_nc", 128, 8, 16384, DType::kBF16, RotationKind::kHadamard,
       StoreRotationPath::kAuto},
      {"turboquant_k3v4_nc", 128, 8, 16384, DType::kF16, RotationKind::kHadamard,
       StoreRotationPath::kGemm},
      {"turboquant_3bit_nc", 64, 8, 65536, DType::kF16, RotationKind::kHadamardSigns,
       StoreRotationPath::kAuto},
      {"turboquant_4bit_nc", 64, 2, 65536, DType::kBF16, RotationKind::kHaar,
       StoreRotationPath::kAuto},
      {"turboquant_4bit_nc", 128, 8, 16384, DType::kBF16, RotationKind::kHaar,
       StoreRotationPath::kAuto},
      {"turboquant_k3v4_nc", 128, 4, 8192, DType::kF32, RotationKind::kHaar,
       StoreRotationPath::kMma},
      {"turboquant_3bit_nc", 64, 8, 16384, DType::kF16, RotationKind::kHadamard,
       StoreRotationPath::kMma},
      {"turboquant_3bit_nc", 256, 4, 4096, DType::kF32, RotationKind::kHadamardSigns,
       StoreRotationPath::kAuto},
      // The wide FWHT kernel (16-bit inputs, D = 128 / 256, from 32,768 rows).
      {"turboquant_3bit_nc", 128, 8, 16384, DType::kBF16, RotationKind::kHadamardSigns,
       StoreRotationPath::kAuto},
      {"turboquant_k3v4_nc", 256, 4, 8192, DType::kF16, RotationKind::kHadamard,
       StoreRotationPath::kAuto},
      {"turboquant_4bit_nc", 256, 2, 16384, DType::kBF16, RotationKind::kHadamardSigns,
       StoreRotationPath::kAuto},
      {"turboquant_k8v4", 128, 8, 65536, DType::kBF16, RotationKind::kHadamard,
       StoreRotationPath::kAuto},
  };
  for (const Big& b : bigs) {
    Case c;
    c.preset = b.preset;
    c.head_dim = b.d;
    c.heads = b.heads;
    c.num_tokens = b.n;
    c.dtype = b.dtype;
    c.rotation = b.rotation;
    c.options.rotation_path = b.path;
    c.block_size = 16;
    c.padding = 0.02;
    c.slot_dtype = b.n == 65536 ? DType::kI32 : DType::kI64;
    const Diff d = RunCase(c, Seed());
    std::printf("%s: %lld indices, %lld flips (%.2e, max %.1f ulp from the midpoint)\n",
                c.Name().c_str(), static_cast<long long>(d.indices),
                static_cast<long long>(d.flips), d.indices ? double(d.flips) / d.indices : 0.0,
                d.max_flip_ulps);
  }
}

// The GEMM path's two fp32-accurate products: the default (bf16 keys as three bf16 copies times
// the three-part Πᵀ on tensor cores; fp16 / fp32 keys by SGEMM) and SGEMM for every dtype. Both
// must give the reference's bytes up to rare midpoint flips (RunCase: <= 1e-4 of the indices),
// for every MSE preset, dtype and head_dim, with padding and poison.
TEST(StoreCudaTest, Fp32AccurateGemmPrecisionsMatchTheReference) {
  TQKV_SKIP_WITHOUT_GPU();
  for (GemmPrecision precision : {GemmPrecision::kFp32, GemmPrecision::kSgemm}) {
    for (const char* preset : {"turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"}) {
      for (int d : {64, 128, 256}) {
        for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
          Case c;
          c.preset = preset;
          c.head_dim = d;
          c.dtype = dtype;
          c.num_tokens = d == 128 && dtype == DType::kBF16 ? 8192 : 1000;
          c.rotation = RotationKind::kHaar;
          c.options.rotation_path = StoreRotationPath::kGemm;
          c.options.gemm_precision = precision;
          const Diff diff = RunCase(c, Seed());
          if (d == 128 && dtype == DType::kBF16) {
            std::printf("%s %s: %lld of %lld indices flipped (%.2e)\n",
                        precision == GemmPrecision::kFp32 ? "default (3-part bf16)" : "SGEMM",
                        preset, static_cast<long long>(diff.flips),
                        static_cast<long long>(diff.indices), double(diff.flips) / diff.indices);
          }
        }
      }
    }
  }
}

// TF32 and bf16 GEMMs: opt-in precisions. Indices may flip farther from midpoints; everything
// else (values, metadata, untouched bytes, k_norm from the stored indices) stays exact.
TEST(StoreCudaTest, LowPrecisionGemmOptionsOnlyFlipIndices) {
  TQKV_SKIP_WITHOUT_GPU();
  for (GemmPrecision precision : {GemmPrecision::kTf32, GemmPrecision::kBf16}) {
    Case c;
    c.num_tokens = 4096;
    c.options.rotation_path = StoreRotationPath::kGemm;
    c.options.gemm_precision = precision;
    const Diff d = RunCase(c, Seed());
    const double rate = double(d.flips) / d.indices;
    std::printf("%s: flip rate %.2e (%lld of %lld indices)\n",
                precision == GemmPrecision::kTf32 ? "TF32" : "bf16", rate,
                static_cast<long long>(d.flips), static_cast<long long>(d.indices));
    EXPECT_LE(rate, precision == GemmPrecision::kTf32 ? 5e-3 : 5e-2);
  }
}

// One capture of the whole Store (status memset, kernels, cuBLAS), replayed over new inputs.
TEST(StoreCudaTest, GraphCaptureAndReplayGiveTheSameBytes) {
  TQKV_SKIP_WITHOUT_GPU();
  struct Variant {
    const char* preset;
    RotationKind rotation;
    StoreRotationPath path;
  };
  for (const Variant& v :
       {Variant{"turboquant_4bit_nc", RotationKind::kHadamard, StoreRotationPath::kAuto},
        Variant{"turboquant_k3v4_nc", RotationKind::kHaar, StoreRotationPath::kAuto},
        Variant{"turboquant_3bit_nc", RotationKind::kHadamardSigns, StoreRotationPath::kGemm},
        Variant{"turboquant_4bit_nc", RotationKind::kHadamard, StoreRotationPath::kMma},
        Variant{"turboquant_k8v4", RotationKind::kHadamard, StoreRotationPath::kAuto}}) {
    Case c;
    c.preset = v.preset;
    c.rotation = v.rotation;
    c.options.rotation_path = v.path;
    c.options.validate_slots = true;
    c.num_tokens = 256;
    c.padding = 0.0;  // the slot mapping stays fixed; fresh keys and values each replay
    std::mt19937_64 rng(Seed());
    const Quantizer q = c.MakeQuantizer();
    const StoreDeviceState state(q, c.options);
    HostInputs in = MakeInputs(c, rng);
    DeviceCall call(state, in, c);
    Stream stream;
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    TQKV_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
    state.Store(call.inputs, call.cache_ref, call.ws, stream.get());
    TQKV_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
    TQKV_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 3; ++replay) {
      const HostInputs fresh = MakeInputs(c, rng);
      in.key = fresh.key;
      in.value = fresh.value;
      call.Upload(in);
      TQKV_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
      stream.Synchronize();
      EXPECT_TRUE(state.ReadStatus(call.ws, call.inputs, stream.get()).ok());
      std::vector<uint8_t> ref = PoisonedCache(call.cache_bytes + DeviceCall::kGuardBytes);
      ReferenceStore(q, HostView(in, c), ref, in.num_blocks);
      const Diff d = Compare(q, in, c, ref, call.Download());
      EXPECT_EQ(d.bad_bytes, 0) << c.Name() << " replay " << replay;
      g_total += d;
    }
    TQKV_CUDA_CHECK(cudaGraphExecDestroy(exec));
    TQKV_CUDA_CHECK(cudaGraphDestroy(graph));
  }
}

// Slots at or beyond the cache: never written; with validation the first such token and the
// count are reported. Everything else is stored as usual.
void RunOutOfRangeCase(bool validate) {
  for (const char* preset : {"turboquant_4bit_nc", "turboquant_k8v4"}) {
    for (StoreRotationPath path :
         {StoreRotationPath::kAuto, StoreRotationPath::kMma, StoreRotationPath::kGemm}) {
      Case c;
      c.preset = preset;
      c.num_tokens = 300;
      c.options.validate_slots = validate;
      c.options.rotation_path = path;
      c.slot_dtype = DType::kI64;
      std::mt19937_64 rng(Seed());
      const Quantizer q = c.MakeQuantizer();
      const StoreDeviceState state(q, c.options);
      HostInputs in = MakeInputs(c, rng);
      const int64_t num_slots = in.num_blocks * c.block_size;
      std::vector<int64_t> slots = in.slots;
      slots[37] = num_slots;  // the first offending token
      slots[38] = num_slots + 1000;
      slots[200] = int64_t{1} << 40;
      slots[299] = std::numeric_limits<int64_t>::max();
      SetSlots(in, slots, c.slot_dtype);
      DeviceCall call(state, in, c);
      Stream stream;
      // CheckSlots (the debugging aid) refuses the mapping before any store, naming token 37.
      EXPECT_THAT([&] { state.CheckSlots(call.inputs, call.cache_ref, stream.get()); },
                  ::testing::ThrowsMessage<Error>(HasSubstr(fmt::format(
                      "StoreDeviceState::CheckSlots: invalid slot_mapping[37] = {}", num_slots))));
      state.Store(call.inputs, call.cache_ref, call.ws, stream.get());
      const StoreStatus s = state.ReadStatus(call.ws, call.inputs, stream.get());  // synchronizes
      if (validate) {
        EXPECT_EQ(s.num_bad_tokens, 4);
        EXPECT_EQ(s.first_bad_token, 37);
        EXPECT_EQ(s.first_bad_slot, num_slots);
        try {
          state.CheckStatus(call.ws, call.inputs, call.cache_ref, stream.get());
          ADD_FAILURE() << "no throw";
        } catch (const Error& e) {
          EXPECT_THAT(e.what(), HasSubstr(fmt::format("slot_mapping[37] = {}", num_slots)));
          EXPECT_THAT(e.what(), HasSubstr("4 token(s)"));
        }
        // Read with the inputs of a shorter call, the first bad token (37) would lie past their
        // slot_mapping: refused, not read.
        StoreInputs shorter = call.inputs;
        shorter.num_tokens = 37;
        EXPECT_THAT([&] { state.ReadStatus(call.ws, shorter, stream.get()); },
                    ::testing::ThrowsMessage<Error>(HasSubstr("invalid inputs.num_tokens = 37")));
      } else {
        EXPECT_TRUE(s.ok());
      }
      // The reference of the good tokens; the guard after the cache must still be poison.
      std::vector<int64_t> good = slots;
      for (int64_t& x : good) {
        if (x >= num_slots) x = -1;
      }
      HostInputs ref_in = in;
      SetSlots(ref_in, good, c.slot_dtype);
      std::vector<uint8_t> ref = PoisonedCache(call.cache_bytes + DeviceCall::kGuardBytes);
      ReferenceStore(q, HostView(ref_in, c), ref, in.num_blocks);
      const Diff d = Compare(q, ref_in, c, ref, call.Download());
      EXPECT_EQ(d.bad_bytes, 0) << c.Name();
    }
  }
}

TEST(StoreCudaTest, OutOfRangeSlotsAreReportedAndNeverWritten) {
  TQKV_SKIP_WITHOUT_GPU();
  RunOutOfRangeCase(true);
}

TEST(StoreCudaTest, OutOfRangeSlotsAreNeverWrittenWithoutValidation) {
  TQKV_SKIP_WITHOUT_GPU();
  RunOutOfRangeCase(false);
}

// NaN, ±inf, fp32-huge, subnormal and zero rows: the reference's bytes, and never inf/NaN
// metadata.
TEST(StoreCudaTest, NonFiniteInputsGiveTheReferenceBytesAndFiniteMetadata) {
  TQKV_SKIP_WITHOUT_GPU();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const char* preset : kPresets) {
    for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      // kAuto twice: the narrow FWHT kernel (the default at this size) and the wide one.
      for (int run = 0; run < 4; ++run) {
        const StoreRotationPath path = run == 2   ? StoreRotationPath::kMma
                                       : run == 3 ? StoreRotationPath::kGemm
                                                  : StoreRotationPath::kAuto;
        Case c;
        c.preset = preset;
        c.dtype = dtype;
        c.heads = 2;
        c.num_tokens = 16;
        c.padding = 0.0;
        c.options.rotation_path = path;
        c.options.fwht_kernel = run == 1 ? StoreFwhtKernel::kWide : StoreFwhtKernel::kAuto;
        std::mt19937_64 rng(Seed());
        const Quantizer q = c.MakeQuantizer();
        const StoreDeviceState state(q, c.options);
        HostInputs in = MakeInputs(c, rng);
        const int d = c.head_dim;
        std::vector<float> k(in.slots.size() * c.heads * d), v(k.size());
        for (size_t i = 0; i < k.size(); ++i) {
          k[i] = LoadAsFloat(in.key.data(), dtype, static_cast<int64_t>(i));
          v[i] = LoadAsFloat(in.value.data(), dtype, static_cast<int64_t>(i));
        }
        const float big = dtype == DType::kF16 ? 60000.0f : 3e38f;
        const float tiny = dtype == DType::kF16 ? 6e-8f : 1e-40f;
        auto row = [&](std::vector<float>& x, int r) { return x.data() + int64_t(r) * d; };
        row(k, 0)[3] = nan;                                              // NaN key element
        row(v, 0)[5] = nan;                                              // NaN value element
        row(k, 1)[0] = INFINITY;                                         // +inf key
        row(v, 1)[7] = INFINITY;                                         // +inf value
        row(k, 2)[9] = -INFINITY;                                        // -inf key
        row(v, 2)[1] = -INFINITY;                                        // -inf value
        for (int i = 0; i < d; ++i) row(v, 3)[i] = nan;                  // all-NaN values
        for (int i = 0; i < d; ++i) row(k, 4)[i] = 0.0f;                 // zero key
        for (int i = 0; i < d; ++i) row(v, 4)[i] = 0.0f;                 // constant values
        for (int i = 0; i < d; ++i) row(k, 5)[i] = i % 3 ? big : -big;   // overflowing sums
        for (int i = 0; i < d; ++i) row(v, 5)[i] = i % 2 ? big : -big;   // range beyond fp16
        for (int i = 0; i < d; ++i) row(k, 6)[i] = (i % 5 - 2) * tiny;   // subnormal key
        for (int i = 0; i < d; ++i) row(v, 6)[i] = (i % 7) * tiny;       // subnormal values
        for (int i = 0; i < d; ++i) row(v, 7)[i] = (i % 16) * 0.5f;      // exact .5 ties
        for (int i = 0; i < d; ++i) row(v, 8)[i] = (i % 8) * 0.25f - 1;  // ties at 3 bits
        row(k, 9)[0] = nan;
        row(k, 9)[1] = INFINITY;  // NaN and inf together
        in.key = Encode(k, dtype);
        in.value = Encode(v, dtype);
        DeviceCall call(state, in, c);
        Stream stream;
        state.Store(call.inputs, call.cache_ref, call.ws, stream.get());
        stream.Synchronize();  // the download runs on the legacy stream
        const std::vector<uint8_t> gpu = call.Download();
        std::vector<uint8_t> ref = PoisonedCache(call.cache_bytes + DeviceCall::kGuardBytes);
        ReferenceStore(q, HostView(in, c), ref, in.num_blocks);
        const Diff diff = Compare(q, in, c, ref, gpu);
        EXPECT_EQ(diff.bad_bytes, 0) << c.Name();
        const BlockFormat& f = q.format();
        for (int64_t slot : in.slots) {
          if (slot < 0) continue;
          for (int h = 0; h < c.heads; ++h) {
            for (MetaField m :
                 {MetaField::kKeyNorm, MetaField::kValueScale, MetaField::kValueZero}) {
              if (f.fp8_keys && m == MetaField::kKeyNorm) continue;
              const uint16_t bits =
                  LoadHalfBits(&gpu[(slot / f.block_size) * f.block_bytes +
                                    f.MetaOffset(m, static_cast<int>(slot % f.block_size), h)]);
              EXPECT_NE(bits & 0x7C00, 0x7C00) << c.Name() << " slot " << slot << " head " << h
                                               << " field " << static_cast<int>(m);
            }
          }
        }
      }
    }
  }
}

// The value quantizer's hoisted-reciprocal division gives __fdiv_rn's codes: random rows, exact
// .5 ties, and special values.
TEST(StoreCudaTest, ValueCodesOfTheFastDivisionAreExact) {
  TQKV_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(Seed());
  std::vector<float> v, vmin, scale;
  std::uniform_real_distribution<float> u01(0.0f, 1.0f);
  std::uniform_real_distribution<float> expo(-30.0f, 17.0f);
  for (int levels : {7, 15}) {
    for (int i = 0; i < 1 << 20; ++i) {  // random rows: vmin, scale, v inside and around
      const float s = std::max(std::exp2(expo(rng)) / levels, 1e-8f);
      const float lo = (u01(rng) - 0.5f) * 100.0f;
      vmin.push_back(lo);
      scale.push_back(s);
      v.push_back(lo + (u01(rng) * (levels + 2) - 1) * s);
    }
    for (int i = 0; i < 1 << 18; ++i) {  // ties: v = vmin + (c + 0.5) · scale exactly
      const float s = std::ldexp(1.0f, static_cast<int>(expo(rng)));
      const float lo = std::ldexp(std::floor((u01(rng) - 0.5f) * 64), static_cast<int>(expo(rng)));
      const float c = static_cast<float>(rng() % (levels + 1));
      vmin.push_back(lo);
      scale.push_back(s);
      v.push_back(lo + (c + 0.5f) * s);
    }
  }
  const float specials[] = {0.0f,     -0.0f,     std::numeric_limits<float>::quiet_NaN(),
                            INFINITY, -INFINITY, 3e38f,
                            -3e38f,   1e-45f,    1e-38f,
                            65504.0f};
  for (float a : specials) {
    for (float b : specials) {
      for (float s : {1e-8f, 1.0f, 18714.0f}) {
        v.push_back(a);
        vmin.push_back(std::clamp(std::isnan(b) ? 0.0f : b, -65504.0f, 65504.0f));
        scale.push_back(s);
      }
    }
  }
  const int n = static_cast<int>(v.size());
  for (uint32_t levels : {7u, 15u}) {
    DeviceBuffer<float> dv(n), dmin(n), ds(n);
    DeviceBuffer<uint32_t> fast(n), in_range(n), exact(n);
    dv.CopyFromHost(v);
    dmin.CopyFromHost(vmin);
    ds.CopyFromHost(scale);
    store::testing::LaunchValueCodes(dv.data(), dmin.data(), ds.data(), n, levels, fast.data(),
                                     in_range.data(), exact.data(), nullptr);
    TQKV_CHECK_LAUNCH("ValueCodesKernel");
    std::vector<uint32_t> f(n), g(n), e(n);
    fast.CopyToHost(f);
    in_range.CopyToHost(g);
    exact.CopyToHost(e);
    int64_t mismatches = 0, in_range_checked = 0;
    for (int i = 0; i < n; ++i) {
      // The CPU reference's expression, for the record.
      const float t = std::floor((v[i] - vmin[i]) / scale[i] + 0.5f);
      const uint32_t cpu =
          t >= 0.0f ? static_cast<uint32_t>(std::min(t, static_cast<float>(levels))) : 0u;
      // ValueCodeInRange serves rows whose values lie in [vmin, vmax], vmax - vmin = levels·scale
      // up to the rounding of scale (and NaN).
      const bool in_row = std::isnan(v[i]) ||
                          (v[i] >= vmin[i] && double(v[i]) - vmin[i] <= levels * double(scale[i]));
      in_range_checked += in_row;
      if (f[i] != e[i] || e[i] != cpu || (in_row && g[i] != e[i])) {
        if (mismatches++ < 10) {
          ADD_FAILURE() << "v " << v[i] << " vmin " << vmin[i] << " scale " << scale[i] << ": fast "
                        << f[i] << ", in-range " << g[i] << ", __fdiv_rn " << e[i] << ", CPU "
                        << cpu;
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << "levels " << levels;
    EXPECT_GT(in_range_checked, n / 2);
  }
}

TEST(StoreCudaTest, CloseMidpointsBucketizeByBinarySearch) {
  TQKV_SKIP_WITHOUT_GPU();
  for (StoreRotationPath path :
       {StoreRotationPath::kAuto, StoreRotationPath::kMma, StoreRotationPath::kGemm}) {
    Case c;
    c.preset = "turboquant_k3v4_nc";
    c.codebook = CodebookFromCentroids(
        std::vector<float>{-0.2f, -0.1f, -0.03f, -1e-6f, 0.0f, 1e-6f, 0.05f, 0.2f}, 3);
    c.options.rotation_path = path;
    c.num_tokens = 500;
    const StoreDeviceState state(c.MakeQuantizer(), c.options);
    EXPECT_FALSE(state.uses_lookup_table());
    RunCase(c, Seed());
  }
}

// The MMA path holds 2^8 · Πᵀ in fp16: a rotation filled by a caller (its id computed as
// rotation.h defines it; only RotationFromMatrix checks orthogonality) with larger entries is
// refused with a message that names the way out (the cuBLAS path), which takes it.
TEST(StoreCudaTest, OnlyOrthogonalRotationsReachTheMmaPath) {
  TQKV_SKIP_WITHOUT_GPU();
  // The tensor-core path needs 2^8 · Πᵀ inside fp16's range, which every orthogonal Πᵀ is: the
  // Quantizer refuses any other rotation (here 1000 · I) before a store path is chosen.
  Rotation r;
  r.kind = RotationKind::kCustom;
  r.head_dim = 128;
  r.matrix.assign(128 * 128, 0.0f);
  for (int i = 0; i < 128; ++i) r.matrix[size_t(i) * 128 + i] = 1000.0f;
  r.id = RotationMatrixId(128, r.matrix);
  try {
    const Quantizer q(PresetByName("turboquant_4bit_nc"), 128, 8, 16, r);
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("must be orthogonal"));
  }
  // A custom orthogonal rotation with entries of magnitude 1 (a signed permutation) takes it.
  for (int i = 0; i < 128; ++i) {
    r.matrix[size_t(i) * 128 + i] = 0.0f;
    r.matrix[size_t(i) * 128 + (i * 37 + 5) % 128] = i % 3 == 0 ? -1.0f : 1.0f;
  }
  r.id = RotationMatrixId(128, r.matrix);
  const Quantizer q(PresetByName("turboquant_4bit_nc"), 128, 8, 16, r);
  StoreOptions o;
  o.rotation_path = StoreRotationPath::kMma;
  const StoreDeviceState state(q, o);
  EXPECT_EQ(state.path(), StorePath::kMma);
}

TEST(StoreCudaTest, SmallWorkspaceAndEmptyStores) {
  TQKV_SKIP_WITHOUT_GPU();
  Case c;
  c.num_tokens = 10;
  std::mt19937_64 rng(Seed());
  const Quantizer q = c.MakeQuantizer();
  const StoreDeviceState state(q, c.options);
  const HostInputs in = MakeInputs(c, rng);
  DeviceCall call(state, in, c);
  Stream stream;
  StoreOptions gemm;
  gemm.rotation_path = StoreRotationPath::kGemm;
  const StoreDeviceState gemm_state(q, gemm);
  EXPECT_THROW(gemm_state.Store(call.inputs, call.cache_ref, call.ws, stream.get()), Error);
  StoreInputs empty = call.inputs;
  empty.num_tokens = 0;
  state.Store(empty, call.cache_ref, call.ws, stream.get());
  // CheckSlots accepts this call's slots and refuses two tokens of one slot (a race in Store).
  EXPECT_NO_THROW(state.CheckSlots(call.inputs, call.cache_ref, stream.get()));
  std::vector<int64_t> twice = in.slots;
  size_t first = 0;  // the first token written (padding tokens have slot -1)
  while (twice[first] < 0) ++first;
  ASSERT_LT(first + 1, twice.size());
  twice.back() = twice[first];
  DeviceBuffer<int64_t> twice_dev(static_cast<int64_t>(twice.size()));
  twice_dev.CopyFromHost(twice);
  StoreInputs duplicate = call.inputs;
  duplicate.slot_mapping = twice_dev.data();
  duplicate.slot_dtype = DType::kI64;
  EXPECT_THAT([&] { state.CheckSlots(duplicate, call.cache_ref, stream.get()); },
              ::testing::ThrowsMessage<Error>(::testing::AllOf(
                  ::testing::HasSubstr(
                      fmt::format("invalid slot_mapping[{}] = {}", twice.size() - 1, twice[first])),
                  ::testing::HasSubstr(fmt::format("token {} writes it too", first)))));
  // A workspace over the cache (the store writes both) and inputs inside the cache are refused
  // before anything is written.
  DeviceWorkspace over_cache{call.cache_ref.data, call.ws.size_bytes};
  EXPECT_THAT([&] { state.Store(call.inputs, call.cache_ref, over_cache, stream.get()); },
              ::testing::ThrowsMessage<Error>(::testing::AllOf(::testing::HasSubstr("workspace ("),
                                                               ::testing::HasSubstr("cache ("),
                                                               ::testing::HasSubstr("overlap"))));
  StoreInputs slots_in_cache = call.inputs;
  slots_in_cache.slot_mapping = call.cache_ref.data;
  EXPECT_THAT([&] { state.Store(slots_in_cache, call.cache_ref, call.ws, stream.get()); },
              ::testing::ThrowsMessage<Error>(::testing::AllOf(
                  ::testing::HasSubstr("cache ("), ::testing::HasSubstr("slot_mapping ("),
                  ::testing::HasSubstr("overlap"))));
  stream.Synchronize();
  const std::vector<uint8_t> after = call.Download();
  const std::vector<uint8_t> poison = PoisonedCache(call.cache.size_bytes());
  EXPECT_TRUE(after == poison) << "a failed or empty store wrote into the cache";
}

// Runs last (gtest keeps file order): the flip count over every fp32-rotation comparison.
TEST(StoreCudaTest, ZzFlipsAreRare) {
  TQKV_SKIP_WITHOUT_GPU();
  std::printf("all fp32-rotation comparisons: %lld indices, %lld flips (%.2e), max %.1f ulp\n",
              static_cast<long long>(g_total.indices), static_cast<long long>(g_total.flips),
              g_total.indices ? double(g_total.flips) / g_total.indices : 0.0,
              g_total.max_flip_ulps);
  EXPECT_LE(g_total.flips, 1e-4 * g_total.indices);
}

#endif  // TQKV_HAVE_CUDA

}  // namespace
}  // namespace tqkv
