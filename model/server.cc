#include "model/server.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "runtime/error.h"

namespace tqkv::model {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

bool IsStop(const Request& r, int32_t token) {
  return std::find(r.stop_tokens.begin(), r.stop_tokens.end(), token) != r.stop_tokens.end();
}

}  // namespace

std::vector<int32_t> ProposeDrafts(std::span<const int32_t> context, int max_ngram,
                                   int max_drafts) {
  const int64_t len = static_cast<int64_t>(context.size());
  if (max_drafts < 1) return {};
  for (int64_t n = std::min<int64_t>(max_ngram, len - 1); n >= 1; --n) {
    const auto suffix = context.subspan(static_cast<size_t>(len - n));
    for (int64_t s = len - n - 1; s >= 0; --s) {  // the most recent earlier occurrence
      if (!std::equal(suffix.begin(), suffix.end(), context.begin() + s)) continue;
      // The tokens after it, read on past the context's end from the drafts themselves: a suffix
      // that recurs p tokens back continues with period p (a repeated token, max_drafts copies),
      // where the context alone would give p tokens at most.
      const int64_t from = s + n;
      std::vector<int32_t> drafts;
      drafts.reserve(static_cast<size_t>(max_drafts));
      for (int64_t at = from; at < from + max_drafts; ++at) {
        drafts.push_back(at < len ? context[static_cast<size_t>(at)]
                                  : drafts[static_cast<size_t>(at - len)]);
      }
      return drafts;
    }
  }
  return {};
}

int32_t SampleToken(const float* logits, int vocab, float temperature, int32_t argmax,
                    std::mt19937_64& rng) {
  if (temperature == 0.0f) return argmax;
  const float mx = *std::max_element(logits, logits + vocab);
  std::vector<double> w(static_cast<size_t>(vocab));
  for (int v = 0; v < vocab; ++v) w[v] = std::exp((logits[v] - mx) / temperature);
  return static_cast<int32_t>(std::discrete_distribution<int>(w.begin(), w.end())(rng));
}

int32_t AcceptDraft(const float* logits, int vocab, float temperature, int32_t argmax,
                    int32_t draft, std::mt19937_64& rng, bool* kept) {
  const int32_t t = SampleToken(logits, vocab, temperature, argmax, rng);
  *kept = t == draft;
  return t;
}

Server::Server(Engine& engine, ServerOptions options) : engine_(engine), options_(options) {
  if (options_.max_running < 1) {
    throw InvalidArgument("Server", "options.max_running", options_.max_running, ">= 1");
  }
  // Decode rows are never deferred: a step holds one row for each running sequence.
  if (options_.step_tokens < options_.max_running) {
    throw InvalidArgument("Server", "options.step_tokens", options_.step_tokens,
                          fmt::format(">= options.max_running = {} (a row for every running "
                                      "sequence)",
                                      options_.max_running));
  }
  // What the engine's kernels cannot run in one step is refused here, not at the step that
  // first reaches it.
  if (options_.max_running > engine.MaxStepSequences()) {
    throw InvalidArgument(
        "Server", "options.max_running", options_.max_running,
        fmt::format("1 to {} (the engine's most sequences per step)", engine.MaxStepSequences()));
  }
  if (options_.step_tokens > engine.MaxStepTokens()) {
    throw InvalidArgument(
        "Server", "options.step_tokens", options_.step_tokens,
        fmt::format("at most {} (the engine's most rows per step)", engine.MaxStepTokens()));
  }
  if (options_.spec_tokens < 0 || options_.spec_tokens > 64) {
    throw InvalidArgument("Server", "options.spec_tokens", options_.spec_tokens, "0 to 64");
  }
  if (options_.spec_ngram < 1) {
    throw InvalidArgument("Server", "options.spec_ngram", options_.spec_ngram, ">= 1");
  }
  engine_.manager();  // the pool exists (and its size was given) before any request
}

