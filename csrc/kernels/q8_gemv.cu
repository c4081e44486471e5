// Q8_0 GEMV: one kernel template for the three activation lanes (see q8_gemv.h for the math).
//
// Why it is shaped like this. At batch 1 the GEMV streams each weight byte exactly once and does almost no
// arithmetic per byte, so its speed is the HBM rate times the fraction of the kernel during which enough
// loads are in flight (Little's law on the H200: ~4.5 TB/s x ~1-2 us loaded latency = 5-9 MB, 40-70 KB per
// SM). The mapping is the one measured fastest on the H200 (shared/reference/decode-gap.md: 75 / 86 / 83 /
// 85 / 93 / 98% of the read probe on the six 27B shapes, against 53 / 66 / 73 / 68 / 88 / 98% for this
// file's previous 4-warp blocks with an in-block split-K):
// - One warp = one weight row, the whole K range; 256-thread blocks (8 rows); at most 48 registers
//   (__launch_bounds__ with 5 blocks per SM: 40 warps per SM). The 5120-row projections are 640 blocks,
//   one wave of the 660 slots of 132 SMs, with no split-K and no shared-memory combine.
// - A warp walks its row in trips of TRIP 512-byte pieces (lane l loads the 16 bytes of chunk 32p + l, one
//   half of a 32-weight block). ALL loads of a trip -- weights, weight scales, activation chunks, activation
//   scales -- are issued back to back before any math: the loop of the previous form issued one activation
//   load per piece inside the math (one serialized L1/L2 round trip each, visible in its SASS).
// - Weights are read with L1::no_allocate (read once; they must not evict the activation, which every warp
//   of an SM reads through L1).
// - No per-lane branch before a shuffle: pieces past the row end exist only in the tail, rows past N are
//   recomputed from row N - 1 and not stored.
// - The first trip's weights are loaded before griddepcontrol.wait (PDL: they are constants, pdl.cuh).
//
// Numerics. The int8 lane needs the EXACT int32 sum of a block (ggml: sumi * (d_w * d_x)): the two lanes of a
// block add their dp4a halves with one shuffle, and one lane of the pair adds sumi * (d_w * d_x) to a double
// with one DFMA. d_w * d_x is formed in fp32 and is exact there: both are fp16 values (the int8 producers
// store d rounded to fp16, as ggml's q8_0 does), so the product has at most 22 significant bits; and
// sumi * (d_w * d_x) is exact in double. So the only roundings are the double additions and the final
// conversion to float: the bits of the previous form of this kernel (which formed the scale product in
// double), in its order. With float accumulation (this kernel's first form) the int8 model drifted from
// llama.cpp's logits at position 5 of the oracle (a rounding flip in the next activation; median
// per-position rel L2 1.8e-2) where the double sum stays within 7e-8 up to position 17.
// The two-word lane's s = amax/127 is a full fp32 value, so its scale product stays in double (35 bits,
// exact); 127 hi + lo is exact in int32 and the 1/127 is applied once at the end (a double division per
// block measured 67% -> 52% of the read probe at 16384 x 5120). The f32 lane dequantizes in float32
// (16 FMAs per chunk in four chains, then one FMA by the block scale) and sums in float.
// The summation order is fixed per config (q8_gemv.h: PARTS), never by T: rows of a T-row call are
// computed exactly as a T = 1 call computes them, only their weight loads are shared.
#include "q8_gemv.h"

#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "pdl.cuh"

