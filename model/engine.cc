#include "model/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <optional>

#include "attention/attention_cpu.h"
#include "kvcache/cache_format.h"
#include "kvcache/kv_cache.h"
#include "kvcache/manager.h"
#include "quant/numerics.h"
#include "quant/quantizer.h"
#include "runtime/error.h"

namespace tqkv::model {
namespace {

// Writes fp32 K/V rows [n, H, D] as bf16 into an uncompressed paged cache at the slots.
void StoreBf16(const Bf16BlockFormat& f, const float* k, const float* v, const int64_t* slots,
               int n, uint8_t* cache) {
  const int hd = f.num_kv_heads * f.head_dim;
  for (int t = 0; t < n; ++t) {
    const int64_t block = slots[t] / f.block_size;
    const int pos = static_cast<int>(slots[t] % f.block_size);
    uint8_t* base = cache + block * f.block_bytes;
    for (int h = 0; h < f.num_kv_heads; ++h) {
      auto* kd = reinterpret_cast<uint16_t*>(base + f.KeyOffset(pos, h));
      auto* vd = reinterpret_cast<uint16_t*>(base + f.ValueOffset(pos, h));
      for (int i = 0; i < f.head_dim; ++i) {
        kd[i] = FloatToBFloat16Bits(k[int64_t{t} * hd + h * f.head_dim + i]);
        vd[i] = FloatToBFloat16Bits(v[int64_t{t} * hd + h * f.head_dim + i]);
      }
    }
  }
}

// The position of a step's first new token: what the sequence has scheduled so far, or, while it
// is fresh (nothing scheduled and no block, not even a lookahead reservation), its cached prefix,
// where the manager's Schedule starts it.
int64_t StepStart(const KVCacheManager& m, SeqId seq) {
  const SequenceInfo info = m.GetSequenceInfo(seq);
  const bool fresh = info.num_scheduled == 0 && info.num_table_entries == 0;
  return fresh ? m.Lookup(seq).num_tokens : info.num_scheduled;
}

}  // namespace

Engine::Engine(const LlamaModel& model, KvPolicy policy, CacheDevice device)
    : model_(model), policy_(std::move(policy)), device_(device) {
  const LlamaConfig& c = model_.config();
  if (policy_.boundary_layers < 0 || policy_.boundary_layers > c.num_layers / 2) {
    throw InvalidArgument("Engine", "policy.boundary_layers", policy_.boundary_layers,
                          fmt::format("0 to {}", c.num_layers / 2));
  }
  if (policy_.num_blocks < 0 || policy_.num_blocks == 1) {
    throw InvalidArgument("Engine", "policy.num_blocks", policy_.num_blocks, "0 or >= 2");
  }
  const bool all_bf16 = policy_.preset == "bf16";
  bf16_format_ = MakeCacheFormat("bf16", c.head_dim, c.num_kv_heads, policy_.block_size);
  if (!all_bf16) {
    compressed_format_ =
        MakeCacheFormat(policy_.preset, c.head_dim, c.num_kv_heads, policy_.block_size);
    quantizer_.emplace(
        Quantizer::Create(policy_.preset, c.head_dim, c.num_kv_heads, policy_.block_size));
  }
  int num_compressed = 0, num_bf16 = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    const bool bf16 =
        all_bf16 || l < policy_.boundary_layers || l >= c.num_layers - policy_.boundary_layers;
    bf16_layer_.push_back(bf16);
    cache_layer_.push_back(bf16 ? num_bf16++ : num_compressed++);
  }
  num_blocks_ = policy_.num_blocks;
}

Engine::~Engine() = default;

int64_t Engine::kv_bytes_per_token() const {
  const int hk = model_.config().num_kv_heads;
  int64_t bytes = 0;
  for (bool bf16 : bf16_layer_) {
    bytes += hk * (bf16 ? bf16_format_.slot_bytes : compressed_format_.slot_bytes);
  }
  return bytes;
}

int64_t Engine::prefix_hit_tokens() const {
  return manager_ ? manager_->Stats().prefix_hit_tokens : 0;
}

KVCacheManager& Engine::manager() {
  if (!manager_) {
    if (policy_.num_blocks == 0) {
      throw InvalidArgument("Engine::manager", "policy.num_blocks", 0,
                            ">= 2 (a server sizes its block pool)");
    }
    Prepare(0, "Engine::manager", 0);
  }
  return *manager_;
}

