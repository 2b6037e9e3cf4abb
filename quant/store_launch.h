// Kernel-facing side of the CUDA store: the parameter structs and the launch functions that
// store_kernels.cu defines. The public API is quant/store_cuda.h; only store_cuda.cc (and tests of
// the launch layer) include this. Included by kernel files: no fmt, no spdlog, no exceptions.
#pragma once

#include <cstdint>

#include "quant/block_format.h"
#include "quant/store_device.h"
#include "runtime/device.h"
#include "runtime/dtype.h"

namespace tqkv::store {

// Where the rotated unit key y = x̂ · Πᵀ of an MSE preset comes from.
enum class KeySource {
  kFwht,   // computed in the kernel from the key: y = FWHT(x̂ ⊙ s) / √D (Hadamard kinds)
  kLoadY,  // read from a [rows, D] fp32 buffer the GEMM wrote, with the norms of kNormalize
  kMma,    // computed in the kernel from the key on tensor cores (any Πᵀ, D <= 128; see
           // quant/store_device.h, MmaScaleForNorm): y = k' · (hi + lo) · factor
};

// Device tables of one quantizer, uploaded once (StoreDeviceState).
struct DeviceTables {
  LutEntry lut[kMaxLutCells];
  double centroid_sq[kMaxCodebookSize];  // c[i]² (exact in fp64)
  // c[a]² + c[b]² for the two codes of one byte (4-bit: 256 entries) or of one 6-bit field (3-bit:
  // 64 entries) of the packed codes, in fp64: the norm correction sums a lane's 16 codes in 8
  // lookups.
  double pair_sq[256];
  float midpoints[kMaxCodebookSize];  // for the binary-search fallback
  uint32_t sign_bits[8];              // hadamard_signs: bit i set where s[i] = -1 (D <= 256)
};

// Status of a store with slot validation on. Reset (zeroed) by the launcher before the kernels.
struct DeviceStatus {
  unsigned long long inverted_first_bad_token;  // ~token of the smallest bad token (0: none)
  unsigned long long num_bad_tokens;
};

struct StoreParams {
  const void* key = nullptr;    // [num_tokens, H, D] of `input` (FWHT and FP8 paths)
  const void* value = nullptr;  // [num_tokens, H, D] of `input`
  DType input = DType::kF32;
  const void* slot_mapping = nullptr;  // [num_tokens] int32 or int64; < 0 = write nothing
  bool slots_are_i64 = true;
  int64_t num_tokens = 0;

  uint8_t* cache = nullptr;  // [num_blocks, block_bytes]
  int64_t num_slots = 0;     // num_blocks · block_size: slots at or above are never written
  BlockFormat format;

  // MSE presets.
  KeySource key_source = KeySource::kFwht;
  bool norm_correction = true;
  const float* y = nullptr;      // kLoadY: [num_tokens · H, D] fp32
  const float* norms = nullptr;  // kLoadY: [num_tokens · H] fp32 key norms
  // kLoadY: nullptr when y = x̂ · Πᵀ; otherwise y holds (k · 2^s) · Πᵀ and the row's y is y · its
  // factor (NormalizeParams::replicate_scaled).
  const float* y_factors = nullptr;
  const DeviceTables* tables = nullptr;
  BucketLut lut;
  bool use_signs = false;  // kFwht: multiply by hadamard_signs' s before the transform
  float fwht_scale = 0;    // kFwht: fp32(1/√D), the magnitude of every entry of Πᵀ
  // kMma: [2][D][D] fp16 bits, hi then lo of 2^kMmaRotationShift · Πᵀ, transposed (entry [n][k]
  // is Πᵀ[k][n]: row n holds output column n), 16-byte aligned.
  const uint16_t* rotation_f16 = nullptr;

  DeviceStatus* status = nullptr;  // non-null: report out-of-range slots there
  // The norm correction's pair table in 2^n interleaved shared-memory copies (0 or 4; set by
  // LaunchStore from the row count; used by the FWHT kernel, the others keep one copy).
  int pair_copies_log2 = 0;
  StoreFwhtKernel fwht_kernel = StoreFwhtKernel::kAuto;  // StoreOptions::fwht_kernel
  // The wide FWHT kernel: H16 stages on tensor cores (FwhtOnTensorCores); false = fp32
  // butterflies only (StoreFwhtKernel::kWideFp32, for comparison).
  bool fwht_on_tensor_cores = true;
  // −(0x4B400000 << 3) mod 2^32, added at run time to the bucketize table's shared address: as a
  // parameter it stays one register, so each lookup address is one shift-add (StoreKernel).
  uint32_t lut_address_bias = 0xA6000000u;
};

// x̂ = k / (‖k‖ + 1e-8) for the GEMM path (every row, slots not read), and ‖k‖.
struct NormalizeParams {
  const void* key = nullptr;  // [rows, D] of `input`
  DType input = DType::kF32;
  int64_t rows = 0;
  int head_dim = 0;
  void* unit_keys = nullptr;  // [rows, D] fp32, or bf16 when unit_keys_bf16
  bool unit_keys_bf16 = false;
  float* norms = nullptr;  // [rows]
  // bf16 keys only: instead of x̂, write unit_keys [rows, 3·D] bf16 = three copies of k · 2^s, and
  // factors[row] = 2^-s / (‖k‖ + 1e-8), so that y = (unit row · Πᵀ parts) · factor (StoreParams::
  // y_factors). s as MmaScaleForNorm's (without its rotation shift).
  bool replicate_scaled = false;
  float* factors = nullptr;  // [rows]
};

// Each returns false (launching nothing) for a combination the kernels do not instantiate; the
// caller checks the launch with TQKV_CHECK_LAUNCH.
bool LaunchStore(const StoreParams& params, StreamHandle stream);
bool LaunchNormalize(const NormalizeParams& params, StreamHandle stream);

// Sets the shared-memory limit of every kMma kernel for `format` (all input types) and caches
// their occupancy, so that no launch does it first (e.g. inside a graph capture). Returns false
// when the format has no kMma kernel (head_dim 256, FP8 keys). Idempotent.
bool PrepareMmaStore(const BlockFormat& format);

// The same per head_dim (store_kernels_d{64,128,256}.cu, one instantiation unit each); chunks:
// row chunks of the narrow kernel's CTA size (LaunchStore computes it).
bool LaunchStoreD64(const StoreParams& params, int64_t chunks, StreamHandle stream);
bool LaunchStoreD128(const StoreParams& params, int64_t chunks, StreamHandle stream);
bool LaunchStoreD256(const StoreParams& params, int64_t chunks, StreamHandle stream);
bool PrepareMmaStoreD64(const BlockFormat& format);
bool PrepareMmaStoreD128(const BlockFormat& format);

}  // namespace tqkv::store