namespace qwen38 {
namespace {

// Every load here is a coherent ld.global, none is ld.global.nc (__ldg): ptxas takes .nc data to be constant
// for the kernel's lifetime and moves .nc loads across griddepcontrol.wait both ways (SASS of CUDA 13.0's
// ptxas): this kernel's weight loads, written before the wait, sank below it (the PDL prologue lost), and in
// a minimal kernel an __ldg written after the wait was issued before it (a race with the predecessor that
// writes the activation). Coherent loads stay on their side of the wait.
// Weights: read once, L1::no_allocate so they do not evict the activation that all warps of an SM share.
__device__ __forceinline__ int4 load_weights16(const int8_t* p) {
  int4 v;
  asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ float load_weight_scale(const __half* p) {
  unsigned short bits;
  asm volatile("ld.global.L1::no_allocate.u16 %0, [%1];" : "=h"(bits) : "l"(p));
  return __half2float(__ushort_as_half(bits));
}

// Activations: L1-allocating (the default), read after the wait.
__device__ __forceinline__ int4 load_act16(const int4* p) {
  int4 v;
  asm volatile("ld.global.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ float load_act_scale(const float* p) {
  float v;
  asm volatile("ld.global.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
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

// What a lane holds of one row of x for one 16-byte chunk c (16 weights, half of block c / 2).
template <Q8Act ACT>
struct XChunk;
template <>
struct XChunk<Q8Act::F32> {
  float4 v[4];
};
template <>
struct XChunk<Q8Act::Int8> {
  int4 q;
  float d;
};
template <>
struct XChunk<Q8Act::Int8x2> {
  int4 q, lo;
  float d;
};

// A lane's place in one row of x: its chunk of the current piece. at(u) loads the chunk u pieces on.
template <Q8Act ACT>
struct XCursor {
  const int4* q;   // Int8 lanes: x_q (16 bytes a chunk); F32: x (64 bytes a chunk, as four int4)
  const int4* lo;  // Int8x2: x_q_lo
  const float* d;  // Int8 lanes: x_d, the block of this lane's chunk
  static constexpr int kChunkInt4 = ACT == Q8Act::F32 ? 4 : 1;

  __device__ __forceinline__ XChunk<ACT> at(int u) const {
    XChunk<ACT> x;
    if constexpr (ACT == Q8Act::F32) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int4 v = load_act16(q + u * 32 * kChunkInt4 + i);
        x.v[i] = make_float4(__int_as_float(v.x), __int_as_float(v.y), __int_as_float(v.z), __int_as_float(v.w));
      }
    } else {
      x.q = load_act16(q + u * 32);
      if constexpr (ACT == Q8Act::Int8x2) x.lo = load_act16(lo + u * 32);
      x.d = load_act_scale(d + u * 16);
    }
    return x;
  }
  __device__ __forceinline__ void advance(int pieces) {
    q += pieces * 32 * kChunkInt4;
    if constexpr (ACT == Q8Act::Int8x2) lo += pieces * 32;
    if constexpr (ACT != Q8Act::F32) d += pieces * 16;
  }
};

// The same for the weight row: 16 quants and the block scale of this lane's chunk.
struct WCursor {
  const int8_t* q;
  const __half* d;
  __device__ __forceinline__ int4 quants(int u) const { return load_weights16(q + u * 512); }
  __device__ __forceinline__ float scale(int u) const { return load_weight_scale(d + u * 16); }
  __device__ __forceinline__ void advance(int pieces) {
    q += pieces * 512;
    d += pieces * 16;
  }
};

template <Q8Act ACT>
__device__ __forceinline__ XChunk<ACT> zero_x() {
  XChunk<ACT> x;
  if constexpr (ACT == Q8Act::F32) {
#pragma unroll
    for (int i = 0; i < 4; ++i) x.v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  } else {
    x.q = make_int4(0, 0, 0, 0);
    if constexpr (ACT == Q8Act::Int8x2) x.lo = x.q;
    x.d = 0.f;
  }
  return x;
}

template <Q8Act ACT>
using Acc = std::conditional_t<ACT == Q8Act::F32, float, double>;

// Where part q's partial sum lives. f32: in slot q of every lane (each lane has its own 16 products). Int
// lanes: a block's sum is formed on both lanes of its pair and added by one of them, so the pair holds the
// parts between its two lanes -- slot q % kSlots of the even (q < kSlots) or the odd lane -- and half the
// registers hold all PARTS sums. The value is the same as if the even lane held them all: the odd lane of
// pair m adds exactly what the even lane would, and a butterfly over the odd lanes (xor 16, 8, 4, 2) pairs
// them as the one over the even lanes does.
template <Q8Act ACT, int PARTS>
constexpr int kSlots = ACT == Q8Act::F32 ? PARTS : (PARTS + 1) / 2;

// Adds one chunk's 16 products to the partial sum `acc` of this lane. The int lanes shuffle (all 32 lanes
// must be here); `adds` says whether this lane is the one of its pair that adds the block to this part.
template <Q8Act ACT>
__device__ __forceinline__ void accumulate(Acc<ACT>& acc, int4 w, float wd, const XChunk<ACT>& x, bool adds) {
  if constexpr (ACT == Q8Act::F32) {
    acc = fmaf(dot16_f32(w, x.v), wd, acc);
  } else {
    int hi = dot16_i8(w, x.q);
    hi += __shfl_xor_sync(0xffffffffu, hi, 1);  // the block's other 16 weights
    if constexpr (ACT == Q8Act::Int8) {
      const float scale = adds ? wd * x.d : 0.f;  // exact: two fp16 values
      acc = fma(static_cast<double>(hi), static_cast<double>(scale), acc);
    } else {
      int lo = dot16_i8(w, x.lo);
      lo += __shfl_xor_sync(0xffffffffu, lo, 1);
      const double scale = adds ? static_cast<double>(wd) * static_cast<double>(x.d) : 0.0;  // exact
      acc = fma(static_cast<double>(127 * hi + lo), scale, acc);
    }
  }
}

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

// Blocks per SM the register budget is cut for: 5 at T = 1 (<= 48 registers, 40 warps per SM). The T-row
// forms hold TOKENS chunks of x and TOKENS x slots sums per lane; these counts are the most blocks whose
// register share holds them without spilling in the loop (ptxas -v, CUDA 13.0).
template <Q8Act ACT, int TOKENS>
constexpr int kMinBlocks = TOKENS == 1 ? 5
                           : ACT == Q8Act::Int8 ? (TOKENS == 2 ? 4 : 3)
                           : ACT == Q8Act::Int8x2 ? (TOKENS == 2 ? 3 : 2)
                                                   : (TOKENS == 2 ? 4 : 2);

// Warp w of block b owns weight row 8b + w, for TOKENS rows of x (t0 = TOKENS * blockIdx.y onwards).
template <Q8Act ACT, int TOKENS, int TRIP, int PARTS>
__global__ void __launch_bounds__(kThreads, (kMinBlocks<ACT, TOKENS>)) q8_0_gemv_kernel(const Q8GemvArgs a) {
  // Pieces are consumed in steps of kStep, in which piece p0 + u belongs to part u % PARTS (p0 a multiple of
  // kStep): the part, and so the slot, is known at compile time.
  constexpr int kStep = TRIP > PARTS ? TRIP : PARTS;
  static_assert(kStep % TRIP == 0 && kStep % PARTS == 0, "TRIP and PARTS must be powers of two");
  constexpr int kSlot = kSlots<ACT, PARTS>;
  pdl_allow_successor();

  const int lane = threadIdx.x & 31;
  const int parity = ACT == Q8Act::F32 ? 0 : lane & 1;
  const int row_id = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const size_t row = static_cast<size_t>(row_id < a.N ? row_id : a.N - 1);
  const int t0 = blockIdx.y * TOKENS;
  const int chunks = a.K >> 4;            // 16-byte chunks per row
  const int pieces = (chunks + 31) >> 5;  // 512-byte pieces per row; the last may be partial
  const int whole_steps_end = ((chunks >> 5) / kStep) * kStep;  // pieces [0, this) come in whole steps

  WCursor wc{a.weight_q + row * a.K + lane * 16, a.weight_d + row * (a.K >> 5) + (lane >> 1)};
  XCursor<ACT> xc[TOKENS];
#pragma unroll
  for (int t = 0; t < TOKENS; ++t) {
    const size_t tok = static_cast<size_t>(t0 + t < a.T ? t0 + t : a.T - 1);  // rows past T: recomputed, not stored
    if constexpr (ACT == Q8Act::F32) {
      xc[t].q = reinterpret_cast<const int4*>(static_cast<const float*>(a.x) + tok * a.x_stride) + lane * 4;
    } else {
      xc[t].q = reinterpret_cast<const int4*>(static_cast<const int8_t*>(a.x) + tok * a.x_stride) + lane;
      xc[t].d = a.x_d + tok * a.x_d_stride + (lane >> 1);
      if constexpr (ACT == Q8Act::Int8x2) xc[t].lo = reinterpret_cast<const int4*>(a.x_lo + tok * a.x_lo_stride) + lane;
    }
  }

  Acc<ACT> acc[kSlot][TOKENS];
#pragma unroll
  for (int i = 0; i < kSlot; ++i)
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) acc[i][t] = Acc<ACT>(0);
  // Adds piece u of a step (part u % PARTS) for every row of x.
  auto add_piece = [&](int u, int4 w, float wd, const XChunk<ACT>(&x)[TOKENS]) {
    const int part = u % PARTS;
    const bool adds = ACT == Q8Act::F32 || part / kSlot == parity;
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) accumulate<ACT>(acc[part % kSlot][t], w, wd, x[t], adds);
  };

  int4 w[TRIP];
  float wd[TRIP];
  auto load_weights = [&](int s) {
#pragma unroll
    for (int u = 0; u < TRIP; ++u) {
      w[u] = wc.quants(s + u);
      wd[u] = wc.scale(s + u);
    }
  };
  // One step of whole pieces from the cursors' place; its first trip's weights are already in w, wd when
  // `first_loaded` (a constant at each call, so no branch is left between a trip's loads).
  auto step = [&](bool first_loaded) {
#pragma unroll
    for (int s = 0; s < kStep; s += TRIP) {
      if (!(first_loaded && s == 0)) load_weights(s);
      XChunk<ACT> x[TRIP][TOKENS];
#pragma unroll
      for (int u = 0; u < TRIP; ++u)
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) x[u][t] = xc[t].at(s + u);
#pragma unroll
      for (int u = 0; u < TRIP; ++u) add_piece(s + u, w[u], wd[u], x[u]);
    }
    wc.advance(kStep);
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) xc[t].advance(kStep);
  };