ScheduleResult Engine::Schedule(std::span<const StepRequest> requests) {
  constexpr const char* kWhere = "Engine::Schedule";
  // A second Schedule would replace the batch of a step never computed, whose positions the
  // manager counts as stored (their K/V unwritten, then published to the prefix cache).
  if (step_pending_) {
    throw Error(
        fmt::format("{}: the scheduled step is not computed yet (Compute it first)", kWhere));
  }
  int64_t new_tokens = 0;
  for (const StepRequest& r : requests) new_tokens += std::max(r.num_new_tokens, 0);
  if (new_tokens == 0) {  // (Compute refuses a step of no rows)
    throw InvalidArgument(kWhere, "requests",
                          fmt::format("{} requests of 0 new tokens", requests.size()),
                          "at least one new token in the step");
  }
  KVCacheManager& m = manager();
  // As Server::Submit: positions past the trained context are not served (RoPE past it is
  // extrapolation the model never saw).
  const int64_t context = model().config().context;
  for (size_t i = 0; i < requests.size(); ++i) {
    const StepRequest& r = requests[i];
    if (r.num_new_tokens <= 0 || !m.IsLive(r.seq)) continue;  // the manager says what is wrong
    const int64_t start = StepStart(m, r.seq);
    if (start + r.num_new_tokens > context) {
      throw InvalidArgument(kWhere, fmt::format("requests[{}].num_new_tokens", i), r.num_new_tokens,
                            fmt::format("at most {}: the model's context_length = {} less the "
                                        "sequence's {} tokens before this step",
                                        std::max<int64_t>(context - start, 0), context, start));
    }
  }
  ScheduleOptions options;
  if (width_multiple_ > 1) {
    int64_t longest = 1;
    for (const StepRequest& r : requests) {
      if (!m.IsLive(r.seq)) continue;  // Schedule says what is wrong with it
      const SequenceInfo info = m.GetSequenceInfo(r.seq);
      const int64_t start = StepStart(m, r.seq);
      const int64_t end = start + std::max(r.num_new_tokens, 0) + std::max(r.num_lookahead, 0);
      longest = std::max({longest, int64_t{info.num_table_entries},
                          (end + policy_.block_size - 1) / policy_.block_size});
    }
    const int64_t width = (longest + width_multiple_ - 1) / width_multiple_ * width_multiple_;
    options.block_table_width = static_cast<int32_t>(std::min<int64_t>(width, INT32_MAX));
  }
  step_seqs_.reserve(requests.size());  // before the manager changes anything
  step_new_tokens_.reserve(requests.size());
  const ScheduleResult r = m.Schedule(requests, batch_, options);
  if (r.admitted) {
    step_seqs_.clear();
    step_new_tokens_.clear();
    for (const StepRequest& req : requests) {
      step_seqs_.push_back(req.seq);
      step_new_tokens_.push_back(req.num_new_tokens);
    }
    step_pending_ = true;
    if (compressed_) compressed_->ApplyCopies(batch_.copies(), copy_stream_);
    if (bf16_) bf16_->ApplyCopies(batch_.copies(), copy_stream_);
  }
  return r;
}

bool Engine::IsBf16Layer(int layer) const {
  if (layer < 0 || static_cast<size_t>(layer) >= bf16_layer_.size()) {
    throw InvalidArgument("Engine::IsBf16Layer", "layer", layer,
                          fmt::format("0 to {}", static_cast<int>(bf16_layer_.size()) - 1));
  }
  return bf16_layer_[static_cast<size_t>(layer)];
}

void Engine::AbandonStep() {
  if (!manager_ || step_seqs_.empty()) {
    throw Error("Engine::AbandonStep: no scheduled step to abandon");
  }
  for (size_t i = 0; i < step_seqs_.size(); ++i) {
    if (!manager_->IsLive(step_seqs_[i])) continue;
    const int64_t scheduled = manager_->GetSequenceInfo(step_seqs_[i]).num_scheduled;
    manager_->Rewind(step_seqs_[i], std::min<int64_t>(step_new_tokens_[i], scheduled));
  }
  step_seqs_.clear();
  step_new_tokens_.clear();
  step_pending_ = false;
}

