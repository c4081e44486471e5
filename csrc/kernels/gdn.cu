// Gated DeltaNet: fused causal conv (+ SiLU + per-head L2 norm of q and k), the two gates, and the
// delta-rule recurrence on the float32 state [Hv, dv, dk] (key index fastest).
//
// Decode (T = 1) is what these kernels are shaped for; T > 1 (prefill, verification) runs the same
// recurrence token by token inside one launch (next token's inputs in flight while one is computed), so
// the state is still read once and written once; the conv runs its tokens in parallel runs.
//
// Token t of a T-token call computes exactly what a T = 1 call computes from the state token t-1 left:
// every float operation of a token is written out (fmaf, __fmul_rn, __fadd_rn: fixed roundings that no
// contraction, unrolling or loop versioning can change; nvcc -O3 emits the recurrent token loop twice, with
// and without the token_states stores), the reductions run in a fixed order, and a state kept in registers
// between tokens holds the same bits as one stored and reloaded. So the optional per-token states
// (speculative decoding's verify keeps the state after any prefix of its tokens) are bitwise those of plain
// decode steps.
#include "gdn.h"

#include <cuda_runtime.h>

#include "common.cuh"
#include "gdn_math.cuh"
#include "pdl.cuh"

namespace qwen38 {
namespace {

// ---------------------------------------------------------------------------------------------------
// Programmatic dependent launch (pdl.cuh). In a captured decode graph consecutive kernels are separated by
// a fixed ~1.4 us (measured here: a 48-thread kernel costs 1.41 us a launch), which is as much as the
// recurrent step's whole memory time; with PDL the launch gap overlaps the previous kernel instead of
// following it. Measured on the H200 in a graph rotating over 48 layers: the recurrent step 3.70 -> 2.72 us
// a layer (38% -> 52% of the read probe), conv + gates + recurrent 7.78 -> 5.87 us.
//
// PDL wait of every GDN kernel: gdn_wait_then_release (gdn_math.cuh), before which NOTHING is loaded into
// registers (not even the recurrent state: the kernel just before may be the one writing it, e.g. a state reset or
// the previous token's recurrent step on the same state). The only thing done before it is the recurrent step's
// prefetch of its state rows into L2 (L2 is the GPU's point of coherence, so a prefetched line is simply updated
// by a write the predecessor still makes, and the real load after the wait sees that write). Each kernel releases
// its own dependents right after its wait. Every launch goes through launch_pdl (no dynamic shared memory).

// ---------------------------------------------------------------------------------------------------
// gdn_conv. Depthwise: a channel never mixes with another, so one thread owns one channel for a run of
// up to kConvTokens tokens and keeps its taps-1 previous inputs in registers. The L2 norm needs a whole
// head, so the q and k region is cut into blocks of exactly one head (blockDim = head_k_dim rounded up to
// a warp); the v region only needs the SiLU and is cut into blocks of the same width. Block-uniform
// `normalize` keeps the __syncthreads legal.
// Prompts: blockIdx.y picks a run of kConvTokens tokens, whose first taps-1 inputs come from the
// previous tokens' rows of qkv (or from conv_state before token 0), so the runs are independent. One
// thread per channel over all T was latency-bound (one dependent global load per token: ~0.2 ms per layer
// at T = 512, measured). Only the first run reads conv_state, so it alone writes the new state, after its
// reads: no other block touches it. token_conv_states (optional, [T, taps-1, C]) gets the window after each
// token, straight from the registers that hold it.
constexpr int kConvTokens = 16;  // >= taps - 1 (8 at most), so only run 0 reads conv_state
template <int kTaps>
__global__ void gdn_conv_kernel(const float* __restrict__ qkv, int64_t qkv_row_stride, float* __restrict__ conv_state,
                                const float* __restrict__ conv_weight, float* __restrict__ out,
                                int64_t out_row_stride, float* __restrict__ token_conv_states, int num_tokens,
                                int channels, int num_qk_heads, int head_k_dim) {
  gdn_wait_then_release();
  const bool normalize = blockIdx.x < num_qk_heads;
  int channel;
  bool active;
  if (normalize) {
    channel = blockIdx.x * head_k_dim + threadIdx.x;
    active = threadIdx.x < head_k_dim;
  } else {
    channel = num_qk_heads * head_k_dim + (blockIdx.x - num_qk_heads) * blockDim.x + threadIdx.x;
    active = channel < channels;
  }

  // Input t of the conv (t < 0: conv_state's row taps-1+t, the inputs before this call).
  auto input = [&](int t) {
    return t >= 0 ? qkv[t * qkv_row_stride + channel] : conv_state[(int64_t)(kTaps - 1 + t) * channels + channel];
  };
  const int first = blockIdx.y * kConvTokens, last = min(first + kConvTokens, num_tokens);
  float weight[kTaps];
  float window[kTaps - 1];  // oldest first, like conv_state's rows
#pragma unroll
  for (int i = 0; i < kTaps; ++i) weight[i] = active ? conv_weight[(int64_t)channel * kTaps + i] : 0.0f;
#pragma unroll
  for (int i = 0; i < kTaps - 1; ++i) window[i] = active ? input(first - (kTaps - 1) + i) : 0.0f;

  __shared__ float warp_sums[2][32];  // double-buffered by token parity: one barrier per token
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = (blockDim.x + 31) >> 5;

  for (int t = first; t < last; ++t) {
    const float x = active ? qkv[t * qkv_row_stride + channel] : 0.0f;
    const float acc = gdn_conv_token<kTaps>(weight, window, x, kTaps);
    if (token_conv_states != nullptr && active) {
#pragma unroll
      for (int i = 0; i < kTaps - 1; ++i)
        token_conv_states[((int64_t)t * (kTaps - 1) + i) * channels + channel] = window[i];
    }

    float y = gdn_silu(acc);
    if (normalize) {
      const float sum = warp_sum(__fmul_rn(y, y));
      if (lane == 0) warp_sums[t & 1][warp] = sum;
      __syncthreads();
      float total = 0.0f;
      for (int w = 0; w < num_warps; ++w) total += warp_sums[t & 1][w];
      y = gdn_l2_normalize(y, total);
    }
    if (active) out[t * out_row_stride + channel] = y;
  }
  if (active && blockIdx.y == 0) {
    float next[kTaps - 1];  // the last taps-1 inputs of [conv_state ; qkv], all read before any write
#pragma unroll
    for (int i = 0; i < kTaps - 1; ++i) next[i] = input(num_tokens - (kTaps - 1) + i);
#pragma unroll
    for (int i = 0; i < kTaps - 1; ++i) conv_state[(int64_t)i * channels + channel] = next[i];
  }
}

// ---------------------------------------------------------------------------------------------------
// gdn_gates: gdn_beta and gdn_decay (gdn_math.cuh), one thread per token and value head.
__global__ void gdn_gates_kernel(const float* __restrict__ ba, int64_t ba_row_stride, const float* __restrict__ a_neg,
                                 const float* __restrict__ dt_bias, float* __restrict__ beta,
                                 float* __restrict__ decay, int num_tokens, int num_v_heads) {
  gdn_wait_then_release();
  // 64-bit: T and Hv are ints, their product reaches 2^31 at T = 44.7M tokens for Hv = 48.
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (int64_t)num_tokens * num_v_heads) return;
  const int64_t t = i / num_v_heads;
  const int h = (int)(i - t * num_v_heads);
  const float b = ba[t * ba_row_stride + h];
  const float a = ba[t * ba_row_stride + num_v_heads + h];
  beta[i] = gdn_beta(b);
  decay[i] = gdn_decay(a, a_neg[h], dt_bias[h]);
}

// ---------------------------------------------------------------------------------------------------
// gdn_recurrent. ONE WARP PER STATE ROW: row a of head h (dk floats) needs S·k, S·q and k·q, three
// reductions over dk, and a warp makes them register shuffles with no barrier; the row stays in the same
// registers for all T tokens and the write-back, so the state is read once and written once per call.
// Lane l owns keys (i*32 + l)*kVec + e: with kVec = 4 a warp reads a 128-key row as one coalesced
// 512-byte run of 16-byte loads.
//
// Per token: gdn_row_dots, gdn_delta, gdn_row_out, gdn_row_update (gdn_math.cuh has the math): all three
// dot products come from the same pass over the old row and reduce together (3 independent shuffle chains
// instead of two dependent ones).
// token_states (optional, [T, Hv, dv, dk]): the row after each token, stored from the registers that hold
// it with the same coalesced 16-byte stores as the final write-back (T x 3.1 MB a layer at the 27B shape).
//
// Why 4 rows per block and a register cap: the 27B step is 48*128 = 6144 rows, i.e. 6144 warps. With
// <= 40 registers a thread, 12 such blocks (48 warps) fit on an SM, so all of them are resident in one
// wave on 132 SMs and every state load is issued up front: the step is one memory round trip, not several.
constexpr int kRecurrentRowsPerBlock = 4;

template <int kVec, int kChunks>
__global__ void __launch_bounds__(kRecurrentRowsPerBlock * 32, kChunks * kVec <= 4 ? 12 : 1)
gdn_recurrent_kernel(const float* __restrict__ qkv, int64_t qkv_row_stride, const float* __restrict__ beta,
                     const float* __restrict__ decay, float* __restrict__ state, float* __restrict__ out,
                     float* __restrict__ token_states, int num_tokens, int num_k_heads, int num_v_heads, int dk,
                     int dv, float q_scale) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kRecurrentRowsPerBlock + (threadIdx.x >> 5);
  const int head = blockIdx.y;
  float* state_row = state + ((int64_t)head * dv + min(row, dv - 1)) * dk;
  bool owns[kChunks];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    owns[i] = (i * 32 + lane) * kVec < dk;  // dk % kVec == 0 (the launcher picks kVec so)
    // The state is what this kernel's time is: start pulling it into L2 while the previous kernel ends.
    if (owns[i] && row < dv) gdn_prefetch_l2(state_row + (i * 32 + lane) * kVec);
  }
  gdn_wait_then_release();
  if (row >= dv) return;  // no barriers below: whole warps leave together
  // ggml's tiled broadcast of key heads (index modulo), the internal value-head order.
  const int key_head = head % num_k_heads;

  float s[kChunks][kVec];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int key = (i * 32 + lane) * kVec;
    if (owns[i]) {
      gdn_load_vec<kVec>(state_row + key, s[i]);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) s[i][e] = 0.0f;
    }
  }

  const int q_offset = key_head * dk;
  const int k_offset = (num_k_heads + key_head) * dk;
  const int v_offset = 2 * num_k_heads * dk + head * dv + row;
  // Token t+1's inputs are loaded while token t is computed: without this the loop waited one L2 round
  // trip per token (prompts: ~1 us per token per layer, measured at T = 512).
  float k[kChunks][kVec], q[kChunks][kVec], v = 0.0f, beta_t = 0.0f, decay_t = 0.0f;
  auto load_token = [&](int t, float (&k_out)[kChunks][kVec], float (&q_out)[kChunks][kVec], float& v_out,
                        float& beta_out, float& decay_out) {
    const float* x = qkv + t * qkv_row_stride;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int key = (i * 32 + lane) * kVec;
      if (owns[i]) {
        gdn_load_vec<kVec>(x + k_offset + key, k_out[i]);
        gdn_load_vec<kVec>(x + q_offset + key, q_out[i]);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) k_out[i][e] = q_out[i][e] = 0.0f;
      }
    }
    v_out = x[v_offset];
    beta_out = beta[(int64_t)t * num_v_heads + head];
    decay_out = decay[(int64_t)t * num_v_heads + head];
  };
  if (num_tokens > 0) load_token(0, k, q, v, beta_t, decay_t);
  for (int t = 0; t < num_tokens; ++t) {
    float k_next[kChunks][kVec], q_next[kChunks][kVec], v_next = 0.0f, beta_next = 0.0f, decay_next = 0.0f;
    if (t + 1 < num_tokens) load_token(t + 1, k_next, q_next, v_next, beta_next, decay_next);

    float sk, sq, kq;
    gdn_row_dots<kVec, kChunks>(s, k, q, sk, sq, kq);
    const float delta = gdn_delta(beta_t, decay_t, sk, v);
    if (lane == 0) out[((int64_t)t * num_v_heads + head) * dv + row] = gdn_row_out(decay_t, sq, delta, kq, q_scale);
    gdn_row_update<kVec, kChunks>(s, k, decay_t, delta);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        k[i][e] = k_next[i][e];
        q[i][e] = q_next[i][e];
      }
    }
    if (token_states != nullptr) {
      float* token_row = token_states + (int64_t)t * num_v_heads * dv * dk + (state_row - state);
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        if (owns[i]) gdn_store_vec<kVec>(token_row + (i * 32 + lane) * kVec, s[i]);
      }
    }
    v = v_next;
    beta_t = beta_next;
    decay_t = decay_next;
  }

