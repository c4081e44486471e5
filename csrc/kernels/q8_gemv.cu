// Q8_0 GEMV: one kernel template for the three activation lanes (see q8_gemv.h for the math).
//
// Why it is shaped like this. At batch 1 the GEMV streams each weight byte exactly once and does almost no
// arithmetic per byte, so its speed is the HBM rate times the fraction of the kernel during which enough
// loads are in flight (Little's law on the H200: ~4.5 TB/s x ~1-2 us loaded latency = 5-9 MB, 40-70 KB
// per SM). So:
// - Each lane loads 16 bytes per instruction (a warp covers a contiguous 512-byte "piece" of a row) with
//   ld.global.nc.L1::no_allocate: the weights are read once and must not evict the activation from L1.
// - Each warp issues PIECES such loads for each of its ROWS rows before using any (K-unrolled), then
//   consumes the whole batch branch-free, so the batch's activation loads are hoisted together too.
// - SPLIT warps of a block may share one row's K range, combined in shared memory in a fixed order (no
//   atomics, no workspace -- the op has none -- the same bits on every run): finer work units for the
//   5120-row projections. No split crosses blocks; none was needed to beat the alternatives measured.
// - The activation (<= 70 KB) is read with __ldg: L1/L2-resident for all warps of an SM.
// - The first batch of weight loads is issued before griddepcontrol.wait (PDL, see q8_gemv.h).
// Measured (bench_q8_gemv, H200, 2026-11-29): the wide shapes stream at 76-97% of the read probe, the
// narrow ones at 60-69% (int8 lane). What is lost is mostly the partly filled last wave of blocks and the
// ramp of each launch. A persistent variant (grid = resident blocks, equal rows per block, each warp
// streaming a contiguous piece range through a register ring, rows cut between warps combined in shared
// memory) was tried and measured WORSE (int8 LM head 74% vs 97%, 5120 x 6144 62% vs 60%): its per-piece
// segment bookkeeping serialised the activation loads that this batch form hoists.
//
// Lanes of a piece: lane l holds chunk c = 32p + l, bytes [16c, 16c + 16) = half of the 32-weight block c/2.
// The int8 lanes need the EXACT int32 sum of a block (ggml: sumi * (d_w * d_x)), so the two lanes of a block
// add their dp4a halves with one shuffle and the even lane accumulates -- in double: sumi * d_w * d_x is
// exact in double and so is the sum to ~1e-16, so `out` is the exact dot rounded once to float. With float
// accumulation (this kernel's first form) the int8 model drifted from llama.cpp's logits at position 5 of
// the oracle (a rounding flip in the next activation; median per-position rel L2 1.8e-2) where the exact
// value stays within 7e-8 up to position 17 -- llama.cpp's own order is one of many float orders, and the
// exact sum is the one closest to all of them. One DFMA per 32-weight block costs nothing at HBM speed. K % 512 != 0: the last piece of a
// row is partial; lanes past the row end load nothing and add zero.
#include "q8_gemv.h"

#include <cstdio>
#include <cstdlib>
#include <type_traits>

