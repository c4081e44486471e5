// The sigmoid output gate of gated attention, one definition for its two users: attn_output_gate's kernel
// (attention_rope_gate.cu) and attention_gated's combine (attention.cu), so the fused form is bitwise the two ops.
// out = attn * sigmoid(gate), the gate from qgkv's interleaved [query_h | gate_h] rows, plus the int8 / two-word
// int8 form the o_proj GEMV reads.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "attention.h"
#include "quantize.cuh"

namespace qwen38 {

// kNone: the combine writes attention's plain output.
enum class GateLane { kNone, kFloat, kInt8, kInt8x2 };

__device__ __forceinline__ float gate_of(const GateOutputs& g, int t, int c, int head_dim) {
  const int head = c / head_dim, d = c - head * head_dim;
  return g.qgkv[t * g.qgkv_row_stride + (int64_t)head * 2 * head_dim + head_dim + d];
}

// Value c of row t (flat index i = t * Hq*hd + c). The 32 lanes of the calling warp must hold one quantization
// block (32 consecutive c of one row): its amax is a warp shuffle.
template <GateLane kLane>
__device__ __forceinline__ void store_gated(float attn, float gate, int t, int c, int64_t i, const GateOutputs& g) {
  const float y = attn * (1.0f / (1.0f + expf(-gate)));
  g.out[t * g.out_row_stride + c] = y;
  if constexpr (kLane == GateLane::kInt8 || kLane == GateLane::kInt8x2) {
    store_quantized_lane<kLane == GateLane::kInt8x2>(y, &g.out_q[i], kLane == GateLane::kInt8x2 ? &g.out_q_lo[i] : nullptr,
                                                    &g.out_d[i / kQuantBlock]);
  }
}

}  // namespace qwen38