void Server::Check(const Request& request) const {
  const int vocab = engine_.model().config().vocab;
  if (request.prompt.empty()) throw InvalidArgument("Server::Submit", "prompt.size()", 0, ">= 1");
  for (int32_t t : request.prompt) {
    if (t < 0 || t >= vocab) {
      throw InvalidArgument("Server::Submit", "prompt token", t, fmt::format("0 to {}", vocab - 1));
    }
  }
  if (request.max_new_tokens < 1) {
    throw InvalidArgument("Server::Submit", "max_new_tokens", request.max_new_tokens, ">= 1");
  }
  // As vLLM refuses a request past max_model_len: positions past the trained context are not
  // served.
  const int context = engine_.model().config().context;
  if (int64_t{request.max_new_tokens} + static_cast<int64_t>(request.prompt.size()) > context) {
    throw InvalidArgument(
        "Server::Submit", "prompt.size() + max_new_tokens",
        int64_t{request.max_new_tokens} + static_cast<int64_t>(request.prompt.size()),
        fmt::format("at most the model's context_length = {} ({} prompt tokens)", context,
                    request.prompt.size()));
  }
  if (!(request.sampling.temperature >= 0.0f) || std::isinf(request.sampling.temperature)) {
    throw InvalidArgument("Server::Submit", "sampling.temperature", request.sampling.temperature,
                          "finite and >= 0");
  }
  for (size_t i = 0; i < request.stop_tokens.size(); ++i) {
    if (request.stop_tokens[i] < 0 || request.stop_tokens[i] >= vocab) {
      throw InvalidArgument("Server::Submit", fmt::format("stop_tokens[{}]", i),
                            request.stop_tokens[i], fmt::format("a token, 0 to {}", vocab - 1));
    }
  }
  // A prompt the whole pool cannot hold can never run. (Its generated tokens are not counted: a
  // request may stop before it runs out of blocks; one that does not fails then, alone.)
  const KVCacheManager& m = engine_.manager();
  const int64_t bs = m.options().block_size;
  const int64_t prompt_blocks = (static_cast<int64_t>(request.prompt.size()) + bs - 1) / bs;
  if (m.options().sliding_window == 0 && prompt_blocks > m.Stats().num_blocks) {
    throw InvalidArgument(
        "Server::Submit", "prompt.size()", static_cast<int64_t>(request.prompt.size()),
        fmt::format("at most {} tokens: the pool's {} blocks of {}",
                    int64_t{m.Stats().num_blocks} * bs, m.Stats().num_blocks, bs));
  }
}

void Server::CheckId(const char* where, int id) const {
  if (id < 0 || id >= static_cast<int>(completions_.size())) {
    throw InvalidArgument(where, "id", id,
                          completions_.empty() ? std::string("none: no request was submitted")
                                               : fmt::format("0 to {}", completions_.size() - 1));
  }
}

const Completion& Server::completion(int id) const {
  CheckId("Server::completion", id);
  return completions_[static_cast<size_t>(id)];
}

int Server::Submit(Request request) {
  Check(request);
  const int id = static_cast<int>(requests_.size());
  Live live;
  live.id = id;
  live.tokens = request.prompt;
  live.rng.seed(request.sampling.seed);
  Completion c;
  c.submit_step = stats_.steps;
  // All or nothing: every allocation first, so that ids stay the requests' indices.
  requests_.reserve(requests_.size() + 1);
  completions_.reserve(completions_.size() + 1);
  submit_time_.reserve(submit_time_.size() + 1);
  waiting_.push_back(std::move(live));
  requests_.push_back(std::move(request));
  completions_.push_back(std::move(c));
  submit_time_.push_back(Seconds(Clock::now()));
  return id;
}

void Server::Admit() {
  KVCacheManager& m = engine_.manager();
  while (!waiting_.empty() && static_cast<int>(running_.size()) < options_.max_running) {
    // The request leaves the queue only once its sequence exists: a failed allocation lost it.
    running_.reserve(running_.size() + 1);
    const SeqId seq = m.AddSequence(waiting_.front().tokens);
    Live r = std::move(waiting_.front());
    waiting_.pop_front();
    r.seq = seq;
    r.fresh = true;
    running_.push_back(std::move(r));
  }
}