std::vector<float> Engine::Forward(std::span<const int32_t> tokens, int chunk,
                                   LayerErrors* errors) {
  constexpr const char* kWhere = "Engine::Forward";
  const LlamaConfig& c = model_.config();
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw InvalidArgument(kWhere, "tokens.size()", tokens.size(),
                          fmt::format("at most {}", std::numeric_limits<int32_t>::max()));
  }
  const int n = static_cast<int>(tokens.size());
  if (chunk < 1) throw InvalidArgument(kWhere, "chunk", chunk, ">= 1");
  if (errors != nullptr && !MeasuresLayerErrors()) {
    throw InvalidArgument(kWhere, "errors", "a LayerErrors",
                          "null on this engine (CpuEngine measures layer errors)");
  }
  if (step_pending_) {
    throw Error(fmt::format("{}: a scheduled step is not computed yet (Compute it first)", kWhere));
  }
  if (n < 1) return {};
  if (n > c.context) {
    throw InvalidArgument(kWhere, "tokens.size()", n,
                          fmt::format("at most the model's context_length = {}", c.context));
  }
  const int32_t blocks_needed =
      static_cast<int32_t>((n + policy_.block_size - 1) / policy_.block_size) + 1;
  for (int i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= c.vocab) {
      throw InvalidArgument(kWhere, fmt::format("tokens[{}]", i), tokens[i],
                            fmt::format("0 to {}", c.vocab - 1));
    }
  }
  Prepare(blocks_needed, kWhere, n);
  KVCacheManager& m = *manager_;
  const SeqId seq = m.AddSequence(tokens);
  // Freed on every exit, and no step left to compute: a throw below left it live, holding blocks
  // the next call then missed.
  struct FreeOnExit {
    KVCacheManager& m;
    SeqId seq;
    bool& step_pending;
    ~FreeOnExit() {
      m.Free(seq);
      step_pending = false;
    }
  } free_on_exit{m, seq, step_pending_};
  std::vector<float> logits(static_cast<size_t>(n) * c.vocab, std::nanf(""));
  int done = 0;
  while (done < n) {
    const SequenceInfo info = m.GetSequenceInfo(seq);
    const int64_t start = info.num_scheduled > 0 ? info.num_scheduled : m.Lookup(seq).num_tokens;
    const int step = static_cast<int>(std::min<int64_t>(chunk, n - start));
    if (step <= 0) break;  // (the manager always leaves a prompt's last token to compute)
    // Positions [start, start + step): the cached prefix (a prefix hit) is never recomputed.
    const int first = static_cast<int>(start);
    if (errors != nullptr && done == 0 && first > 0) {  // before Schedule takes the hit
      throw Error(fmt::format(
          "{}: layer errors need the whole sequence, but {} tokens came from the prefix cache",
          kWhere, first));
    }
    const StepRequest request{seq, step, 0};
    const ScheduleResult r = Schedule(std::span<const StepRequest>(&request, 1));
    if (!r.admitted) throw Error(fmt::format("{}: {} blocks missing", kWhere, r.blocks_missing));
    std::vector<int32_t> rows(static_cast<size_t>(step));
    for (int t = 0; t < step; ++t) rows[t] = t;
    ForwardStep(tokens.subspan(static_cast<size_t>(first), static_cast<size_t>(step)), rows,
                logits.data() + int64_t{first} * c.vocab, errors, first, n);
    done = first + step;
    m.Commit(seq, {});  // the step completed: its full blocks join the prefix cache
  }
  return logits;
}

void Engine::ForwardStep(std::span<const int32_t> tokens, std::span<const int32_t> rows,
                         float* logits, LayerErrors* errors, int /*first*/, int /*n*/) {
  TQKV_CHECK(errors == nullptr);  // (Forward refused them here)
  Compute(tokens, rows, logits, nullptr);
}