#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    if (owns[i]) gdn_store_vec<kVec>(state_row + (i * 32 + lane) * kVec, s[i]);
  }
}

template <int kVec, int kChunks>
cudaError_t launch_recurrent(const GdnRecurrentArgs& a, cudaStream_t stream) {
  const int dk = a.head_k_dim, dv = a.head_v_dim;
  const dim3 grid((dv + kRecurrentRowsPerBlock - 1) / kRecurrentRowsPerBlock, a.num_v_heads);
  const float q_scale = 1.0f / sqrtf((float)dk);
  return launch_pdl(gdn_recurrent_kernel<kVec, kChunks>, grid, dim3(kRecurrentRowsPerBlock * 32), 0, stream, a.qkv,
                    a.qkv_row_stride, a.beta, a.decay, a.state, a.out, a.token_states, a.num_tokens, a.num_k_heads,
                    a.num_v_heads, dk, dv, q_scale);
}

}  // namespace

cudaError_t gdn_conv_launch(const GdnConvArgs& a, cudaStream_t stream) {
  if (a.num_tokens <= 0 || a.channels <= 0) return cudaSuccess;
  if (a.head_k_dim <= 0 || a.head_k_dim > 1024 || 2 * a.num_k_heads * a.head_k_dim > a.channels)
    return cudaErrorInvalidValue;
  const int threads = (a.head_k_dim + 31) / 32 * 32;
  const int num_qk_heads = 2 * a.num_k_heads;
  const int rest = a.channels - num_qk_heads * a.head_k_dim;
  const dim3 grid(num_qk_heads + (rest + threads - 1) / threads, (a.num_tokens + kConvTokens - 1) / kConvTokens);
#define QWEN38_GDN_CONV(K)                                                                                       \
  case K:                                                                                                        \
    return launch_pdl(gdn_conv_kernel<K>, grid, dim3(threads), 0, stream, a.qkv, a.qkv_row_stride, a.conv_state, \
                      a.conv_weight, a.out, a.out_row_stride, a.token_conv_states, a.num_tokens, a.channels,     \
                      num_qk_heads, a.head_k_dim);
  switch (a.taps) {
    QWEN38_GDN_CONV(2)
    QWEN38_GDN_CONV(3)
    QWEN38_GDN_CONV(4)
    QWEN38_GDN_CONV(5)
    QWEN38_GDN_CONV(6)
    QWEN38_GDN_CONV(7)
    QWEN38_GDN_CONV(8)
    default:
      return cudaErrorInvalidValue;
  }
#undef QWEN38_GDN_CONV
}