  // PDL wait: before it, only the first trip's weights and scales (constants) are loaded; x, x_d and out
  // may belong to the predecessor.
  if (whole_steps_end > 0) load_weights(0);
  pdl_wait_for_predecessor();
  if (whole_steps_end > 0) step(true);
  for (int p0 = kStep; p0 < whole_steps_end; p0 += kStep) step(false);

  // The tail: fewer than kStep whole pieces and the partial last piece, one piece at a time; lanes past the
  // row's end load nothing and add zero.
#pragma unroll
  for (int u = 0; u < kStep; ++u) {
    if (whole_steps_end + u < pieces) {  // warp-uniform
      int4 wt = make_int4(0, 0, 0, 0);
      float wdt = 0.f;
      XChunk<ACT> xt[TOKENS];
#pragma unroll
      for (int t = 0; t < TOKENS; ++t) xt[t] = zero_x<ACT>();
      if ((whole_steps_end + u) * 32 + lane < chunks) {
        wt = wc.quants(u);
        wdt = wc.scale(u);
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) xt[t] = xc[t].at(u);
      }
      add_piece(u, wt, wdt, xt);
    }
  }

  // Each slot's lane sums by an xor butterfly (every lane of a parity ends with the same total; the int
  // lanes keep the two parities apart), then the parts in order.