void Engine::CheckStep(const char* where, std::span<const int32_t> tokens,
                       std::span<const int32_t> logit_rows) {
  // A step is computed once: again after its Commit it would overwrite committed K/V.
  if (!step_pending_) {
    throw Error(
        fmt::format("{}: no scheduled step to compute (each Schedule is computed once)", where));
  }
  if (tokens.size() != static_cast<size_t>(batch_.num_tokens())) {
    throw InvalidArgument(where, "tokens.size()", tokens.size(),
                          fmt::format("the scheduled step's {} tokens", batch_.num_tokens()));
  }
  const int step = batch_.num_tokens();
  if (logit_rows.size() > tokens.size()) {
    throw InvalidArgument(where, "logit_rows.size()", logit_rows.size(),
                          fmt::format("at most the step's {} rows", step));
  }
  for (int32_t row : logit_rows) {
    if (row < 0 || row >= step) {
      throw InvalidArgument(where, "logit_rows", row, fmt::format("0 to {}", step - 1));
    }
  }
  const int vocab = model_.config().vocab;
  for (int32_t t : tokens) {
    if (t < 0 || t >= vocab) {
      throw InvalidArgument(where, "token", t, fmt::format("0 to {}", vocab - 1));
    }
  }
  // Each row's position: the last rows of its sequence's context. A row at a known token's
  // position must carry that token: its K/V are published to the prefix cache under the known
  // tokens' hashes (rows past them, drafts, are free).
  positions_.resize(static_cast<size_t>(step));
  for (int32_t i = 0; i < batch_.num_requests(); ++i) {
    const int32_t q0 = batch_.query_start_loc()[i], q1 = batch_.query_start_loc()[i + 1];
    const std::span<const int32_t> known = manager_->Tokens(step_seqs_[static_cast<size_t>(i)]);
    for (int32_t t = q0; t < q1; ++t) {
      const int32_t pos = batch_.seq_lens()[i] - (q1 - t);
      positions_[t] = pos;
      if (static_cast<size_t>(pos) < known.size() && tokens[t] != known[pos]) {
        throw InvalidArgument(where, fmt::format("tokens[{}]", t), tokens[t],
                              fmt::format("{}, sequence {}'s token at position {}", known[pos],
                                          step_seqs_[static_cast<size_t>(i)], pos));
      }
    }
  }
  step_pending_ = false;
}

CpuEngine::CpuEngine(const LlamaModel& model, KvPolicy policy)
    : Engine(model, std::move(policy), CacheDevice::kCpu) {}

void LayerErrors::Resize(int layers) {
  const auto n = static_cast<size_t>(layers);
  key_err.resize(n, 0.0);
  key_norm.resize(n, 0.0);
  value_err.resize(n, 0.0);
  value_norm.resize(n, 0.0);
  cosine_sum.resize(n, 0.0);
  cosine_min.resize(n, 1.0);
  outputs.resize(n, 0);
}

namespace {

// Exact attention of one token's heads (q [hq, d]) at position pos over fp32 K/V [pos + 1, hk, d].
void ExactAttention(const float* q, const float* keys, const float* values, int pos, int hq, int hk,
                    int d, float* out) {
  const int group = hq / hk;
  std::vector<double> p(static_cast<size_t>(pos) + 1);
  for (int h = 0; h < hq; ++h) {
    const int g = h / group;
    double mx = -INFINITY;
    for (int s = 0; s <= pos; ++s) {
      double dot = 0.0;
      for (int i = 0; i < d; ++i) dot += double{q[h * d + i]} * keys[(int64_t{s} * hk + g) * d + i];
      p[s] = dot / std::sqrt(static_cast<double>(d));
      mx = std::max(mx, p[s]);
    }
    double sum = 0.0;
    for (int s = 0; s <= pos; ++s) sum += (p[s] = std::exp(p[s] - mx));
    for (int i = 0; i < d; ++i) {
      double o = 0.0;
      for (int s = 0; s <= pos; ++s) o += p[s] * values[(int64_t{s} * hk + g) * d + i];
      out[h * d + i] = static_cast<float>(o / sum);
    }
  }
}

}  // namespace

