#include "tools/sim_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention/attention_cpu.h"
#include "attention/attention_cuda.h"
#include "kvcache/kv_cache.h"
#include "quant/numerics.h"
#include "quant/store_cuda.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "runtime/stream.h"

#if TQKV_HAVE_CUDA
#include <cuda_runtime.h>

#include "runtime/cuda_check.h"
#endif

namespace tqkv::sim {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// The CPU reference: Quantizer::StoreCpu and AttentionCpu for TurboQuant; for bf16 / fp16, the
// values are rounded to the format's type into the Bf16BlockFormat layout, and AttentionCpu reads
// them back. Each request of the batch is one AttentionCpu call over its row of the tables (the
// same arithmetic as one call over all of them), on all cores.
class CpuBackend : public Backend {
  static uint16_t Bits(const Bf16BlockFormat& f, float x) {
    return f.dtype == DType::kF16 ? FloatToHalfBits(x) : FloatToBFloat16Bits(x);
  }

 public:
  CpuBackend(const CacheFormat& format, const Quantizer* q, int layers, int32_t blocks, int hq,
             int32_t window)
      : format_(format),
        q_(q),
        layers_(layers),
        hq_(hq),
        window_(window),
        cache_(format, layers, blocks, CacheDevice::kCpu) {}

  StepInputs PrepareStep(const StepBatch& batch) override {
    t_ = batch.num_tokens();
    b_ = batch.num_requests();
    const size_t row = size_t(format_.num_kv_heads) * format_.head_dim;
    const size_t q_row = size_t(hq_) * format_.head_dim;
    k_.resize(size_t(layers_) * t_ * row);
    v_.resize(k_.size());
    q_in_.assign(size_t(layers_) * t_ * q_row, 0.0f);
    out_.resize(q_in_.size());
    lse_.resize(size_t(layers_) * t_ * hq_);
    return {k_.data(), v_.data(), q_in_.data()};
  }

  void BeginStep(const StepBatch& batch) override {
    cache_.ApplyCopies(batch.copies());
    view_ = ViewStepBatch(batch, batch.bytes().data());
    result_ = StepResult{};
    result_.output = out_.data();
    result_.lse = lse_.data();
  }

  void Store(int layer) override {
    const auto t0 = Clock::now();
    StoreLayer(layer);
    Account(result_.store, Seconds(t0));
  }

  void Attend(int layer) override {
    const auto t0 = Clock::now();
    ParallelFor(b_, [&](int i) { AttendRow(layer, i); });
    Account(result_.attention, Seconds(t0));
  }

  const StepResult& FinishStep() override { return result_; }

 private:
  static void Account(CallTimes& c, double s) {
    ++c.calls;
    c.host_s += s;
    c.stream_s += s;
    c.kernels_s += s;
  }

  void StoreLayer(int layer) {
    const size_t row = size_t(format_.num_kv_heads) * format_.head_dim;
    const float* k = k_.data() + size_t(layer) * t_ * row;
    const float* v = v_.data() + size_t(layer) * t_ * row;
    const int64_t* slots = view_.slot_mapping;
    if (q_ != nullptr) {
      StoreInputs in;
      in.key = k;
      in.value = v;
      in.dtype = DType::kF32;
      in.slot_mapping = slots;
      in.slot_dtype = DType::kI64;
      in.num_tokens = t_;
      q_->StoreCpu(in, cache_.layer(layer));
      return;
    }
    const Bf16BlockFormat& f = format_.bf16_format;
    const int d = f.head_dim;
    for (int32_t t = 0; t < t_; ++t) {
      if (slots[t] < 0) continue;
      uint8_t* block = cache_.layer_data(layer) + (slots[t] / f.block_size) * f.block_bytes;
      const int pos = static_cast<int>(slots[t] % f.block_size);
      for (int h = 0; h < f.num_kv_heads; ++h) {
        for (int i = 0; i < d; ++i) {
          const size_t at = (size_t(t) * f.num_kv_heads + h) * d + i;
          const uint16_t kb = Bits(f, k[at]), vb = Bits(f, v[at]);
          std::memcpy(block + f.KeyOffset(pos, h) + 2 * i, &kb, 2);
          std::memcpy(block + f.ValueOffset(pos, h) + 2 * i, &vb, 2);
        }
      }
    }
  }