void Server::PlanStep(std::vector<StepRequest>& requests, std::vector<int>& live,
                      std::vector<std::vector<int32_t>>& drafts, bool with_drafts) const {
  const KVCacheManager& m = engine_.manager();
  requests.clear();
  live.clear();
  drafts.clear();
  std::vector<int64_t> remaining(running_.size());
  int budget = options_.step_tokens;
  // Decode rows (a sequence at its last known token) are never deferred; their drafts take what
  // the budget has left after them, and prompt chunks what is left then, in admission order.
  int decoding = 0;
  for (size_t i = 0; i < running_.size(); ++i) {
    const Live& r = running_[i];
    int64_t done = m.GetSequenceInfo(r.seq).num_scheduled;
    if (done == 0) done = m.Lookup(r.seq).num_tokens;  // fresh: its cached prefix
    remaining[i] = static_cast<int64_t>(r.tokens.size()) - done;
    if (remaining[i] == 1) ++decoding;
  }
  budget -= decoding;
  for (size_t i = 0; i < running_.size(); ++i) {
    if (remaining[i] != 1) continue;
    const Live& r = running_[i];
    // Drafts never reach past max_new_tokens: the step commits one token more than it accepts.
    const int room = requests_[r.id].max_new_tokens - r.generated - 1;
    std::vector<int32_t> d = ProposeDrafts(
        r.tokens, options_.spec_ngram,
        with_drafts ? std::min({options_.spec_tokens, room, std::max(budget, 0)}) : 0);
    budget -= static_cast<int>(d.size());
    requests.push_back({r.seq, 1 + static_cast<int32_t>(d.size()), 0});
    live.push_back(static_cast<int>(i));
    drafts.push_back(std::move(d));
  }
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    if (remaining[i] <= 1) continue;
    const int n = static_cast<int>(std::min<int64_t>(remaining[i], budget));
    requests.push_back({running_[i].seq, n, 0});
    live.push_back(static_cast<int>(i));
    drafts.emplace_back();
    budget -= n;
  }
}

void Server::Preempt() {
  Live victim = std::move(running_.back());
  running_.pop_back();
  engine_.manager().Free(victim.seq);
  victim.seq = -1;
  ++completions_[victim.id].preemptions;
  ++stats_.preemptions;
  waiting_.push_front(std::move(victim));
}

void Server::Finish(Live& r, std::string error) {
  if (r.seq >= 0) engine_.manager().Free(r.seq);  // first: it changes nothing when it throws
  r.seq = -1;
  Completion& c = completions_[r.id];
  c.finished = true;
  c.error = std::move(error);
  c.finish_step = stats_.steps;
  c.finish_seconds = Seconds(Clock::now()) - submit_time_[r.id];
}

void Server::FinishDone() {
  for (Live& r : running_) {
    const Request& req = requests_[r.id];
    if (r.generated > 0 && (IsStop(req, r.tokens.back()) || r.generated == req.max_new_tokens)) {
      Finish(r);
    }
  }
  std::erase_if(running_, [](const Live& r) { return r.seq < 0; });
}