namespace qwen38 {
namespace {

__device__ __forceinline__ int4 load_weights16(const int8_t* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ float load_weight_scale(const __half* p) {
  unsigned short bits;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(bits) : "l"(p));
  return __half2float(__ushort_as_half(bits));
}

__device__ __forceinline__ int dot16_i8(int4 w, int4 x) {
  return __dp4a(w.w, x.w, __dp4a(w.z, x.z, __dp4a(w.y, x.y, __dp4a(w.x, x.x, 0))));
}

// int8 -> float without I2F (a quarter-rate conversion on this chip; it is what made the old f32-activation
// GEMV compute-bound): put the biased byte b + 128 into the mantissa of 2^23 with one PRMT, subtract
// 2^23 + 128. Exact for every int8.
__device__ __forceinline__ float biased_byte_to_float(uint32_t biased_word, int byte) {
  return __int_as_float(static_cast<int>(__byte_perm(biased_word, 0x4B000000u, 0x7440u | byte))) - 8388736.0f;
}

__device__ __forceinline__ float dot4_f32(uint32_t word, float4 x, float acc) {
  const uint32_t biased = word ^ 0x80808080u;
  acc = fmaf(biased_byte_to_float(biased, 0), x.x, acc);
  acc = fmaf(biased_byte_to_float(biased, 1), x.y, acc);
  acc = fmaf(biased_byte_to_float(biased, 2), x.z, acc);
  acc = fmaf(biased_byte_to_float(biased, 3), x.w, acc);
  return acc;
}

__device__ __forceinline__ float dot16_f32(int4 w, const float4 (&x)[4]) {
  // Four independent chains (one per word) for ILP, combined in a fixed order.
  const float s0 = dot4_f32(static_cast<uint32_t>(w.x), x[0], 0.f);
  const float s1 = dot4_f32(static_cast<uint32_t>(w.y), x[1], 0.f);
  const float s2 = dot4_f32(static_cast<uint32_t>(w.z), x[2], 0.f);
  const float s3 = dot4_f32(static_cast<uint32_t>(w.w), x[3], 0.f);
  return (s0 + s1) + (s2 + s3);
}

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// Block = 4 warps. SPLIT warps share a row's K range (pieces interleaved, so the block reads one contiguous
// span), ROWS rows per warp share each activation load. A warp loads PIECES pieces of each of its rows,
// then consumes them, then loads the next PIECES.
template <Q8Act ACT, int TOKENS, int PIECES, int SPLIT, int ROWS>
__global__ void __launch_bounds__(kThreads) q8_0_gemv_kernel(const Q8GemvArgs a) {
  static_assert(kWarps % SPLIT == 0, "SPLIT must divide the warps of a block");
  constexpr int kRowsPerBlock = (kWarps / SPLIT) * ROWS;
  pdl_allow_successor();

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int part = warp % SPLIT;
  const int row0 = blockIdx.x * kRowsPerBlock + (warp / SPLIT) * ROWS;
  const int t0 = blockIdx.y * TOKENS;
  const int chunks = a.K >> 4;            // 16-byte chunks per row
  const int pieces = (chunks + 31) >> 5;  // 512-byte pieces per row (the last may be partial)
  const int my_pieces = pieces > part ? (pieces - part + SPLIT - 1) / SPLIT : 0;  // pieces part + SPLIT*j
  const int blocks_per_row = a.K >> 5;

  using Acc = std::conditional_t<ACT == Q8Act::F32, float, double>;
  auto result = [](Acc v) {
    if constexpr (ACT == Q8Act::Int8x2) return static_cast<float>(v / 127.0);
    return static_cast<float>(v);
  };
  int4 w[PIECES][ROWS];
  float wd[PIECES][ROWS];
  Acc acc[ROWS][TOKENS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) acc[r][t] = Acc(0);

  auto load_batch = [&](int j0) {
#pragma unroll
    for (int u = 0; u < PIECES; ++u) {
      const int c = (part + SPLIT * (j0 + u)) * 32 + lane;
      const bool in_row = j0 + u < my_pieces && c < chunks;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const size_t row = static_cast<size_t>(row0 + r);
        if (in_row && row0 + r < a.N) {
          w[u][r] = load_weights16(a.weight_q + row * a.K + static_cast<size_t>(c) * 16);
          wd[u][r] = load_weight_scale(a.weight_d + row * blocks_per_row + (c >> 1));
        } else {
          w[u][r] = make_int4(0, 0, 0, 0);
          wd[u][r] = 0.f;
        }
      }
    }
  };

