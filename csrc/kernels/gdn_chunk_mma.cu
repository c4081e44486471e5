// Gated DeltaNet prefill on tensor cores: the chunk form of gdn_prefill.cu in matrices of n = kGdnPrefillMmaChunk
// tokens, every product on mma.sync m16n8k8 TF32 in the 3xTF32 split (float32 error, below).
//
// Per value head and chunk, from the state S_0 [dv, dk] it starts from (gamma_i = g_0 ... g_i, G_ij = g_{j+1}
// ... g_i for j <= i, K, Q [n, dk], V [n, dv], beta, gamma diagonal):
//   L = strictly-lower(diag(beta) G o K K^T),  T = (I + L)^-1        (the UT transform)
//   R = diag(beta) (V - diag(gamma) K S_0^T)                          (each token's residual against S_0)
//   D = T R                                                           (the deltas, = U - W S_0^T of the WY form)
//   O = (diag(gamma) Q S_0^T + lower(G o Q K^T) D) / sqrt(dk)
//   S_n = gamma_{n-1} S_0 + D^T diag(G_{n-1,.}) K
// (the forward substitution of gdn_prefill.cu, solved as a matrix). D = T R instead of U - W S_0^T: this kernel
// walks the chunks itself, so it never needs W = T diag(beta gamma) K (n x n x dk products a chunk) and the
// residual cancels in R as it does token by token. Decay products are direct products of decays <= 1, never
// ratios of cumulative products: a decay of 0 leaves exact zeros, not 0/0.
//
// Chunk of 32, not FLA's 64: the three passes over the state (K S^T, Q S^T, the update) cost the same per
// token at any n, the intra-chunk products (K K^T, Q K^T, T R, M D) grow with n, and T's substitution is a
// chain of n dependent steps on one warp.
//
// Precision (the 1e-5 contract of gdn_recurrent): each operand x = hi + lo, hi = tf32(x), lo = tf32(x - hi)
// (cvt.rna), each product as lo*hi + hi*lo + hi*hi into one float32 accumulator, in a fresh accumulator per
// chunk, added to the state with a float32 FMA (the tensor core's truncating sums never carry the state: the
// float32 attention lane drifted to 1e-4 when they did, benchmarks/NOTES.md). A float64 emulation of this
// kernel's algorithm (same chunk, splits, order and float32 roundings; the accumulator modelled as truncating
// to 24 bits after every 4 products, coarser than the hardware) measured rel L2 <= 1.4e-6 against the float64
// reference at the 27B head shape, T = 4096, uniform, edge, trained-like and nearly collinear gates, <= 1.7e-6
// at T = 100 (tests/ops/test_gdn.py runs it on the CPU); 7e-8 with exact float32 products: the TF32 split's
// error dominates, K K^T's most, through T.
//
// Layout: one block of 8 warps per (value head, kBV state rows), grid Hv x dv / kBV, kBV = 64, 32 or 16 (a
// template parameter; every (head, row slice) is independent: a block recomputes its chunk's G, L, M and T, the
// same for every slice of a head, and does only its own rows' share of X, Y, D, O and the update). The state's
// kBV x 128 rows in registers (accumulator layout, kBV / 2 floats a thread) and in shared memory as the B operand
// of K S^T and Q S^T. Operands in shared memory are stored so that fragment loads are free of bank conflicts:
// k-contiguous ones (the MMA's A row-major, B column-major) with rows 16 floats apart modulo 32 banks (read as a
// float4 a row for two k-steps), the others with rows 8 apart; the update reads K token-major at 16 apart, 2-way
// (K is staged once, not twice as before: that copy's 34 KB kept two blocks off an SM).
// Shared memory: K, beta and the decays in two stages (read until the update at the chunk's end), Q and V in one
// (their last reads are Y and R, so chunk c + 1's copies go out after barrier [3] and land during D, O and the
// update); G shares T's buffer (G's last read is [2], T's first write [3]). 140 KB at kBV = 64 (one block an SM),
// 106 KB at 32 and 89 KB at 16 (two blocks an SM, so one block's serial phases overlap the other's MMAs).
// Per chunk, 5 barriers:
//   [top]  chunk c landed, chunk c + 1's K copies issued
//   [1]    K K^T and Q K^T (16 x 8 tiles, three a sub-partition); warp 2: G (a column a lane) and the tail
//          products, warp 3: gamma
//   [2]    L^T and M from the Gram tiles and G
//   [3]    warp 0: T by right-looking substitution (a column a lane), meanwhile warp 4 of its sub-partition
//          keeps the tensor core busy; then every warp: X = K S^T, Y = Q S^T (16 x 8 kBV / 32 tiles; at kBV = 16
//          warps 0-3 X, 4-7 Y, 16 x 8 each), R from X
//   [4]    chunk c + 1's Q, V copies issued; D = T R (X's tiles), D and D diag(tail) to shared memory
//   [top]  O = gamma Y + M D stored (Y's tiles); the state update (kBV x 128 in 8 warp tiles), the state to
//          shared memory
// Tensor work a chunk and block (mma.sync; the busiest sub-partition's share): kBV = 64: 3168 (792), 32: 1872
// (468), 16: 1224 (312); the Gram tiles' 576 (144) at every kBV.
//
// Cost model (benchmarks/NOTES.md, prefill round 3): issue-bound at low occupancy, not tensor-bound. ptxas's
// SASS spends ~60% of a chunk's instructions on the 3xTF32 splits (cvt.rna.tf32.f32 is emulated: FSETP, IADD,
// LOP3), and at 2 warps a sub-partition each warp's LDS -> split -> HMMA chains stall it: measured (kBV = 64,
// 5e2d493) 13.5 us a chunk for ~9K instructions a sub-partition, an IPC near 0.35. So the splits round with two
// integer operations (bitwise cvt.rna for finite x; with K staged once and Q, V copies overlapped, 48 layers at
// T = 4096 went from 75 to 60 ms), and kBV = 32 was to put two blocks (4 warps a sub-partition) on an SM: it
// measured slower than 64 (rows_per_block), so 64 is the default and QWEN38_GDN_MMA_ROWS=32|16 picks the others
// (benchmarks, tests).
#include "gdn_prefill.h"

