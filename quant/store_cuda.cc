#include "quant/store_cuda.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "quant/numerics.h"
#include "quant/store_launch.h"
#include "runtime/error.h"
#include "runtime/stream.h"

#if TQKV_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExtMemCudaRt.h>

#include "runtime/cuda_check.h"
#endif

namespace tqkv {
namespace {

constexpr const char* kWhere = "StoreDeviceState::Store";
constexpr int64_t kAlign = 256;
// cuBLAS's own recommendation for Hopper; handed to it with cublasSetWorkspace so that it never
// allocates during a call (graph capture).
constexpr int64_t kCublasWorkspaceBytes = int64_t{32} << 20;
constexpr int kThreadsPerCta = 256;  // store_kernels.cu

int64_t AlignUp(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

#if TQKV_HAVE_CUDA
// compute-sanitizer's initcheck does not see the writes of some cuBLAS GEMM kernels (bf16 inputs
// with fp32 output, the fp32-accurate split GEMM, on the H200): it reports every later read of
// their output as uninitialized although the values are the exact product
// (tools/bench/initcheck_cublas_probe.cu shows it on a bare cublasGemmEx). Telling it through the
// NVTX memory API that [ptr, ptr + bytes) is initialized keeps initcheck useful for the store's
// other reads. Without a tool attached, the call returns at once.
void MarkWrittenByCublas(void* ptr, int64_t bytes, cudaStream_t stream) {
  static const nvtxDomainHandle_t domain = nvtxDomainCreateA("tqkv");
  const nvtxMemVirtualRangeDesc_t range{static_cast<size_t>(bytes), ptr};
  nvtxMemMarkInitializedBatch_t batch{};
  batch.extCompatID = NVTX_EXT_COMPATID_MEM;
  batch.structSize = sizeof(batch);
  batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  batch.regionDescCount = 1;
  batch.regionDescElementSize = sizeof(range);
  batch.regionDescElements = &range;
  nvtxMemCudaMarkInitialized(domain, stream, 0, &batch);
}
#endif

bool IsHadamardKind(RotationKind kind) {
  return kind == RotationKind::kHadamard || kind == RotationKind::kHadamardSigns;
}

// Byte offsets of the GEMM path's buffers in the workspace.
struct GemmLayout {
  int64_t norms = 0, factors = 0, unit_keys = 0, y = 0, cublas = 0, total = 0;
};

GemmLayout MakeGemmLayout(const Quantizer& q, const StoreOptions& options, int64_t num_tokens) {
  const BlockFormat& f = q.format();
  const int64_t rows = num_tokens * f.num_kv_heads;
  // Per element of a row: x̂ in fp32 (SGEMM, TF32) or bf16, or (kFp32, which takes the split
  // GEMM for bf16 keys) the larger of three bf16 copies and fp32 x̂.
  int64_t unit_key_bytes = 4;
  if (options.gemm_precision == GemmPrecision::kBf16) unit_key_bytes = 2;
  if (options.gemm_precision == GemmPrecision::kFp32) unit_key_bytes = 6;
  GemmLayout l;
  l.norms = kAlign;  // after the status
  l.factors = l.norms + AlignUp(rows * 4);
  l.unit_keys = l.factors + AlignUp(rows * 4);
  l.y = l.unit_keys + AlignUp(rows * f.head_dim * unit_key_bytes);
  l.cublas = l.y + AlignUp(rows * f.head_dim * 4);
  l.total = l.cublas + kCublasWorkspaceBytes;
  return l;
}

// The tensor-core store kernel holds Πᵀ in shared memory: head_dim 64 and 128.
bool HasMmaKernel(const Quantizer& q) {
  return q.format().head_dim == 64 || q.format().head_dim == 128;
}

bool Misaligned(const void* p, uintptr_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment != 0;
}

}  // namespace

std::string_view StorePathName(StorePath path) {
  switch (path) {
    case StorePath::kFp8:
      return "fp8";
    case StorePath::kFwht:
      return "fwht";
    case StorePath::kMma:
      return "mma";
    case StorePath::kGemm:
      return "gemm";
  }
  return "?";
}

StorePath ResolveStorePath(const Quantizer& quantizer, const StoreOptions& options) {
  if (!quantizer.uses_rotation()) return StorePath::kFp8;
  const RotationKind kind = quantizer.rotation().kind;
  switch (options.rotation_path) {
    case StoreRotationPath::kAuto:
      if (IsHadamardKind(kind)) return StorePath::kFwht;
      return HasMmaKernel(quantizer) ? StorePath::kMma : StorePath::kGemm;
    case StoreRotationPath::kFwht:
      if (!IsHadamardKind(kind)) {
        throw InvalidArgument(kWhere, "rotation path", "fwht",
                              fmt::format("gemm or auto for rotation {} (the in-kernel transform "
                                          "needs hadamard or hadamard_signs)",
                                          RotationKindName(kind)));
      }
      return StorePath::kFwht;
    case StoreRotationPath::kMma:
      if (!HasMmaKernel(quantizer)) {
        throw InvalidArgument(kWhere, "rotation path", "mma",
                              fmt::format("gemm or auto for head_dim {} (the tensor-core path "
                                          "covers head_dim 64 and 128)",
                                          quantizer.format().head_dim));
      }
      return StorePath::kMma;
    case StoreRotationPath::kGemm:
      return StorePath::kGemm;
  }
  return StorePath::kGemm;
}

namespace {

// The most tokens one store takes on `path`: element offsets in int64, and a grid the kernels
// can launch (and cuBLAS's int n; the GEMM path's workspace, some 11 bytes per element of at most
// 2^31 rows, then stays far inside int64).
int64_t MaxStoreTokens(const BlockFormat& f, StorePath path) {
  const int64_t max_rows =
      std::min<int64_t>(std::numeric_limits<int64_t>::max() / f.head_dim / 4,
                        static_cast<int64_t>(std::numeric_limits<int32_t>::max()) *
                            (kThreadsPerCta / (f.head_dim / store::kLaneElems)));
  const int64_t row_limit = path == StorePath::kGemm
                                ? std::min<int64_t>(max_rows, std::numeric_limits<int32_t>::max())
                                : max_rows;
  return row_limit / f.num_kv_heads;
}

void CheckStoreTokens(const BlockFormat& f, StorePath path, int64_t num_tokens) {
  const int64_t most = MaxStoreTokens(f, path);
  if (num_tokens < 0 || num_tokens > most) {
    throw InvalidArgument(kWhere, "num_tokens", num_tokens,
                          fmt::format("0 to {} at {} heads", most, f.num_kv_heads));
  }
}

}  // namespace

int64_t StoreWorkspaceBytes(const Quantizer& quantizer, const StoreOptions& options,
                            int64_t num_tokens) {
  const StorePath path = ResolveStorePath(quantizer, options);
  // (Past the limit the GEMM layout's byte counts wrapped int64 into small, plausible sizes.)
  CheckStoreTokens(quantizer.format(), path, num_tokens);
  if (path != StorePath::kGemm) return kAlign;
  return MakeGemmLayout(quantizer, options, num_tokens).total;
}

void ValidateStoreArguments(const Quantizer& quantizer, const StoreOptions& options,
                            const StoreInputs& in, CacheRef cache, DeviceWorkspace workspace) {
  const BlockFormat& f = quantizer.format();
  ValidateStoreInputs(in, cache, quantizer.layout(), kWhere);
  const StorePath path = ResolveStorePath(quantizer, options);
  CheckStoreTokens(f, path, in.num_tokens);
  // The kernels address a row as block id (32 bits, ValidateStoreInputs) x block_bytes + an
  // offset in the block (32 bits).
  if (f.block_bytes > std::numeric_limits<int32_t>::max()) {
    throw Error(fmt::format("{}: blocks of {} bytes are too large (the store kernels take < 2^31)",
                            kWhere, f.block_bytes));
  }
  const int64_t needed = StoreWorkspaceBytes(quantizer, options, in.num_tokens);
  if (workspace.size_bytes < needed) {
    throw InvalidArgument(kWhere, "workspace size_bytes", workspace.size_bytes,
                          fmt::format(">= {} (StoreWorkspaceBytes for {} tokens, path {})", needed,
                                      in.num_tokens, StorePathName(path)));
  }
  if (workspace.data == nullptr || Misaligned(workspace.data, kAlign)) {
    throw Error(fmt::format("{}: workspace must be non-null and {}-byte aligned", kWhere, kAlign));
  }
  // The workspace is written (the status, the GEMM path's rows): not over the cache or the
  // inputs.
  const int64_t rows = in.num_tokens * int64_t{f.num_kv_heads} * f.head_dim;
  const ByteRange written{"workspace", workspace.data, workspace.size_bytes};
  for (const ByteRange& other :
       {ByteRange{"cache", cache.data, cache.num_blocks * f.block_bytes},
        ByteRange{"key", in.key, rows * DTypeSize(in.dtype)},
        ByteRange{"value", in.value, rows * DTypeSize(in.dtype)},
        ByteRange{"slot_mapping", in.slot_mapping, in.num_tokens * DTypeSize(in.slot_dtype)}}) {
    CheckDisjoint(kWhere, {written, other});
  }
  if (in.num_tokens == 0) return;
  if (Misaligned(in.key, 16) || Misaligned(in.value, 16)) {
    throw Error(
        fmt::format("{}: key and value must be 16-byte aligned (the kernels read 16-byte "
                    "vectors)",
                    kWhere));
  }
  if (Misaligned(in.slot_mapping, static_cast<uintptr_t>(DTypeSize(in.slot_dtype)))) {
    throw Error(fmt::format("{}: slot_mapping must be aligned to its {}-byte elements", kWhere,
                            DTypeSize(in.slot_dtype)));
  }
  if (Misaligned(cache.data, 16)) {
    throw Error(fmt::format("{}: cache must be 16-byte aligned", kWhere));
  }
}

namespace store {

std::vector<uint16_t> SplitRotationF16(std::span<const float> pit, int d) {
  TQKV_CHECK_EQ(pit.size(), size_t(d) * d);
  std::vector<uint16_t> out(size_t(2) * d * d);
  const float scale = std::ldexp(1.0f, kMmaRotationShift);
  for (int k = 0; k < d; ++k) {
    for (int n = 0; n < d; ++n) {
      const float x = pit[size_t(k) * d + n] * scale;  // exact: a power of two
      const uint16_t hi = FloatToHalfBits(x);
      out[size_t(n) * d + k] = hi;
      out[size_t(d) * d + size_t(n) * d + k] = FloatToHalfBits(x - HalfBitsToFloat(hi));
    }
  }
  return out;
}

std::vector<uint16_t> SplitRotationBf16(std::span<const float> pit) {
  const size_t n = pit.size();
  std::vector<uint16_t> out(3 * n);
  for (size_t i = 0; i < n; ++i) {
    float rest = pit[i];
    for (size_t part = 0; part < 3; ++part) {
      const uint16_t b = FloatToBFloat16Bits(rest);
      out[part * n + i] = b;
      rest -= BFloat16BitsToFloat(b);  // exact: b is rest rounded to 8 significant bits
    }
  }
  return out;
}

BucketLutTable BuildBucketLut(std::span<const float> m) {
  BucketLutTable none;
  const int n = static_cast<int>(m.size());
  if (n < 1 || n >= kMaxCodebookSize) return none;
  for (float x : m) {
    if (!std::isfinite(x)) return none;
  }
  double min_gap = 1.0;  // one midpoint: any grid works
  for (int j = 0; j + 1 < n; ++j) min_gap = std::min(min_gap, double(m[j + 1]) - double(m[j]));
  if (!(min_gap > 0)) return none;
  // Cells 1/2.5 of the smallest gap wide; widened by a quarter cell on each side they span 0.6 of
  // it, so no widened cell holds two midpoints. Cell u holds the y with y · inv + K within 1/2 of
  // u (inv is the fp32 value the device multiplies by), u = 0 .. 2K, covering ±kLutRange and every
  // midpoint with two cells to spare; the outer cells extend to ±inf.
  const float inv_f = static_cast<float>(2.5 / min_gap);
  const double inv = inv_f, step = 1.0 / inv, eps = step / 4;
  const double range =
      std::max({double(kLutRange), std::abs(double(m[0])), std::abs(double(m[n - 1]))}) + 2 * step;
  const double k_d = std::ceil(range * inv) + 1;
  if (!(2 * k_d + 1 <= kMaxLutCells)) return none;
  const int k = static_cast<int>(k_d), cells = 2 * k + 1;
  BucketLutTable t;
  t.entries.resize(cells);
  for (int u = 0; u < cells; ++u) {
    const double lower = u == 0 ? -INFINITY : (u - 0.5 - k) / inv - eps;
    const double upper = u == cells - 1 ? INFINITY : (u + 0.5 - k) / inv + eps;
    int below = 0, inside = 0;
    for (float x : m) {
      below += double(x) < lower;
      inside += double(x) >= lower && double(x) <= upper;
    }
    if (inside > 1) return none;
    t.entries[u].base_index = below;
    t.entries[u].next_midpoint = below < n ? m[below] : std::numeric_limits<float>::quiet_NaN();
  }
  t.grid.inv_step = inv_f;
  t.grid.magic_bias = 12582912.0f + static_cast<float>(k);  // exact: an integer below 2^24
  t.grid.cells = cells;
  // The device computes the cell in fp32 exactly as LutBucketize does here; check it against the
  // definition around every midpoint and every cell edge, and across the range, before trusting it.
  auto reference = [&](float y) {
    return static_cast<int>(std::upper_bound(m.begin(), m.end(), y) - m.begin());
  };
  auto check_around = [&](float y, int below, int above) {
    for (int i = 0; i < below; ++i) y = std::nextafter(y, -INFINITY);
    for (int i = 0; i < below + above; ++i, y = std::nextafter(y, INFINITY)) {
      if (std::abs(y) <= kLutRange && LutBucketize(y, t.entries.data(), t.grid) != reference(y)) {
        return false;
      }
    }
    return true;
  };
  for (int u = 0; u <= cells; ++u) {
    if (!check_around(static_cast<float>((u - 0.5 - k) / inv), 16, 16)) return none;
  }
  for (float x : m) {
    if (!check_around(x, 64, 64)) return none;
  }
  for (int i = 0; i <= 20000; ++i) {
    if (!check_around(kLutRange * (i / 10000.0f - 1.0f), 0, 1)) return none;
  }
  return t;
}

}  // namespace store

// ---------------------------------------------------------------------------------------------
// StoreDeviceState

StoreDeviceState::StoreDeviceState(const Quantizer& quantizer, const StoreOptions& options)
    : quantizer_(quantizer), options_(options), path_(ResolveStorePath(quantizer, options)) {
  RequireCudaDevice("StoreDeviceState");
  if (path_ == StorePath::kFp8) return;
  const BlockFormat& f = quantizer_.format();
  const Codebook& book = quantizer_.codebook();

  auto tables = std::make_unique<store::DeviceTables>();
  std::memset(tables.get(), 0, sizeof(store::DeviceTables));
  const store::BucketLutTable lut = store::BuildBucketLut(book.midpoints);
  std::copy(lut.entries.begin(), lut.entries.end(), tables->lut);
  lut_ = lut.grid;
  // The table assumes |y| <= kLutRange for finite keys, true for any Πᵀ whose columns have norm
  // near 1 (RotationFromMatrix checks orthogonality; a caller may fill a Rotation with another
  // matrix and its id).
  const std::vector<float>& pit = quantizer_.rotation().matrix;
  for (int j = 0; j < f.head_dim && lut_.cells > 0; ++j) {
    double col = 0;
    for (int i = 0; i < f.head_dim; ++i)
      col += double(pit[size_t(i) * f.head_dim + j]) * pit[size_t(i) * f.head_dim + j];
    if (!(std::sqrt(col) <= 1.2)) lut_ = store::BucketLut{};  // NaN too
  }
  for (int i = 0; i < store::kMaxCodebookSize; ++i) {
    const double c = i < book.size() ? double(book.centroids[i]) : 0.0;
    tables->centroid_sq[i] = c * c;
    tables->midpoints[i] = i < static_cast<int>(book.midpoints.size())
                               ? book.midpoints[i]
                               : std::numeric_limits<float>::quiet_NaN();
  }
  const int bits = quantizer_.format().key_bits;
  for (int b = 0; b < (1 << (2 * bits)); ++b) {
    const double lo = book.centroids[b & ((1 << bits) - 1)], hi = book.centroids[b >> bits];
    tables->pair_sq[b] = lo * lo + hi * hi;
  }
  const std::vector<float>& signs = quantizer_.rotation().signs;
  for (size_t i = 0; i < signs.size(); ++i) {
    if (signs[i] < 0) tables->sign_bits[i / 32] |= 1u << (i % 32);
  }
  tables_ = DeviceAllocation(sizeof(store::DeviceTables));
  tables_.CopyFromHost(tables.get(), sizeof(store::DeviceTables), 0, nullptr);

  if (path_ == StorePath::kMma) {
    // 2^8 · Πᵀ must stay inside fp16's range. Any orthogonal Πᵀ has entries ≤ 1 and the Quantizer
    // takes no other rotation, so this only guards that contract.
    float largest = 0;
    for (float x : pit) largest = std::isfinite(x) ? std::max(largest, std::abs(x)) : INFINITY;
    if (!(largest <= 255.0f)) {
      throw InvalidArgument("StoreDeviceState", "rotation path", StorePathName(path_),
                            fmt::format("gemm for a rotation with entries up to {} (the "
                                        "tensor-core path needs finite entries of magnitude "
                                        "<= 255)",
                                        largest));
    }
    const std::vector<uint16_t> split = store::SplitRotationF16(pit, f.head_dim);
    rotation_ = DeviceAllocation(static_cast<int64_t>(split.size() * 2));
    rotation_.CopyFromHost(split.data(), rotation_.size_bytes(), 0, nullptr);
#if TQKV_HAVE_CUDA
    TQKV_CHECK(store::PrepareMmaStore(f));
#endif
  }
  if (path_ == StorePath::kGemm) {
    if (options_.gemm_precision == GemmPrecision::kBf16) {
      std::vector<uint16_t> bf(pit.size());
      for (size_t i = 0; i < pit.size(); ++i) bf[i] = FloatToBFloat16Bits(pit[i]);
      rotation_ = DeviceAllocation(static_cast<int64_t>(bf.size() * 2));
      rotation_.CopyFromHost(bf.data(), rotation_.size_bytes(), 0, nullptr);
    } else {
      rotation_ = DeviceAllocation(static_cast<int64_t>(pit.size() * 4));
      rotation_.CopyFromHost(pit.data(), rotation_.size_bytes(), 0, nullptr);
    }
    if (options_.gemm_precision == GemmPrecision::kFp32) {
      const std::vector<uint16_t> split = store::SplitRotationBf16(pit);
      rotation_split_ = DeviceAllocation(static_cast<int64_t>(split.size() * 2));
      rotation_split_.CopyFromHost(split.data(), rotation_split_.size_bytes(), 0, nullptr);
    }
    blas_ = std::make_unique<CublasHandle>();
#if TQKV_HAVE_CUDA
    TQKV_CUBLAS_CHECK(cublasSetMathMode(
        blas_->get(), options_.gemm_precision == GemmPrecision::kSgemm ? CUBLAS_PEDANTIC_MATH
                                                                       : CUBLAS_DEFAULT_MATH));
#endif
  }
#if TQKV_HAVE_CUDA
  // The uploads above are synchronous copies from pageable memory on the legacy stream, which may
  // return before the data lands; a store on a non-blocking stream is not ordered after them.
  TQKV_CUDA_CHECK(cudaDeviceSynchronize());
#endif
}

StoreDeviceState::~StoreDeviceState() = default;

void StoreDeviceState::Store(const StoreInputs& in, CacheRef cache, DeviceWorkspace workspace,
                             StreamHandle stream) const {
  ValidateStoreArguments(quantizer_, options_, in, cache, workspace);
#if TQKV_HAVE_CUDA
  const BlockFormat& f = quantizer_.format();
  auto* const ws = static_cast<uint8_t*>(workspace.data);
  auto* const status = reinterpret_cast<store::DeviceStatus*>(ws);
  if (options_.validate_slots) {
    TQKV_CUDA_CHECK(cudaMemsetAsync(status, 0, sizeof(store::DeviceStatus), stream));
  }
  if (in.num_tokens == 0) return;

  store::StoreParams p;
  p.key = in.key;
  p.value = in.value;
  p.input = in.dtype;  // F32, F16 or BF16 (ValidateStoreArguments)
  p.slot_mapping = in.slot_mapping;
  p.slots_are_i64 = in.slot_dtype == DType::kI64;
  p.num_tokens = in.num_tokens;
  p.cache = cache.data;
  p.num_slots = cache.num_blocks * f.block_size;
  p.format = f;
  p.norm_correction = quantizer_.preset().norm_correction;
  p.tables = static_cast<const store::DeviceTables*>(tables_.data());
  p.lut = lut_;
  p.status = options_.validate_slots ? status : nullptr;
  p.fwht_kernel = options_.fwht_kernel;
  p.fwht_on_tensor_cores = options_.fwht_kernel != StoreFwhtKernel::kWideFp32;

  if (path_ == StorePath::kFwht) {
    p.key_source = store::KeySource::kFwht;
    p.use_signs = quantizer_.rotation().kind == RotationKind::kHadamardSigns;
    p.fwht_scale = quantizer_.rotation().matrix[0] < 0 ? -quantizer_.rotation().matrix[0]
                                                       : quantizer_.rotation().matrix[0];
  } else if (path_ == StorePath::kMma) {
    p.key_source = store::KeySource::kMma;
    p.rotation_f16 = static_cast<const uint16_t*>(rotation_.data());
  } else if (path_ == StorePath::kGemm) {
    const GemmLayout l = MakeGemmLayout(quantizer_, options_, in.num_tokens);
    const int64_t rows = in.num_tokens * f.num_kv_heads;
    const bool bf16 = options_.gemm_precision == GemmPrecision::kBf16;
    // bf16 keys are exact in bf16: the fp32-accurate default multiplies them as they are.
    const bool split = options_.gemm_precision == GemmPrecision::kFp32 && in.dtype == DType::kBF16;
    store::NormalizeParams np;
    np.key = in.key;
    np.input = p.input;
    np.rows = rows;
    np.head_dim = f.head_dim;
    np.unit_keys = ws + l.unit_keys;
    np.unit_keys_bf16 = bf16;
    np.norms = reinterpret_cast<float*>(ws + l.norms);
    np.replicate_scaled = split;
    np.factors = split ? reinterpret_cast<float*>(ws + l.factors) : nullptr;
    TQKV_CHECK(store::LaunchNormalize(np, stream));
    TQKV_CHECK_LAUNCH("NormalizeKernel");

    // Row-major y[rows, D] = x̂[rows, D] · Πᵀ[D, D]: column-major yᵀ = Πᵀᵀ · x̂ᵀ, i.e. the GEMM
    // with m = D, n = rows, k = D and A = Πᵀ, B = x̂ as stored.
    cublasHandle_t h = blas_->get();
    blas_->SetStream(stream);  // resets cuBLAS to its own workspace pool: set ours after it
    TQKV_CUBLAS_CHECK(cublasSetWorkspace(h, ws + l.cublas, kCublasWorkspaceBytes));
    const int d = f.head_dim, n = static_cast<int>(rows);
    const float one = 1.0f, zero = 0.0f;
    float* y = reinterpret_cast<float*>(ws + l.y);
    // fp16 / fp32 keys with the kFp32 default: SGEMM.
    const GemmPrecision gemm = split ? GemmPrecision::kFp32
                               : options_.gemm_precision == GemmPrecision::kFp32
                                   ? GemmPrecision::kSgemm
                                   : options_.gemm_precision;
    switch (gemm) {
      case GemmPrecision::kFp32:
        // y' = [k'|k'|k'] · [hi; mid; lo]: k = 3·D, products exact (8 x 8 significant bits), fp32
        // sums on tensor cores.
        TQKV_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, d, n, 3 * d, &one,
                                       rotation_split_.data(), CUDA_R_16BF, d, np.unit_keys,
                                       CUDA_R_16BF, 3 * d, &zero, y, CUDA_R_32F, d,
                                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        break;
      case GemmPrecision::kSgemm:  // true fp32 products and sums, no TF32
        TQKV_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, d, n, d, &one, rotation_.data(),
                                       CUDA_R_32F, d, np.unit_keys, CUDA_R_32F, d, &zero, y,
                                       CUDA_R_32F, d, CUBLAS_COMPUTE_32F_PEDANTIC,
                                       CUBLAS_GEMM_DEFAULT));
        break;
      case GemmPrecision::kTf32:
        TQKV_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, d, n, d, &one, rotation_.data(),
                                       CUDA_R_32F, d, np.unit_keys, CUDA_R_32F, d, &zero, y,
                                       CUDA_R_32F, d, CUBLAS_COMPUTE_32F_FAST_TF32,
                                       CUBLAS_GEMM_DEFAULT));
        break;
      case GemmPrecision::kBf16:
        TQKV_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, d, n, d, &one, rotation_.data(),
                                       CUDA_R_16BF, d, np.unit_keys, CUDA_R_16BF, d, &zero, y,
                                       CUDA_R_32F, d, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        break;
    }
    MarkWrittenByCublas(y, rows * d * int64_t{4}, stream);
    p.key_source = store::KeySource::kLoadY;
    p.y = y;
    p.norms = np.norms;
    p.y_factors = np.factors;
  }
  TQKV_CHECK(store::LaunchStore(p, stream));
  TQKV_CHECK_LAUNCH("StoreKernel");
