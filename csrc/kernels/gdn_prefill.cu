// Gated DeltaNet prefill, float32 FMAs: the delta rule over T tokens in chunks of n = kGdnPrefillChunk.
//
// The recurrence (gdn_recurrent, per value head, state S [dv, dk], key index fastest), token i of a chunk:
//   S~ = g_i S_{i-1},  delta_i = beta_i (v_i - S~ k_i),  S_i = S~ + delta_i k_i^T,  o_i = S_i q_i / sqrt(dk).
// Chunk form, per state ROW a (x_i = S_0[a].k_i and y_i = S_0[a].q_i against the state S_0 the chunk starts
// from; G_ij = g_{j+1} ... g_i for j <= i, G_ii = 1; gamma_i = g_0 ... g_i):
//   delta_i = beta_i (v_i - gamma_i x_i) - sum_{j<i} L_ij delta_j,   L_ij = beta_i G_ij (k_i.k_j)
//   o_i     = gamma_i y_i + sum_{j<=i} M_ij delta_j,                 M_ij = G_ij (q_i.k_j)
//   S_n[a]  = gamma_{n-1} S_0[a] + sum_j G_{n-1,j} delta_j k_j
// (expand S_i = gamma_i S_0 + sum_{j<=i} G_ij delta_j k_j^T into the recurrence). One pass over a state row
// serves n tokens: 2n dot products against the chunk's k and q, an n-term forward substitution, n outputs,
// a rank-n update. That is 3 FMAs per state element and token; the per-token kernel (gdn.cu) spends 5 FP
// instructions and three warp reductions (~13 instructions) on each, latency-bound on the reductions. L and
// M are shared by the rows of a value head, k.k and q.k by the Hv/Hk value heads of a key head. Every decay
// product is a direct product of decays <= 1, never a ratio of cumulative products: decays at or near 0
// make exact 0 contributions, not 0/0.
//
// Precision: float32 FMAs only, like the per-token kernel. The chunk form in float32 (a CPU emulation in
// tests/ops/test_gdn.py) is ~1e-7 rel L2 from the float64 reference, ~2e-7 at T = 4096 and dk = 128, as
// float32 token by token is. The 27B shape (dk = 128, dv % 64 == 0) runs the tensor-core form of the same
// chunk algebra instead (gdn_chunk_mma.cu: 3xTF32, no W = T diag(beta gamma) K, so ~1x these FMAs' count
// in MMAs at 3 MMAs a product); this kernel takes every other shape, chunks under 32 tokens and QWEN38_GDN_PREFILL=fp32 (gdn_prefill.h).
//
// Layout. A block serves key head kh and 16 state rows of each of its value heads kh, kh + Hk, ... (G =
// ceil(Hv / Hk) slots): 4 warps a slot, each warp 4 rows, each row 8 lanes. Lane kg of a row holds keys
// 4 (kg + 8c) .. +3, c < dk / 32 (interleaved float4s: the 8 lanes of a row read 8 consecutive float4s of a
// shared-memory k or q row, one wavefront broadcast to the warp's 4 rows). 27B: G = 3, 12 warps (3 per SM
// sub-partition), 16 x 8 = 128 blocks, one an SM, 16 state floats a thread, 75 KB of shared memory.
// Per chunk c: [all] wait for chunk c + 1's copies, one barrier, issue chunk c + 2's cp.async copies (q, k
// rows [n][dk], v [slot][row][n], beta, decay; 3 buffers); [warps 0-3] k.k and q.k of chunk c + 1 (a pair
// of 128-long dot products a lane) and its L, M, gamma, G_{n-1,j} (2 buffers); [all] chunk c: x and y
// (reduced over the row's 8 lanes: x to all 8, y scattered 2 tokens a lane), delta (every lane of the row,
// identically), the outputs, the rank-n update of the lane's keys.
// Cost (SASS at dk = 128): a thread's chunk is 1497 instructions (936 FFMA, 260 LDS, 62 SHFL); k.k adds
// ~700 on warps 0-3 and staging ~120 a thread, so an SM sub-partition issues ~5.6K instructions per 16
// tokens: ~0.18 us per token per layer at full issue; the whole GDN core took ~1.3 us (b6f1a55, pp4096).
#include "gdn_prefill.h"

