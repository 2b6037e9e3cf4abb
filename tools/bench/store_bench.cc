// Benchmark of the CUDA store (quant/store_cuda.h) on the shapes: Hk = 8, D = 128, bf16,
// block 16, N = 16 .. 65,536 tokens, every preset, both rotation paths. Prints µs per call (CUDA
// events, median of batches, inputs rotated over more than 4x the L2), µs per call inside a CUDA
// graph for small N, the minimum bytes (read K and V once, write the slots once), GB/s and the
// fraction of the copy ceiling measured in the same run. Also: cuBLAS GEMM alone and one read of y
// (the GEMM path's own floor), index flip rates of every rotation path against the CPU reference,
// and input/output files for tools/bench/store_seed_bench.py (the vLLM Triton seed on the same
// inputs).
//
// Usage: store_bench [--out DIR] [--seed-dir DIR] [--quick] [--fwht-only]
//   DIR defaults to $LOG_DIR or "."; --seed-dir defaults to /tmp/store_bench. --fwht-only: the
//   default path of every preset at N = 16 (graph) and 65,536, three rounds, for A/B runs.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if TQKV_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

#include "quant/numerics.h"
#include "quant/packing.h"
#include "quant/quantizer.h"
#include "quant/store_cuda.h"
#if TQKV_HAVE_CUDA
#include "runtime/cuda_check.h"
#endif
#include "runtime/device.h"
#include "runtime/memory.h"
#include "runtime/safetensors.h"
#include "runtime/stream.h"
#include "tools/bench/store_bench_kernels.h"