#else
  (void)stream;
  RequireCudaDevice(kWhere);
#endif
}

StoreStatus StoreDeviceState::ReadStatus(DeviceWorkspace workspace, const StoreInputs& in,
                                         StreamHandle stream) const {
  StoreStatus out;
#if TQKV_HAVE_CUDA
  TQKV_CUDA_CHECK(cudaStreamSynchronize(stream));  // also without validation: the store is done
  if (!options_.validate_slots) return out;
  store::DeviceStatus s{};
  TQKV_CUDA_CHECK(cudaMemcpyAsync(&s, workspace.data, sizeof(s), cudaMemcpyDeviceToHost, stream));
  TQKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  out.num_bad_tokens = static_cast<int64_t>(s.num_bad_tokens);
  if (s.inverted_first_bad_token != 0) {
    out.first_bad_token = static_cast<int64_t>(~s.inverted_first_bad_token);
    if (out.first_bad_token >= in.num_tokens) {  // the status of another call's inputs
      throw InvalidArgument("StoreDeviceState::ReadStatus", "inputs.num_tokens", in.num_tokens,
                            fmt::format("more than {} (the stored call's first bad token): the "
                                        "inputs of the Store call that wrote this workspace",
                                        out.first_bad_token));
    }
    const int64_t size = DTypeSize(in.slot_dtype);
    int64_t slot64 = 0;
    int32_t slot32 = 0;
    void* dst = size == 8 ? static_cast<void*>(&slot64) : static_cast<void*>(&slot32);
    TQKV_CUDA_CHECK(
        cudaMemcpy(dst, static_cast<const uint8_t*>(in.slot_mapping) + out.first_bad_token * size,
                   static_cast<size_t>(size), cudaMemcpyDeviceToHost));
    out.first_bad_slot = size == 8 ? slot64 : slot32;
  }
#else
  (void)workspace;
  (void)in;
  (void)stream;
#endif
  return out;
}