#include <cstdlib>
#include <cstring>

#include <cuda_runtime.h>

#include "common.cuh"
#include "pdl.cuh"

namespace qwen38 {
namespace {

constexpr int kChunk = kGdnPrefillChunk;
constexpr int kLanesPerRow = 8;
constexpr int kRowsPerWarp = 32 / kLanesPerRow;
constexpr int kBlockRows = 16;  // state rows of each value head a block holds
constexpr int kWarpsPerSlot = kBlockRows / kRowsPerWarp;
constexpr int kMaxThreads = kGdnPrefillMaxGroup * kWarpsPerSlot * 32;
constexpr int kStages = 3;  // staging buffers: chunk c computed, c + 1 derived, c + 2 landing
// Staged v is [slot][row][token]: a lane reads its row's n values as float4s. The 16 rows of a token are
// 16 consecutive floats of qkv, copied one float a lane: rows kVStride apart keep those 4-byte writes
// within 2 ways of bank conflict (a stride of n = 16 would be 8 ways).
constexpr int kVStride = kChunk + 4;
// Lanes computing k.k and q.k: one off-diagonal pair (i > j: k_i.k_j and q_i.k_j) each, then the n
// diagonal q_i.k_i two a lane: n(n-1)/2 + n/2 = 128 lanes, warps 0-3 (one per SM sub-partition).
constexpr int kOffDiagonalPairs = kChunk * (kChunk - 1) / 2;
constexpr int kGramLanes = kOffDiagonalPairs + kChunk / 2;
static_assert(kChunk == 16 && kGramLanes == 4 * 32, "the lane mappings below are written for 16-token chunks");
static_assert(kGramLanes <= kWarpsPerSlot * 32, "a block of one slot has the k.k lanes");

// Shared memory, in floats: kStages staging buffers then 2 derived buffers.
__host__ __device__ constexpr int stage_floats(int padded_dk, int group) {
  return 2 * kChunk * padded_dk + group * kBlockRows * kVStride + 2 * group * kChunk;
}
__host__ __device__ constexpr int derived_floats(int group) { return 2 * group * kChunk * kChunk + 2 * group * kChunk; }

struct Stage {
  float* q;      // [n][padded dk], rows past T and keys past dk zero
  float* k;      // [n][padded dk]
  float* v;      // [slot][kBlockRows][kVStride], rows past dv, heads past Hv and tokens past T zero
  float* beta;   // [slot][n], zero past T
  float* decay;  // [slot][n], one past T
};
struct Derived {
  float* l;      // [slot][n][n] L_ij, zero for j >= i
  float* m;      // [slot][n][n] M_ij, zero for j > i
  float* gamma;  // [slot][n] gamma_i
  float* tail;   // [slot][n] G_{n-1,j}
};

__device__ __forceinline__ Stage stage_at(float* smem, int index, int padded_dk, int group) {
  float* p = smem + index * stage_floats(padded_dk, group);
  Stage s;
  s.q = p;
  s.k = s.q + kChunk * padded_dk;
  s.v = s.k + kChunk * padded_dk;
  s.beta = s.v + group * kBlockRows * kVStride;
  s.decay = s.beta + group * kChunk;
  return s;
}
__device__ __forceinline__ Derived derived_at(float* smem, int index, int padded_dk, int group) {
  float* p = smem + kStages * stage_floats(padded_dk, group) + index * derived_floats(group);
  Derived d;
  d.l = p;
  d.m = d.l + group * kChunk * kChunk;
  d.gamma = d.m + group * kChunk * kChunk;
  d.tail = d.gamma + group * kChunk;
  return d;
}

__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }

// n floats of shared memory (16-byte aligned) into registers, as float4 loads.
__device__ __forceinline__ void load_row(float (&r)[kChunk], const float* p) {
#pragma unroll
  for (int j = 0; j < kChunk; j += 4) {
    const float4 w = load4(p + j);
    r[j] = w.x;
    r[j + 1] = w.y;
    r[j + 2] = w.z;
    r[j + 3] = w.w;
  }
}

struct Problem {
  const float* qkv;  // [T, 2*Hk*dk + Hv*dv], row stride qkv_row_stride
  int64_t qkv_row_stride;
  const float* beta;   // [T, Hv]
  const float* decay;  // [T, Hv]
  int num_tokens, num_k_heads, num_v_heads, dk, dv;
};

// Chunk `first / n` into stage `st` (all threads; cp.async, committed by the caller).
template <int kKeyChunks>
__device__ void stage_chunk(const Stage& st, const Problem& p, int first, int key_head, int row0, int group) {
  constexpr int kRowQuads = 8 * kKeyChunks, kPaddedDk = 4 * kRowQuads;
  const int valid = min(kChunk, p.num_tokens - first);
  // q and k rows: n tokens x kRowQuads float4s each
  for (int idx = threadIdx.x; idx < 2 * kChunk * kRowQuads; idx += blockDim.x) {
    const int is_k = idx / (kChunk * kRowQuads), i = idx / kRowQuads % kChunk, quad = idx % kRowQuads;
    const bool fill = i < valid && 4 * quad < p.dk;
    const float* src = p.qkv + (int64_t)(first + (fill ? i : 0)) * p.qkv_row_stride +
                       (is_k * p.num_k_heads + key_head) * p.dk + (fill ? 4 * quad : 0);
    cp_async<16>((is_k ? st.k : st.q) + i * kPaddedDk + 4 * quad, src, fill);
  }
  // v: slot m, token i, row r; r fastest, so a warp reads runs of 16 consecutive floats
  const int64_t v_offset = 2 * (int64_t)p.num_k_heads * p.dk;
  for (int idx = threadIdx.x; idx < group * kChunk * kBlockRows; idx += blockDim.x) {
    const int m = idx / (kChunk * kBlockRows), i = idx / kBlockRows % kChunk, r = idx % kBlockRows;
    const int head = key_head + m * p.num_k_heads, row = row0 + r;
    const bool fill = i < valid && head < p.num_v_heads && row < p.dv;
    const float* src = fill ? p.qkv + (int64_t)(first + i) * p.qkv_row_stride + v_offset + (int64_t)head * p.dv + row
                            : p.qkv;
    cp_async<4>(st.v + (m * kBlockRows + r) * kVStride + i, src, fill);
  }
  // beta and decay: past T (and past Hv) beta = 0 and decay = 1, so those tokens leave the state as it is
  for (int idx = threadIdx.x; idx < 2 * group * kChunk; idx += blockDim.x) {
    const int is_decay = idx / (group * kChunk), m = idx / kChunk % group, i = idx % kChunk;
    const int head = key_head + m * p.num_k_heads;
    float* dst = (is_decay ? st.decay : st.beta) + m * kChunk + i;
    if (i < valid && head < p.num_v_heads)
      cp_async<4>(dst, (is_decay ? p.decay : p.beta) + (int64_t)(first + i) * p.num_v_heads + head, true);
    else
      *dst = is_decay ? 1.0f : 0.0f;
  }
}

// k.k, q.k of a staged chunk, then L, M, gamma and the tail products of every slot (threads < kGramLanes).
template <int kKeyChunks>
__device__ void derive_chunk(const Stage& st, const Derived& d, int group) {
  constexpr int kRowQuads = 8 * kKeyChunks, kPaddedDk = 4 * kRowQuads;
  const int lane = threadIdx.x;
  const bool diagonal = lane >= kOffDiagonalPairs;
  int i, j;  // off-diagonal: the pair (i, j), j < i, lane = i(i-1)/2 + j; diagonal: entries (i, i), (j, j)
  if (diagonal) {
    i = 2 * (lane - kOffDiagonalPairs);
    j = i + 1;
  } else {
    i = 1;
    j = lane;
    while (j >= i) j -= i++;
  }
  // dot0 = a0.b0, dot1 = a1.b1: k_i.k_j and q_i.k_j, or q_i.k_i and q_j.k_j
  const float* a0 = (diagonal ? st.q : st.k) + i * kPaddedDk;
  const float* b0 = st.k + (diagonal ? i : j) * kPaddedDk;
  const float* a1 = st.q + (diagonal ? j : i) * kPaddedDk;
  const float* b1 = st.k + j * kPaddedDk;
  float dot0 = 0.0f, dot1 = 0.0f;
#pragma unroll 4
  for (int c = 0; c < kRowQuads; ++c) {
    // Each lane starts at its own quad: the 8 lanes of a 128-byte shared-memory phase then read 8
    // different bank groups whatever rows they read (every row starts at bank 0).
    const int quad = 4 * ((c + lane) & (kRowQuads - 1));
    const float4 x0 = load4(a0 + quad), y0 = load4(b0 + quad), x1 = load4(a1 + quad), y1 = load4(b1 + quad);
    dot0 = fmaf(x0.x, y0.x, dot0);
    dot0 = fmaf(x0.y, y0.y, dot0);
    dot0 = fmaf(x0.z, y0.z, dot0);
    dot0 = fmaf(x0.w, y0.w, dot0);
    dot1 = fmaf(x1.x, y1.x, dot1);
    dot1 = fmaf(x1.y, y1.y, dot1);
    dot1 = fmaf(x1.z, y1.z, dot1);
    dot1 = fmaf(x1.w, y1.w, dot1);
  }
  for (int m = 0; m < group; ++m) {
    float* l_rows = d.l + m * kChunk * kChunk;
    float* m_rows = d.m + m * kChunk * kChunk;
    float g[kChunk];
    load_row(g, st.decay + m * kChunk);
    if (diagonal) {
      m_rows[i * kChunk + i] = dot0;
      m_rows[j * kChunk + j] = dot1;
      if (i == 0) d.gamma[m * kChunk] = g[0];
      if (j == kChunk - 1) d.tail[m * kChunk + j] = 1.0f;
    } else {
      float product = 1.0f;  // G_ij = g_{j+1} ... g_i, unrolled with predicates (a loop from j + 1 to i
#pragma unroll                // ran the warp's longest trip with a branch per step)
      for (int l = 1; l < kChunk; ++l)
        if (l > j && l <= i) product *= g[l];
      l_rows[i * kChunk + j] = st.beta[m * kChunk + i] * product * dot0;
      m_rows[i * kChunk + j] = product * dot1;
      if (j == 0) d.gamma[m * kChunk + i] = g[0] * product;
      if (i == kChunk - 1) d.tail[m * kChunk + j] = product;
    }
  }
}

// One level of a reduce-scatter over lanes `offset` apart: the lane keeps y[0, kHalf) or y[kHalf, 2 kHalf) as
// `upper` says, adds the partner's partial sums of them, and leaves the result in y[0, kHalf).
template <int kHalf>
__device__ __forceinline__ void reduce_scatter_half(float (&y)[kChunk], bool upper, int offset) {
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const float keep = upper ? y[kHalf + i] : y[i], send = upper ? y[i] : y[kHalf + i];
    y[i] = keep + __shfl_xor_sync(kFullMask, send, offset);
  }
}

