// A serving loop over an Engine (CpuEngine or CudaEngine): requests arrive at any time (Submit between Steps) and every
// Step runs one batch through the model, like an inference engine's scheduler loop:
//
// - continuous batching: up to max_running sequences in flight; a finished one frees its blocks
//   and a waiting request takes its place at the next step;
// - each step gives every decoding sequence its one row first, then prompt chunks in arrival
//   order within the step's token budget (chunked prefill);
// - prefix caching: a request whose prompt starts with blocks another request already computed
//   (a shared system prompt) reuses them and computes only the rest;
// - preemption: when Schedule finds too few blocks, the sequence admitted last is freed and
//   requeued at the front; readmitted, it recomputes from its prompt and the tokens it already
//   generated (mostly prefix-cache hits), and goes on sampling where it stopped;
// - greedy or temperature sampling, one random stream per request seeded by the request.
//
// A request's tokens do not depend on what else is in the batch, on prefix hits or on
// preemption: every row's computation depends only on its own sequence (Engine::Compute), and
// a cached block holds the bytes the request would have written itself.
#pragma once

#include <cstdint>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "model/engine.h"

namespace tqkv::model {

struct Sampling {
  float temperature = 0.0f;  // 0: greedy
  uint64_t seed = 0;
};

struct Request {
  std::vector<int32_t> prompt;  // >= 1 token
  int max_new_tokens = 32;      // >= 1
  Sampling sampling;
  int32_t stop_token = -1;  // generation ends after this token (-1: none)
};

struct Completion {
  bool finished = false;
  std::string error;            // set when the request can never fit the block pool
  std::vector<int32_t> tokens;  // the new tokens (the stop token included if reached)
  int64_t prefix_hit_tokens = 0;  // prompt tokens served from the prefix cache (first admission)
  int preemptions = 0;
  int64_t submit_step = 0, first_token_step = -1, finish_step = -1;  // Step() counts
  double first_token_seconds = 0.0, finish_seconds = 0.0;  // since Submit
};

struct ServerOptions {
  int max_running = 16;     // sequences in flight
  int step_tokens = 256;    // tokens per step: decode rows first, then prompt chunks
};

struct ServerStats {
  int64_t steps = 0;
  int64_t computed_tokens = 0;    // rows run through the model (prompts, decodes, recomputation)
  int64_t generated_tokens = 0;
  int64_t prefix_hit_tokens = 0;  // positions taken from the prefix cache (readmissions too)
  int64_t preemptions = 0;
  int max_batch_sequences = 0;  // most sequences in one step
  double compute_seconds = 0.0;  // Engine::Compute (its results on the host)
  double manager_seconds = 0.0;  // AddSequence, Schedule, Commit, Free
};

class Server {
 public:
  // The engine's policy must size the block pool (KvPolicy::num_blocks). Throws tqkv::Error
  // naming the option for max_running or step_tokens below 1.
  Server(Engine& engine, ServerOptions options);

  // Queues a request; returns its id (0, 1, ...). Throws tqkv::Error naming the field for an
  // empty prompt, max_new_tokens < 1, a negative temperature or a token outside the vocabulary.
  int Submit(Request request);
  // One step: admits waiting requests, schedules (preempting while blocks are short), computes,
  // samples and commits. Returns false, doing nothing, when no request is waiting or running.
  bool Step();
  // Steps until every submitted request has finished.
  void RunToCompletion();

  const Completion& completion(int id) const { return completions_.at(static_cast<size_t>(id)); }
  bool idle() const { return waiting_.empty() && running_.empty(); }
  const ServerStats& stats() const { return stats_; }

 private:
  struct Live {
    int id = 0;
    SeqId seq = -1;
    std::vector<int32_t> tokens;  // prompt, then the generated tokens
    int generated = 0;
    bool fresh = false;  // admitted, not yet scheduled
    bool admitted_before = false;
    std::mt19937_64 rng;
  };
  // Admits waiting requests (front first) while fewer than max_running are in flight.
  void Admit();
  // The step's requests: every sequence at its last known token decodes one row, then prompt
  // chunks in admission order within the budget. `live` gets each request's index in running_.
  void PlanStep(std::vector<StepRequest>& requests, std::vector<int>& live) const;
  // Frees the sequence admitted last and requeues it at the front of the queue.
  void Preempt();
  // The next token: the argmax (greedy), or drawn from the logits.
  int32_t Sample(Live& r, const float* logits, int32_t argmax);
  void Finish(Live& r, std::string error = {});

  Engine& engine_;
  ServerOptions options_;
  std::vector<Request> requests_;
  std::vector<Completion> completions_;
  std::vector<double> submit_time_;
  std::deque<Live> waiting_;
  std::vector<Live> running_;  // admission order
  ServerStats stats_;
};

}  // namespace tqkv::model