#pragma unroll
  for (int t = 0; t < TOKENS; ++t) {
    Acc<ACT> part[PARTS];
#pragma unroll
    for (int i = 0; i < kSlot; ++i) {
      Acc<ACT> v = acc[i][t];
#pragma unroll
      for (int o = 16; o >= (ACT == Q8Act::F32 ? 1 : 2); o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      part[i] = v;  // lane 0's parity: part i
      if (kSlot < PARTS) part[kSlot + i] = __shfl_xor_sync(0xffffffffu, v, 1);  // the odd lanes' part
    }
    Acc<ACT> v = part[0];
#pragma unroll
    for (int q = 1; q < PARTS; ++q) v += part[q];
    float y;
    if constexpr (ACT == Q8Act::Int8x2) {
      y = static_cast<float>(v / 127.0);
    } else {
      y = static_cast<float>(v);
    }
    if (lane == 2 * t && row_id < a.N && t0 + t < a.T) a.out[static_cast<size_t>(t0 + t) * a.out_stride + row] = y;
  }
}

template <Q8Act ACT, int TOKENS, int TRIP, int PARTS>
cudaError_t launch(const Q8GemvArgs& a, bool pdl, cudaStream_t stream) {
  const unsigned grid_y = static_cast<unsigned>((a.T + TOKENS - 1) / TOKENS);
  if (grid_y > 65535u) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((a.N + kWarps - 1) / kWarps), grid_y);
  return launch_maybe_pdl(q8_0_gemv_kernel<ACT, TOKENS, TRIP, PARTS>, grid, dim3(kThreads), 0, stream, pdl, a);
}