// One chunk for this lane's share of a state row: s [kKeyChunks][4] holds keys 4 (kg + 8c) .. +3.
template <int kKeyChunks>
__device__ __forceinline__ void compute_chunk(float (&s)[kKeyChunks][4], const Stage& st, const Derived& d, int slot,
                                              int row_local, int kg, int first, int num_tokens, float* out_row,
                                              int64_t out_token_stride, bool active, float q_scale) {
  constexpr int kPaddedDk = 32 * kKeyChunks;
  // x_i = S_0[a].k_i, y_i = S_0[a].q_i over this lane's keys
  float x[kChunk], y[kChunk];
#pragma unroll
  for (int i = 0; i < kChunk; ++i) x[i] = y[i] = 0.0f;
#pragma unroll
  for (int c = 0; c < kKeyChunks; ++c) {
    const int key = 4 * (kg + 8 * c);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const float4 k = load4(st.k + i * kPaddedDk + key), q = load4(st.q + i * kPaddedDk + key);
      x[i] = fmaf(s[c][0], k.x, x[i]);
      x[i] = fmaf(s[c][1], k.y, x[i]);
      x[i] = fmaf(s[c][2], k.z, x[i]);
      x[i] = fmaf(s[c][3], k.w, x[i]);
      y[i] = fmaf(s[c][0], q.x, y[i]);
      y[i] = fmaf(s[c][1], q.y, y[i]);
      y[i] = fmaf(s[c][2], q.z, y[i]);
      y[i] = fmaf(s[c][3], q.w, y[i]);
    }
  }
  // x summed over the row's 8 lanes into every one of them (xor butterfly: the 8 lanes get the same bits);
  // y reduce-scattered: at each level a lane keeps the half its lane bit picks and sends the other, so lane
  // kg ends with y for tokens 2 kg and 2 kg + 1 (14 shuffles instead of 48).
