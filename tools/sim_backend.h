// Where the sim stores and attends: the CPU reference or the CUDA kernels, behind one interface
// shaped like an engine's step (DESIGN.md, "One decode step, as data flows"):
//
//   StepInputs in = backend->PrepareStep(batch);   // host memory for the step's K/V/Q
//   ... the sim writes every layer's K, V and queries into `in` ...
//   backend->BeginStep(batch);                     // copy-on-write copies, the batch's upload
//                                                  // and the inputs' upload: one copy each
//   for each layer: backend->Store(layer); backend->Attend(layer);   // launches only
//   const StepResult& r = backend->FinishStep();  // the step's one synchronization; outputs
//
// Attend runs attention for every token the step schedules (decode rows, speculative verify
// rows, prefill chunks: attention/attention.h) over the cache the store has just written. On CUDA
// the per-layer calls do no host<->device traffic and never synchronize: the store reads the slot
// mapping and the attention the block tables, lengths and query starts from the device copy of
// the StepBatch (UploadStepBatch), K/V/Q from the step's one upload of inputs, and every layer's
// outputs stay on the device until FinishStep reads them all back with one copy.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <thread>
#include <vector>

#include "kvcache/cache_format.h"
#include "kvcache/step_batch.h"
#include "quant/quantizer.h"

namespace tqkv::sim {

// Runs fn(i) for every i in [0, n) on up to 16 threads (inline with one core). Each index runs
// once and writes only its own results, so nothing depends on the number of threads.
template <typename Fn>
void ParallelFor(int n, Fn&& fn) {
  const int threads =
      std::min({n, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())), 16});
  if (threads <= 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&] {
    for (int i; (i = next.fetch_add(1)) < n;) {
      try {
        fn(i);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

// One step's inputs in host memory the backend owns (page-locked for CUDA, so that one
// asynchronous copy uploads them all), fp32, in the batch's order; valid until the next
// PrepareStep. T = batch.num_tokens(), B = batch.num_requests().
struct StepInputs {
  float* key = nullptr;    // [layers, T, Hk, D]: token t of layer l at (l · T + t) · Hk · D
  float* value = nullptr;  // [layers, T, Hk, D]
  float* query = nullptr;  // [layers, T, Hq, D]: the query of token t at (l · T + t) · Hq · D
};

// Per-layer call times of one step, in seconds, summed over the step's calls.
struct CallTimes {
  int calls = 0;
  double host_s = 0;     // host time inside the library call (on CPU: the whole work)
  double stream_s = 0;   // CUDA events around each call on the stream (on CPU: = host_s)
  double kernels_s = 0;  // the same calls captured in a CUDA graph and replayed, per call, times
                         // `calls` (on CPU: = host_s)
};

struct StepResult {
  // [layers, T, Hq, D] and [layers, T, Hq] on the host: every token's attention output and LSE.
  // Valid until the next BeginStep.
  const float* output = nullptr;
  const float* lse = nullptr;
  CallTimes store, attention;
  // CUDA: the step on the stream, from before its copies and uploads to its outputs on the host
  // (events); CPU: 0.
  double step_stream_s = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  // Host memory for the inputs of `batch` (which Schedule has just filled).
  virtual StepInputs PrepareStep(const StepBatch& batch) = 0;
  // Starts the step whose inputs PrepareStep returned: runs (CUDA: enqueues) the batch's
  // copy-on-write copies, uploads the batch and the inputs. `batch` must not be rescheduled
  // before FinishStep.
  virtual void BeginStep(const StepBatch& batch) = 0;
  // Stores layer `layer`'s K/V of every token at the batch's slots.
  virtual void Store(int layer) = 0;
  // Attention of every scheduled token's query over layer `layer` (after its Store).
  virtual void Attend(int layer) = 0;
  // Ends the step: waits for it (the one synchronization of a CUDA step) and returns the outputs
  // and times.
  virtual const StepResult& FinishStep() = 0;
};

// device "cpu" or "cuda"; quantizer is null for the bf16 format; sliding_window: the attention
// window (AttentionArgs::sliding_window, 0: none). On CUDA, kernel_timing adds the graph-replay
// timing pass to every step (StepResult::*.kernels_s; 0 without it).
std::unique_ptr<Backend> MakeBackend(std::string_view device, const CacheFormat& format,
                                     const Quantizer* quantizer, int num_layers, int32_t num_blocks,
                                     int num_q_heads, int32_t sliding_window = 0,
                                     bool kernel_timing = true);

}  // namespace tqkv::sim
