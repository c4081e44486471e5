// The per-token float math of the Gated DeltaNet kernels, shared by gdn.cu (gdn_conv, gdn_gates,
// gdn_recurrent) and gdn_step.cu (the fused decode step): one definition of every operation whose bits the
// two must agree on, so the fused step is bitwise the sequence of the three ops by construction.
//
// Every float operation that could be contracted or reassociated is written out (fmaf, __fmul_rn,
// __fadd_rn), except in the gate formulas, which keep the expressions gdn_gates always had: nvcc contracts
// `1 + expf(-b)` into one FMA with expf's last product, identically wherever the expression is inlined
// (checked in the PTX of both kernels); pinning it now would change gdn_gates' bits.
#pragma once
#include <cuda_runtime.h>

#include "common.cuh"  // warp_sum: an xor butterfly, every lane ends with the same total, summed in one order
#include "pdl.cuh"

namespace qwen38 {

constexpr float kGdnL2NormEps = 1e-6f;  // inside the sqrt of the sum of squares (HF / FLA l2norm)

__device__ __forceinline__ float gdn_silu(float x) { return x / __fadd_rn(1.0f, expf(-x)); }

// PDL wait of every GDN kernel (pdl.cuh): nothing is loaded into registers before it (the kernel just before
// may be the one writing the state); each kernel releases its own dependents right after it.
__device__ __forceinline__ void gdn_wait_then_release() {
  pdl_wait_for_predecessor();
  pdl_allow_successor();
}

__device__ __forceinline__ void gdn_prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(__cvta_generic_to_global(p)));
}

// ---- conv: one channel, one token. window holds the taps-1 previous inputs, oldest first; returns the
// pre-activation sum (tap taps-1 meets the newest input x) and shifts x into the window. kMaxTaps is the
// array size; taps <= kMaxTaps may be a run-time value (gdn_step) or kMaxTaps itself (gdn_conv).
template <int kMaxTaps>
__device__ __forceinline__ float gdn_conv_token(const float (&weight)[kMaxTaps], float (&window)[kMaxTaps - 1],
                                                float x, int taps) {
  float acc = 0.0f, last_weight = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxTaps - 1; ++i) {
    if (i < taps - 1) acc = fmaf(weight[i], window[i], acc);
  }
#pragma unroll
  for (int i = 0; i < kMaxTaps; ++i) {
    if (i == taps - 1) last_weight = weight[i];
  }
  acc = fmaf(last_weight, x, acc);
#pragma unroll
  for (int i = 0; i < kMaxTaps - 2; ++i) {
    if (i < taps - 2) window[i] = window[i + 1];
  }
#pragma unroll
  for (int i = 0; i < kMaxTaps - 1; ++i) {
    if (i == taps - 2) window[i] = x;
  }
  return acc;
}

// L2 norm of a q or k head: y / sqrt(sum of squares + eps), `total` the head's sum of __fmul_rn(y, y).
__device__ __forceinline__ float gdn_l2_normalize(float y, float total) {
  return __fmul_rn(y, 1.0f / sqrtf(__fadd_rn(total, kGdnL2NormEps)));
}

// ---- gates. softplus with torch's threshold (x > 20 returns x), so decay matches F.softplus bit for bit
// in the branch and to rounding elsewhere; a_neg already holds -exp(A_log) (never exponentiate it again).
__device__ __forceinline__ float gdn_beta(float b) { return 1.0f / (1.0f + expf(-b)); }

__device__ __forceinline__ float gdn_decay(float a, float a_neg, float dt_bias) {
  const float x = a + dt_bias;
  const float softplus = x > 20.0f ? x : log1pf(expf(x));
  return expf(a_neg * softplus);
}

// ---- recurrence: one state row a of one value head (dk floats held by a warp; lane l owns keys
// (i*32 + l)*kVec + e, owned[i] false past dk with zeros in s, k and q). Per token, with the decayed state
// never materialized before the reductions:
//   S·k' = decay (S·k),  delta = beta (v - decay S·k),  S' = decay S + delta k^T,
//   out = S'·q = decay (S·q) + delta (k·q)        (out reads the UPDATED state, as the reference does)
// so all three dot products come from the same pass over the old row and reduce together.
template <int kVec>
__device__ __forceinline__ void gdn_load_vec(const float* p, float (&v)[kVec]) {
  if constexpr (kVec == 4) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = p[e];
  }
}

template <int kVec>
__device__ __forceinline__ void gdn_store_vec(float* p, const float (&v)[kVec]) {
  if constexpr (kVec == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) p[e] = v[e];
  }
}

// S·k, S·q and k·q of one row, each warp-reduced (every lane gets the totals).
template <int kVec, int kChunks>
__device__ __forceinline__ void gdn_row_dots(const float (&s)[kChunks][kVec], const float (&k)[kChunks][kVec],
                                             const float (&q)[kChunks][kVec], float& sk, float& sq, float& kq) {
  sk = 0.0f, sq = 0.0f, kq = 0.0f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      sk = fmaf(s[i][e], k[i][e], sk);
      sq = fmaf(s[i][e], q[i][e], sq);
      kq = fmaf(k[i][e], q[i][e], kq);
    }
  }
  sk = warp_sum(sk);
  sq = warp_sum(sq);
  kq = warp_sum(kq);
}

__device__ __forceinline__ float gdn_delta(float beta, float decay, float sk, float v) {
  return __fmul_rn(beta, fmaf(-decay, sk, v));
}

// The row's output element, q's 1/sqrt(dk) applied last (q_scale computed on the host: 1.0f / sqrtf(dk)).
__device__ __forceinline__ float gdn_row_out(float decay, float sq, float delta, float kq, float q_scale) {
  return __fmul_rn(fmaf(decay, sq, __fmul_rn(delta, kq)), q_scale);
}

template <int kVec, int kChunks>
__device__ __forceinline__ void gdn_row_update(float (&s)[kChunks][kVec], const float (&k)[kChunks][kVec],
                                               float decay, float delta) {
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) s[i][e] = fmaf(decay, s[i][e], __fmul_rn(delta, k[i][e]));
  }
}

}  // namespace qwen38