  // Request i's tokens of one layer: one AttentionCpu call over its row of the batch.
  void AttendRow(int layer, int32_t i) {
    const int d = format_.head_dim;
    const int32_t begin = view_.query_start_loc[i];
    const int32_t loc[2] = {0, view_.query_start_loc[i + 1] - begin};
    const size_t at = size_t(layer) * t_ + size_t(begin);
    AttentionArgs a;
    a.query = q_in_.data() + at * hq_ * d;
    a.num_seqs = 1;
    a.num_tokens = loc[1];
    a.num_q_heads = hq_;
    a.query_start_loc = loc;
    a.seq_lens = view_.seq_lens + i;
    a.block_tables = view_.block_tables + size_t(i) * view_.block_table_width;
    a.max_blocks_per_seq = view_.block_table_width;
    a.cache = cache_.layer(layer);
    a.output = out_.data() + at * hq_ * d;
    a.lse = lse_.data() + at * hq_;
    a.sliding_window = window_;
    if (q_ != nullptr) {
      AttentionCpu(*q_, a);
    } else {
      AttentionCpu(format_.bf16_format, a);
    }
  }

  CacheFormat format_;
  const Quantizer* q_;
  int layers_, hq_;
  int32_t window_;
  KVCache cache_;
  int32_t t_ = 0, b_ = 0;
  std::vector<float> k_, v_, q_in_, out_, lse_;
  StepBatchView view_;
  StepResult result_;
};

#if TQKV_HAVE_CUDA
int64_t Align256(int64_t n) { return (n + 255) / 256 * 256; }

// The CUDA path: StoreDeviceState (rotation + fused bucketize/pack kernel) and CudaAttention on
// one stream, the way an engine runs a step:
//  - BeginStep enqueues the copy-on-write copies, UploadStepBatch (slot mapping, block tables,
//    lengths, query starts: one copy from the batch's pinned buffer) and one copy of the step's
//    inputs (every layer's K, V and queries, from pinned memory), and plans the attention once.
//  - Store(l) and Attend(l) only launch, reading device views of those two uploads (no copy, no
//    synchronization): stream order puts them after the uploads and copies, and Attend(l) after
//    Store(l) (a decode-only step's split kernel is a programmatic dependent of the store kernel
//    and waits for it before reading anything, attention/decode_cuda.h).
//  - FinishStep enqueues one copy of every layer's outputs to pinned memory and synchronizes
//    once; only then may the sim reschedule the batch and overwrite the inputs (PrepareStep).
// Timing: events around each Store / Attend call (what the call takes on the stream, host launch
// gaps included), the host time inside each library call, and (kernel_timing) a pass after the
// step's read-back that captures the step's stores, and its attention calls, kReps times over in a
// CUDA graph each and replays it: the kernels alone. Replaying is idempotent (the same bytes to the
// same slots, the same outputs).
class CudaBackend : public Backend {
 public:
  CudaBackend(const CacheFormat& format, const Quantizer* q, int layers, int32_t blocks, int hq,
              int32_t window, bool kernel_timing)
      : layers_(layers),
        hq_(hq),
        hk_(format.num_kv_heads),
        d_(format.head_dim),
        window_(window),
        kernel_timing_(kernel_timing),
        cache_(format, layers, blocks, CacheDevice::kCuda),
        store_(*q),
        attention_(*q) {
    for (int i = 0; i < 4 * layers; ++i) call_events_.emplace_back();
  }

  ~CudaBackend() override {
    if (store_graph_ != nullptr) (void)cudaGraphExecDestroy(store_graph_);
    if (attention_graph_ != nullptr) (void)cudaGraphExecDestroy(attention_graph_);
  }

