// A serving loop over an Engine (CpuEngine or CudaEngine): requests arrive at any time (Submit
// between Steps) and every Step runs one batch through the model, like an inference engine's
// scheduler loop:
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
// - greedy or temperature sampling, one random stream per request seeded by the request;
// - speculative decoding by prompt lookup (ServerOptions::spec_tokens): a decoding sequence
//   drafts the tokens that followed an earlier occurrence of its last few tokens, the step
//   verifies them as extra rows of that sequence (attention over the compressed cache, the
//   drafts' K/V stored like any token's), and the rejected positions are rewound.
//
// A request's tokens do not depend on what else is in the batch, on prefix hits, on preemption
// or on its drafts: every row's computation depends only on its own sequence (Engine::Compute),
// a cached block holds the bytes the request would have written itself, and each position's token
// is drawn from its request's random stream as it would be without drafts (AcceptDraft). Bit for
// bit on CpuEngine; on CudaEngine up to rounding (Engine::Compute; draft rows run attention as
// half-precision verify passes, AttentionOptions::verify_precision), so a near-tie may go either
// way.
#pragma once

#include <cstdint>
#include <deque>
#include <random>
#include <span>
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
  // Generation ends after any of these tokens (an end of turn, end of text; none: after
  // max_new_tokens).
  std::vector<int32_t> stop_tokens;
};

struct Completion {
  bool finished = false;
  bool cancelled = false;         // ended by Server::Cancel (tokens: those generated until then)
  std::string error;              // set when the request can never fit the block pool
  std::vector<int32_t> tokens;    // the new tokens (the stop token included if reached)
  int64_t prefix_hit_tokens = 0;  // prompt tokens served from the prefix cache (first admission)
  int preemptions = 0;
  int64_t submit_step = 0, first_token_step = -1, finish_step = -1;  // Step() counts
  double first_token_seconds = 0.0, finish_seconds = 0.0;            // since Submit
};

struct ServerOptions {
  int max_running = 16;   // sequences in flight
  int step_tokens = 256;  // tokens per step: decode rows (and drafts) first, then prompt chunks
  // Draft tokens per decoding sequence and step, 0-64 (ProposeDrafts; 0: no speculation). The
  // accepted drafts and one more token are committed per step. A request produces the same tokens
  // as without drafts, greedy or sampled: each position's token is drawn as it would be without
  // one, and a draft is kept when it is that token (AcceptDraft). Drafts are optional work: a step
  // whose drafts do not fit the block pool runs without them, before anything is preempted.
  int spec_tokens = 0;
  int spec_ngram = 3;  // the longest suffix ProposeDrafts looks up, >= 1
};

struct ServerStats {
  int64_t steps = 0;
  int64_t computed_tokens = 0;  // rows run through the model (prompts, decodes, recomputation)
  int64_t generated_tokens = 0;
  int64_t prefix_hit_tokens = 0;  // positions taken from the prefix cache (readmissions too)
  int64_t preemptions = 0;
  int max_batch_sequences = 0;   // most sequences in one step
  int64_t draft_tokens = 0;      // drafts verified (ServerOptions::spec_tokens)
  int64_t accepted_drafts = 0;   // of those, committed
  double compute_seconds = 0.0;  // Engine::Compute (its results on the host)
  double manager_seconds = 0.0;  // AddSequence, Schedule, Commit, Free
};

// Prompt lookup: the `max_drafts` tokens that follow the most recent earlier occurrence of the
// context's last n tokens, for the longest n from max_ngram down to 1 that occurs, as if the
// context repeated from there on (past its end the drafts continue with the period the match
// shows: "x y x y" drafts "x y x y ..."); none when no suffix recurs.
std::vector<int32_t> ProposeDrafts(std::span<const int32_t> context, int max_ngram, int max_drafts);

// The token of one position: the argmax (temperature 0), or one draw from softmax(logits /
// temperature) from `rng`.
int32_t SampleToken(const float* logits, int vocab, float temperature, int32_t argmax,
                    std::mt19937_64& rng);

// Speculative sampling of one position whose draft is `draft` (a proposal of probability 1): the
// position's token is drawn exactly as without a draft (SampleToken, the same draws from `rng`),
// and the draft is kept when it is that token. So the draft is kept with the model's probability
// p(draft) (greedy: when it is the argmax), a rejected position's token has p without the draft,
// renormalized, as in speculative sampling, and a request's tokens do not depend on its drafts.
// Returns the token; *kept says whether it is the draft.
int32_t AcceptDraft(const float* logits, int vocab, float temperature, int32_t argmax,
                    int32_t draft, std::mt19937_64& rng, bool* kept);

class Server {
 public:
  // The engine's policy must size the block pool (KvPolicy::num_blocks). Throws tqkv::Error
  // naming the option for max_running below 1, step_tokens below max_running (every running
  // sequence's decode row fits a step), spec_tokens outside 0-64 or spec_ngram below 1.
  Server(Engine& engine, ServerOptions options);

  // Throws tqkv::Error naming the field where Submit would refuse the request: an empty prompt, a
  // token outside the vocabulary, max_new_tokens < 1, prompt and max_new_tokens past the model's
  // context, a negative or non-finite temperature, a stop token outside the vocabulary, or a
  // prompt longer than the whole block pool holds. (A request whose generated tokens outgrow the
  // pool is accepted: it may stop before; if not, it fails then, alone, with Completion::error.)
  void Check(const Request& request) const;
  // Queues a request (after Check; nothing changes where it throws); returns its id (0, 1, ...).
  int Submit(Request request);
  // One step: admits waiting requests, schedules (preempting while blocks are short), computes,
  // samples and commits. Returns false, doing nothing, when no request is waiting or running.
  // When it throws (std::bad_alloc, an engine's error), every request keeps what it had committed
  // and the step's uncommitted positions are rewound: a later Step recomputes them, and each
  // request still produces its tokens (server_alloc_test fails allocations throughout Step).
  bool Step();
  // Steps until every submitted request has finished.
  void RunToCompletion();
  // Ends request `id` between Steps, as a server does when its client goes away: a waiting
  // request never runs; a running one frees its sequence at once (its full blocks stay in the
  // prefix cache for other requests), and its place goes to a waiting request at the next Step.
  // Its completion is finished and cancelled, with the tokens generated until now. The other
  // requests' tokens do not change. Returns false, changing nothing, for a request that has
  // already finished; throws tqkv::Error naming an id that Submit did not return.
  bool Cancel(int id);

  // Throws tqkv::Error naming an id that Submit did not return.
  const Completion& completion(int id) const;
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
  // Throws tqkv::Error (from `where`) for an id that Submit did not return.
  void CheckId(const char* where, int id) const;
  // Admits waiting requests (front first) while fewer than max_running are in flight.
  void Admit();
  // The step's requests: every sequence at its last known token decodes one row and (with
  // `with_drafts`) its drafts, then prompt chunks in admission order within the budget. `live`
  // gets each request's index in running_, `drafts` its draft tokens.
  void PlanStep(std::vector<StepRequest>& requests, std::vector<int>& live,
                std::vector<std::vector<int32_t>>& drafts, bool with_drafts) const;
  // Frees the sequence admitted last and requeues it at the front of the queue.
  void Preempt();
  // Frees r's sequence (first: a throw changes nothing) and marks its completion finished.
  void Finish(Live& r, std::string error = {});
  // Finishes the running requests whose last token is a stop token or that have all their tokens,
  // and drops every finished one from running_.
  void FinishDone();

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