  // No branches on piece validity here: every activation load is issued (from a clamped, always-legal
  // address) and masked by a select, so the compiler hoists all of a batch's loads ahead of the math
  // instead of paying one L1 round trip per piece. Masked pieces carry zero weights and scales.
  auto compute_batch = [&](int j0) {
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
      if (t0 + t < a.T) {  // block-uniform
        const size_t tok = static_cast<size_t>(t0 + t);
#pragma unroll
        for (int u = 0; u < PIECES; ++u) {
          const int c_raw = (part + SPLIT * (j0 + u)) * 32 + lane;
          const bool in_row = j0 + u < my_pieces && c_raw < chunks;
          const size_t c = in_row ? static_cast<size_t>(c_raw) : 0;
          if constexpr (ACT == Q8Act::F32) {
            const float* x_row = static_cast<const float*>(a.x) + tok * a.x_stride;
            const float4* xp = reinterpret_cast<const float4*>(x_row + c * 16);
            float4 x[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float4 v = __ldg(xp + i);
              x[i] = in_row ? v : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[r][t] = fmaf(dot16_f32(w[u][r], x), wd[u][r], acc[r][t]);
          } else {
            const int8_t* x_row = static_cast<const int8_t*>(a.x) + tok * a.x_stride;
            const int4 xq = __ldg(reinterpret_cast<const int4*>(x_row + c * 16));
            int4 xlo = make_int4(0, 0, 0, 0);
            if constexpr (ACT == Q8Act::Int8x2)
              xlo = __ldg(reinterpret_cast<const int4*>(a.x_lo + tok * a.x_lo_stride + c * 16));
            // Both lanes of a block hold its full int32 sum after the shuffle; only the even one adds it
            // (a select, not a branch, so the batch's loads stay hoistable).
            const float xd_raw = __ldg(a.x_d + tok * a.x_d_stride + (c >> 1));
            const float xd = in_row && !(lane & 1) ? xd_raw : 0.f;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
              int hi = dot16_i8(w[u][r], xq);
              hi += __shfl_xor_sync(0xffffffffu, hi, 1);  // the block's other 16 weights
              const double scale = static_cast<double>(wd[u][r]) * static_cast<double>(xd);  // exact
              if constexpr (ACT == Q8Act::Int8) {
                acc[r][t] = fma(static_cast<double>(hi), scale, acc[r][t]);
              } else {
                int lo = dot16_i8(w[u][r], xlo);
                lo += __shfl_xor_sync(0xffffffffu, lo, 1);
                // 127 (hi + lo/127), exact in int32 (|.| < 2^27); the 1/127 is applied once at the end
                // (a double division per block measured 67% -> 52% of the read probe at 16384 x 5120).
                acc[r][t] = fma(static_cast<double>(127 * hi + lo), scale, acc[r][t]);
              }
            }
          }
        }
      }
    }
  };

  load_batch(0);
  pdl_wait_for_predecessor();  // weights are constant; the activation and `out` belong to the predecessor
  for (int j0 = 0; j0 < my_pieces; j0 += PIECES) {
    compute_batch(j0);
    if (j0 + PIECES < my_pieces) load_batch(j0 + PIECES);
  }

#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
      Acc v = acc[r][t];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      acc[r][t] = v;
    }

  if constexpr (SPLIT == 1) {
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int t = 0; t < TOKENS; ++t)
          if (row0 + r < a.N && t0 + t < a.T)
            a.out[static_cast<size_t>(t0 + t) * a.out_stride + row0 + r] = result(acc[r][t]);
    }
  } else {
    __shared__ Acc partial[kWarps][ROWS][TOKENS];
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) partial[warp][r][t] = acc[r][t];
    }
    __syncthreads();
    constexpr int kOutputs = kRowsPerBlock * TOKENS;
    if (threadIdx.x < kOutputs) {
      const int group = threadIdx.x / (ROWS * TOKENS);
      const int r = (threadIdx.x / TOKENS) % ROWS;
      const int t = threadIdx.x % TOKENS;
      Acc v = partial[group * SPLIT][r][t];
#pragma unroll
      for (int s = 1; s < SPLIT; ++s) v += partial[group * SPLIT + s][r][t];  // fixed order: same bits every run
      const int row = blockIdx.x * kRowsPerBlock + group * ROWS + r;
      if (row < a.N && t0 + t < a.T) a.out[static_cast<size_t>(t0 + t) * a.out_stride + row] = result(v);
    }
  }
}

template <Q8Act ACT, int TOKENS, int PIECES, int SPLIT, int ROWS>
cudaError_t launch(const Q8GemvArgs& a, bool pdl, cudaStream_t stream) {
  constexpr int kRowsPerBlock = (kWarps / SPLIT) * ROWS;
  const unsigned grid_y = static_cast<unsigned>((a.T + TOKENS - 1) / TOKENS);
  if (grid_y > 65535u) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((a.N + kRowsPerBlock - 1) / kRowsPerBlock), grid_y);
  return launch_maybe_pdl(q8_0_gemv_kernel<ACT, TOKENS, PIECES, SPLIT, ROWS>, grid, dim3(kThreads), 0, stream, pdl,
                          a);
}