#include <cstdlib>
#include <cstring>

#include <cuda_runtime.h>

#include "common.cuh"
#include "pdl.cuh"

namespace qwen38 {
namespace {

constexpr int kC = kGdnPrefillMmaChunk;
constexpr int kDk = 128;
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
// Row strides (floats): k-contiguous operands 16 banks apart (read as float4s), n- or m-contiguous ones 8 apart.
constexpr int kQKStride = kDk + 16;
constexpr int kCStride = kC + 4;
constexpr int kLtStride = kC;  // L^T below the diagonal, row k from L_{k+1,k}; zeros past row n - 1
static_assert(kC == 32 && kWarps == 8, "the warp tilings below are written for these sizes");

// Shared memory of a block of kBV state rows, offsets in floats.
template <int kBV>
struct Smem {
  static_assert(kBV == 64 || kBV == 32 || kBV == 16, "the warp tilings below are written for these sizes");
  static constexpr int kVStride = kBV + 8;
  static constexpr int kKeyStage = kC * kQKStride + 2 * kC;  // k [n][kQKStride], beta [n], decay [n]
  static constexpr int kQ = 2 * kKeyStage;                   // [n][kQKStride]: rows past T zero
  static constexpr int kV = kQ + kC * kQKStride;             // [n][kVStride]: the block's kBV value channels
  static constexpr int kState = kV + kC * kVStride;          // [kBV][kQKStride] S[a][d]
  static constexpr int kLt = kState + kBV * kQKStride;       // [n][n] L^T shifted: lt[j * n + i - j - 1] = L_ij
  static constexpr int kM = kLt + kC * kLtStride;            // [n][kCStride] M
  static constexpr int kT = kM + kC * kCStride;              // [n][kCStride] T; before it [n][n] G_ij
  static constexpr int kR = kT + kC * kCStride;              // [n][kVStride] R
  static constexpr int kD = kR + kC * kVStride;              // [n][kVStride] D
  static constexpr int kDt = kD + kC * kVStride;             // [n][kVStride] D_j G_{n-1,j}
  static constexpr int kGamma = kDt + kC * kVStride;         // [n] gamma_i
  static constexpr int kTail = kGamma + kC;                  // [n] G_{n-1,j}
  static constexpr int kBytes = (kTail + kC) * (int)sizeof(float);
};

// ---- 3xTF32 mma.sync (PTX ISA, mma.m16n8k8 .tf32; lane = 4 g + t). A 16 x 8, row: a[r] = A(g + 8 (r & 1),
// t + 4 (r >> 1)). B 8 x 8, col: b[r] = B(t + 4 r, g). C 16 x 8: c[r] = C(g + 8 (r >> 1), 2 t + (r & 1)).
struct FragA {
  uint32_t hi[4], lo[4];
};
struct FragB {
  uint32_t hi[2], lo[2];
};

// tf32(x) rounded to nearest, ties away from zero, on the magnitude bits: cvt.rna.tf32.f32's result for every
// finite x in two integer operations (ptxas emulates the cvt in three, with a NaN/Inf test these operands never
// need). tests/ops/test_gdn.py's tf32() is the same formula.
__device__ __forceinline__ uint32_t tf32_rna(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = tf32_rna(x);
  lo = tf32_rna(__fsub_rn(x, __uint_as_float(hi)));
}

// A(m, k) at p[m * ld + k] (kKMajor) or p[k * ld + m]; the fragment of rows m0.., columns k0...
template <bool kKMajor>
__device__ __forceinline__ FragA load_a(const float* p, int ld, int m0, int k0, int g, int t) {
  FragA f;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int m = m0 + g + 8 * (r & 1), k = k0 + t + 4 * (r >> 1);
    split_tf32(kKMajor ? p[m * ld + k] : p[k * ld + m], f.hi[r], f.lo[r]);
  }
  return f;
}
// B(k, n) at p[n * ld + k] (kKMajor) or p[k * ld + n].
template <bool kKMajor>
__device__ __forceinline__ FragB load_b(const float* p, int ld, int n0, int k0, int g, int t) {
  FragB f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int n = n0 + g, k = k0 + t + 4 * r;
    split_tf32(kKMajor ? p[n * ld + k] : p[k * ld + n], f.hi[r], f.lo[r]);
  }
  return f;
}

