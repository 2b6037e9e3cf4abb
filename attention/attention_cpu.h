// CPU reference of attention for several new tokens per sequence (attention/attention.h) over a
// TurboQuant cache or an uncompressed bf16/fp16 one. It defines the semantics, and every CUDA
// attention kernel is judged against it.
#pragma once

#include "attention/attention.h"
#include "quant/block_format.h"
#include "quant/quantizer.h"

namespace tqkv {

// Validates every argument first (ValidateAttentionShapes and ValidateAttentionArrays: all
// pointers are host memory; the workspace is not used) and throws tqkv::Error naming the
// argument, its value and what is allowed, with nothing written. Computes in fp64 from the
// dequantized cache (keys in the rotated space against q·Πᵀ for the MSE presets, as TURBOQUANT.md
// defines them) and rounds the outputs to output_dtype (every row reads at least its own token).
void AttentionCpu(const Quantizer& quantizer, const AttentionArgs& args);
void AttentionCpu(const Bf16BlockFormat& format, const AttentionArgs& args);

}  // namespace tqkv