#pragma unroll
  for (int offset = 1; offset < kLanesPerRow; offset <<= 1) {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) x[i] += __shfl_xor_sync(kFullMask, x[i], offset);
  }
  reduce_scatter_half<kChunk / 2>(y, kg & 4, 4);
  reduce_scatter_half<kChunk / 4>(y, kg & 2, 2);
  reduce_scatter_half<kChunk / 8>(y, kg & 1, 1);
  static_assert(kLanesPerRow == 8, "three halvings: 2 tokens a lane");

  // delta by forward substitution (every lane of the row, in the same order), in x's registers:
  // x_i -> b_i = beta_i (v_i - gamma_i x_i) -> delta_i = b_i - sum_{j<i} L_ij delta_j
  float* delta = x;
  const float* beta = st.beta + slot * kChunk;
  const float* gamma = d.gamma + slot * kChunk;
  const float* v = st.v + (slot * kBlockRows + row_local) * kVStride;
#pragma unroll
  for (int i = 0; i < kChunk; i += 4) {
    const float4 b4 = load4(beta + i), g4 = load4(gamma + i), v4 = load4(v + i);
    x[i] = b4.x * fmaf(-g4.x, x[i], v4.x);
    x[i + 1] = b4.y * fmaf(-g4.y, x[i + 1], v4.y);
    x[i + 2] = b4.z * fmaf(-g4.z, x[i + 2], v4.z);
    x[i + 3] = b4.w * fmaf(-g4.w, x[i + 3], v4.w);
  }
  const float* l = d.l + slot * kChunk * kChunk;