  StepInputs PrepareStep(const StepBatch& batch) override {
    t_ = batch.num_tokens();
    b_ = batch.num_requests();
    const int64_t kv_bytes = int64_t{layers_} * t_ * hk_ * d_ * 4;
    in_.key = 0;
    in_.value = Align256(kv_bytes);
    in_.query = in_.value + Align256(kv_bytes);
    in_.total = in_.query + Align256(int64_t{layers_} * t_ * hq_ * d_ * 4);
    // The previous step's copies completed at its FinishStep: the buffer is free to rewrite.
    if (h_in_.size_bytes() < in_.total) {
      h_in_ = HostAllocation(std::max(in_.total, 2 * h_in_.size_bytes()));
    }
    auto* base = static_cast<uint8_t*>(h_in_.data());
    return {reinterpret_cast<float*>(base + in_.key), reinterpret_cast<float*>(base + in_.value),
            reinterpret_cast<float*>(base + in_.query)};
  }

  void BeginStep(const StepBatch& batch) override {
    StreamHandle s = stream_.get();
    int max_q_len = 1;
    const auto loc = batch.query_start_loc();
    for (int32_t i = 0; i < b_; ++i) max_q_len = std::max(max_q_len, loc[i + 1] - loc[i]);
    // The decoding sequences at the front of the batch (one new token, or with --spec-tokens up
    // to 1 + K) run on the decode kernels in place.
    // Under a sliding window a step of decoding sequences alone (one new token each, or with
    // --spec-tokens their drafts as verify passes) runs the decode kernels with splits sized for
    // it (the other steps run the chunk or prefill kernel).
    AttentionOptions options =
        WithLeadingSequences({}, loc.first(b_ + 1), attention_.MaxLeadingQLen(hq_));
    options.decode.sliding_window = window_;
    plan_ = attention_.Plan(b_, t_, hq_, batch.block_table_width(), max_q_len, options);
    out_bytes_ = int64_t{layers_} * t_ * hq_ * (d_ + 1) * 4;  // outputs, then LSEs
    // Growing frees the old buffers (cudaFree waits for the device): rare, and before this
    // step's work is enqueued.
    Fit(d_in_, in_.total);
    Fit(store_ws_, store_.WorkspaceBytes(t_));
    Fit(attention_ws_, plan_.workspace_bytes);
    Fit(d_out_, out_bytes_);
    if (h_out_.size_bytes() < out_bytes_) {
      h_out_ = HostAllocation(std::max(out_bytes_, 2 * h_out_.size_bytes()));
    }

    step_begin_.Record(s);
    cache_.ApplyCopies(batch.copies(), s);
    view_ = UploadStepBatch(batch, d_batch_, s);
    d_in_.CopyFromHost(h_in_.data(), in_.total, 0, s);  // K, V, Q: one copy
    result_ = StepResult{};
    result_.output = static_cast<const float*>(h_out_.data());
    result_.lse = result_.output + int64_t{layers_} * t_ * hq_ * d_;
    stored_.clear();
    attended_.clear();
  }

  void Store(int layer) override {
    const StoreInputs in = StoreArgs(layer);
    const CacheRef cache = cache_.layer(layer);
    const DeviceWorkspace ws{store_ws_.data(), store_ws_.size_bytes()};
    StreamHandle s = stream_.get();
    call_events_[4 * layer].Record(s);
    const auto t0 = Clock::now();
    store_.Store(in, cache, ws, s);
    result_.store.host_s += Seconds(t0);
    call_events_[4 * layer + 1].Record(s);
    ++result_.store.calls;
    stored_.push_back(layer);
  }

  void Attend(int layer) override {
    const AttentionArgs a = AttendArgs(layer);
    StreamHandle s = stream_.get();
    call_events_[4 * layer + 2].Record(s);
    const auto t0 = Clock::now();
    attention_.Run(plan_, a, s);
    result_.attention.host_s += Seconds(t0);
    call_events_[4 * layer + 3].Record(s);
    ++result_.attention.calls;
    attended_.push_back(layer);
  }

