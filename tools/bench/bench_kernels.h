// Kernels the GPU benchmarks use to fill inputs and measure the memory ceilings.
#pragma once

#include <cstdint>

#include "runtime/device.h"

namespace tqkv::bench {

// Pseudo-random bytes (splitmix64 of the index), never zeros.
void FillRandomBytes(uint8_t* dst, int64_t num_bytes, uint64_t seed, StreamHandle stream);
// Makes a randomly filled compressed cache decodable: every fp16 metadata field gets a finite
// positive value (norm, scale) or a finite value (zero), and FP8 key bytes are cleared of NaN
// codes.
void FixCompressedCache(uint8_t* cache, int64_t num_blocks, int64_t block_bytes,
                        int64_t meta_offset, int num_kv_heads, int num_meta, int block_size,
                        int key_bytes, int data_per_slot, bool fp8_keys, StreamHandle stream);
// Random bf16 values in [-2, 2).
void FillRandomBf16(uint16_t* dst, int64_t count, uint64_t seed, StreamHandle stream);
// The same values as fp16.
void FillRandomF16(uint16_t* dst, int64_t count, uint64_t seed, StreamHandle stream);
// Reads num_bytes (a multiple of 16) with 128-bit loads and writes one word per CTA to sink.
void ReadAll(const uint8_t* src, int64_t num_bytes, uint32_t* sink, int sink_len,
             StreamHandle stream);

// The fewest-frills read of num_bytes (a multiple of 16) in one launch: one 32 KB tile per CTA,
// every load issued up front. sink (>= 1,024 words) is written only for an improbable checksum.
// The floor that any one-kernel decode reading the same bytes is held to, launch included.
// trigger_dependents: each CTA lets a programmatic dependent launch once its loads are done (as
// the decode's split kernel does after its chunks), for a floor with the decode's merge after it.
void ReadFloor(const uint8_t* src, int64_t num_bytes, uint32_t* sink, StreamHandle stream,
               bool trigger_dependents = false);

}  // namespace tqkv::bench
