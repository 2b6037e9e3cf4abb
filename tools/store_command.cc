// `tqkv store`: quantize K/V from a safetensors file into a paged cache, with the CPU reference
// (default) or the CUDA store (--device cuda).
#include <fmt/format.h>

#include <unordered_map>

#include "quant/quantizer.h"
#include "quant/store_cuda.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "runtime/safetensors.h"
#include "runtime/stream.h"
#include "tools/cli_util.h"
#include "tools/commands.h"

namespace tqkv::cli {
namespace {

struct StoreFlags {
  QuantizerFlags quant;
  int64_t num_blocks = 0;
  std::string in, cache_in, out;
  std::string device = "cpu";
  std::string rotation_path = "auto";
  std::string gemm_precision = "fp32";
};

// The CPU reference rejects duplicate slots before writing; the device checks only the range, so
// the command checks duplicates here, with the same wording.
void RejectDuplicateSlots(const StoreInputs& in) {
  std::unordered_map<int64_t, int64_t> first;
  for (int64_t t = 0; t < in.num_tokens; ++t) {
    const int64_t slot = in.slot_dtype == DType::kI32
                             ? static_cast<const int32_t*>(in.slot_mapping)[t]
                             : static_cast<const int64_t*>(in.slot_mapping)[t];
    if (slot < 0) continue;
    const auto [it, inserted] = first.emplace(slot, t);
    if (!inserted) {
      throw InvalidArgument(
          "tqkv store", fmt::format("slot_mapping[{}]", t), slot,
          fmt::format("a slot no other token writes (token {} writes it too)", it->second));
    }
  }
}

StoreOptions ParseStoreOptions(const StoreFlags& flags) {
  StoreOptions o;
  o.validate_slots = true;  // a command line reports bad slots whatever the build
  if (flags.rotation_path == "auto") {
    o.rotation_path = StoreRotationPath::kAuto;
  } else if (flags.rotation_path == "fwht") {
    o.rotation_path = StoreRotationPath::kFwht;
  } else if (flags.rotation_path == "mma") {
    o.rotation_path = StoreRotationPath::kMma;
  } else if (flags.rotation_path == "gemm") {
    o.rotation_path = StoreRotationPath::kGemm;
  } else {
    throw InvalidArgument("tqkv store", "--rotation-path", flags.rotation_path,
                          "auto, fwht, mma, gemm");
  }
  if (flags.gemm_precision == "fp32") {
    o.gemm_precision = GemmPrecision::kFp32;
  } else if (flags.gemm_precision == "sgemm") {
    o.gemm_precision = GemmPrecision::kSgemm;
  } else if (flags.gemm_precision == "tf32") {
    o.gemm_precision = GemmPrecision::kTf32;
  } else if (flags.gemm_precision == "bf16") {
    o.gemm_precision = GemmPrecision::kBf16;
  } else {
    throw InvalidArgument("tqkv store", "--gemm-precision", flags.gemm_precision,
                          "fp32, sgemm, tf32, bf16");
  }
  return o;
}

// Uploads inputs and cache, runs StoreDeviceState::Store on the GPU, downloads the cache.
void StoreOnDevice(const Quantizer& q, const StoreOptions& options, const StoreInputs& host,
                   Tensor& cache, int64_t num_blocks) {
  RejectDuplicateSlots(host);
  const StoreDeviceState state(q, options);  // throws without CUDA or a device
  const int64_t elem = DTypeSize(host.dtype) * q.format().num_kv_heads * q.format().head_dim;
  DeviceAllocation key(host.num_tokens * elem), value(host.num_tokens * elem);
  DeviceAllocation slots(host.num_tokens * DTypeSize(host.slot_dtype));
  DeviceAllocation device_cache(static_cast<int64_t>(cache.data.size()));
  DeviceAllocation workspace(state.WorkspaceBytes(host.num_tokens));
  Stream stream;
  key.CopyFromHost(host.key, key.size_bytes(), 0, stream.get());
  value.CopyFromHost(host.value, value.size_bytes(), 0, stream.get());
  slots.CopyFromHost(host.slot_mapping, slots.size_bytes(), 0, stream.get());
  device_cache.CopyFromHost(cache.data.data(), device_cache.size_bytes(), 0, stream.get());
  StoreInputs in = host;
  in.key = key.data();
  in.value = value.data();
  in.slot_mapping = slots.data();
  const CacheRef ref{static_cast<uint8_t*>(device_cache.data()), num_blocks, q.layout()};
  const DeviceWorkspace ws{workspace.data(), workspace.size_bytes()};
  state.Store(in, ref, ws, stream.get());
  state.CheckStatus(ws, in, ref, stream.get());  // synchronizes; names the first bad slot
  device_cache.CopyToHost(cache.data.data(), device_cache.size_bytes(), 0, stream.get());
  stream.Synchronize();
}

void RunStore(const StoreFlags& flags) {
  const SafetensorsFile in = ReadSafetensors(flags.in);
  const StoreInputTensors tensors = RequireStoreInputs(in);
  const Quantizer q = MakeQuantizer(flags.quant, tensors.head_dim, tensors.num_kv_heads, in);
  const BlockFormat& f = q.format();
  CheckNumBlocks(flags.num_blocks, f);

  SafetensorsFile out;
  out.source_name = flags.out;
  Tensor cache;
  if (!flags.cache_in.empty()) {
    SafetensorsFile prev = ReadSafetensors(flags.cache_in);
    CheckCacheMetadata(prev, q);
    cache = TakeStoreCache(prev, flags.num_blocks, f);
  } else {
    cache.dtype = DType::kU8;
    cache.shape = {flags.num_blocks, f.block_bytes};
    cache.data.assign(static_cast<size_t>(flags.num_blocks * f.block_bytes), 0);
  }
  const StoreInputs inputs = MakeStoreInputs(tensors);
  if (flags.device == "cpu") {
    q.StoreCpu(inputs, {cache.data.data(), flags.num_blocks, q.layout()});
  } else if (flags.device == "cuda") {
    StoreOnDevice(q, ParseStoreOptions(flags), inputs, cache, flags.num_blocks);
  } else {
    throw InvalidArgument("tqkv store", "--device", flags.device, "cpu, cuda");
  }
  out.tensors.emplace("cache", std::move(cache));
  out.metadata = CacheMetadata(q);
  WriteSafetensors(flags.out, out);
}

}  // namespace

void AddStoreCommand(CLI::App& app) {
  auto flags = std::make_shared<StoreFlags>();
  auto* cmd = app.add_subcommand(
      "store", "Quantize key/value [N, Hk, D] into a paged cache at slot_mapping [N]");
  AddQuantizerFlags(*cmd, flags->quant, /*block_size_required=*/true);
  cmd->add_option("--num-blocks", flags->num_blocks, "blocks in the cache")->required();
  cmd->add_option("--in", flags->in,
                  "safetensors with key, value, slot_mapping "
                  "[, rotation, centroids]")
      ->required();
  cmd->add_option("--cache-in", flags->cache_in, "cache to update (default: a zero-filled one)");
  cmd->add_option("--out", flags->out, "safetensors to write with 'cache' U8 [NB, block_bytes]")
      ->required();
  cmd->add_option("--device", flags->device,
                  "cpu (the reference, default) or cuda (the GPU store of the same bytes, up to "
                  "MSE index flips at midpoints)");
  cmd->add_option("--rotation-path", flags->rotation_path,
                  "--device cuda: auto (default: in-kernel FWHT for Hadamard rotations, "
                  "otherwise tensor cores in the store kernel at head_dim 64/128 and cuBLAS at "
                  "256), fwht, mma, gemm")
      ->check(CLI::IsMember({"auto", "fwht", "mma", "gemm"}));
  cmd->add_option("--gemm-precision", flags->gemm_precision,
                  "--device cuda, GEMM path: fp32 (default: fp32-accurate; bf16 keys as a 3-part "
                  "bf16 tensor-core GEMM), sgemm (fp32 SGEMM for every dtype), tf32, bf16 (more "
                  "index flips)")
      ->check(CLI::IsMember({"fp32", "sgemm", "tf32", "bf16"}));
  cmd->callback([flags] { RunStore(*flags); });
}

}  // namespace tqkv::cli
