// The CUDA store: Quantizer::StoreCpu's bytes, written by the GPU into a layer's paged cache.
//
//   StoreDeviceState state(quantizer);                    // once: device tables, cuBLAS handle
//   DeviceAllocation ws(state.WorkspaceBytes(max_tokens));  // once: the caller owns all scratch
//   state.Store(inputs, cache, {ws.data(), ws.size_bytes()}, stream);     // every step
//
// Paths (StorePath):
//  - kFp8  (turboquant_k8v4): one kernel, E4M3 keys and quantized values.
//  - kFwht (MSE presets, `hadamard` / `hadamard_signs`, the default there): one kernel that rotates
//    each key in registers by a fast Walsh–Hadamard transform; no GEMM, no y in memory.
//  - kMma  (MSE presets, any Πᵀ, head_dim 64 and 128, the default for rotations other than the
//    Hadamard kinds): one kernel that rotates a tile of keys on tensor cores, y = k' · Πᵀ from
//    an fp16 hi + lo split of Πᵀ held in shared memory and fp32 accumulation (fp32 keys are split
//    too); no GEMM call, no x̂ or y in memory. quant/store_device.h, MmaScaleForNorm, has the
//    arithmetic.
//  - kGemm (MSE presets, any Πᵀ): cuBLAS computes the rotation, then the store kernel bucketizes
//    y. By default (GemmPrecision::kFp32) the product is fp32-accurate: bf16 keys, exact in bf16,
//    are written three times side by side (each row scaled by a power of two) and multiplied on
//    tensor cores by Πᵀ split into three bf16 parts (hi + mid + lo = Πᵀ to 24 bits) stacked
//    along k, with fp32 accumulation; the store kernel scales y by 2^-s / (‖k‖ + 1e-8). fp16 /
//    fp32 keys (and GemmPrecision::kSgemm) take an fp32 SGEMM (CUBLAS_PEDANTIC_MATH: no TF32) of
//    x̂ = k / (‖k‖ + 1e-8) written by a normalize kernel. GemmPrecision::kTf32 / kBf16 are faster
//    opt-ins that flip more indices (tools/bench/README.md).
// All paths produce the bytes of StoreCpu, except that an MSE index may be one off where y lies
// within a few ulp of a midpoint (the reference rotates in fp64, these paths in fp32); the norm
// correction then follows the stored indices. quant/README.md lists the shared numeric choices.
//
// Every call works on the caller's stream, allocates nothing and synchronizes with nothing, so a
// whole Store (memset of the status, kernels, cuBLAS) can be captured in a CUDA graph. A state
// serves every layer of its quantizer, but one host thread at a time (it holds a cuBLAS handle).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "quant/quantizer.h"
#include "quant/store_device.h"
#include "runtime/device.h"
#include "runtime/memory.h"

namespace tqkv {

class CublasHandle;

enum class StoreRotationPath {
  kAuto,  // kFwht for `hadamard` and `hadamard_signs`; any other rotation: kMma at head_dim 64
          // and 128, kGemm at 256
  kFwht,  // error unless the rotation is a Hadamard kind
  kMma,   // tensor cores in the store kernel, any rotation; error at head_dim 256
  kGemm,  // cuBLAS, any rotation
};

enum class GemmPrecision {
  kFp32,   // fp32-accurate: bf16 keys × Πᵀ as three bf16 parts on tensor cores (fp32 sums);
           // fp16 / fp32 keys: as kSgemm
  kSgemm,  // SGEMM with CUBLAS_PEDANTIC_MATH (true fp32 products and sums) for every key dtype
  kTf32,   // TF32 tensor cores (10-bit mantissa products): more index flips
  kBf16,   // bf16 x̂ and Πᵀ, fp32 accumulation: even more index flips
};

enum class StorePath { kFp8, kFwht, kMma, kGemm };

std::string_view StorePathName(StorePath path);  // "fp8", "fwht", "mma", "gemm"

// On in debug builds (`bazel ... -c dbg`, e.g. --config=asan; .bazelrc builds -c opt).
#ifdef NDEBUG
inline constexpr bool kValidateSlotsByDefault = false;
#else
inline constexpr bool kValidateSlotsByDefault = true;
#endif

struct StoreOptions {
  StoreRotationPath rotation_path = StoreRotationPath::kAuto;
  GemmPrecision gemm_precision = GemmPrecision::kFp32;
  // Slots at or above num_blocks · block_size are never written. With validation on, the store
  // also counts them and records the first such token in the workspace (ReadStatus); this costs
  // one memset per call.
  bool validate_slots = kValidateSlotsByDefault;
  // The FWHT path's kernel build (tests and benchmarks compare them; ignored by other paths).
  StoreFwhtKernel fwht_kernel = StoreFwhtKernel::kAuto;
};

// Caller-owned device scratch of at least StoreWorkspaceBytes(...) bytes, 256-byte aligned.
struct DeviceWorkspace {
  void* data = nullptr;
  int64_t size_bytes = 0;
};

// What a store with validate_slots found.
struct StoreStatus {
  int64_t num_bad_tokens = 0;    // tokens whose slot was >= num_blocks · block_size (not written)
  int64_t first_bad_token = -1;  // the smallest such token, -1 if none
  int64_t first_bad_slot = 0;    // its slot
  bool ok() const { return num_bad_tokens == 0; }
};

// The path a store of `quantizer` with `options` takes. Throws tqkv::Error for kFwht with a
// rotation that is not a Hadamard kind, and for kMma at head_dim 256.
StorePath ResolveStorePath(const Quantizer& quantizer, const StoreOptions& options);

// Bytes of workspace a store of up to `num_tokens` tokens needs: 256 for the FP8, FWHT and MMA
// paths; the GEMM path adds x̂, y and norms for every row and cuBLAS's workspace.
int64_t StoreWorkspaceBytes(const Quantizer& quantizer, const StoreOptions& options,
                            int64_t num_tokens);

// Everything the launcher checks on the host before launching (no device needed): the cache's
// layout (the quantizer's), dtypes, null pointers, alignment (key/value 16 bytes, slot mapping
// its element size, cache 16 bytes, workspace 256 bytes), workspace size, sizes (the cache:
// fewer than 2^32 blocks, each under 2^31 bytes: the kernels address a block by a 32-bit id).
// Throws tqkv::Error naming the argument. Slot values live on the device and are checked there
// (StoreOptions::validate_slots).
void ValidateStoreArguments(const Quantizer& quantizer, const StoreOptions& options,
                            const StoreInputs& inputs, CacheRef cache, DeviceWorkspace workspace);

// Device copies of one quantizer's tables (bucketize lookup table, centroids², midpoints, signs,
// Πᵀ for the GEMM path) and, for the GEMM path, a cuBLAS handle: built once, used by every store.
class StoreDeviceState {
 public:
  // Uploads the tables (synchronously) and creates the cuBLAS handle. Throws tqkv::Error without a
  // CUDA device, and as ResolveStorePath does.
  explicit StoreDeviceState(const Quantizer& quantizer, const StoreOptions& options = {});
  ~StoreDeviceState();
  StoreDeviceState(const StoreDeviceState&) = delete;
  StoreDeviceState& operator=(const StoreDeviceState&) = delete;

