// An engine-shaped serving simulation over the real API (`tqkv sim`): requests arrive, share a
// system prompt, are prefilled in chunks and decoded token by token (or, with spec_tokens, verify
// that many draft tokens per step, reject a random suffix and Rewind), some fork (n > 1 sampling),
// and a Schedule shortfall preempts the lowest-priority sequence, like an engine. Every step calls
// the real KVCacheManager and, for every layer, the real store and attention for every scheduled
// token (prefill chunks, decode and verify rows; attention/attention.h) on the chosen device.
//
// K/V are a deterministic function of (layer, position, the token ids up to it), so a shared
// prefix has the same K/V in every request (prefix caching is exact) and a preempted sequence
// recomputes the same bytes; "sampled" tokens are a function of (request, branch, position), so a
// run's outputs do not depend on scheduling, prefix caching or preemption.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <tuple>

namespace tqkv::sim {

struct SimConfig {
  int layers = 2;
  int q_heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  std::string preset = "turboquant_4bit_nc";  // a preset name, "bf16" or "fp16"
  int block_size = 16;
  int64_t num_blocks = 0;    // 0: from kv_memory_gib, else sized so that preemption happens
  double kv_memory_gib = 0;  // KV memory for all layers (alternative to num_blocks)
  int requests = 24;
  int prompt_len = 150;         // including the shared prefix
  int shared_prefix = 96;       // system prompt shared by every request
  int decode_len = 32;          // generated tokens per branch
  // Speculative decoding: draft tokens verified per decoding sequence and step (0: none). A draft
  // is right with a fixed seeded probability; the first wrong one and all after it are rejected
  // and rewound, so the generated tokens are the same as without drafts.
  int spec_tokens = 0;
  // Sliding-window attention (KVCacheManagerOptions::sliding_window: a token at position p
  // attends to (p - window, p], and blocks before a sequence's window are released); 0: none.
  int sliding_window = 0;
  int prefill_chunk = 256;      // prompt tokens per step, all sequences together
  int max_running = 16;         // sequences in flight
  double fork_fraction = 0.25;  // requests that fork one extra branch after their prompt
  uint64_t seed = 1;
  std::string device = "cpu";  // cpu or cuda
  bool enable_prefix_caching = true;
  bool check_invariants = false;  // CheckInvariants() after every step
  bool progress = true;           // a progress line on stderr while running
  // cuda: after each step, replay its stores and its attention calls from CUDA graphs to time the
  // kernels alone (SimReport::*_kernels_us_per_layer).
  bool kernel_timing = true;
};

struct SimReport {
  int64_t steps = 0;
  int64_t prompt_tokens = 0;   // prompt tokens of all admissions (re-admissions included)
  int64_t prefill_tokens = 0;  // prompt tokens computed (stored), cached prefixes excluded
  int64_t cached_tokens = 0;   // prompt tokens served from the prefix cache
  int64_t decode_tokens = 0;   // generated tokens
  // Known tokens of readmitted decoding branches computed again (not from the prefix cache).
  int64_t recomputed_tokens = 0;
  int64_t draft_tokens = 0;    // drafts verified (spec_tokens)
  int64_t accepted_drafts = 0;
  int64_t preemptions = 0;
  int64_t forks = 0;
  int64_t cow_copies = 0;
  int64_t finished_branches = 0;
  int64_t num_blocks = 0;
  int64_t capacity_tokens = 0;       // (num_blocks - 1) · block_size
  int64_t bf16_capacity_tokens = 0;  // the same memory as bf16
  int64_t kv_bytes_per_token = 0;    // all layers and KV heads
  int64_t bf16_bytes_per_token = 0;
  double prefix_hit_rate = 0;  // cached / prompt tokens looked up
  double wall_s = 0;
  double decode_tokens_per_s = 0;  // generated tokens / wall time
  double manager_us_per_step = 0;  // Schedule + Commit + Fork + Free + AddSequence
  // All layers' store / attention calls per step: on cpu their time, on cuda their time on the
  // stream (CUDA events around each call).
  double store_us_per_step = 0;
  double attention_us_per_step = 0;
  // One layer's Store or Decode call, the median over steps of a step's mean per call (a kernel's
  // first launch also loads its module, which only the per-step totals above include): the host
  // time inside the library call, the call's time on the stream (events around it: launch gaps
  // included), and the same calls' kernels alone (captured in a CUDA graph and replayed; 0
  // without kernel_timing). On cpu the call is the work: all three are its CPU time.
  int64_t store_calls = 0, attention_calls = 0;
  double store_host_us_per_layer = 0, store_stream_us_per_layer = 0, store_kernels_us_per_layer = 0;
  double attention_host_us_per_layer = 0, attention_stream_us_per_layer = 0,
         attention_kernels_us_per_layer = 0;
  // The same medians of attention over two kinds of step apart: steps whose every row is a
  // decoding sequence's (one new token, or one plus its drafts), and steps with prompt tokens
  // (prefill chunks, alone or beside decoding rows). Their kernels differ: the decode kernels
  // and verify passes, against the chunk or prefill kernel.
  struct StepKindTimes {
    int64_t steps = 0;  // steps of this kind with attention calls
    double host_us = 0, stream_us = 0, kernels_us = 0;
  };
  StepKindTimes attention_decode_steps, attention_prefill_steps;
  // cuda: a step on the stream, from before its copy-on-write copies and uploads to its outputs
  // on the host (the step's one synchronization); 0 on cpu.
  double step_stream_us = 0;
  // The sim's own host work per step, outside the library calls: K/V/Q generation for every
  // layer, and the checksums and fp64 reference attention of the accuracy checks.
  double generate_us_per_step = 0;
  double check_us_per_step = 0;
  // The sampling rows' outputs (last known token, accepted drafts) vs fp64 attention over the raw
  // K/V.
  double cosine_mean = 0, cosine_worst = 1;
  double rel_error_mean = 0, rel_error_worst = 0;
  int64_t accuracy_samples = 0;  // (query, head) pairs compared (layer 0)
  // Attention outputs keyed by (request, branch, position, layer): a checksum of the output rows
  // of every computed token (prefill, decode, accepted drafts; not rejected drafts), for
  // comparing runs (prefix caching on and off, with and without drafts, CPU and CUDA).
  std::map<std::tuple<int, int, int, int>, double> output_checksums;
  // Outputs computed again for a key already held (recomputation after a preemption), and of
  // those, how many differ from the first computation (cpu: never, its attention is fp64 row by
  // row; cuda: a recomputed row may run on another kernel).
  int64_t recomputed_outputs = 0;
  int64_t recomputed_differing = 0;
};

// Runs the simulation. Throws tqkv::Error for invalid configurations (naming the flag).
SimReport RunSim(const SimConfig& config);

// The report as the table `tqkv sim` prints, and as JSON.
std::string FormatReport(const SimConfig& config, const SimReport& report);
std::string ReportJson(const SimConfig& config, const SimReport& report);

}  // namespace tqkv::sim