cudaError_t gdn_gates_launch(const GdnGatesArgs& a, cudaStream_t stream) {
  const int64_t n = (int64_t)a.num_tokens * a.num_v_heads;
  if (n <= 0) return cudaSuccess;
  const int threads = 128;
  return launch_pdl(gdn_gates_kernel, dim3((unsigned)((n + threads - 1) / threads)), dim3(threads), 0, stream, a.ba,
                    a.ba_row_stride, a.a_neg, a.dt_bias, a.beta, a.decay, a.num_tokens, a.num_v_heads);
}

cudaError_t gdn_recurrent_launch(const GdnRecurrentArgs& a, cudaStream_t stream) {
  if (a.num_tokens <= 0 || a.num_v_heads <= 0 || a.head_v_dim <= 0) return cudaSuccess;
  const int dk = a.head_k_dim;
  if (dk <= 0 || dk > kGdnMaxHeadKDim || a.num_k_heads <= 0) return cudaErrorInvalidValue;
  // token_states' alignment is a requirement, not a dispatch input: the kernel (so the sums' order) must be
  // the one a T = 1 call on the same qkv and state picks.
  if (a.token_states != nullptr && !aligned16(a.token_states)) return cudaErrorInvalidValue;
  const bool vec4 = dk % 4 == 0 && a.qkv_row_stride % 4 == 0 && aligned16(a.qkv) && aligned16(a.state);
  if (vec4) {
    if (dk <= 128) return launch_recurrent<4, 1>(a, stream);
    return launch_recurrent<4, 2>(a, stream);
  }
  if (dk <= 32) return launch_recurrent<1, 1>(a, stream);
  if (dk <= 64) return launch_recurrent<1, 2>(a, stream);
  if (dk <= 128) return launch_recurrent<1, 4>(a, stream);
  return launch_recurrent<1, 8>(a, stream);
}

}  // namespace qwen38
