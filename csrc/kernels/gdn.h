// Gated DeltaNet kernels: the fused causal conv (+ SiLU + q/k L2 norm), the two gates, and the delta-rule
// recurrence on the float32 state. Each launcher takes its op's Args and a stream, launches asynchronously (with
// PDL when pdl_enabled(): pdl.cuh) and returns the launch's cudaError_t. Layouts are those of csrc/bindings.cpp.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace qwen38 {

// Largest key head the recurrent step keeps in registers (one warp per state row of dk floats).
constexpr int kGdnMaxHeadKDim = 256;
// Largest conv kernel width: the window of earlier inputs lives in registers.
constexpr int kGdnMaxConvTaps = 8;

// qkv [T, C] (row stride qkv_row_stride floats), conv_state [taps-1, C], conv_weight [C, taps],
// out [T, C] (row stride out_row_stride). C = 2*num_k_heads*head_k_dim + (value channels).
// token_conv_states: nullptr, or [T, taps-1, C] contiguous, the conv state after each token.
// head_k_dim <= 1024 (one thread per channel of a head), 2 <= taps <= kGdnMaxConvTaps.
struct GdnConvArgs {
  const float* qkv = nullptr;
  int64_t qkv_row_stride = 0;
  float* conv_state = nullptr;
  const float* conv_weight = nullptr;
  float* out = nullptr;
  int64_t out_row_stride = 0;
  float* token_conv_states = nullptr;
  int num_tokens = 0, channels = 0, taps = 0, num_k_heads = 0, head_k_dim = 0;
};
cudaError_t gdn_conv_launch(const GdnConvArgs& args, cudaStream_t stream);

// ba [T, 2*num_v_heads] = [b | a] (row stride ba_row_stride), a_neg, dt_bias [num_v_heads];
// beta, decay [T, num_v_heads] contiguous.
struct GdnGatesArgs {
  const float* ba = nullptr;
  int64_t ba_row_stride = 0;
  const float *a_neg = nullptr, *dt_bias = nullptr;
  float *beta = nullptr, *decay = nullptr;
  int num_tokens = 0, num_v_heads = 0;
};
cudaError_t gdn_gates_launch(const GdnGatesArgs& args, cudaStream_t stream);

// qkv [T, 2*Hk*dk + Hv*dv] (row stride qkv_row_stride), beta, decay [T, Hv], state [Hv, dv, dk] in place,
// out [T, Hv, dv]. token_states: nullptr, or [T, Hv, dv, dk] contiguous and 16-byte aligned, the state after
// each token (bitwise what T calls of one token leave). dk <= kGdnMaxHeadKDim. q/k rows and the state are
// read with 16-byte loads when dk and the row stride are multiples of 4 and qkv and the state are 16-byte
// aligned. gdn_prefill_launch (gdn_prefill.h) takes the same arguments, without token_states.
struct GdnRecurrentArgs {
  const float* qkv = nullptr;
  int64_t qkv_row_stride = 0;
  const float *beta = nullptr, *decay = nullptr;
  float *state = nullptr, *out = nullptr, *token_states = nullptr;
  int num_tokens = 0, num_k_heads = 0, num_v_heads = 0, head_k_dim = 0, head_v_dim = 0;
};
cudaError_t gdn_recurrent_launch(const GdnRecurrentArgs& args, cudaStream_t stream);

}  // namespace qwen38