// The fragments of two k-steps, k0.. and k0 + 8.., of a k-contiguous operand, one float4 a row: lane t holds keys
// k0 + 4 t .. + 3, the first two in k-step 0's slots t and t + 4, the last two in k-step 1's. A permutation of
// the 16 keys, the same for A and B, so the products are those of the natural order, summed in another.
__device__ __forceinline__ void load_a_pair(FragA (&f)[2], const float* p, int ld, int m0, int k0, int g, int t) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // rows g, g + 8: registers 0, 2 and 1, 3
    const float4 x = *reinterpret_cast<const float4*>(p + (m0 + g + 8 * h) * ld + k0 + 4 * t);
    split_tf32(x.x, f[0].hi[h], f[0].lo[h]);
    split_tf32(x.y, f[0].hi[h + 2], f[0].lo[h + 2]);
    split_tf32(x.z, f[1].hi[h], f[1].lo[h]);
    split_tf32(x.w, f[1].hi[h + 2], f[1].lo[h + 2]);
  }
}
__device__ __forceinline__ void load_b_pair(FragB (&f)[2], const float* p, int ld, int n0, int k0, int g, int t) {
  const float4 x = *reinterpret_cast<const float4*>(p + (n0 + g) * ld + k0 + 4 * t);
  split_tf32(x.x, f[0].hi[0], f[0].lo[0]);
  split_tf32(x.y, f[0].hi[1], f[0].lo[1]);
  split_tf32(x.z, f[1].hi[0], f[1].lo[0]);
  split_tf32(x.w, f[1].hi[1], f[1].lo[1]);
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c += a b: the two small cross products first, then hi * hi (the emulated order).
__device__ __forceinline__ void mma3(float (&c)[4], const FragA& a, const FragB& b) {
  mma_tf32(c, a.lo, b.hi);
  mma_tf32(c, a.hi, b.lo);
  mma_tf32(c, a.hi, b.hi);
}

struct Problem {
  const float* qkv;  // [T, 2*Hk*dk + Hv*dv], row stride qkv_row_stride
  int64_t qkv_row_stride;
  const float* beta;   // [T, Hv]
  const float* decay;  // [T, Hv]
  int num_tokens, num_k_heads, num_v_heads, dv;
};

// k, beta and the decays of the chunk from token `first` into a key stage (all threads; cp.async, committed by
// the caller). Past T: zero k rows, beta = 0 and decay = 1, so those tokens leave the state as it is.
__device__ void stage_keys(float* stage, const Problem& p, int first, int head) {
  constexpr int kQuads = kDk / 4;
  const int valid = min(kC, p.num_tokens - first);
  const int64_t k_offset = (int64_t)(p.num_k_heads + head % p.num_k_heads) * kDk;
  for (int idx = threadIdx.x; idx < kC * kQuads; idx += kThreads) {
    const int i = idx / kQuads, quad = idx % kQuads;  // a warp copies runs of 512 contiguous bytes
    const bool fill = i < valid;
    const float* src = p.qkv + (int64_t)(first + (fill ? i : 0)) * p.qkv_row_stride + k_offset + 4 * quad;
    cp_async<16>(stage + i * kQKStride + 4 * quad, src, fill);
  }
  if (threadIdx.x < 2 * kC) {
    const int i = threadIdx.x % kC;
    const bool is_decay = threadIdx.x >= kC;
    float* dst = stage + kC * kQKStride + (is_decay ? kC : 0) + i;
    if (i < valid)
      cp_async<4>(dst, (is_decay ? p.decay : p.beta) + (int64_t)(first + i) * p.num_v_heads + head, true);
    else
      *dst = is_decay ? 1.0f : 0.0f;
  }
}

// q and the block's kBV value channels of the chunk from token `first` (all threads; cp.async, committed by the
// caller); zero rows past T.
template <int kBV>
__device__ void stage_qv(float* q, float* v, const Problem& p, int first, int head, int row0) {
  constexpr int kQuads = kDk / 4, kVQuads = kBV / 4, kCopies = kQuads + kVQuads;  // 16-byte copies a token
  const int valid = min(kC, p.num_tokens - first);
  for (int idx = threadIdx.x; idx < kC * kCopies; idx += kThreads) {
    const int i = idx / kCopies, col = idx % kCopies;
    const bool fill = i < valid;
    const float* row = p.qkv + (int64_t)(first + (fill ? i : 0)) * p.qkv_row_stride;
    if (col < kQuads)
      cp_async<16>(q + i * kQKStride + 4 * col, row + (int64_t)(head % p.num_k_heads) * kDk + 4 * col, fill);
    else
      cp_async<16>(v + i * Smem<kBV>::kVStride + 4 * (col - kQuads),
                   row + 2 * (int64_t)p.num_k_heads * kDk + (int64_t)head * p.dv + row0 + 4 * (col - kQuads), fill);
  }
}

// Steps k = k_begin .. k_end - 1 of T's substitution for column j (see [3] in the kernel), each updating the
// kRows - 1 rows below it (kRows - 1 >= n - 1 - k: rows past n - 1 are L^T's zero padding, wasted FMAs, so the
// caller shortens kRows as k grows). lt row k holds L_{k+1,k}, L_{k+2,k}, ..., then zeros. The next step's row of
// L^T is loaded during this one: the loads do not wait on the chain of T_kj.
template <int kRows>
__device__ __forceinline__ void substitution_steps(float (&partial)[kC], const float* lt, float* t_sh, int k_begin,
                                                   int k_end, int j) {
  constexpr int kQuads = kRows / 4;
  float4 l_next[kQuads];
#pragma unroll
  for (int m = 0; m < kQuads; ++m) l_next[m] = *reinterpret_cast<const float4*>(lt + k_begin * kLtStride + 4 * m);
#pragma unroll 1
  for (int k = k_begin; k < k_end; ++k) {
    float l[kRows];
#pragma unroll
    for (int m = 0; m < kQuads; ++m) {
      l[4 * m] = l_next[m].x;
      l[4 * m + 1] = l_next[m].y;
      l[4 * m + 2] = l_next[m].z;
      l[4 * m + 3] = l_next[m].w;
    }
    const float* next_row = lt + min(k + 1, kC - 1) * kLtStride;
#pragma unroll
    for (int m = 0; m < kQuads; ++m) l_next[m] = *reinterpret_cast<const float4*>(next_row + 4 * m);
    const float tkj = (k == j ? 1.0f : 0.0f) - partial[0];
    t_sh[k * kCStride + j] = tkj;
#pragma unroll
    for (int m = 0; m + 1 < kRows; ++m) partial[m] = fmaf(l[m], tkj, partial[m + 1]);
    partial[kRows - 1] = 0.0f;
  }
}

// Grid (Hv, dv / kBV), kThreads threads; two blocks an SM from kBV = 32 (shared memory and 128 registers allow).
template <int kBV>
__global__ void __launch_bounds__(kThreads, kBV <= 32 ? 2 : 1)
gdn_prefill_mma_kernel(Problem p, float* __restrict__ state,  // [Hv, dv, dk]
                       float* __restrict__ out,                // [T, Hv, dv]
                       float q_scale) {
  using L = Smem<kBV>;
  constexpr int kVStride = L::kVStride;
  // X, Y, D and O (n x kBV) in 16 x 8 kNT tiles: every warp one of X and Y each, D from X's, O from Y's; at
  // kBV = 16 there are 4 such tiles, so warps 0-3 hold X (then R, D) and warps 4-7 Y (then O), one warp of each
  // a sub-partition.
  constexpr int kNT = kBV >= 32 ? kBV / 32 : 1;
  constexpr bool kSplitXY = kBV == 16;
  // The state (kBV x 128) in warp tiles of kSM 16-row by kSN 8-key tiles: 32 x 32, 16 x 32, 16 x 16.
  constexpr int kSM = kBV == 64 ? 2 : 1;
  constexpr int kKeyWarps = kWarps / (kBV / (16 * kSM));
  constexpr int kSN = kDk / (8 * kKeyWarps);
  extern __shared__ __align__(16) float smem[];
  float* q_sh = smem + L::kQ;
  float* v_sh = smem + L::kV;
  float* s_sh = smem + L::kState;
  float* lt = smem + L::kLt;
  float* m_sh = smem + L::kM;
  float* t_sh = smem + L::kT;
  float* g_sh = t_sh;
  float* r_sh = smem + L::kR;
  float* d_sh = smem + L::kD;
  float* dt_sh = smem + L::kDt;
  float* gamma_sh = smem + L::kGamma;
  float* tail_sh = smem + L::kTail;

  const int head = blockIdx.x, row0 = blockIdx.y * kBV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int tm = (kSplitXY ? (warp >> 1) & 1 : warp >> 2) * 16;
  const int tn = (kSplitXY ? warp & 1 : warp & 3) * 8 * kNT;
  const bool has_x = !kSplitXY || warp < 4, has_y = !kSplitXY || warp >= 4;
  const int sm = warp / kKeyWarps * 16 * kSM, sn = warp % kKeyWarps * 8 * kSN;
  // Gram jobs, 16 x 8 tiles of the lower half of A = K K^T and P = Q K^T, three a sub-partition (warps w and
  // w + 4 share one): warps 4-7 A and P at rows 16.., columns gn; warps 0-3 one of them (even warps A) at rows 0...
  const bool both = warp >= 4, only_p = !both && (warp & 1);
  const int gm = both ? 16 : 0, gn = both ? 8 * (warp - 4) : 8 * (warp >> 1);
  float* state_rows = state + ((int64_t)head * p.dv + row0) * kDk;

  pdl_wait_for_predecessor();  // qkv, the gates or this state may be the predecessor's output
  pdl_allow_successor();

  // Entries no chunk writes: L's and M's tiles above the diagonal blocks, L^T's padding.
  for (int idx = threadIdx.x; idx < kC * kLtStride; idx += kThreads) lt[idx] = 0.0f;
  for (int idx = threadIdx.x; idx < kC * kC; idx += kThreads) m_sh[idx / kC * kCStride + idx % kC] = 0.0f;
  float s[kSM][kSN][4];  // S[sm + 16 i + g + 8 (r >> 1)][sn + 8 j + 2 t + (r & 1)]
#pragma unroll
  for (int i = 0; i < kSM; ++i) {
#pragma unroll
    for (int j = 0; j < kSN; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int a = sm + 16 * i + g + 8 * h, d = sn + 8 * j + 2 * t;
        const float2 x = *reinterpret_cast<const float2*>(state_rows + (int64_t)a * kDk + d);
        s[i][j][2 * h] = x.x;
        s[i][j][2 * h + 1] = x.y;
        *reinterpret_cast<float2*>(s_sh + a * kQKStride + d) = x;
      }
    }
  }

  const int num_chunks = (p.num_tokens + kC - 1) / kC;
  const int64_t out_token_stride = (int64_t)p.num_v_heads * p.dv;
  float* out_cols = out + (int64_t)head * p.dv + row0;
  stage_keys(smem, p, 0, head);
  stage_qv<kBV>(q_sh, v_sh, p, 0, head, row0);
  cp_async_commit();

  for (int c = 0; c < num_chunks; ++c) {
    const int first = c * kC;
    cp_async_wait<0>();
    __syncthreads();  // chunk c and the state for every thread; chunk c - 1's key stage is free
    if (c + 1 < num_chunks) stage_keys(smem + ((c + 1) & 1) * L::kKeyStage, p, first + kC, head);
    cp_async_commit();
    const float* k_sh = smem + (c & 1) * L::kKeyStage;
    const float* beta_sh = k_sh + kC * kQKStride;
    const float* decay_sh = beta_sh + kC;

    // [1] K K^T, Q K^T (the Gram jobs); then warp 2: G and the tail products, warp 3: gamma
    float gram0[4] = {}, gram1[4] = {};  // warps 4-7: A, P; warps 0-3: A or P in gram0
#pragma unroll 2
    for (int k0 = 0; k0 < kDk; k0 += 16) {
      FragB kb[2];
      FragA a[2];
      load_b_pair(kb, k_sh, kQKStride, gn, k0, g, t);
      load_a_pair(a, only_p ? q_sh : k_sh, kQKStride, gm, k0, g, t);
#pragma unroll
      for (int h = 0; h < 2; ++h) mma3(gram0, a[h], kb[h]);
      if (both) {
        load_a_pair(a, q_sh, kQKStride, gm, k0, g, t);
#pragma unroll
        for (int h = 0; h < 2; ++h) mma3(gram1, a[h], kb[h]);
      }
    }
    if (warp == 2) {  // G, a column j a lane: G_ij = g_{j+1} ... g_i, multiplied in that order
      const int j = lane;
      float product = 1.0f;
#pragma unroll
      for (int i = 0; i < kC; ++i) {
        if (i > j) product *= decay_sh[i];
        g_sh[i * kC + j] = i >= j ? product : 0.0f;
      }
      tail_sh[j] = product;
    } else if (warp == 3) {  // gamma_i = g_0 ... g_i
      const int i = lane;
      float product = 1.0f;
#pragma unroll
      for (int l = 0; l < kC; ++l)
        if (l <= i) product *= decay_sh[l];
      gamma_sh[i] = product;
    }
    __syncthreads();

    // [2] L^T and M
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = gm + g + 8 * (r >> 1), j = gn + 2 * t + (r & 1);
      const float gij = g_sh[i * kC + j];
      if (!only_p && j < i) lt[j * kLtStride + i - j - 1] = beta_sh[i] * gij * gram0[r];
      if (both || only_p) m_sh[i * kCStride + j] = gij * (both ? gram1[r] : gram0[r]);  // G is zero above the diagonal
    }
    __syncthreads();

    // [3] T = (I + L)^-1 (warp 0, while the other warp of its sub-partition keeps the tensor core busy with its
    // X and Y), lane j its column: T_kj = [k == j] - sum_{l<k} L_kl T_lj, each T_kj added into the partial sums
    // of the rows below it as soon as it is known (independent FMAs, not a chain). The partial sums shift down a
    // register each step (partial[m] is row k + m's), so a step is one loop body with register indices fixed,
    // not 32 unrolled copies (those took ptxas to 255 registers and spills).
    if (warp == 0) {
      const int j = lane;
      float partial[kC];
#pragma unroll
      for (int m = 0; m < kC; ++m) partial[m] = 0.0f;
      substitution_steps<kC>(partial, lt, t_sh, 0, kC / 4, j);
      substitution_steps<3 * kC / 4>(partial, lt, t_sh, kC / 4, kC / 2, j);
      substitution_steps<kC / 2>(partial, lt, t_sh, kC / 2, 3 * kC / 4, j);
      substitution_steps<kC / 4>(partial, lt, t_sh, 3 * kC / 4, kC, j);
    }

    // X = K S^T, Y = Q S^T, then R = beta (V - gamma X)
    float x[kNT][4] = {}, y[kNT][4] = {};
#pragma unroll 2
    for (int k0 = 0; k0 < kDk; k0 += 16) {
      FragB sb[kNT][2];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) load_b_pair(sb[nt], s_sh, kQKStride, tn + 8 * nt, k0, g, t);
      if (has_x) {
        FragA ka[2];
        load_a_pair(ka, k_sh, kQKStride, tm, k0, g, t);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) mma3(x[nt], ka[h], sb[nt][h]);
        }
      }
      if (has_y) {
        FragA qa[2];
        load_a_pair(qa, q_sh, kQKStride, tm, k0, g, t);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) mma3(y[nt], qa[h], sb[nt][h]);
        }
      }
    }
    if (has_x) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = tm + g + 8 * h, a = tn + 8 * nt + 2 * t;
          const float2 v = *reinterpret_cast<const float2*>(v_sh + i * kVStride + a);
          const float b = beta_sh[i], gm_i = gamma_sh[i];
          *reinterpret_cast<float2*>(r_sh + i * kVStride + a) =
              make_float2(b * fmaf(-gm_i, x[nt][2 * h], v.x), b * fmaf(-gm_i, x[nt][2 * h + 1], v.y));
        }
      }
    }
    __syncthreads();

    // [4] q and v are free: chunk c + 1's copies land during D, O and the update
    if (c + 1 < num_chunks) stage_qv<kBV>(q_sh, v_sh, p, first + kC, head, row0);
    cp_async_commit();
    // D = T R (T lower triangular: columns past this tile's rows are zero)
    if (has_x) {
      float dacc[kNT][4] = {};
#pragma unroll
      for (int k0 = 0; k0 < kC; k0 += 8) {
        if (k0 >= tm + 16) break;
        const FragA ta = load_a<true>(t_sh, kCStride, tm, k0, g, t);
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) mma3(dacc[nt], ta, load_b<false>(r_sh, kVStride, tn + 8 * nt, k0, g, t));
      }
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = tm + g + 8 * h, a = tn + 8 * nt + 2 * t;
          const float tail = tail_sh[i];
          *reinterpret_cast<float2*>(d_sh + i * kVStride + a) = make_float2(dacc[nt][2 * h], dacc[nt][2 * h + 1]);
          *reinterpret_cast<float2*>(dt_sh + i * kVStride + a) =
              make_float2(dacc[nt][2 * h] * tail, dacc[nt][2 * h + 1] * tail);
        }
      }
    }
    __syncthreads();

    // O = gamma Y + M D (M lower triangular), scaled, stored for the chunk's tokens
    if (has_y) {
      float o[kNT][4] = {};
#pragma unroll
      for (int k0 = 0; k0 < kC; k0 += 8) {
        if (k0 >= tm + 16) break;
        const FragA ma = load_a<true>(m_sh, kCStride, tm, k0, g, t);
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) mma3(o[nt], ma, load_b<false>(d_sh, kVStride, tn + 8 * nt, k0, g, t));
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = tm + g + 8 * h;
        if (first + i >= p.num_tokens) continue;
        const float gm_i = gamma_sh[i];
        float* dst = out_cols + (int64_t)(first + i) * out_token_stride + tn + 2 * t;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) dst[8 * nt + e] = fmaf(gm_i, y[nt][2 * h + e], o[nt][2 * h + e]) * q_scale;
        }
      }
    }

    // S = gamma_{n-1} S + (D diag(tail))^T K: A(a, j) = dt[j][a], B(j, d) = k[j][d]
    {
      float acc[kSM][kSN][4] = {};
#pragma unroll 1
      for (int k0 = 0; k0 < kC; k0 += 8) {
        FragA da[kSM];
#pragma unroll
        for (int i = 0; i < kSM; ++i) da[i] = load_a<false>(dt_sh, kVStride, sm + 16 * i, k0, g, t);
#pragma unroll
        for (int j = 0; j < kSN; ++j) {
          const FragB kb = load_b<false>(k_sh, kQKStride, sn + 8 * j, k0, g, t);
#pragma unroll
          for (int i = 0; i < kSM; ++i) mma3(acc[i][j], da[i], kb);
        }
      }
      const float decay_all = gamma_sh[kC - 1];
#pragma unroll
      for (int i = 0; i < kSM; ++i) {
#pragma unroll
        for (int j = 0; j < kSN; ++j) {
#pragma unroll
          for (int r = 0; r < 4; ++r) s[i][j][r] = fmaf(decay_all, s[i][j][r], acc[i][j][r]);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int a = sm + 16 * i + g + 8 * h, d = sn + 8 * j + 2 * t;
            *reinterpret_cast<float2*>(s_sh + a * kQKStride + d) = make_float2(s[i][j][2 * h], s[i][j][2 * h + 1]);
          }
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < kSM; ++i) {
#pragma unroll
    for (int j = 0; j < kSN; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int a = sm + 16 * i + g + 8 * h, d = sn + 8 * j + 2 * t;
        *reinterpret_cast<float2*>(state_rows + (int64_t)a * kDk + d) = make_float2(s[i][j][2 * h], s[i][j][2 * h + 1]);
      }
    }
  }
}