bool Server::Step() {
  FinishDone();  // (requests a Step that threw left finished but running)
  if (idle()) return false;
  ++stats_.steps;
  KVCacheManager& m = engine_.manager();
  auto t0 = Clock::now();
  Admit();
  std::vector<StepRequest> requests;
  std::vector<int> live;
  std::vector<std::vector<int32_t>> drafts;
  bool with_drafts = options_.spec_tokens > 0;
  for (;;) {
    PlanStep(requests, live, drafts, with_drafts);
    if (requests.empty()) return true;
    const ScheduleResult result = engine_.Schedule(requests);
    if (result.admitted) break;
    // Drafts are optional work: without them the step may fit (Schedule changed nothing).
    if (with_drafts && std::any_of(drafts.begin(), drafts.end(),
                                   [](const std::vector<int32_t>& d) { return !d.empty(); })) {
      with_drafts = false;
      continue;
    }
    // A request that needs more blocks than the pool holds fails alone; otherwise preempt.
    bool dropped = false;
    for (const ScheduleRejection& rej : result.rejected) {
      if (!rej.never_fits) continue;
      Live& r = running_[live[rej.request_index]];
      Finish(r, fmt::format("needs {} blocks, more than the pool's {}",
                            rej.blocks_missing + m.Stats().num_blocks, m.Stats().num_blocks));
      dropped = true;
    }
    if (dropped) {
      std::erase_if(running_, [](const Live& r) { return r.seq < 0; });
    } else if (running_.size() > 1) {
      Preempt();
    } else {
      throw Error(
          fmt::format("Server::Step: one sequence alone lacks {} blocks", result.blocks_missing));
    }
    if (running_.empty()) return true;
  }
  // Until the step is computed, a throw (an allocation, a device error) undoes it: its positions
  // would otherwise stay scheduled with their K/V never written, and the step pending.
  struct AbandonOnThrow {
    Engine& engine;
    bool armed = true;
    ~AbandonOnThrow() {
      if (!armed) return;
      try {
        engine.AbandonStep();
      } catch (...) {  // the exception in flight is the one to report
      }
    }
  } abandon{engine_};
  const StepBatch& batch = engine_.batch();
  const int num_req = static_cast<int>(requests.size());
  stats_.max_batch_sequences = std::max(stats_.max_batch_sequences, num_req);

  // The step's tokens in row order (a decoding sequence's drafts after its last known token),
  // and the rows that sample: those of a request whose rows reach its last known token, from
  // that token's row on (one per draft, and one more).
  std::vector<int32_t> tokens, logit_rows;
  std::vector<int> samples(static_cast<size_t>(num_req), -1);  // index into logit_rows
  tokens.reserve(static_cast<size_t>(batch.num_tokens()));
  for (int k = 0; k < num_req; ++k) {
    const Live& r = running_[live[k]];
    const int32_t nd = static_cast<int32_t>(drafts[k].size());
    const int32_t end = batch.seq_lens()[k] - nd;
    const int32_t start = end - (requests[k].num_new_tokens - nd);
    tokens.insert(tokens.end(), r.tokens.begin() + start, r.tokens.begin() + end);
    tokens.insert(tokens.end(), drafts[k].begin(), drafts[k].end());
    if (end == static_cast<int32_t>(r.tokens.size())) {
      samples[k] = static_cast<int>(logit_rows.size());
      for (int32_t i = nd; i >= 0; --i)
        logit_rows.push_back(batch.query_start_loc()[k + 1] - 1 - i);
    }
  }
  stats_.manager_seconds += std::chrono::duration<double>(Clock::now() - t0).count();

  // Logits come back only when a row samples with a temperature (greedy needs the argmax).
  const int vocab = engine_.model().config().vocab;
  bool need_logits = false;
  for (int k = 0; k < num_req; ++k) {
    need_logits |= samples[k] >= 0 && requests_[running_[live[k]].id].sampling.temperature > 0.0f;
  }
  std::vector<float> logits(need_logits ? logit_rows.size() * static_cast<size_t>(vocab) : 0);
  std::vector<int32_t> argmax(logit_rows.size());
  t0 = Clock::now();
  engine_.Compute(tokens, logit_rows, need_logits ? logits.data() : nullptr, argmax.data());
  abandon.armed = false;
  const auto t1 = Clock::now();
  stats_.compute_seconds += std::chrono::duration<double>(t1 - t0).count();
  stats_.computed_tokens += static_cast<int64_t>(tokens.size());

  // Each request commits as a unit: its tokens are drawn from a copy of its random stream and its
  // token vectors are grown before the manager's Commit (which changes nothing when it throws), so
  // that nothing after it can fail. A throw (an allocation) leaves the requests before it
  // committed and rewinds this step's positions of the others: a later step recomputes them, as
  // after a preemption, with the same tokens.
  int k = 0;
  try {
    for (; k < num_req; ++k) {
      Live& r = running_[live[k]];
      Completion& c = completions_[r.id];
      const Request& req = requests_[r.id];
      // Each position's token as without drafts (AcceptDraft), while its draft was that token; up
      // to the first position whose draft was not (or the one after the last draft), the stop
      // token or max_new_tokens.
      const std::vector<int32_t>& d = drafts[k];
      std::vector<int32_t> next;
      std::mt19937_64 rng = r.rng;
      int64_t accepted = 0;
      if (samples[k] >= 0) {
        bool done = false;
        for (size_t i = 0; i <= d.size() && !done; ++i) {
          const int row = samples[k] + static_cast<int>(i);
          const float* lg =
              need_logits ? logits.data() + static_cast<int64_t>(row) * vocab : nullptr;
          bool kept = false;
          const int32_t t =
              i < d.size()
                  ? AcceptDraft(lg, vocab, req.sampling.temperature, argmax[row], d[i], rng, &kept)
                  : SampleToken(lg, vocab, req.sampling.temperature, argmax[row], rng);
          next.push_back(t);
          accepted += kept ? 1 : 0;
          done = !kept || IsStop(req, t) ||
                 r.generated + static_cast<int>(next.size()) == req.max_new_tokens;
        }
        r.tokens.reserve(r.tokens.size() + next.size());
        c.tokens.reserve(c.tokens.size() + next.size());
        // The positions of drafts not committed (the last committed token has no K/V yet).
        const int64_t rejected =
            static_cast<int64_t>(d.size()) + 1 - static_cast<int64_t>(next.size());
        if (rejected > 0) m.Rewind(r.seq, rejected);
      }
      m.Commit(r.seq, next);
      // Committed: nothing below throws.
      r.rng = rng;
      if (r.fresh) {  // its first step began after its prefix hit
        const int64_t hit = batch.seq_lens()[k] - requests[k].num_new_tokens;
        if (!r.admitted_before) c.prefix_hit_tokens = hit;
        stats_.prefix_hit_tokens += hit;
        r.fresh = false;
        r.admitted_before = true;
      }
      if (samples[k] < 0) continue;
      stats_.accepted_drafts += accepted;
      stats_.draft_tokens += static_cast<int64_t>(d.size());
      stats_.generated_tokens += static_cast<int64_t>(next.size());
      r.tokens.insert(r.tokens.end(), next.begin(), next.end());
      r.generated += static_cast<int>(next.size());
      c.tokens.insert(c.tokens.end(), next.begin(), next.end());
      if (c.first_token_step < 0) {
        c.first_token_step = stats_.steps;
        c.first_token_seconds = Seconds(Clock::now()) - submit_time_[r.id];
      }
    }
  } catch (...) {
    for (int j = k; j < num_req; ++j) {
      const Live& r = running_[live[j]];
      const int64_t start = batch.seq_lens()[j] - requests[j].num_new_tokens;
      const int64_t scheduled = m.GetSequenceInfo(r.seq).num_scheduled;
      if (scheduled > start) m.Rewind(r.seq, scheduled - start);
    }
    throw;
  }
  FinishDone();
  stats_.manager_seconds += std::chrono::duration<double>(Clock::now() - t1).count();
  return true;
}

bool Server::Cancel(int id) {
  CheckId("Server::Cancel", id);
  Completion& c = completions_[static_cast<size_t>(id)];
  if (c.finished) return false;
  auto is_id = [id](const Live& r) { return r.id == id; };
  if (auto it = std::find_if(waiting_.begin(), waiting_.end(), is_id); it != waiting_.end()) {
    Finish(*it);  // never admitted, or preempted: no sequence to free
    waiting_.erase(it);
  } else {
    auto run = std::find_if(running_.begin(), running_.end(), is_id);
    TQKV_CHECK(run != running_.end());  // an unfinished request waits or runs
    Finish(*run);
    running_.erase(run);  // the rest keep their admission order (Preempt takes the last)
  }
  c.cancelled = true;
  return true;
}

void Server::RunToCompletion() {
  while (Step()) {
  }
}

}  // namespace tqkv::model