  const Quantizer& quantizer() const { return quantizer_; }
  const StoreOptions& options() const { return options_; }
  StorePath path() const { return path_; }
  // True when bucketizing uses the lookup table (always for the built-in codebooks); false means
  // a caller's codebook with midpoints too close for it, bucketized by binary search instead.
  bool uses_lookup_table() const { return lut_.cells > 0; }

  int64_t WorkspaceBytes(int64_t num_tokens) const {
    return StoreWorkspaceBytes(quantizer_, options_, num_tokens);
  }

  // Stores `inputs` (key, value, slot mapping in device memory) into `cache` (device memory) on
  // `stream`. Validates the arguments first (ValidateStoreArguments) and throws tqkv::Error,
  // launching nothing, when one is invalid. Asynchronous; graph-capturable.
  void Store(const StoreInputs& inputs, CacheRef cache, DeviceWorkspace workspace,
             StreamHandle stream) const;

  // Synchronizes `stream`, then returns the slot check of the last Store that used `workspace`
  // (with validate_slots; otherwise ok()). `inputs` must be that store's (to read the offending
  // slot); inputs with fewer tokens than the recorded first bad token throw tqkv::Error.
  StoreStatus ReadStatus(DeviceWorkspace workspace, const StoreInputs& inputs,
                         StreamHandle stream) const;
  // ReadStatus, then throws tqkv::Error naming the first offending token and slot if any.
  void CheckStatus(DeviceWorkspace workspace, const StoreInputs& inputs, CacheRef cache,
                   StreamHandle stream) const;
  // A debugging aid for engines, not for the step loop: before a Store, copies `inputs`'
  // slot_mapping from the device (synchronizing `stream` after the copy) and applies the CPU
  // store's slot checks (ValidateSlotMapping: in range, no slot written twice), so that a bad
  // mapping is refused before any byte of the cache is written (Store itself never reads the
  // slots on the host; it skips out-of-range ones, and two tokens of one slot race).
  void CheckSlots(const StoreInputs& inputs, CacheRef cache, StreamHandle stream) const;

 private:
  Quantizer quantizer_;
  StoreOptions options_;
  StorePath path_;
  store::BucketLut lut_;
  DeviceAllocation tables_;  // store::DeviceTables
  // kGemm: Πᵀ [D, D], fp32 (or bf16 for GemmPrecision::kBf16); kMma: the fp16 hi/lo of
  // store::StoreParams::rotation_f16.
  DeviceAllocation rotation_;
  // kGemm with GemmPrecision::kFp32: the hi, mid and lo bf16 parts of Πᵀ, [3][D, D]
  // (store::SplitRotationBf16).
  DeviceAllocation rotation_split_;
  std::unique_ptr<CublasHandle> blas_;
};

namespace store {

// The bucketize lookup table of quant/store_device.h for increasing `midpoints`: entries and grid.
// cells == 0 when the midpoints are too close together for kMaxLutCells cells.
struct BucketLutTable {
  std::vector<LutEntry> entries;
  BucketLut grid;
};
BucketLutTable BuildBucketLut(std::span<const float> midpoints);

// Πᵀ ([D, D] row-major, as Rotation::matrix) for the tensor-core path: hi = fp16(2^8 · Πᵀ) and
// lo = fp16(2^8 · Πᵀ − hi) (round to nearest even), each transposed: out[n·D + k] = hi of
// Πᵀ[k][n], out[D² + n·D + k] = lo of it (StoreParams::rotation_f16).
std::vector<uint16_t> SplitRotationF16(std::span<const float> pit, int d);

// Πᵀ ([D, D] row-major) as three bf16 arrays, hi = bf16(Πᵀ), mid = bf16(Πᵀ − hi), lo = bf16(Πᵀ −
// hi − mid) (round to nearest even; each difference is exact in fp32), one after the other:
// hi + mid + lo equals Πᵀ to ~2^-24 relative (exactly for most entries).
std::vector<uint16_t> SplitRotationBf16(std::span<const float> pit);

}  // namespace store
}  // namespace tqkv