void Engine::Prepare(int32_t blocks_needed, const char* where, int n) {
  const LlamaConfig& c = model_.config();
  if (!manager_) {  // the manager and caches, sized by the first call unless the policy says
    // Set once all is built: a pool that failed to allocate must not stay this engine's size.
    const int32_t num_blocks = num_blocks_ == 0 ? std::max(blocks_needed, 2) : num_blocks_;
    KVCacheManagerOptions o;
    o.num_blocks = num_blocks;
    o.block_size = policy_.block_size;
    FormatTag tag = MakeFormatTag(quantizer_ ? compressed_format_ : bf16_format_,
                                  quantizer_ ? quantizer_->rotation().id : 0);
    if (policy_.boundary_layers > 0 && quantizer_) {  // the tag covers the per-layer policy
      tag.preset += fmt::format("+bf16x{}", policy_.boundary_layers);
    }
    o.format = tag;
    const int num_bf16 = static_cast<int>(std::count(bf16_layer_.begin(), bf16_layer_.end(), true));
    const int num_compressed = c.num_layers - num_bf16;
    try {
      if (num_compressed > 0)
        compressed_.emplace(compressed_format_, num_compressed, num_blocks, device_);
      if (num_bf16 > 0) bf16_.emplace(bf16_format_, num_bf16, num_blocks, device_);
      manager_.emplace(o);
    } catch (...) {
      compressed_.reset();
      bf16_.reset();
      throw;
    }
    num_blocks_ = num_blocks;
  }
  if (blocks_needed > num_blocks_) {
    throw InvalidArgument(
        where, "tokens", n,
        fmt::format("at most {} with {} blocks of {}", (num_blocks_ - 1) * policy_.block_size,
                    num_blocks_, policy_.block_size));
  }
}

void CpuEngine::Compute(std::span<const int32_t> tokens, std::span<const int32_t> logit_rows,
                        float* logits, int32_t* argmax) {
  RunStep(tokens, logit_rows, logits, argmax, nullptr);
}