  const StepResult& FinishStep() override {
    StreamHandle s = stream_.get();
    if (!attended_.empty()) d_out_.CopyToHost(h_out_.data(), out_bytes_, 0, s);  // one copy
    step_end_.Record(s);
    if (kernel_timing_) TimeKernelsAlone();
    stream_.Synchronize();  // the step's one synchronization
    result_.step_stream_s = Elapsed(step_begin_, step_end_);
    for (const int l : stored_) {
      result_.store.stream_s += Elapsed(call_events_[4 * l], call_events_[4 * l + 1]);
    }
    for (const int l : attended_) {
      result_.attention.stream_s += Elapsed(call_events_[4 * l + 2], call_events_[4 * l + 3]);
    }
    if (kernel_timing_) {  // a replay holds kReps times this step's calls
      if (!stored_.empty()) {
        result_.store.kernels_s = Elapsed(graph_events_[0], graph_events_[1]) / kReps;
      }
      if (!attended_.empty()) {
        result_.attention.kernels_s = Elapsed(graph_events_[2], graph_events_[3]) / kReps;
      }
    }
    return result_;
  }

 private:
  static constexpr int kReps = 4;  // the step's calls, this many times over in one graph

  struct InputLayout {  // byte offsets into the inputs buffer
    int64_t key = 0, value = 0, query = 0, total = 0;
  };

  static void Fit(DeviceAllocation& a, int64_t bytes) {
    if (a.size_bytes() < bytes) a = DeviceAllocation(std::max(bytes, 2 * a.size_bytes()));
  }
  static uint8_t* DeviceBytes(DeviceAllocation& a) { return static_cast<uint8_t*>(a.data()); }
  static double Elapsed(const Event& a, const Event& b) { return 1e-3 * Event::ElapsedMs(a, b); }

  StoreInputs StoreArgs(int layer) {
    const int64_t layer_bytes = int64_t{t_} * hk_ * d_ * 4;
    StoreInputs in;
    in.key = DeviceBytes(d_in_) + in_.key + layer * layer_bytes;
    in.value = DeviceBytes(d_in_) + in_.value + layer * layer_bytes;
    in.dtype = DType::kF32;
    in.slot_mapping = view_.slot_mapping;
    in.slot_dtype = DType::kI64;
    in.num_tokens = t_;
    return in;
  }

  AttentionArgs AttendArgs(int layer) {
    const int64_t rows = int64_t{layer} * t_ * hq_;
    AttentionArgs a;
    a.query = DeviceBytes(d_in_) + in_.query + rows * d_ * 4;
    a.query_dtype = DType::kF32;
    a.num_seqs = b_;
    a.num_tokens = t_;
    a.num_q_heads = hq_;
    a.query_start_loc = view_.query_start_loc;
    a.seq_lens = view_.seq_lens;
    a.block_tables = view_.block_tables;
    a.max_blocks_per_seq = view_.block_table_width;
    a.cache = cache_.layer(layer);
    float* out = reinterpret_cast<float*>(d_out_.data());
    a.output = out + rows * d_;
    a.output_dtype = DType::kF32;
    a.lse = out + int64_t{layers_} * t_ * hq_ * d_ + rows;
    a.workspace = attention_ws_.data();
    a.workspace_bytes = attention_ws_.size_bytes();
    a.sliding_window = window_;
    return a;
  }

