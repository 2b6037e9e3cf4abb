#include "model/cuda_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "attention/attention_cuda.h"
#include "runtime/error.h"

#if TQKV_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "model/llama_kernels.h"
#include "quant/numerics.h"
#include "quant/store_cuda.h"
#include "runtime/cuda_check.h"
#include "runtime/memory.h"
#include "runtime/stream.h"
#endif

namespace tqkv::model {

#if TQKV_HAVE_CUDA
namespace {

// Grows a buffer (to at least twice its size); true when it moved.
template <typename T>
bool Ensure(DeviceBuffer<T>& b, int64_t n) {
  if (b.size() >= n) return false;
  b = DeviceBuffer<T>(std::max<int64_t>(n, 2 * b.size()));
  return true;
}
template <typename T>
void Ensure(PinnedHostBuffer<T>& b, int64_t n) {
  if (b.size() < n) b = PinnedHostBuffer<T>(std::max<int64_t>(n, 2 * b.size()));
}
bool Ensure(DeviceAllocation& a, int64_t bytes) {
  if (a.size_bytes() >= bytes) return false;
  a = DeviceAllocation(std::max<int64_t>(bytes, 2 * a.size_bytes()));
  return true;
}

struct GraphExecDeleter {
  void operator()(CUgraphExec_st* exec) const { (void)cudaGraphExecDestroy(exec); }
};
using GraphExec = std::unique_ptr<CUgraphExec_st, GraphExecDeleter>;

// cuBLAS's recommended workspace on Hopper, set on the handle so that it never allocates while a
// graph is captured.
constexpr int64_t kCublasWorkspaceBytes = int64_t{32} << 20;

// fp32 rows [out, in] of several matrices, stacked along out, as bf16 on the device.
DeviceBuffer<uint16_t> UploadBf16(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<uint16_t> host;
  for (const std::vector<float>* p : parts) {
    for (float x : *p) host.push_back(FloatToBFloat16Bits(x));
  }
  DeviceBuffer<uint16_t> d(static_cast<int64_t>(host.size()));
  d.CopyFromHost(host);
  return d;
}

DeviceBuffer<float> UploadF32(const std::vector<float>& v) {
  DeviceBuffer<float> d(static_cast<int64_t>(v.size()));
  d.CopyFromHost(v);
  return d;
}

}  // namespace

struct CudaEngine::Device {
  struct Layer {
    DeviceBuffer<float> attn_norm, ffn_norm;
    DeviceBuffer<uint16_t> qkv, wo, gate_up, down;  // bf16 [out, in]
  };
  Stream stream;
  CublasHandle blas;
  std::vector<Layer> layers;
  DeviceBuffer<float> embedding, output_norm;
  DeviceBuffer<uint16_t> output;  // bf16 [vocab, hidden]
  std::optional<StoreDeviceState> store;
  std::optional<CudaAttention> attention, attention_bf16;
  int64_t weight_bytes = 0;

  // Per-step buffers, grown to the largest step so far.
  PinnedHostBuffer<int32_t> host_ints;  // tokens, positions, logit rows
  PinnedHostBuffer<float> host_logits;
  PinnedHostBuffer<int32_t> host_argmax;
  DeviceBuffer<int32_t> ints;
  DeviceBuffer<uint8_t> batch;
  DeviceBuffer<float> x, qkv, q, k, v, lse, gate_up, logits;
  DeviceBuffer<uint16_t> h, attn, act, last;
  DeviceBuffer<int32_t> argmax;
  DeviceAllocation store_ws, attention_ws, cublas_ws;
  // Decode-step graphs by (rows, block-table width); cleared when a buffer they use moves.
  std::map<std::pair<int, int>, GraphExec> graphs;
  int64_t graphs_captured = 0;