#pragma unroll
  for (int i = 1; i < kChunk; ++i) {
#pragma unroll
    for (int j = 0; j < i; j += 4) {  // the float4s holding L_i0 .. L_i,i-1 (past i - 1: zeros, unused)
      const float4 w = load4(l + i * kChunk + j);
      delta[i] = fmaf(-w.x, delta[j], delta[i]);
      if (j + 1 < i) delta[i] = fmaf(-w.y, delta[j + 1], delta[i]);
      if (j + 2 < i) delta[i] = fmaf(-w.z, delta[j + 2], delta[i]);
      if (j + 3 < i) delta[i] = fmaf(-w.w, delta[j + 3], delta[i]);
    }
  }
  // outputs of this lane's two tokens (M_ij = 0 for j > i)
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int i = 2 * kg + e;
    float m_row[kChunk];
    load_row(m_row, d.m + (slot * kChunk + i) * kChunk);
    float acc = gamma[i] * y[e];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) acc = fmaf(m_row[j], delta[j], acc);
    if (active && first + i < num_tokens) out_row[(int64_t)(first + i) * out_token_stride] = acc * q_scale;
  }
  // S_n = gamma_{n-1} S_0 + sum_j G_{n-1,j} delta_j k_j over this lane's keys
  const float* tail = d.tail + slot * kChunk;
  const float scale = gamma[kChunk - 1];
#pragma unroll
  for (int j = 0; j < kChunk; j += 4) {
    const float4 t4 = load4(tail + j);
    delta[j] *= t4.x;
    delta[j + 1] *= t4.y;
    delta[j + 2] *= t4.z;
    delta[j + 3] *= t4.w;
  }
#pragma unroll
  for (int c = 0; c < kKeyChunks; ++c) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[c][e] *= scale;
  }
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    // A fence every 4 tokens that ptxas does not move shared loads across: without it ptxas issued all
    // n * dk / 32 of these loads up front and spilled (0.8 KB a thread at dk = 128, ptxas -v).
    if (j % 4 == 0) __syncwarp();
#pragma unroll
    for (int c = 0; c < kKeyChunks; ++c) {
      const float4 k = load4(st.k + j * kPaddedDk + 4 * (kg + 8 * c));
      s[c][0] = fmaf(delta[j], k.x, s[c][0]);
      s[c][1] = fmaf(delta[j], k.y, s[c][1]);
      s[c][2] = fmaf(delta[j], k.z, s[c][2]);
      s[c][3] = fmaf(delta[j], k.w, s[c][3]);
    }
  }
}

