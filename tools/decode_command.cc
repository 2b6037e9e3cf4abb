// `tqkv decode`: attention over a compressed paged cache, one query per sequence (decode) or,
// given query_start_loc, several new tokens per sequence (verify, prefill chunks); CPU reference
// or CUDA.

#include <limits>
#include <optional>
#include <span>

#include "attention/attention_cpu.h"
#include "attention/attention_cuda.h"
#include "attention/decode_cpu.h"
#include "attention/decode_cuda.h"
#include "quant/quantizer.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "runtime/safetensors.h"
#include "tools/cli_util.h"
#include "tools/commands.h"

namespace tqkv::cli {
namespace {

struct DecodeFlags {
  QuantizerFlags quant;
  std::string cache, in, out;
  std::optional<float> scale;
  int32_t sliding_window = 0;
  std::string device = "cpu";
};

// The same decode on the GPU (attention/decode_cuda.h); output F32, lse F32.
void DecodeOnDevice(const Quantizer& q, const Tensor& cache, const Tensor& query,
                    const Tensor& tables, const Tensor& lens, std::optional<float> scale,
                    std::vector<float>& output, std::vector<float>& lse) {
  const int batch = static_cast<int>(query.shape[0]);
  const int hq = static_cast<int>(query.shape[1]);
  DeviceBuffer<uint8_t> d_cache(static_cast<int64_t>(cache.data.size()));
  d_cache.CopyFromHost(cache.data);
  DeviceBuffer<uint8_t> d_query(static_cast<int64_t>(query.data.size()));
  d_query.CopyFromHost(query.data);
  DeviceBuffer<int32_t> d_tables(static_cast<int64_t>(tables.values<int32_t>().size()));
  d_tables.CopyFromHost(tables.values<int32_t>());
  DeviceBuffer<int32_t> d_lens(batch);
  d_lens.CopyFromHost(lens.values<int32_t>());
  const CudaDecoder decoder(q);
  const DecodePlan plan = decoder.Plan(batch, hq, static_cast<int>(tables.shape[1]));
  DeviceBuffer<uint8_t> workspace(plan.workspace_bytes);
  DeviceBuffer<float> d_out(static_cast<int64_t>(output.size())),
      d_lse(static_cast<int64_t>(lse.size()));
  CudaDecodeArgs a;
  a.query = d_query.data();
  a.query_dtype = query.dtype;
  a.cache = {d_cache.data(), cache.shape[0], q.layout()};
  a.block_tables = d_tables.data();
  a.seq_lens = d_lens.data();
  a.scale = scale;
  a.output = d_out.data();
  a.output_dtype = DType::kF32;
  a.lse = d_lse.data();
  a.workspace = workspace.data();
  a.workspace_bytes = workspace.size_bytes();
  decoder.Run(plan, a, nullptr);
  d_out.CopyToHost(output);  // synchronous on the default stream: waits for the decode
  d_lse.CopyToHost(lse);
}

// Several new tokens per sequence (query_start_loc), or one with a sliding window: AttentionCpu,
// or CudaAttention after the same checks on the host; output F32 [T, Hq, D], lse F32 [T, Hq].
void RunAttention(const Quantizer& q, const DecodeInputTensors& t,
                  std::span<const int32_t> query_start_loc, const DecodeFlags& flags,
                  std::vector<float>& output, std::vector<float>& lse) {
  const Tensor& cache = *t.cache;
  AttentionArgs a = MakeAttentionArgs(t, q, query_start_loc, flags.scale, flags.sliding_window);
  a.output = output.data();
  a.lse = lse.data();
  if (flags.device != "cuda") {
    AttentionCpu(q, a);
    return;
  }
  ValidateAttentionShapes("tqkv decode", q.layout(), a);
  ValidateAttentionArrays("tqkv decode", q.layout(), a);
  if (t.num_tokens == 0) return;  // nothing to attend (CudaAttention::Plan takes >= 1 sequence)
  int max_q_len = 1;
  for (int b = 0; b < t.batch; ++b) {
    max_q_len = std::max(max_q_len, a.query_start_loc[b + 1] - a.query_start_loc[b]);
  }
  DeviceBuffer<uint8_t> d_cache(static_cast<int64_t>(cache.data.size()));
  d_cache.CopyFromHost(cache.data);
  DeviceBuffer<uint8_t> d_query(static_cast<int64_t>(t.query->data.size()));
  d_query.CopyFromHost(t.query->data);
  DeviceBuffer<int32_t> d_tables(static_cast<int64_t>(t.block_tables->values<int32_t>().size()));
  d_tables.CopyFromHost(t.block_tables->values<int32_t>());
  DeviceBuffer<int32_t> d_lens(t.batch), d_loc(t.batch + 1);
  d_lens.CopyFromHost(t.seq_lens->values<int32_t>());
  d_loc.CopyFromHost(query_start_loc);
  const CudaAttention attention(q);
  // Told of the window: one-token and verify calls run it on the decode kernels, their splits
  // sized for it.
  AttentionOptions options;
  options.decode.sliding_window = flags.sliding_window;
  const AttentionPlan plan = attention.Plan(t.batch, t.num_tokens, t.num_q_heads,
                                            t.max_blocks_per_seq, max_q_len, options);
  DeviceBuffer<uint8_t> workspace(std::max<int64_t>(1, plan.workspace_bytes));
  DeviceBuffer<float> d_out(static_cast<int64_t>(std::max<size_t>(1, output.size()))),
      d_lse(static_cast<int64_t>(std::max<size_t>(1, lse.size())));
  a.query = d_query.data();
  a.query_start_loc = d_loc.data();
  a.seq_lens = d_lens.data();
  a.block_tables = d_tables.data();
  a.cache.data = d_cache.data();
  a.output = d_out.data();
  a.lse = d_lse.data();
  a.workspace = workspace.data();
  a.workspace_bytes = workspace.size_bytes();
  attention.Run(plan, a, nullptr);
  d_out.CopyToHost(std::span<float>(output));  // synchronous: waits for the attention
  d_lse.CopyToHost(std::span<float>(lse));
}

void RunDecode(const DecodeFlags& flags) {
  const SafetensorsFile cache_file = ReadSafetensors(flags.cache);
  const SafetensorsFile in = ReadSafetensors(flags.in);
  const DecodeInputTensors tensors = RequireDecodeInputs(cache_file, in, flags.quant);
  const Tensor& cache = *tensors.cache;
  const Tensor& query = *tensors.query;
  const int64_t batch = tensors.batch;
  const Quantizer q = MakeQuantizer(flags.quant, tensors.head_dim, tensors.num_kv_heads, in);
  CheckCacheMetadata(cache_file, q);
  // Decode runs as attention of one new token per sequence with a window (the decode API reads
  // whole contexts; on CUDA, attention runs such rows on the decode kernels too) and, on CUDA,
  // past the longest context the decode kernels read (the attention kernels take any).
  const bool beyond_decode =
      flags.device == "cuda" &&
      int64_t{tensors.max_blocks_per_seq} * q.format().block_size > CudaDecoder::kMaxContextTokens;
  if (tensors.query_start_loc != nullptr || flags.sliding_window > 0 || beyond_decode) {
    const std::vector<int32_t> loc = AttentionQueryStarts(
        tensors, flags.sliding_window > 0 ? "--sliding-window"
                                          : "a table past the decode kernels' longest context");
    const int64_t rows = int64_t{tensors.num_tokens} * tensors.num_q_heads;
    std::vector<float> output(static_cast<size_t>(rows * tensors.head_dim)),
        lse(static_cast<size_t>(rows));
    RunAttention(q, tensors, loc, flags, output, lse);
    SafetensorsFile out;
    out.source_name = flags.out;
    out.tensors.emplace("output", Tensor::FromValues<float>(DType::kF32, query.shape, output));
    out.tensors.emplace(
        "lse", Tensor::FromValues<float>(DType::kF32, {tensors.num_tokens, query.shape[1]}, lse));
    WriteSafetensors(flags.out, out);
    return;
  }

  std::vector<float> query_f32;
  const DecodeInputs inputs = MakeDecodeInputs(tensors, flags.scale, query_f32);
  std::vector<float> output(query_f32.size()), lse(static_cast<size_t>(batch * query.shape[1]));
  // The CPU reference validates everything (seq_lens, block ids) on the host; the GPU path runs
  // it first in checking-only form so that bad tables give the same clear error.
  if (flags.device == "cuda") {
    DecodeInputs check = inputs;
    check.token_end = 0;  // validate, attend to nothing
    DecodeCpu(q, {cache.data.data(), cache.shape[0], q.layout()}, check,
              {output.data(), lse.data()});
    DecodeOnDevice(q, cache, query, *tensors.block_tables, *tensors.seq_lens, flags.scale, output,
                   lse);
  } else {
    DecodeCpu(q, {cache.data.data(), cache.shape[0], q.layout()}, inputs,
              {output.data(), lse.data()});
  }

  SafetensorsFile out;
  out.source_name = flags.out;
  out.tensors.emplace("output", Tensor::FromValues<float>(DType::kF32, query.shape, output));
  out.tensors.emplace("lse", Tensor::FromValues<float>(DType::kF32, {batch, query.shape[1]}, lse));
  WriteSafetensors(flags.out, out);
}

}  // namespace

void AddDecodeCommand(CLI::App& app) {
  auto flags = std::make_shared<DecodeFlags>();
  auto* cmd = app.add_subcommand(
      "decode",
      "Attention of query [B, Hq, D] (or [T, Hq, D] with query_start_loc) over a "
      "compressed cache (CPU or CUDA)");
  AddQuantizerFlags(*cmd, flags->quant, /*block_size_required=*/false);
  cmd->add_option("--cache", flags->cache, "safetensors with 'cache' U8 [NB, block_bytes]")
      ->required();
  cmd->add_option("--in", flags->in,
                  "safetensors with query, block_tables, seq_lens [, query_start_loc I32 [B + 1]: "
                  "query [T, Hq, D], several new tokens per sequence] [, rotation, centroids]")
      ->required();
  cmd->add_option("--out", flags->out,
                  "safetensors to write: output F32 [B or T, Hq, D], lse F32 [B or T, Hq]")
      ->required();
  cmd->add_option("--scale", flags->scale, "softmax scale (default 1/sqrt(D))");
  cmd->add_option("--sliding-window", flags->sliding_window,
                  "a query at position p reads positions (p - window, p]; 0: whole context "
                  "(KVCacheManagerOptions::sliding_window)")
      ->check(CLI::Range(0, std::numeric_limits<int32_t>::max()));
  cmd->add_option("--device", flags->device, "cpu (reference, default) or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->callback([flags] { RunDecode(*flags); });
}

}  // namespace tqkv::cli