// 2 <= T < the GEMM's threshold (a verify batch, a short prompt): the shape's decode config with TOKENS
// rows sharing each weight load, so the weights stream once per TOKENS rows.
template <Q8Act ACT, int TOKENS>
cudaError_t launch_rows(const Q8GemvArgs& a, bool pdl, cudaStream_t stream) {
  const Q8GemvConfig cfg = q8_0_gemv_default_config(ACT, a.N, a.K, 1);
  if (cfg.pieces == 2 && cfg.split == 1 && cfg.rows == 4) return launch<ACT, TOKENS, 2, 1, 4>(a, pdl, stream);
  if (cfg.pieces == 4 && cfg.split == 4 && cfg.rows == 1) return launch<ACT, TOKENS, 4, 4, 1>(a, pdl, stream);
  return launch<ACT, TOKENS, 4, 1, 2>(a, pdl, stream);
}

template <Q8Act ACT>
cudaError_t dispatch(const Q8GemvArgs& a, Q8GemvConfig cfg, bool pdl, cudaStream_t stream) {
  if (a.T == 2) return launch_rows<ACT, 2>(a, pdl, stream);
  if (a.T > 2) return launch_rows<ACT, 4>(a, pdl, stream);
#define QWEN38_Q8_GEMV_DISPATCH(P, S, R) \
  if (cfg.pieces == P && cfg.split == S && cfg.rows == R) return launch<ACT, 1, P, S, R>(a, pdl, stream);
  QWEN38_Q8_GEMV_CONFIGS(QWEN38_Q8_GEMV_DISPATCH)
#undef QWEN38_Q8_GEMV_DISPATCH
  return cudaErrorInvalidValue;
}

}  // namespace

// Chosen from the config sweep of benchmarks/ops/bench_q8_gemv.py on the H200 (2026-11-29, PDL on, commit
// 3a455de, after the int lanes moved to double accumulation):
// N > 8192: 2 pieces x 4 rows per warp was the fastest in every lane (int8 72-98%, int8x2 63-94%, f32 60-78%
// of the read probe, against 70-96 / 60-89 / 47-65% for the 4 x 2 chosen before the switch to double);
// N <= 8192 (the 5120-row output projections): int lanes: 4 warps sharing a row's K range (int8 56% / 66% at
// K = 6144 / 17408); f32: 4 pieces x 2 rows (bound by activation loads and float math).
Q8GemvConfig q8_0_gemv_default_config(Q8Act act, int N, int K, int T) {
  (void)K, (void)T;
  if (N > 8192) return Q8GemvConfig{2, 1, 4};
  if (act != Q8Act::F32) return Q8GemvConfig{4, 4, 1};
  return Q8GemvConfig{4, 1, 2};
}

bool q8_0_gemv_config_from_env(Q8GemvConfig* cfg) {
  const char* v = std::getenv("QWEN38_Q8_GEMV_CONFIG");
  if (v == nullptr || v[0] == '\0') return false;
  Q8GemvConfig parsed;
  if (std::sscanf(v, "%d,%d,%d", &parsed.pieces, &parsed.split, &parsed.rows) != 3) return false;
  *cfg = parsed;
  return true;
}

cudaError_t q8_0_gemv(Q8Act act, const Q8GemvArgs& args, Q8GemvConfig cfg, bool pdl, cudaStream_t stream) {
  if (args.N == 0 || args.T == 0) return cudaSuccess;
  if (args.K <= 0 || args.K % 32 != 0) return cudaErrorInvalidValue;
  switch (act) {
    case Q8Act::F32: return dispatch<Q8Act::F32>(args, cfg, pdl, stream);
    case Q8Act::Int8: return dispatch<Q8Act::Int8>(args, cfg, pdl, stream);
    case Q8Act::Int8x2: return dispatch<Q8Act::Int8x2>(args, cfg, pdl, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace qwen38