// Grid (Hk, ceil(dv / kBlockRows)), block G * kWarpsPerSlot warps.
template <int kKeyChunks>
__global__ void __launch_bounds__(kMaxThreads, 1)
gdn_prefill_kernel(Problem p, float* __restrict__ state,  // [Hv, dv, dk]
                   float* __restrict__ out,                // [T, Hv, dv]
                   float q_scale) {
  constexpr int kPaddedDk = 32 * kKeyChunks;
  extern __shared__ __align__(16) float smem[];
  const int group = blockDim.x / (kWarpsPerSlot * 32);
  const int key_head = blockIdx.x, row0 = blockIdx.y * kBlockRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slot = warp / kWarpsPerSlot, kg = lane % kLanesPerRow;
  const int row_local = warp % kWarpsPerSlot * kRowsPerWarp + lane / kLanesPerRow;
  const int head = key_head + slot * p.num_k_heads, row = row0 + row_local;
  const bool active = head < p.num_v_heads && row < p.dv;
  float* state_row = state + ((int64_t)min(head, p.num_v_heads - 1) * p.dv + min(row, p.dv - 1)) * p.dk;
  float* out_row = out + (int64_t)min(head, p.num_v_heads - 1) * p.dv + min(row, p.dv - 1);
  const int64_t out_token_stride = (int64_t)p.num_v_heads * p.dv;

  // PDL wait: nothing is read before the predecessor (which may write qkv, the gates or this state) completes.
  pdl_wait_for_predecessor();
  pdl_allow_successor();

  // L's diagonal and upper triangle and M's upper triangle stay zero (derive_chunk writes the rest).
  for (int b = 0; b < 2; ++b) {
    float* lm = derived_at(smem, b, kPaddedDk, group).l;  // L then M: [2][slot][n][n]
    for (int idx = threadIdx.x; idx < 2 * group * kChunk * kChunk; idx += blockDim.x) {
      const int i = idx / kChunk % kChunk, j = idx % kChunk;
      if (idx >= group * kChunk * kChunk ? j > i : j >= i) lm[idx] = 0.0f;
    }
  }
  float s[kKeyChunks][4];
#pragma unroll
  for (int c = 0; c < kKeyChunks; ++c) {
    const int key = 4 * (kg + 8 * c);
    const float4 x = active && key < p.dk ? load4(state_row + key) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    s[c][0] = x.x;
    s[c][1] = x.y;
    s[c][2] = x.z;
    s[c][3] = x.w;
  }

  const int num_chunks = (p.num_tokens + kChunk - 1) / kChunk;
  stage_chunk<kKeyChunks>(stage_at(smem, 0, kPaddedDk, group), p, 0, key_head, row0, group);
  cp_async_commit();
  if (num_chunks > 1) stage_chunk<kKeyChunks>(stage_at(smem, 1, kPaddedDk, group), p, kChunk, key_head, row0, group);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
  if (threadIdx.x < kGramLanes)
    derive_chunk<kKeyChunks>(stage_at(smem, 0, kPaddedDk, group), derived_at(smem, 0, kPaddedDk, group), group);

  for (int c = 0; c < num_chunks; ++c) {
    cp_async_wait<0>();  // chunk c + 1 landed
    __syncthreads();     // ... for every thread; chunk c - 1's buffers are free
    if (c + 2 < num_chunks)
      stage_chunk<kKeyChunks>(stage_at(smem, (c + 2) % kStages, kPaddedDk, group), p, (c + 2) * kChunk, key_head,
                              row0, group);
    cp_async_commit();
    if (c + 1 < num_chunks && threadIdx.x < kGramLanes)
      derive_chunk<kKeyChunks>(stage_at(smem, (c + 1) % kStages, kPaddedDk, group),
                               derived_at(smem, (c + 1) % 2, kPaddedDk, group), group);
    compute_chunk<kKeyChunks>(s, stage_at(smem, c % kStages, kPaddedDk, group), derived_at(smem, c % 2, kPaddedDk, group),
                              slot, row_local, kg, c * kChunk, p.num_tokens, out_row, out_token_stride, active,
                              q_scale);
  }

  if (!active) return;
#pragma unroll
  for (int c = 0; c < kKeyChunks; ++c) {
    const int key = 4 * (kg + 8 * c);
    if (key < p.dk) *reinterpret_cast<float4*>(state_row + key) = make_float4(s[c][0], s[c][1], s[c][2], s[c][3]);
  }
}

