// Bit packing of 3/4-bit codes and little-endian fp16 fields (TURBOQUANT.md, "Bit packing"),
// shared by the CPU reference and kernels. Element i of a b-bit code vector occupies bits
// [i·b, i·b + b) of one little-endian bit stream (4-bit: low nibble = even element; 3-bit: 8
// codes per 3 bytes).
#pragma once

#include <cstdint>

#include "runtime/host_device.h"

namespace tqkv {

// Writes `count` codes (each < 2^bits) as ceil(count · bits / 8) bytes at `out`.
TQKV_HOST_DEVICE inline void PackCodes(const uint8_t* codes, int count, int bits, uint8_t* out) {
  const int bytes = (count * bits + 7) / 8;
  for (int b = 0; b < bytes; ++b) out[b] = 0;
  for (int i = 0; i < count; ++i) {
    const int bit = i * bits;
    const uint32_t shifted = static_cast<uint32_t>(codes[i]) << (bit % 8);
    out[bit / 8] |= static_cast<uint8_t>(shifted & 0xFF);
    if ((bit % 8) + bits > 8) out[bit / 8 + 1] |= static_cast<uint8_t>(shifted >> 8);
  }
}

// Code i of a packed `bits`-bit stream.
TQKV_HOST_DEVICE inline int UnpackCode(const uint8_t* packed, int i, int bits) {
  const int bit = i * bits;
  uint32_t word = packed[bit / 8];
  if ((bit % 8) + bits > 8) word |= static_cast<uint32_t>(packed[bit / 8 + 1]) << 8;
  return static_cast<int>((word >> (bit % 8)) & ((1u << bits) - 1));
}

TQKV_HOST_DEVICE inline void StoreHalfBits(uint8_t* at, uint16_t bits) {
  at[0] = static_cast<uint8_t>(bits & 0xFF);
  at[1] = static_cast<uint8_t>(bits >> 8);
}

TQKV_HOST_DEVICE inline uint16_t LoadHalfBits(const uint8_t* at) {
  return static_cast<uint16_t>(at[0] | (static_cast<uint16_t>(at[1]) << 8));
}

}  // namespace tqkv
