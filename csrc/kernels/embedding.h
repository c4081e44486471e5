// Embedding row lookups, the token ids read on the device (the decode graph advances them without a host
// round trip):
//   q8_0_embedding: out[t, :] = dequantized row token[t] of a Q8_0 table (int8 quants [V, D] + fp16 scales
//                   [V, D/32]);
//   embedding:      out[t, :] = row token[t] of a dense table (float32, bfloat16 or float16 [V, D]) as float32.
//
// An id outside [0, V) cannot raise from the device without a host sync, and an unchecked one would read
// before or past the table. Its row is written as NaN instead and, when bad_token is given, kBadTokenFlag
// is ORed into bad_token[t * bad_token_stride]: one flag for the rows (stride 0) or, when the T rows are T
// sequences (batched rows), row t's own flag t (stride 1). The host reads the flag at its next sync and raises.
// It can be shared with attention's bad_position (which stores 1), so that one int32 tells both conditions apart.
#pragma once
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "op_limits.h"  // kBadTokenFlag

namespace qwen38 {

struct EmbeddingArgs {
  const int32_t* token = nullptr;    // [T]
  const int8_t* weight_q = nullptr;  // [V, D], 16-byte aligned, D % 32 == 0
  const __half* weight_d = nullptr;  // [V, D/32]
  float* out = nullptr;              // [T, out_stride], rows 16-byte aligned
  int64_t out_stride = 0;
  int32_t* bad_token = nullptr;      // int32 [1] (bad_token_stride 0) or [T] (1), or null
  int bad_token_stride = 0;
  int T = 0, V = 0, D = 0;
};

// Both launchers run on `stream` without PDL (the kernels have no griddepcontrol.wait: pdl.cuh).
cudaError_t q8_0_embedding_launch(const EmbeddingArgs& args, cudaStream_t stream);

// W is float, __nv_bfloat16 or __half; weight [V, D] contiguous, out [T, out_stride] (any alignment).
template <typename W>
struct DenseEmbeddingArgs {
  const int32_t* token = nullptr;  // [T]
  const W* weight = nullptr;       // [V, D]
  float* out = nullptr;            // [T, out_stride]
  int64_t out_stride = 0;
  int32_t* bad_token = nullptr;    // int32 [1] (bad_token_stride 0) or [T] (1), or null
  int bad_token_stride = 0;
  int T = 0, V = 0, D = 0;
};

template <typename W>
cudaError_t embedding_launch(const DenseEmbeddingArgs<W>& args, cudaStream_t stream);

}  // namespace qwen38