void StoreDeviceState::CheckStatus(DeviceWorkspace workspace, const StoreInputs& inputs,
                                   CacheRef cache, StreamHandle stream) const {
  const StoreStatus s = ReadStatus(workspace, inputs, stream);
  if (s.ok()) return;
  const BlockFormat& f = quantizer_.format();
  throw InvalidArgument(
      kWhere, fmt::format("slot_mapping[{}]", s.first_bad_token), s.first_bad_slot,
      fmt::format("negative (skip) or 0 to {} ({} blocks x {} tokens); {} token(s) had a slot "
                  "out of range and were not written",
                  cache.num_blocks * f.block_size - 1, cache.num_blocks, f.block_size,
                  s.num_bad_tokens));
}

void StoreDeviceState::CheckSlots(const StoreInputs& in, CacheRef cache,
                                  StreamHandle stream) const {
  constexpr const char* kCheckSlots = "StoreDeviceState::CheckSlots";
  ValidateStoreInputs(in, cache, quantizer_.layout(), kCheckSlots);
  if (in.num_tokens == 0) return;
#if TQKV_HAVE_CUDA
  const int64_t bytes = in.num_tokens * DTypeSize(in.slot_dtype);
  std::vector<uint8_t> slots(static_cast<size_t>(bytes));
  TQKV_CUDA_CHECK(cudaMemcpyAsync(slots.data(), in.slot_mapping, static_cast<size_t>(bytes),
                                  cudaMemcpyDeviceToHost, stream));
  TQKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  ValidateSlotMapping(slots.data(), in.slot_dtype, in.num_tokens, cache.num_blocks,
                      quantizer_.format().block_size, kCheckSlots);
#else
  (void)stream;
  throw Error(fmt::format("{}: this build of tqkv has no CUDA support", kCheckSlots));
#endif
}

// ---------------------------------------------------------------------------------------------

}  // namespace tqkv