template <int kBV>
cudaError_t launch_rows(const GdnRecurrentArgs& a, cudaStream_t stream) {
  constexpr int kBytes = Smem<kBV>::kBytes;
  cudaError_t err =
      cudaFuncSetAttribute(gdn_prefill_mma_kernel<kBV>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  // the whole unified L1 as shared memory: two blocks of kBV <= 32 need 2 x (106 KB + 1 KB reserved)
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(gdn_prefill_mma_kernel<kBV>, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
  if (err != cudaSuccess) return err;
  const Problem p{a.qkv, a.qkv_row_stride, a.beta, a.decay, a.num_tokens, a.num_k_heads, a.num_v_heads,
                  a.head_v_dim};
  const float q_scale = 1.0f / sqrtf((float)kDk);
  return launch_pdl(gdn_prefill_mma_kernel<kBV>, dim3(a.num_v_heads, a.head_v_dim / kBV), dim3(kThreads), kBytes,
                    stream, p, a.state, a.out, q_scale);
}

// QWEN38_GDN_MMA_ROWS=32|16 (read at each launch, so one process times every variant; tests and bench_gdn run
// each); otherwise 64, measured best (H200, 8debcf9, 48 layers: 7.8 / 9.6 / 14.4 ms at T = 512 and 60 / 75 / 114 ms
// at 4096 for 64 / 32 / 16 rows): the two blocks an SM of 32 and 16 rows did not make up for recomputing the
// chunk's G, L, M and T in twice or four times as many blocks.
int rows_per_block() {
  const char* env = std::getenv("QWEN38_GDN_MMA_ROWS");
  if (env != nullptr && std::strcmp(env, "32") == 0) return 32;
  if (env != nullptr && std::strcmp(env, "16") == 0) return 16;
  return 64;
}

}  // namespace

bool gdn_prefill_mma_supported(const GdnRecurrentArgs& a) {
  return a.token_states == nullptr && a.num_k_heads > 0 && a.head_k_dim == kDk && a.head_v_dim % 64 == 0 &&
         a.qkv_row_stride % 4 == 0 && aligned16(a.qkv) && aligned16(a.state);
}

cudaError_t gdn_prefill_mma_launch(const GdnRecurrentArgs& a, cudaStream_t stream) {
  if (a.num_tokens <= 0 || a.num_v_heads <= 0) return cudaSuccess;
  if (!gdn_prefill_mma_supported(a)) return cudaErrorInvalidValue;
  switch (rows_per_block()) {
    case 32:
      return launch_rows<32>(a, stream);
    case 16:
      return launch_rows<16>(a, stream);
    default:
      return launch_rows<64>(a, stream);
  }
}

}  // namespace qwen38