template <Q8Act ACT, int TOKENS>
cudaError_t launch_config(const Q8GemvArgs& a, Q8GemvConfig cfg, bool pdl, cudaStream_t stream) {
#define QWEN38_Q8_GEMV_DISPATCH(TRIP, PARTS) \
  if (cfg.trip == TRIP && cfg.parts == PARTS) return launch<ACT, TOKENS, TRIP, PARTS>(a, pdl, stream);
  QWEN38_Q8_GEMV_CONFIGS(QWEN38_Q8_GEMV_DISPATCH)
#undef QWEN38_Q8_GEMV_DISPATCH
  return cudaErrorInvalidValue;
}

// T >= 2 (a verify batch, a short prompt): 2 or 4 rows of x share each weight load, with the T = 1 config
// (its PARTS, so every row gets the T = 1 bits).
template <Q8Act ACT>
cudaError_t dispatch(const Q8GemvArgs& a, Q8GemvConfig cfg, bool pdl, cudaStream_t stream) {
  if (a.T == 1) return launch_config<ACT, 1>(a, cfg, pdl, stream);
  if (a.T == 2) return launch_config<ACT, 2>(a, cfg, pdl, stream);
  return launch_config<ACT, 4>(a, cfg, pdl, stream);
}

}  // namespace

// trip: 2 pieces for the int lanes (decode-gap.md: 2-piece trips measured best; 4 spilled at 48 registers
// and lost 3-6 points); 1 for f32, whose 64-byte activation chunks would need 32 registers a trip.
// parts: the order of the previous form of this kernel, so the int lanes keep their bits: it split the rows
// of N <= 8192 over 4 warps by piece (p % 4) and added the 4 warp sums in order; above, one warp per row.
Q8GemvConfig q8_0_gemv_default_config(Q8Act act, int N) {
  Q8GemvConfig cfg;
  cfg.trip = act == Q8Act::F32 ? 1 : 2;
  cfg.parts = act != Q8Act::F32 && N <= 8192 ? 4 : 1;
  return cfg;
}

bool q8_0_gemv_config_from_env(Q8GemvConfig* cfg) {
  struct Override {
    bool set;
    Q8GemvConfig cfg;
  };
  static const Override env = [] {
    Override o{false, Q8GemvConfig{}};
    const char* v = std::getenv("QWEN38_Q8_GEMV_CONFIG");
    if (v == nullptr || v[0] == '\0') return o;
    o.set = true;
    int end = 0;
    if (std::sscanf(v, "%d,%d%n", &o.cfg.trip, &o.cfg.parts, &end) != 2 || v[end] != '\0') o.cfg = Q8GemvConfig{0, 0};
    return o;
  }();
  if (env.set) *cfg = env.cfg;
  return env.set;
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
