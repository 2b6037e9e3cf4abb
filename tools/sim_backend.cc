#include "tools/sim_backend.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "attention/decode_cpu.h"
#include "attention/decode_cuda.h"
#include "kvcache/kv_cache.h"
#include "quant/numerics.h"
#include "quant/store_cuda.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "runtime/stream.h"

namespace tqkv::sim {
namespace {

// The CPU reference: Quantizer::StoreCpu / DecodeCpu for TurboQuant; for bf16 / fp16, the values
// are rounded to the format's type into the Bf16BlockFormat layout and attention is computed over
// them in fp64.
class CpuBackend : public Backend {
  static uint16_t Bits(const Bf16BlockFormat& f, float x) {
    return f.dtype == DType::kF16 ? FloatToHalfBits(x) : FloatToBFloat16Bits(x);
  }
  static float Value(const Bf16BlockFormat& f, uint16_t bits) {
    return f.dtype == DType::kF16 ? HalfBitsToFloat(bits) : BFloat16BitsToFloat(bits);
  }

 public:
  CpuBackend(const CacheFormat& format, const Quantizer* q, int layers, int32_t blocks)
      : format_(format), q_(q), cache_(format, layers, blocks, CacheDevice::kCpu) {}

  void Store(int layer, const std::vector<float>& k, const std::vector<float>& v,
             std::span<const int64_t> slots) override {
    if (q_ != nullptr) {
      StoreInputs in;
      in.key = k.data();
      in.value = v.data();
      in.dtype = DType::kF32;
      in.slot_mapping = slots.data();
      in.slot_dtype = DType::kI64;
      in.num_tokens = static_cast<int64_t>(slots.size());
      q_->StoreCpu(in, {cache_.layer_data(layer), cache_.num_blocks()});
      return;
    }
    const Bf16BlockFormat& f = format_.bf16_format;
    const int d = f.head_dim;
    for (size_t t = 0; t < slots.size(); ++t) {
      if (slots[t] < 0) continue;
      uint8_t* block = cache_.layer_data(layer) + (slots[t] / f.block_size) * f.block_bytes;
      const int pos = static_cast<int>(slots[t] % f.block_size);
      for (int h = 0; h < f.num_kv_heads; ++h) {
        for (int i = 0; i < d; ++i) {
          const size_t at = (t * f.num_kv_heads + h) * d + i;
          const uint16_t kb = Bits(f, k[at]), vb = Bits(f, v[at]);
          std::memcpy(block + f.KeyOffset(pos, h) + 2 * i, &kb, 2);
          std::memcpy(block + f.ValueOffset(pos, h) + 2 * i, &vb, 2);
        }
      }
    }
  }

  void Decode(int layer, const std::vector<float>& q, const std::vector<int32_t>& tables,
              int width, const std::vector<int32_t>& lens, std::vector<float>& out,
              std::vector<float>& lse) override {
    const int b_count = static_cast<int>(lens.size());
    const int d = format_.head_dim, hk = format_.num_kv_heads;
    const int hq = static_cast<int>(q.size() / (size_t(b_count) * d));
    if (q_ != nullptr) {
      DecodeInputs in;
      in.query = q.data();
      in.num_seqs = b_count;
      in.num_q_heads = hq;
      in.block_tables = tables.data();
      in.max_blocks_per_seq = width;
      in.seq_lens = lens.data();
      DecodeCpu(*q_, cache_.layer_data(layer), cache_.num_blocks(), in, {out.data(), lse.data()});
      return;
    }
    const Bf16BlockFormat& f = format_.bf16_format;
    std::vector<float> k, v;
    std::vector<double> o(size_t(hq) * d), l(hq);
    for (int b = 0; b < b_count; ++b) {
      k.clear();
      v.clear();
      for (int t = 0; t < lens[b]; ++t) {
        const uint8_t* block =
            cache_.layer_data(layer) + int64_t{tables[size_t(b) * width + t / f.block_size]} * f.block_bytes;
        for (int h = 0; h < hk; ++h) {
          for (int i = 0; i < d; ++i) {
            uint16_t kb, vb;
            std::memcpy(&kb, block + f.KeyOffset(t % f.block_size, h) + 2 * i, 2);
            std::memcpy(&vb, block + f.ValueOffset(t % f.block_size, h) + 2 * i, 2);
            k.push_back(Value(f, kb));
            v.push_back(Value(f, vb));
          }
        }
      }
      ReferenceAttention(q.data() + size_t(b) * hq * d, k.data(), v.data(), lens[b], hq, hk, d,
                         1.0 / std::sqrt(double(d)), o.data(), l.data());
      for (int i = 0; i < hq * d; ++i) out[size_t(b) * hq * d + i] = static_cast<float>(o[i]);
      for (int i = 0; i < hq; ++i) lse[size_t(b) * hq + i] = static_cast<float>(l[i]);
    }
  }

  void ApplyCopies(std::span<const BlockCopy> copies) override { cache_.ApplyCopies(copies); }
  void Sync() override {}