  // Captures `calls` kReps times over on the stream into a graph, instantiates it into `exec`
  // (the previous step's, complete since that step's synchronization, is destroyed first),
  // launches it once to warm up and once between `begin` and `end`. Enqueued behind the step's
  // work; nothing synchronizes.
  template <typename Calls>
  void TimeInGraph(cudaGraphExec_t& exec, Calls&& calls, Event& begin, Event& end) {
    StreamHandle s = stream_.get();
    if (exec != nullptr) {
      TQKV_CUDA_CHECK(cudaGraphExecDestroy(exec));
      exec = nullptr;
    }
    cudaGraph_t graph = nullptr;
    TQKV_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    try {
      for (int r = 0; r < kReps; ++r) calls();
    } catch (...) {
      (void)cudaStreamEndCapture(s, &graph);
      if (graph != nullptr) (void)cudaGraphDestroy(graph);
      throw;
    }
    TQKV_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
    (void)cudaGraphDestroy(graph);
    if (instantiated != cudaSuccess) exec = nullptr;
    TQKV_CUDA_CHECK(instantiated);
    TQKV_CUDA_CHECK(cudaGraphLaunch(exec, s));  // warm-up (uploads the graph)
    begin.Record(s);
    TQKV_CUDA_CHECK(cudaGraphLaunch(exec, s));
    end.Record(s);
  }

  void TimeKernelsAlone() {
    StreamHandle s = stream_.get();
    const DeviceWorkspace ws{store_ws_.data(), store_ws_.size_bytes()};
    if (!stored_.empty()) {
      TimeInGraph(
          store_graph_,
          [&] {
            for (const int l : stored_) {
              store_.Store(StoreArgs(l), cache_.layer(l), ws, s);
            }
          },
          graph_events_[0], graph_events_[1]);
    }
    if (!attended_.empty()) {
      TimeInGraph(
          attention_graph_,
          [&] {
            for (const int l : attended_) attention_.Run(plan_, AttendArgs(l), s);
          },
          graph_events_[2], graph_events_[3]);
    }
  }

  int layers_, hq_, hk_, d_;
  int32_t window_;
  bool kernel_timing_;
  Stream stream_;
  KVCache cache_;
  StoreDeviceState store_;
  CudaAttention attention_;
  // Step state.
  int32_t t_ = 0, b_ = 0;
  InputLayout in_;
  AttentionPlan plan_;
  StepBatchView view_;  // device views of the batch's upload
  int64_t out_bytes_ = 0;
  std::vector<int> stored_, attended_;
  StepResult result_;
  // Memory: device buffers grow geometrically and are reused every step.
  DeviceBuffer<uint8_t> d_batch_;  // UploadStepBatch
  HostAllocation h_in_;            // pinned inputs: K, V, Q
  DeviceAllocation d_in_;
  DeviceAllocation d_out_;  // outputs [layers, T, Hq, D], then LSEs [layers, T, Hq]
  HostAllocation h_out_;
  DeviceAllocation store_ws_, attention_ws_;
  // Timing.
  Event step_begin_, step_end_;
  std::vector<Event> call_events_;  // per layer: store begin, end, attention begin, end
  Event graph_events_[4];           // store graph begin, end, attention graph begin, end
  cudaGraphExec_t store_graph_ = nullptr, attention_graph_ = nullptr;
};
#endif

}  // namespace

std::unique_ptr<Backend> MakeBackend(std::string_view device, const CacheFormat& format,
                                     const Quantizer* quantizer, int num_layers, int32_t num_blocks,
                                     int num_q_heads, int32_t sliding_window, bool kernel_timing) {
  if (device == "cpu") {
    return std::make_unique<CpuBackend>(format, quantizer, num_layers, num_blocks, num_q_heads,
                                        sliding_window);
  }
  RequireCudaDevice("tqkv sim --device cuda");
  if (quantizer == nullptr) {
    throw Error(
        "tqkv sim: --device cuda runs the TurboQuant presets; the bf16 and fp16 formats "
        "run on --device cpu (there is no store kernel for them yet)");
  }
#if TQKV_HAVE_CUDA
  return std::make_unique<CudaBackend>(format, quantizer, num_layers, num_blocks, num_q_heads,
                                       sliding_window, kernel_timing);
#else
  (void)sliding_window;
  (void)num_layers;
  (void)num_blocks;
  (void)num_q_heads;
  (void)kernel_timing;
  return nullptr;
#endif
}

}  // namespace tqkv::sim