template <int kKeyChunks>
cudaError_t launch(const Problem& p, float* state, float* out, cudaStream_t stream) {
  const int group = (p.num_v_heads + p.num_k_heads - 1) / p.num_k_heads;
  const int smem_bytes =
      (kStages * stage_floats(32 * kKeyChunks, group) + 2 * derived_floats(group)) * (int)sizeof(float);
  const cudaError_t err = cudaFuncSetAttribute(gdn_prefill_kernel<kKeyChunks>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(p.num_k_heads, (p.dv + kBlockRows - 1) / kBlockRows);
  const float q_scale = 1.0f / sqrtf((float)p.dk);
  return launch_pdl(gdn_prefill_kernel<kKeyChunks>, grid, dim3(group * kWarpsPerSlot * 32), smem_bytes, stream, p,
                    state, out, q_scale);
}

// The float32 kernel's shapes.
bool fp32_supported(const GdnRecurrentArgs& a) {
  return a.token_states == nullptr && a.num_k_heads > 0 && a.head_k_dim > 0 &&
         a.head_k_dim <= kGdnPrefillMaxHeadKDim && a.head_k_dim % 4 == 0 &&
         (a.num_v_heads + a.num_k_heads - 1) / a.num_k_heads <= kGdnPrefillMaxGroup && a.qkv_row_stride % 4 == 0 &&
         aligned16(a.qkv) && aligned16(a.state);
}

// QWEN38_GDN_PREFILL=fp32 or =mma: that kernel where it applies (gdn_prefill.h); read at each launch, as
// QWEN38_Q8_GEMM_TILE is, so a benchmark can time both kernels in one process.
const char* forced_kernel() {
  const char* env = std::getenv("QWEN38_GDN_PREFILL");
  return env != nullptr && (std::strcmp(env, "fp32") == 0 || std::strcmp(env, "mma") == 0) ? env : nullptr;
}

// The tensor-core kernel from this many tokens, where both apply. Measured on the H200 at the 27B shape (5e2d493,
// bench_gdn, a layer's gdn_recurrent): 20.6 us (tensor cores) against 13.7 (float32) at 8 tokens, 20.4 against 22.4
// at 32, 221 against 308 at 512, 1732 against 2424 at 4096.
constexpr int kMmaMinTokens = 32;

bool use_mma(const GdnRecurrentArgs& a) {
  if (!gdn_prefill_mma_supported(a)) return false;
  if (!fp32_supported(a)) return true;
  const char* forced = forced_kernel();
  if (forced != nullptr) return std::strcmp(forced, "mma") == 0;
  return a.num_tokens >= kMmaMinTokens;
}

}  // namespace

bool gdn_prefill_supported(const GdnRecurrentArgs& a) { return gdn_prefill_mma_supported(a) || fp32_supported(a); }

cudaError_t gdn_prefill_launch(const GdnRecurrentArgs& a, cudaStream_t stream) {
  if (a.num_tokens <= 0 || a.num_v_heads <= 0 || a.head_v_dim <= 0) return cudaSuccess;
  if (!gdn_prefill_supported(a)) return cudaErrorInvalidValue;
  if (use_mma(a)) return gdn_prefill_mma_launch(a, stream);
  const Problem p{a.qkv, a.qkv_row_stride, a.beta, a.decay, a.num_tokens, a.num_k_heads, a.num_v_heads, a.head_k_dim,
                  a.head_v_dim};
  // A lane holds dk / 8 keys of its row, as float4s: one instance per power-of-two share.
  if (a.head_k_dim <= 32) return launch<1>(p, a.state, a.out, stream);
  if (a.head_k_dim <= 64) return launch<2>(p, a.state, a.out, stream);
  if (a.head_k_dim <= 128) return launch<4>(p, a.state, a.out, stream);
  return launch<8>(p, a.state, a.out, stream);
}

}  // namespace qwen38