 private:
  CacheFormat format_;
  const Quantizer* q_;
  KVCache cache_;
};

#if TQKV_HAVE_CUDA
// The CUDA path: StoreDeviceState (rotation + fused bucketize/pack kernel) and CudaDecoder, on
// one stream; inputs are uploaded each call (the sim generates K/V and queries on the host).
class CudaBackend : public Backend {
 public:
  CudaBackend(const CacheFormat& format, const Quantizer* q, int layers, int32_t blocks)
      : cache_(format, layers, blocks, CacheDevice::kCuda), store_(*q), decoder_(*q) {}

  void Store(int layer, const std::vector<float>& k, const std::vector<float>& v,
             std::span<const int64_t> slots) override {
    const int64_t t = static_cast<int64_t>(slots.size());
    Fit(d_k_, static_cast<int64_t>(k.size()));
    Fit(d_v_, static_cast<int64_t>(v.size()));
    Fit(d_slots_, t);
    Fit(store_ws_, store_.WorkspaceBytes(t));
    d_k_.CopyFromHost(k, 0, stream_.get());
    d_v_.CopyFromHost(v, 0, stream_.get());
    d_slots_.CopyFromHost(slots, 0, stream_.get());
    StoreInputs in;
    in.key = d_k_.data();
    in.value = d_v_.data();
    in.dtype = DType::kF32;
    in.slot_mapping = d_slots_.data();
    in.slot_dtype = DType::kI64;
    in.num_tokens = t;
    store_.Store(in, {cache_.layer_data(layer), cache_.num_blocks()},
                 {store_ws_.data(), store_ws_.size_bytes()}, stream_.get());
    stream_.Synchronize();  // timed per step by the sim
  }

  void Decode(int layer, const std::vector<float>& q, const std::vector<int32_t>& tables,
              int width, const std::vector<int32_t>& lens, std::vector<float>& out,
              std::vector<float>& lse) override {
    const int b = static_cast<int>(lens.size());
    const int hq = static_cast<int>(q.size() / (size_t(b) * decoder_.head_dim()));
    const DecodePlan plan = decoder_.Plan(b, hq, width);
    Fit(d_q_, static_cast<int64_t>(q.size()));
    Fit(d_tables_, static_cast<int64_t>(tables.size()));
    Fit(d_lens_, b);
    Fit(d_out_, static_cast<int64_t>(out.size()));
    Fit(d_lse_, static_cast<int64_t>(lse.size()));
    Fit(decode_ws_, plan.workspace_bytes);
    d_q_.CopyFromHost(q, 0, stream_.get());
    d_tables_.CopyFromHost(tables, 0, stream_.get());
    d_lens_.CopyFromHost(lens, 0, stream_.get());
    CudaDecodeArgs a;
    a.query = d_q_.data();
    a.query_dtype = DType::kF32;
    a.cache = cache_.layer_data(layer);
    a.num_blocks = cache_.num_blocks();
    a.block_tables = d_tables_.data();
    a.seq_lens = d_lens_.data();
    a.output = d_out_.data();
    a.output_dtype = DType::kF32;
    a.lse = d_lse_.data();
    a.workspace = decode_ws_.data();
    a.workspace_bytes = decode_ws_.size_bytes();
    decoder_.Run(plan, a, stream_.get());
    d_out_.CopyToHost(std::span<float>(out.data(), out.size()), 0, stream_.get());
    d_lse_.CopyToHost(std::span<float>(lse.data(), lse.size()), 0, stream_.get());
    stream_.Synchronize();
  }

  void ApplyCopies(std::span<const BlockCopy> copies) override {
    cache_.ApplyCopies(copies, stream_.get());
  }
  void Sync() override { stream_.Synchronize(); }

 private:
  template <typename T>
  void Fit(DeviceBuffer<T>& buffer, int64_t n) {
    if (buffer.size() < n) buffer = DeviceBuffer<T>(n + n / 2);  // grows rarely, geometrically
  }

  Stream stream_;
  KVCache cache_;
  StoreDeviceState store_;
  CudaDecoder decoder_;
  DeviceBuffer<float> d_k_, d_v_, d_q_, d_out_, d_lse_;
  DeviceBuffer<int64_t> d_slots_;
  DeviceBuffer<int32_t> d_tables_, d_lens_;
  DeviceBuffer<uint8_t> store_ws_, decode_ws_;
};
#endif

}  // namespace

std::unique_ptr<Backend> MakeBackend(std::string_view device, const CacheFormat& format,
                                     const Quantizer* quantizer, int num_layers,
                                     int32_t num_blocks) {
  if (device == "cpu") {
    return std::make_unique<CpuBackend>(format, quantizer, num_layers, num_blocks);
  }
  RequireCudaDevice("tqkv sim --device cuda");
  if (quantizer == nullptr) {
    throw Error(
        "tqkv sim: --device cuda runs the TurboQuant presets; the bf16 and fp16 formats "
        "run on --device cpu (there is no store kernel for them yet)");
  }
#if TQKV_HAVE_CUDA
  return std::make_unique<CudaBackend>(format, quantizer, num_layers, num_blocks);
#else
  (void)num_layers;
  (void)num_blocks;
  return nullptr;
#endif
}

}  // namespace tqkv::sim