void CpuEngine::RunStep(std::span<const int32_t> step_tokens, std::span<const int32_t> logit_rows,
                        float* logits, int32_t* argmax, ExactState* exact) {
  const LlamaConfig& c = model_.config();
  CheckStep("CpuEngine::Compute", step_tokens, logit_rows);
  const int step = static_cast<int>(step_tokens.size());
  const std::vector<int32_t>& positions = positions_;
  const int d = c.head_dim, hq = c.num_heads, hk = c.num_kv_heads;
  std::vector<float>& x = x_;
  std::vector<float>& q = q_;
  std::vector<float>& k = k_;
  std::vector<float>& v = v_;
  std::vector<float>& attn = attn_;
  std::vector<float>& lse = lse_;
  std::vector<float> exact_out(static_cast<size_t>(hq) * d);
  x.assign(static_cast<size_t>(step) * c.hidden, 0.0f);
  model_.Embed(step_tokens, x.data());
  q.resize(static_cast<size_t>(step) * hq * d);
  k.resize(static_cast<size_t>(step) * hk * d);
  v.resize(k.size());
  attn.resize(q.size());
  lse.resize(static_cast<size_t>(step) * hq);
  for (int l = 0; l < c.num_layers; ++l) {
    model_.AttentionInputs(l, x.data(), step, positions.data(), q.data(), k.data(), v.data());
    const bool bf16 = bf16_layer_[l];
    const CacheRef layer = LayerRef(l);
    if (bf16) {
      StoreBf16(bf16_format_.bf16_format, k.data(), v.data(), batch_.slot_mapping().data(), step,
                layer.data);
    } else {
      StoreInputs in;
      in.key = k.data();
      in.value = v.data();
      in.dtype = DType::kF32;
      in.slot_mapping = batch_.slot_mapping().data();
      in.slot_dtype = DType::kI64;
      in.num_tokens = step;
      quantizer_->StoreCpu(in, layer);
    }
    AttentionArgs a;
    a.query = q.data();
    a.num_seqs = batch_.num_requests();
    a.num_tokens = step;
    a.num_q_heads = hq;
    a.query_start_loc = batch_.query_start_loc().data();
    a.seq_lens = batch_.seq_lens().data();
    a.block_tables = batch_.block_tables().data();
    a.max_blocks_per_seq = batch_.block_table_width();
    a.cache = layer;
    a.output = attn.data();
    a.lse = lse.data();
    if (bf16) {
      AttentionCpu(bf16_format_.bf16_format, a);
    } else {
      AttentionCpu(*quantizer_, a);
    }
    if (exact != nullptr) {
      const int first = positions[0];
      const int kv = hk * d;
      std::copy(k.begin(), k.end(), exact->k_hist[l].begin() + int64_t{first} * kv);
      std::copy(v.begin(), v.end(), exact->v_hist[l].begin() + int64_t{first} * kv);
      auto bf16 = [](float x) { return BFloat16BitsToFloat(FloatToBFloat16Bits(x)); };
      for (int t = 0; t < step; ++t) {
        for (int h = 0; h < hk; ++h) {
          const float* kt = k.data() + int64_t{t} * kv + h * d;
          const float* vt = v.data() + int64_t{t} * kv + h * d;
          std::vector<float> kq(static_cast<size_t>(d)), vq(static_cast<size_t>(d));
          if (bf16_layer_[l]) {
            for (int i = 0; i < d; ++i) kq[i] = bf16(kt[i]), vq[i] = bf16(vt[i]);
          } else {
            const DequantizedSlot ds = quantizer_->Dequantize(layer, batch_.slot_mapping()[t], h);
            kq = ds.key;
            vq = ds.value;
          }
          for (int i = 0; i < d; ++i) {
            exact->errors->key_err[l] += std::pow(double{kt[i]} - kq[i], 2);
            exact->errors->key_norm[l] += double{kt[i]} * kt[i];
            exact->errors->value_err[l] += std::pow(double{vt[i]} - vq[i], 2);
            exact->errors->value_norm[l] += double{vt[i]} * vt[i];
          }
        }
        ExactAttention(q.data() + int64_t{t} * hq * d, exact->k_hist[l].data(),
                       exact->v_hist[l].data(), first + t, hq, hk, d, exact_out.data());
        for (int h = 0; h < hq; ++h) {
          const float* a_h = attn.data() + (int64_t{t} * hq + h) * d;
          const float* e_h = exact_out.data() + int64_t{h} * d;
          double ab = 0.0, aa = 0.0, bb = 0.0;
          for (int i = 0; i < d; ++i) {
            ab += double{a_h[i]} * e_h[i];
            aa += double{a_h[i]} * a_h[i];
            bb += double{e_h[i]} * e_h[i];
          }
          const double cosine = ab / std::sqrt(std::max(aa * bb, 1e-300));
          exact->errors->cosine_sum[l] += cosine;
          exact->errors->cosine_min[l] = std::min(exact->errors->cosine_min[l], cosine);
          ++exact->errors->outputs[l];
        }
      }
    }
    model_.AttentionOutput(l, attn.data(), step, x.data());
    model_.FeedForward(l, step, x.data());
  }
  // The final norm and output layer for the wanted rows only (a prefill chunk wants its last).
  const int rows = static_cast<int>(logit_rows.size());
  std::vector<float> last(static_cast<size_t>(rows) * c.hidden);
  for (int r = 0; r < rows; ++r) {
    std::copy_n(x.data() + int64_t{logit_rows[r]} * c.hidden, c.hidden,
                last.data() + int64_t{r} * c.hidden);
  }
  std::vector<float> own;
  if (logits == nullptr) {
    own.resize(static_cast<size_t>(rows) * c.vocab);
    logits = own.data();
  }
  model_.Logits(last.data(), rows, logits);
  for (int r = 0; argmax != nullptr && r < rows; ++r) {
    const float* row = logits + int64_t{r} * c.vocab;
    argmax[r] = static_cast<int32_t>(std::max_element(row, row + c.vocab) - row);
  }
}

void CpuEngine::ForwardStep(std::span<const int32_t> tokens, std::span<const int32_t> rows,
                            float* logits, LayerErrors* errors, int first, int n) {
  if (errors == nullptr) {
    RunStep(tokens, rows, logits, nullptr, nullptr);
    return;
  }
  const LlamaConfig& c = model_.config();
  if (first == 0) {
    errors->Resize(c.num_layers);
    exact_.errors = errors;
    exact_.k_hist.assign(
        static_cast<size_t>(c.num_layers),
        std::vector<float>(static_cast<size_t>(n) * c.num_kv_heads * c.head_dim, 0.0f));
    exact_.v_hist = exact_.k_hist;
  }
  try {
    RunStep(tokens, rows, logits, nullptr, &exact_);
  } catch (...) {
    exact_ = {};  // (the caller's LayerErrors and the sequence's K/V are not kept)
    throw;
  }
  if (first + static_cast<int>(rows.size()) == n) exact_ = {};  // the sequence is done
}

}  // namespace tqkv::model
