// q8_0_embedding: out[t, :] = dequantized row token[t] of a Q8_0 table (int8 quants [V, D] + fp16 scales
// [V, D/32]). The token ids live on the device (the decode graph advances them without a host round trip).
#pragma once
#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace qwen38 {

struct EmbeddingArgs {
  const int32_t* token = nullptr;    // [T]
  const int8_t* weight_q = nullptr;  // [V, D], 16-byte aligned, D % 32 == 0
  const __half* weight_d = nullptr;  // [V, D/32]
  float* out = nullptr;              // [T, out_stride], rows 16-byte aligned
  int64_t out_stride = 0;
  int T = 0, V = 0, D = 0;
};

// A token outside [0, V) cannot raise from the device without a host sync: its row is written as NaN, so
// the error surfaces in the logits instead of as a silent read out of bounds.
cudaError_t q8_0_embedding(const EmbeddingArgs& args, cudaStream_t stream);

}  // namespace qwen38