  // y[n, out] (fp32) = x[n, in] (bf16) · w[out, in]ᵀ (bf16), plus y when accumulate.
  void Gemm(const uint16_t* w, const uint16_t* xin, int n, int in, int out, float* y,
            bool accumulate) {
    const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    TQKV_CUBLAS_CHECK(cublasGemmEx(blas.get(), CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, w,
                                   CUDA_R_16BF, in, xin, CUDA_R_16BF, in, &beta, y, CUDA_R_32F,
                                   out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
};

CudaEngine::CudaEngine(const LlamaModel& model, KvPolicy policy, CudaEngineOptions options)
    : Engine(model, std::move(policy), CacheDevice::kCuda),
      options_(options),
      dev_(std::make_unique<Device>()) {
  // Block tables wider than the attention kernels' longest context are refused by every Compute,
  // after the step was scheduled.
  const int64_t max_width = CudaAttention::kMaxContextTokens / policy_.block_size;
  if (options_.width_multiple < 1 || options_.width_multiple > max_width) {
    throw InvalidArgument(
        "CudaEngine", "options.width_multiple", options_.width_multiple,
        fmt::format("1 to {} (block tables of at most {} tokens at block size {})", max_width,
                    CudaAttention::kMaxContextTokens, policy_.block_size));
  }
  width_multiple_ = options_.width_multiple;
  Device& d = *dev_;
  copy_stream_ = d.stream.get();
  d.blas.SetStream(d.stream.get());  // (resets the workspace: set it after)
  d.cublas_ws = DeviceAllocation(kCublasWorkspaceBytes);
  TQKV_CUBLAS_CHECK(cublasSetWorkspace(d.blas.get(), d.cublas_ws.data(), kCublasWorkspaceBytes));
  const LlamaConfig& c = model_.config();
  for (int l = 0; l < c.num_layers; ++l) {
    const LlamaModel::LayerWeights& w = model_.layer(l);
    Device::Layer layer;
    layer.attn_norm = UploadF32(w.attn_norm);
    layer.ffn_norm = UploadF32(w.ffn_norm);
    layer.qkv = UploadBf16({&w.wq, &w.wk, &w.wv});
    layer.wo = UploadBf16({&w.wo});
    layer.gate_up = UploadBf16({&w.gate, &w.up});
    layer.down = UploadBf16({&w.down});
    d.weight_bytes += layer.attn_norm.size_bytes() + layer.ffn_norm.size_bytes() +
                      layer.qkv.size_bytes() + layer.wo.size_bytes() +
                      layer.gate_up.size_bytes() + layer.down.size_bytes();
    d.layers.push_back(std::move(layer));
  }
  d.embedding = UploadF32(model_.embedding());
  d.output_norm = UploadF32(model_.output_norm());
  d.output = UploadBf16({&model_.output()});
  d.weight_bytes += d.embedding.size_bytes() + d.output_norm.size_bytes() + d.output.size_bytes();
  if (quantizer_) {
    d.store.emplace(*quantizer_);
    d.attention.emplace(*quantizer_);
  }
  if (std::count(bf16_layer_.begin(), bf16_layer_.end(), true) > 0) {
    d.attention_bf16.emplace(bf16_format_.bf16_format);
  }
}

CudaEngine::~CudaEngine() = default;

int64_t CudaEngine::weight_bytes() const { return dev_->weight_bytes; }

int64_t CudaEngine::graphs_captured() const { return dev_->graphs_captured; }

void CudaEngine::Compute(std::span<const int32_t> tokens, std::span<const int32_t> logit_rows,
                         float* logits, int32_t* argmax) {
  CheckStep("CudaEngine::Compute", tokens, logit_rows);
  Device& d = *dev_;
  const LlamaConfig& c = model_.config();
  const StreamHandle stream = d.stream.get();
  const int n = static_cast<int>(tokens.size());
  const int rows = static_cast<int>(logit_rows.size());
  const int hid = c.hidden, hq = c.num_heads, hk = c.num_kv_heads, hd = c.head_dim;

  bool moved = false;  // a buffer a captured graph uses was reallocated
  // ... and the graphs go with it on every exit: a throw below (a plan refused, an allocation
  // failed) after a buffer moved left graphs that a later step replayed on freed memory.
  struct DropGraphsIfMoved {
    const bool& moved;
    Device& d;
    ~DropGraphsIfMoved() {
      if (moved) d.graphs.clear();
    }
  } drop_graphs{moved, d};
  moved |= Ensure(d.x, int64_t{n} * hid);
  moved |= Ensure(d.h, int64_t{n} * std::max(hid, c.ffn));
  moved |= Ensure(d.qkv, int64_t{n} * (hq + 2 * hk) * hd);
  moved |= Ensure(d.q, int64_t{n} * hq * hd);
  moved |= Ensure(d.k, int64_t{n} * hk * hd);
  moved |= Ensure(d.v, int64_t{n} * hk * hd);
  moved |= Ensure(d.attn, int64_t{n} * hq * hd);
  moved |= Ensure(d.lse, int64_t{n} * hq);
  moved |= Ensure(d.gate_up, int64_t{n} * 2 * c.ffn);
  moved |= Ensure(d.act, int64_t{n} * c.ffn);
  moved |= Ensure(d.last, int64_t{std::max(rows, 1)} * hid);
  moved |= Ensure(d.logits, int64_t{std::max(rows, 1)} * c.vocab);
  moved |= Ensure(d.argmax, std::max(rows, 1));
  moved |= Ensure(d.ints, 2 * int64_t{n} + rows);
  Ensure(d.host_argmax, std::max(rows, 1));
  Ensure(d.host_ints, 2 * int64_t{n} + rows);

  // One upload of the step's tokens, positions and logit rows, one of the batch.
  std::copy(tokens.begin(), tokens.end(), d.host_ints.data());
  std::copy(positions_.begin(), positions_.end(), d.host_ints.data() + n);
  std::copy(logit_rows.begin(), logit_rows.end(), d.host_ints.data() + 2 * n);
  d.ints.CopyFromHost(std::span<const int32_t>(d.host_ints.data(), 2 * static_cast<size_t>(n) + rows),
                      0, stream);
  const void* batch_before = d.batch.data();
  const StepBatchView view = UploadStepBatch(batch_, d.batch, stream);
  moved |= d.batch.data() != batch_before;

  // Attention plans (host only) and their workspace.
  // The decoding requests at the front of the batch (one new token, or one plus its drafts) run
  // on the decode kernels in place, beside the prompt chunks' kernel.
  int max_q_len = 0;
  for (int32_t i = 0; i < batch_.num_requests(); ++i) {
    max_q_len = std::max(max_q_len, batch_.query_start_loc()[i + 1] - batch_.query_start_loc()[i]);
  }
  // (Up to the most the plans take in place: past it they would run every row on the prompt
  // chunks' kernel, the one-token ones too.)
  int lead_limit = 16;
  if (d.attention) lead_limit = std::min(lead_limit, d.attention->MaxLeadingQLen(hq));
  if (d.attention_bf16) lead_limit = std::min(lead_limit, d.attention_bf16->MaxLeadingQLen(hq));
  const AttentionOptions options = WithLeadingSequences(
      {}, batch_.query_start_loc().first(batch_.num_requests() + 1), lead_limit);
  std::optional<AttentionPlan> plan, plan_bf16;
  int64_t attention_bytes = 256;
  if (d.attention) {
    plan = d.attention->Plan(batch_.num_requests(), n, hq, batch_.block_table_width(), max_q_len,
                             options);
    attention_bytes = std::max(attention_bytes, plan->workspace_bytes);
  }
  if (d.attention_bf16) {
    plan_bf16 = d.attention_bf16->Plan(batch_.num_requests(), n, hq, batch_.block_table_width(),
                                       max_q_len, options);
    attention_bytes = std::max(attention_bytes, plan_bf16->workspace_bytes);
  }
  moved |= Ensure(d.attention_ws, attention_bytes);
  if (d.store) moved |= Ensure(d.store_ws, d.store->WorkspaceBytes(n));
  if (moved) {
    d.graphs.clear();
    moved = false;  // (graphs captured below use the new buffers)
  }

  const AttentionPlan* p = plan ? &*plan : nullptr;
  const AttentionPlan* pb = plan_bf16 ? &*plan_bf16 : nullptr;
  // A decode step: every sequence one row, every row sampled. Its kernels depend only on the
  // row count and the block-table width (the data they read is uploaded above).
  const bool decode = max_q_len == 1 && n == batch_.num_requests() && rows == n;
  if (decode && options_.decode_graphs) {
    const std::pair<int, int> key(n, batch_.block_table_width());
    auto it = d.graphs.find(key);
    if (it == d.graphs.end()) {
      if (d.graphs.size() >= 64) d.graphs.clear();
      cudaGraph_t graph = nullptr;
      TQKV_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      try {
        Enqueue(n, rows, view, p, pb);
      } catch (...) {
        (void)cudaStreamEndCapture(stream, &graph);
        if (graph != nullptr) (void)cudaGraphDestroy(graph);
        throw;
      }
      TQKV_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      cudaGraphExec_t exec = nullptr;
      const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
      (void)cudaGraphDestroy(graph);
      TQKV_CUDA_CHECK(instantiated);
      it = d.graphs.emplace(key, GraphExec(exec)).first;
      ++d.graphs_captured;
    }
    TQKV_CUDA_CHECK(cudaGraphLaunch(it->second.get(), stream));
  } else {
    Enqueue(n, rows, view, p, pb);
  }

  if (rows > 0 && argmax != nullptr) {
    d.argmax.CopyToHost(std::span<int32_t>(d.host_argmax.data(), static_cast<size_t>(rows)), 0,
                        stream);
  }
  if (rows > 0 && logits != nullptr) {
    Ensure(d.host_logits, int64_t{rows} * c.vocab);
    d.logits.CopyToHost(std::span<float>(d.host_logits.data(), static_cast<size_t>(rows) * c.vocab),
                        0, stream);
  }
  d.stream.Synchronize();  // the step's one synchronization
  if (argmax != nullptr) std::copy_n(d.host_argmax.data(), rows, argmax);
  if (logits != nullptr) std::copy_n(d.host_logits.data(), int64_t{rows} * c.vocab, logits);
}

void CudaEngine::Enqueue(int n, int rows, const StepBatchView& view, const AttentionPlan* plan,
                         const AttentionPlan* plan_bf16) {
  Device& d = *dev_;
  const LlamaConfig& c = model_.config();
  const StreamHandle stream = d.stream.get();
  const int hid = c.hidden, hq = c.num_heads, hk = c.num_kv_heads, hd = c.head_dim;
  const int32_t* tokens_d = d.ints.data();
  const int32_t* positions_d = d.ints.data() + n;
  const int32_t* rows_d = d.ints.data() + 2 * n;
  TQKV_CHECK(cuda::LaunchEmbed(d.embedding.data(), tokens_d, n, hid, d.x.data(), stream));
  for (int l = 0; l < c.num_layers; ++l) {
    Device::Layer& w = d.layers[l];
    TQKV_CHECK(cuda::LaunchRmsNorm(d.x.data(), nullptr, n, hid, w.attn_norm.data(), c.rms_eps,
                                   d.h.data(), stream));
    d.Gemm(w.qkv.data(), d.h.data(), n, hid, (hq + 2 * hk) * hd, d.qkv.data(), false);
    TQKV_CHECK(cuda::LaunchRopeSplit(d.qkv.data(), positions_d, n, hq, hk, hd, c.rope_base,
                                     d.q.data(), d.k.data(), d.v.data(), stream));
    const CacheRef layer = LayerRef(l);
    const bool bf16 = bf16_layer_[l];
    if (bf16) {
      TQKV_CHECK(cuda::LaunchStoreBf16(bf16_format_.bf16_format, d.k.data(), d.v.data(),
                                       view.slot_mapping, n, layer.data, stream));
    } else {
      StoreInputs in;
      in.key = d.k.data();
      in.value = d.v.data();
      in.dtype = DType::kF32;
      in.slot_mapping = view.slot_mapping;
      in.slot_dtype = DType::kI64;
      in.num_tokens = n;
      d.store->Store(in, layer, {d.store_ws.data(), d.store_ws.size_bytes()}, stream);
    }
    AttentionArgs a;
    a.query = d.q.data();
    a.query_dtype = DType::kF32;
    a.num_seqs = view.num_requests;
    a.num_tokens = n;
    a.num_q_heads = hq;
    a.query_start_loc = view.query_start_loc;
    a.seq_lens = view.seq_lens;
    a.block_tables = view.block_tables;
    a.max_blocks_per_seq = view.block_table_width;
    a.cache = layer;
    a.output = d.attn.data();
    a.output_dtype = DType::kBF16;
    a.lse = d.lse.data();
    a.workspace = d.attention_ws.data();
    a.workspace_bytes = d.attention_ws.size_bytes();
    if (bf16) {
      d.attention_bf16->Run(*plan_bf16, a, stream);
    } else {
      d.attention->Run(*plan, a, stream);
    }
    d.Gemm(w.wo.data(), d.attn.data(), n, hid, hid, d.x.data(), true);
    TQKV_CHECK(cuda::LaunchRmsNorm(d.x.data(), nullptr, n, hid, w.ffn_norm.data(), c.rms_eps,
                                   d.h.data(), stream));
    d.Gemm(w.gate_up.data(), d.h.data(), n, hid, 2 * c.ffn, d.gate_up.data(), false);
    TQKV_CHECK(cuda::LaunchSwiGlu(d.gate_up.data(), n, c.ffn, d.act.data(), stream));
    d.Gemm(w.down.data(), d.act.data(), n, c.ffn, hid, d.x.data(), true);
  }
  if (rows > 0) {
    TQKV_CHECK(cuda::LaunchRmsNorm(d.x.data(), rows_d, rows, hid, d.output_norm.data(), c.rms_eps,
                                   d.last.data(), stream));
    d.Gemm(d.output.data(), d.last.data(), rows, hid, c.vocab, d.logits.data(), false);
    TQKV_CHECK(cuda::LaunchArgmax(d.logits.data(), rows, c.vocab, d.argmax.data(), stream));
  }
  TQKV_CHECK_LAUNCH("CudaEngine::Compute");
}

#else

struct CudaEngine::Device {};

CudaEngine::CudaEngine(const LlamaModel& model, KvPolicy policy, CudaEngineOptions options)
    : Engine(model, std::move(policy), CacheDevice::kCpu), options_(options) {
  throw Error("CudaEngine: this build has no CUDA support");
}

CudaEngine::~CudaEngine() = default;

int64_t CudaEngine::weight_bytes() const { return 0; }

int64_t CudaEngine::graphs_captured() const { return 0; }

void CudaEngine::Enqueue(int, int, const StepBatchView&, const AttentionPlan*,
                         const AttentionPlan*) {}

void CudaEngine::Compute(std::span<const int32_t>, std::span<const int32_t>, float*, int32_t*) {
  throw Error("CudaEngine: this build has no CUDA support");
}

#endif

int CudaEngine::MaxStepSequences() const { return CudaAttention::kMaxSeqs; }

int CudaEngine::MaxStepTokens() const {
  return std::numeric_limits<int32_t>::max() / model_.config().num_heads;
}

}  // namespace tqkv::model