#if TQKV_HAVE_CUDA
namespace tqkv {
namespace {

using json = nlohmann::json;

constexpr int kHeads = 8, kHeadDim = 128, kBlock = 16;
const char* const kPresets[] = {"turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                                "turboquant_3bit_nc"};

uint8_t Poison(int64_t i) { return static_cast<uint8_t>((i * 131 + 7) ^ (i >> 11)); }

// Median over `batches` of (time of `per_batch` calls) / per_batch, in µs.
double MedianUs(const std::function<void(int)>& call, int per_batch, int batches,
                StreamHandle stream) {
  Event start, end;
  std::vector<double> us;
  int i = 0;
  for (int b = 0; b < batches; ++b) {
    start.Record(stream);
    for (int k = 0; k < per_batch; ++k) call(i++);
    end.Record(stream);
    end.Synchronize();
    us.push_back(1000.0 * Event::ElapsedMs(start, end) / per_batch);
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// Picks a batch so that one batch takes about 2 ms, then measures.
double TimeUs(const std::function<void(int)>& call, StreamHandle stream) {
  for (int w = 0; w < 3; ++w) call(w);
  TQKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  const double one = MedianUs(call, 1, 5, stream);
  const int per_batch = static_cast<int>(std::clamp(2000.0 / std::max(one, 1.0), 1.0, 200.0));
  return MedianUs(call, per_batch, 15, stream);
}

// `calls` calls captured into one graph, replayed; µs per call.
double GraphUs(const std::function<void(int)>& call, int calls, StreamHandle stream) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TQKV_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < calls; ++i) call(i);
  TQKV_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  TQKV_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  auto replay = [&](int) { TQKV_CUDA_CHECK(cudaGraphLaunch(exec, stream)); };
  for (int w = 0; w < 3; ++w) replay(w);
  const double us = MedianUs(replay, 1, 21, stream) / calls;
  TQKV_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TQKV_CUDA_CHECK(cudaGraphDestroy(graph));
  return us;
}

struct Ceilings {
  double copy_gbps = 0, read_gbps = 0;
};

Ceilings MeasureCeilings(StreamHandle stream) {
  const int64_t bytes = int64_t{2} << 30;
  DeviceAllocation a(bytes), b(bytes);
  DeviceBuffer<uint32_t> sink(1024);
  a.FillBytes(0x5A, stream);
  b.FillBytes(0xA5, stream);
  Ceilings c;
  const double copy_us = MedianUs(
      [&](int i) {
        TQKV_CUDA_CHECK(cudaMemcpyAsync(i % 2 ? a.data() : b.data(), i % 2 ? b.data() : a.data(),
                                        bytes, cudaMemcpyDeviceToDevice, stream));
      },
      1, 11, stream);
  c.copy_gbps = 2.0 * bytes / copy_us / 1e3;
  const double read_us = MedianUs(
      [&](int i) { bench::ReadOnlyPass(i % 2 ? a.data() : b.data(), bytes, sink.data(), stream); },
      1, 11, stream);
  c.read_gbps = 1.0 * bytes / read_us / 1e3;
  return c;
}

// Inputs of one shape: `sets` rotating copies of K and V, one slot mapping, one cache.
struct Shape {
  int64_t n = 0;
  int sets = 1;
  DeviceAllocation key, value;  // [sets][n, H, D] bf16
  DeviceBuffer<int64_t> slots;
  int64_t num_blocks = 0;
  std::vector<int64_t> host_slots;

  Shape(int64_t tokens, int64_t l2_bytes, uint64_t seed, StreamHandle stream) : n(tokens) {
    const int64_t set_bytes = n * kHeads * kHeadDim * 2;
    sets = static_cast<int>(std::clamp<int64_t>((4 * l2_bytes) / (2 * set_bytes) + 1, 2, 4096));
    key = DeviceAllocation(set_bytes * sets);
    value = DeviceAllocation(set_bytes * sets);
    bench::FillRowsBf16(static_cast<uint16_t*>(key.data()), n * kHeads * sets, kHeadDim, seed,
                        false, true, stream);
    bench::FillRowsBf16(static_cast<uint16_t*>(value.data()), n * kHeads * sets, kHeadDim, seed + 1,
                        true, false, stream);
    // Decode-sized batches: one token per sequence, scattered over blocks. Prefill-sized: runs
    // of consecutive positions in shuffled blocks.
    std::mt19937_64 rng(seed);
    host_slots.resize(n);
    if (n <= 256) {
      num_blocks = n * 4;
      std::vector<int64_t> blocks(num_blocks);
      std::iota(blocks.begin(), blocks.end(), 0);
      std::shuffle(blocks.begin(), blocks.end(), rng);
      for (int64_t t = 0; t < n; ++t) host_slots[t] = blocks[t] * kBlock + rng() % kBlock;
    } else {
      num_blocks = (n + kBlock - 1) / kBlock + 8;
      std::vector<int64_t> blocks(num_blocks);
      std::iota(blocks.begin(), blocks.end(), 0);
      std::shuffle(blocks.begin(), blocks.end(), rng);
      for (int64_t t = 0; t < n; ++t) host_slots[t] = blocks[t / kBlock] * kBlock + t % kBlock;
    }
    slots = DeviceBuffer<int64_t>(n);
    slots.CopyFromHost(host_slots);
    // Pageable synchronous copies may return before the data lands; stores run on a
    // non-blocking stream.
    TQKV_CUDA_CHECK(cudaDeviceSynchronize());
  }
  const void* Key(int i) const {
    return static_cast<const uint8_t*>(key.data()) + (i % sets) * n * kHeads * kHeadDim * 2;
  }
  const void* Value(int i) const {
    return static_cast<const uint8_t*>(value.data()) + (i % sets) * n * kHeads * kHeadDim * 2;
  }
  StoreInputs Inputs(int i) const {
    StoreInputs in;
    in.key = Key(i);
    in.value = Value(i);
    in.dtype = DType::kBF16;
    in.slot_mapping = slots.data();
    in.slot_dtype = DType::kI64;
    in.num_tokens = n;
    return in;
  }
};

struct Row {
  std::string preset, path;
  int64_t n = 0;
  double us = 0, graph_us = 0, min_bytes = 0;
};

template <typename T>
std::vector<T> ToHost(const void* src, int64_t count) {
  std::vector<T> out(count);
  TQKV_CUDA_CHECK(cudaMemcpy(out.data(), src, count * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

// Flip rate of one path against StoreCpu: differing MSE indices / all indices, and the largest
// index difference.
struct FlipRate {
  int64_t indices = 0, flips = 0;
  int max_delta = 0;
};

FlipRate MeasureFlips(const Quantizer& q, const StoreOptions& options, const Shape& s,
                      const std::vector<uint8_t>& reference, StreamHandle stream) {
  const StoreDeviceState state(q, options);
  const BlockFormat& f = q.format();
  DeviceAllocation cache(s.num_blocks * f.block_bytes);
  DeviceAllocation ws(state.WorkspaceBytes(s.n));
  cache.FillBytes(0, stream);
  state.Store(s.Inputs(0),
              {static_cast<uint8_t*>(cache.data()), s.num_blocks, state.quantizer().layout()},
              {ws.data(), ws.size_bytes()}, stream);
  TQKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<uint8_t> gpu = ToHost<uint8_t>(cache.data(), cache.size_bytes());
  FlipRate r;
  for (int64_t slot : s.host_slots) {
    const int64_t block = (slot / f.block_size) * f.block_bytes;
    for (int h = 0; h < f.num_kv_heads; ++h) {
      const int64_t at = block + f.KeyCodesOffset(static_cast<int>(slot % f.block_size), h);
      for (int j = 0; j < f.head_dim; ++j) {
        const int a = UnpackCode(&reference[at], j, f.key_bits);
        const int b = UnpackCode(&gpu[at], j, f.key_bits);
        ++r.indices;
        if (a != b) {
          ++r.flips;
          r.max_delta = std::max(r.max_delta, std::abs(a - b));
        }
      }
    }
  }
  return r;
}

std::vector<uint8_t> ReferenceCache(const Quantizer& q, const Shape& s) {
  const int64_t elems = s.n * kHeads * kHeadDim;
  const std::vector<uint16_t> key = ToHost<uint16_t>(s.Key(0), elems);
  const std::vector<uint16_t> value = ToHost<uint16_t>(s.Value(0), elems);
  std::vector<uint8_t> cache(s.num_blocks * q.format().block_bytes, 0);
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w) {
    const int64_t t0 = s.n * w / threads, t1 = s.n * (w + 1) / threads;
    pool.emplace_back([&, t0, t1] {
      StoreInputs in;
      in.key = key.data() + t0 * kHeads * kHeadDim;
      in.value = value.data() + t0 * kHeads * kHeadDim;
      in.dtype = DType::kBF16;
      in.slot_mapping = s.host_slots.data() + t0;
      in.slot_dtype = DType::kI64;
      in.num_tokens = t1 - t0;
      q.StoreCpu(in, {cache.data(), s.num_blocks, q.layout()});
    });
  }
  for (auto& t : pool) t.join();
  return cache;
}

// Inputs, tables and tqkv's caches of one shape for store_seed_bench.py.
void WriteSeedInputs(const std::string& dir, const char* preset, const Shape& s,
                     StreamHandle stream) {
  const Quantizer q = Quantizer::Create(preset, kHeadDim, kHeads, kBlock);
  const BlockFormat& f = q.format();
  const int64_t elems = s.n * kHeads * kHeadDim;
  SafetensorsFile file;
  auto put = [&](const char* name, DType dtype, std::vector<int64_t> shape, const void* data,
                 int64_t bytes) {
    Tensor t;
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.data.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + bytes);
    file.tensors.emplace(name, std::move(t));
  };
  const std::vector<uint16_t> key = ToHost<uint16_t>(s.Key(0), elems);
  const std::vector<uint16_t> value = ToHost<uint16_t>(s.Value(0), elems);
  put("key", DType::kBF16, {s.n, kHeads, kHeadDim}, key.data(), elems * 2);
  put("value", DType::kBF16, {s.n, kHeads, kHeadDim}, value.data(), elems * 2);
  put("slot_mapping", DType::kI64, {s.n}, s.host_slots.data(), s.n * 8);
  std::vector<uint8_t> init(s.num_blocks * f.block_bytes);
  for (size_t i = 0; i < init.size(); ++i) init[i] = Poison(static_cast<int64_t>(i));
  put("cache_init", DType::kU8, {s.num_blocks, f.block_bytes}, init.data(),
      static_cast<int64_t>(init.size()));
  if (q.uses_rotation()) {
    put("pit", DType::kF32, {kHeadDim, kHeadDim}, q.rotation().matrix.data(),
        kHeadDim * kHeadDim * 4);
    put("centroids", DType::kF32, {q.codebook().size()}, q.codebook().centroids.data(),
        q.codebook().size() * 4);
    put("midpoints", DType::kF32, {q.codebook().size() - 1}, q.codebook().midpoints.data(),
        (q.codebook().size() - 1) * 4);
  }
  std::vector<StoreRotationPath> paths = {StoreRotationPath::kAuto};
  if (q.uses_rotation()) paths.push_back(StoreRotationPath::kMma);
  if (q.uses_rotation()) paths.push_back(StoreRotationPath::kGemm);
  for (StoreRotationPath path : paths) {
    StoreOptions o;
    o.rotation_path = path;
    const StoreDeviceState state(q, o);
    DeviceAllocation cache(s.num_blocks * f.block_bytes);
    cache.CopyFromHost(init.data(), cache.size_bytes(), 0, nullptr);
    TQKV_CUDA_CHECK(cudaDeviceSynchronize());
    DeviceAllocation ws(state.WorkspaceBytes(s.n));
    state.Store(s.Inputs(0),
                {static_cast<uint8_t*>(cache.data()), s.num_blocks, state.quantizer().layout()},
                {ws.data(), ws.size_bytes()}, stream);
    TQKV_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<uint8_t> out = ToHost<uint8_t>(cache.data(), cache.size_bytes());
    put(fmt::format("cache_{}", StorePathName(state.path())).c_str(), DType::kU8,
        {s.num_blocks, f.block_bytes}, out.data(), static_cast<int64_t>(out.size()));
  }
  // The CPU reference, from the same poisoned cache.
  std::vector<uint8_t> ref_poisoned = init;
  {
    StoreInputs in;
    in.key = key.data();
    in.value = value.data();
    in.dtype = DType::kBF16;
    in.slot_mapping = s.host_slots.data();
    in.slot_dtype = DType::kI64;
    in.num_tokens = s.n;
    q.StoreCpu(in, {ref_poisoned.data(), s.num_blocks, q.layout()});
  }
  put("cache_cpu", DType::kU8, {s.num_blocks, f.block_bytes}, ref_poisoned.data(),
      static_cast<int64_t>(ref_poisoned.size()));
  file.metadata = {{"preset", preset},
                   {"block_size", std::to_string(kBlock)},
                   {"norm_correction", q.preset().norm_correction ? "1" : "0"},
                   {"key_bits", std::to_string(f.key_bits)},
                   {"value_bits", std::to_string(f.value_bits)},
                   {"key_data_bytes", std::to_string(f.key_data_bytes)}};
  WriteSafetensors(fmt::format("{}/inputs_{}.safetensors", dir, preset), file);
}

int Main(int argc, char** argv) {
  std::string out_dir = std::getenv("LOG_DIR") ? std::getenv("LOG_DIR") : ".";
  std::string seed_dir = "/tmp/store_bench";
  bool quick = false, profile = false, fwht_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--profile") {
      profile = true;
    } else if (a == "--out" && i + 1 < argc) {
      out_dir = argv[++i];
    } else if (a == "--seed-dir" && i + 1 < argc) {
      seed_dir = argv[++i];
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--fwht-only") {
      fwht_only = true;
    } else {
      std::fprintf(stderr,
                   "usage: store_bench [--out DIR] [--seed-dir DIR] [--quick] [--profile] "
                   "[--fwht-only]\n");
      return 2;
    }
  }
  RequireCudaDevice("store_bench");
  if (profile) {
    // For a profiler (ncu): each path (and the FWHT kernel's variants) once at N = 65,536.
    Stream stream;
    const DeviceInfo dev = QueryDevices().at(0);
    const Shape s(65536, dev.l2_cache_bytes, 7, stream.get());
    struct Config {
      const char* preset;
      StoreRotationPath path;
      StoreFwhtKernel kernel;
    };
    constexpr StoreFwhtKernel kAuto = StoreFwhtKernel::kAuto;
    for (const Config& c :
         {Config{"turboquant_4bit_nc", StoreRotationPath::kFwht, kAuto},
          Config{"turboquant_4bit_nc", StoreRotationPath::kFwht, StoreFwhtKernel::kNarrow},
          Config{"turboquant_4bit_nc", StoreRotationPath::kFwht, StoreFwhtKernel::kWideFp32},
          Config{"turboquant_4bit_nc", StoreRotationPath::kMma, kAuto},
          Config{"turboquant_4bit_nc", StoreRotationPath::kGemm, kAuto},
          Config{"turboquant_k8v4", StoreRotationPath::kAuto, kAuto},
          Config{"turboquant_k3v4_nc", StoreRotationPath::kFwht, kAuto},
          Config{"turboquant_3bit_nc", StoreRotationPath::kFwht, kAuto}}) {
      const Quantizer q = Quantizer::Create(c.preset, kHeadDim, kHeads, kBlock);
      StoreOptions o;
      o.rotation_path = c.path;
      o.validate_slots = false;
      o.fwht_kernel = c.kernel;
      const StoreDeviceState state(q, o);
      DeviceAllocation cache(s.num_blocks * q.format().block_bytes);
      DeviceAllocation ws(state.WorkspaceBytes(s.n));
      state.Store(s.Inputs(0),
                  {static_cast<uint8_t*>(cache.data()), s.num_blocks, state.quantizer().layout()},
                  {ws.data(), ws.size_bytes()}, stream.get());
      stream.Synchronize();
    }
    return 0;
  }
  std::filesystem::create_directories(out_dir);
  std::filesystem::create_directories(seed_dir);
  const DeviceInfo dev = QueryDevices().at(0);
  std::printf("device: %s, %d SMs, L2 %lld MB\n", dev.name.c_str(), dev.sm_count,
              static_cast<long long>(dev.l2_cache_bytes >> 20));
  Stream stream;
  const Ceilings ceil = MeasureCeilings(stream.get());
  std::printf("copy ceiling %.0f GB/s (read + write bytes), read-only %.0f GB/s\n", ceil.copy_gbps,
              ceil.read_gbps);
  json report;
  report["device"] = dev.name;
  report["copy_gbps"] = ceil.copy_gbps;
  report["read_gbps"] = ceil.read_gbps;

  if (fwht_only) {  // the default path (FWHT for the MSE presets), three rounds
    for (int round = 0; round < 3; ++round) {
      for (int64_t n : {int64_t{16}, int64_t{65536}}) {
        const Shape s(n, dev.l2_cache_bytes, 1000 + n, stream.get());
        for (const char* preset : kPresets) {
          const Quantizer q = Quantizer::Create(preset, kHeadDim, kHeads, kBlock);
          StoreOptions o;
          o.validate_slots = false;
          const StoreDeviceState state(q, o);
          DeviceAllocation cache(s.num_blocks * q.format().block_bytes);
          cache.FillBytes(0, stream.get());
          DeviceAllocation ws(state.WorkspaceBytes(n));
          auto call = [&](int i) {
            state.Store(
                s.Inputs(i),
                {static_cast<uint8_t*>(cache.data()), s.num_blocks, state.quantizer().layout()},
                {ws.data(), ws.size_bytes()}, stream.get());
          };
          const double min_bytes = double(n) * kHeads * (4.0 * kHeadDim + q.format().slot_bytes);
          const double us =
              n <= 256 ? GraphUs(call, 100, stream.get()) : TimeUs(call, stream.get());
          std::printf("round %d %-20s %-5s N=%6lld  %9.2f us%s  %5.1f%% of copy\n", round, preset,
                      StorePathName(state.path()).data(), static_cast<long long>(n), us,
                      n <= 256 ? " (graph)" : "", 100.0 * min_bytes / us / 1e3 / ceil.copy_gbps);
          std::fflush(stdout);
        }
      }
    }
    return 0;
  }

  std::vector<int64_t> sizes = {16, 64, 256, 2048, 16384, 65536};
  if (quick) sizes = {16, 2048, 65536};
  std::vector<Row> rows;
  for (int64_t n : sizes) {
    const Shape s(n, dev.l2_cache_bytes, 1000 + n, stream.get());
    for (const char* preset : kPresets) {
      const Quantizer q = Quantizer::Create(preset, kHeadDim, kHeads, kBlock);
      const BlockFormat& f = q.format();
      std::vector<StoreRotationPath> paths = {StoreRotationPath::kAuto};
      if (q.uses_rotation()) paths.push_back(StoreRotationPath::kMma);
      if (q.uses_rotation()) paths.push_back(StoreRotationPath::kGemm);
      DeviceAllocation cache(s.num_blocks * f.block_bytes);
      cache.FillBytes(0, stream.get());
      for (StoreRotationPath path : paths) {
        StoreOptions o;
        o.rotation_path = path;
        o.validate_slots = false;  // release default
        const StoreDeviceState state(q, o);
        DeviceAllocation ws(state.WorkspaceBytes(n));
        const CacheRef cref{static_cast<uint8_t*>(cache.data()), s.num_blocks,
                            state.quantizer().layout()};
        const DeviceWorkspace w{ws.data(), ws.size_bytes()};
        auto call = [&](int i) { state.Store(s.Inputs(i), cref, w, stream.get()); };
        Row r;
        r.preset = preset;
        r.path = std::string(StorePathName(state.path()));
        r.n = n;
        r.min_bytes = double(n) * kHeads * (4.0 * kHeadDim + f.slot_bytes);
        r.us = TimeUs(call, stream.get());
        if (n <= 2048) r.graph_us = GraphUs(call, n <= 256 ? 100 : 20, stream.get());
        rows.push_back(r);
        std::printf("%-20s %-5s N=%6lld  %9.2f us  graph %8.2f us  %7.1f GB/s  %5.1f%% of copy\n",
                    preset, r.path.c_str(), static_cast<long long>(n), r.us, r.graph_us,
                    r.min_bytes / r.us / 1e3, 100.0 * r.min_bytes / r.us / 1e3 / ceil.copy_gbps);
        std::fflush(stdout);
      }
    }
    if (n == 2048) {
      for (const char* preset : kPresets) WriteSeedInputs(seed_dir, preset, s, stream.get());
    }
  }
  for (const Row& r : rows) {
    report["store"].push_back({{"preset", r.preset},
                               {"path", r.path},
                               {"n", r.n},
                               {"us", r.us},
                               {"graph_us", r.graph_us},
                               {"min_bytes", r.min_bytes},
                               {"gbps", r.min_bytes / r.us / 1e3},
                               {"frac_copy", r.min_bytes / r.us / 1e3 / ceil.copy_gbps}});
  }

  // The FWHT kernel's builds (StoreOptions::fwht_kernel, D = 128 bf16): 0 = the default (the wide
  // kernel from 32,768 rows, the narrow one below), 1 = the narrow kernel at any size, 3 = the wide
  // kernel with its FWHT as fp32 butterflies only (the default runs its H16 stages on tensor
  // cores). The GEMM path has one kernel (its row is the reference for the path). Same bytes but
  // for index flips at midpoints (the kernels sum in other orders) and the k_norm of the rows they
  // occur in.
  // N around 4,096 tokens (32,768 rows: kWideMinRows), where the default switches kernels, and up.
  for (int64_t n : {int64_t{1024}, int64_t{2048}, int64_t{4096}, int64_t{8192}, int64_t{16384},
                    int64_t{65536}}) {
    if (quick && n == 16384) continue;
    const Shape s(n, dev.l2_cache_bytes, 500 + n, stream.get());
    for (const char* preset : {"turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"}) {
      const Quantizer q = Quantizer::Create(preset, kHeadDim, kHeads, kBlock);
      for (StoreRotationPath path : {StoreRotationPath::kFwht, StoreRotationPath::kGemm}) {
        std::vector<uint8_t> first;
        for (StoreFwhtKernel kernel :
             {StoreFwhtKernel::kAuto, StoreFwhtKernel::kNarrow, StoreFwhtKernel::kWideFp32}) {
          if (path != StoreRotationPath::kFwht && kernel != StoreFwhtKernel::kAuto) continue;
          const int variant = static_cast<int>(kernel);
          StoreOptions o;
          o.rotation_path = path;
          o.validate_slots = false;
          o.fwht_kernel = kernel;
          const StoreDeviceState state(q, o);
          DeviceAllocation cache(s.num_blocks * q.format().block_bytes);
          cache.FillBytes(0, stream.get());
          DeviceAllocation ws(state.WorkspaceBytes(n));
          auto call = [&](int i) {
            state.Store(
                s.Inputs(i),
                {static_cast<uint8_t*>(cache.data()), s.num_blocks, state.quantizer().layout()},
                {ws.data(), ws.size_bytes()}, stream.get());
          };
          const double us = TimeUs(call, stream.get());
          // Same inputs (set 0) into a cleared cache: the variants must agree byte for byte.
          cache.FillBytes(0, stream.get());
          call(0);
          TQKV_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
          const std::vector<uint8_t> bytes = ToHost<uint8_t>(cache.data(), cache.size_bytes());
          if (variant == 0) first = bytes;
          const int64_t differ = static_cast<int64_t>(std::inner_product(
              bytes.begin(), bytes.end(), first.begin(), int64_t{0}, std::plus<>(),
              [](uint8_t a, uint8_t b) { return int64_t{a != b}; }));
          std::printf(
              "variant %d %-20s %-4s N=%6lld: %8.2f us (%.1f%% of copy), %lld bytes differ "
              "from variant 0\n",
              variant, preset, StorePathName(state.path()).data(), static_cast<long long>(n), us,
              100.0 * double(n) * kHeads * (4.0 * kHeadDim + q.format().slot_bytes) / us / 1e3 /
                  ceil.copy_gbps,
              static_cast<long long>(differ));
          report["variants"].push_back({{"variant", variant},
                                        {"preset", preset},
                                        {"path", StorePathName(state.path())},
                                        {"n", n},
                                        {"us", us},
                                        {"bytes_differ", differ}});
        }
      }
    }
  }

  // Slot validation's cost (a memset and one compare per row), in a graph at decode size.
  {
    const Shape s(16, dev.l2_cache_bytes, 77, stream.get());
    for (bool validate : {false, true}) {
      const Quantizer q = Quantizer::Create("turboquant_4bit_nc", kHeadDim, kHeads, kBlock);
      StoreOptions o;
      o.validate_slots = validate;
      const StoreDeviceState state(q, o);
      DeviceAllocation cache(s.num_blocks * q.format().block_bytes);
      DeviceAllocation ws(state.WorkspaceBytes(s.n));
      const double us = GraphUs(
          [&](int i) {
            state.Store(
                s.Inputs(i),
                {static_cast<uint8_t*>(cache.data()), s.num_blocks, state.quantizer().layout()},
                {ws.data(), ws.size_bytes()}, stream.get());
          },
          100, stream.get());
      std::printf("4bit_nc fwht N=16 in a graph, validate_slots=%d: %.2f us\n", validate, us);
      report["validate_graph_us"][validate ? "on" : "off"] = us;
    }
  }

  // The GEMM path's own floor at N = 65,536: cuBLAS alone (each precision) and one read of y.
  {
    const int64_t n = quick ? 16384 : 65536, rows_y = n * kHeads;
    DeviceAllocation x(rows_y * kHeadDim * 4), y(rows_y * kHeadDim * 4),
        pit(kHeadDim * kHeadDim * 4);
    DeviceBuffer<uint32_t> sink(1024);
    bench::FillRowsF32(static_cast<float*>(x.data()), rows_y, kHeadDim, 5, stream.get());
    bench::FillRowsF32(static_cast<float*>(pit.data()), kHeadDim, kHeadDim, 6, stream.get());
    CublasHandle blas;
    blas.SetStream(stream.get());
    const float one = 1.0f, zero = 0.0f;
    auto gemm = [&](cublasComputeType_t compute, cudaDataType_t type) {
      TQKV_CUBLAS_CHECK(cublasSetMathMode(blas.get(), compute == CUBLAS_COMPUTE_32F_PEDANTIC
                                                          ? CUBLAS_PEDANTIC_MATH
                                                          : CUBLAS_DEFAULT_MATH));
      return TimeUs(
          [&](int) {
            TQKV_CUBLAS_CHECK(cublasGemmEx(
                blas.get(), CUBLAS_OP_N, CUBLAS_OP_N, kHeadDim, static_cast<int>(rows_y), kHeadDim,
                &one, pit.data(), type, kHeadDim, x.data(), type, kHeadDim, &zero, y.data(),
                CUDA_R_32F, kHeadDim, compute, CUBLAS_GEMM_DEFAULT));
          },
          stream.get());
    };
    const double fp32 = gemm(CUBLAS_COMPUTE_32F_PEDANTIC, CUDA_R_32F);
    const double tf32 = gemm(CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F);
    const double bf16 = gemm(CUBLAS_COMPUTE_32F, CUDA_R_16BF);
    const double read_y = TimeUs(
        [&](int) { bench::ReadOnlyPass(y.data(), y.size_bytes(), sink.data(), stream.get()); },
        stream.get());
    std::printf(
        "N=%lld: cuBLAS GEMM alone fp32 %.1f us, TF32 %.1f us, bf16 %.1f us; one read of "
        "y %.1f us\n",
        static_cast<long long>(n), fp32, tf32, bf16, read_y);
    report["gemm_alone"] = {
        {"n", n}, {"fp32_us", fp32}, {"tf32_us", tf32}, {"bf16_us", bf16}, {"read_y_us", read_y}};
    // The GEMM path with SGEMM for bf16 keys too, and in its lower precisions, for the record.
    const Shape s(n, dev.l2_cache_bytes, 99, stream.get());
    for (GemmPrecision precision :
         {GemmPrecision::kSgemm, GemmPrecision::kTf32, GemmPrecision::kBf16}) {
      const Quantizer q = Quantizer::Create("turboquant_4bit_nc", kHeadDim, kHeads, kBlock);
      StoreOptions o;
      o.rotation_path = StoreRotationPath::kGemm;
      o.gemm_precision = precision;
      o.validate_slots = false;
      const StoreDeviceState state(q, o);
      DeviceAllocation cache(s.num_blocks * q.format().block_bytes);
      DeviceAllocation ws(state.WorkspaceBytes(n));
      const double us = TimeUs(
          [&](int i) {
            state.Store(
                s.Inputs(i),
                {static_cast<uint8_t*>(cache.data()), s.num_blocks, state.quantizer().layout()},
                {ws.data(), ws.size_bytes()}, stream.get());
          },
          stream.get());
      const char* name = precision == GemmPrecision::kSgemm  ? "sgemm"
                         : precision == GemmPrecision::kTf32 ? "tf32"
                                                             : "bf16";
      std::printf("4bit_nc gemm-%s N=%lld: %.1f us\n", name, static_cast<long long>(n), us);
      report["gemm_precision_us"][name] = us;
    }
  }

  // Index flips of every rotation path against the CPU reference (N = 4096: 32,768 rows).
  {
    const Shape s(4096, dev.l2_cache_bytes, 4242, stream.get());
    for (const char* preset : {"turboquant_4bit_nc", "turboquant_3bit_nc"}) {
      const Quantizer q = Quantizer::Create(preset, kHeadDim, kHeads, kBlock);
      const std::vector<uint8_t> ref = ReferenceCache(q, s);
      struct Variant {
        const char* name;
        StoreRotationPath path;
        GemmPrecision precision;
      };
      for (const Variant& v :
           {Variant{"fwht", StoreRotationPath::kFwht, GemmPrecision::kFp32},
            Variant{"mma", StoreRotationPath::kMma, GemmPrecision::kFp32},
            Variant{"gemm-fp32", StoreRotationPath::kGemm, GemmPrecision::kFp32},
            Variant{"gemm-sgemm", StoreRotationPath::kGemm, GemmPrecision::kSgemm},
            Variant{"gemm-tf32", StoreRotationPath::kGemm, GemmPrecision::kTf32},
            Variant{"gemm-bf16", StoreRotationPath::kGemm, GemmPrecision::kBf16}}) {
        StoreOptions o;
        o.rotation_path = v.path;
        o.gemm_precision = v.precision;
        const FlipRate r = MeasureFlips(q, o, s, ref, stream.get());
        std::printf(
            "%s %-9s: %lld of %lld indices differ from the CPU reference (%.2e), max "
            "|delta| %d\n",
            preset, v.name, static_cast<long long>(r.flips), static_cast<long long>(r.indices),
            double(r.flips) / r.indices, r.max_delta);
        report["flips"].push_back({{"preset", preset},
                                   {"variant", v.name},
                                   {"flips", r.flips},
                                   {"indices", r.indices},
                                   {"max_delta", r.max_delta}});
      }
    }
  }

  const std::string path = out_dir + "/store_bench.json";
  std::ofstream(path) << report.dump(1) << "\n";
  std::printf("wrote %s and the seed inputs in %s\n", path.c_str(), seed_dir.c_str());
  return 0;
}

}  // namespace
}  // namespace tqkv

#endif  // TQKV_HAVE_CUDA

int main(int argc, char** argv) {
#if !TQKV_HAVE_CUDA
  (void)argc;
  (void)argv;
  std::fprintf(stderr, "store_bench: this build has no CUDA support\n");
  return 1;
#else
  try {
    return tqkv::Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "store_bench: %s\n", e.what());
    return 1;
  }
#endif
}
