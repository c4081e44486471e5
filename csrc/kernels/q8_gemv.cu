// Q8_0 GEMV: one kernel template for the three activation lanes (see q8_gemv.h for the math). How the mapping
// got here, with the measurements behind each choice: benchmarks/NOTES.md, "q8_gemv: how the kernel got here".
//
// Mapping. At batch 1 the GEMV streams each weight byte once, so its speed is the HBM rate times the share of
// the kernel during which enough loads are in flight.
// - One warp = one weight row, the whole K range; 256-thread blocks (8 rows); at most 48 registers
//   (__launch_bounds__ with 5 blocks per SM: 40 warps per SM). The 5120-row projections are 640 blocks, one
//   wave of the 660 slots of 132 SMs, with no split-K and no shared-memory combine.
// - A warp walks its row in trips of TRIP 512-byte pieces (lane l loads the 16 bytes of chunk 32p + l, one half
//   of a 32-weight block; the f32 lane loads four 4-byte words instead, WCursor). All loads of a trip --
//   weights, weight scales, activation chunks, activation scales -- are issued back to back before any math.
// - Weights are read with L1::no_allocate (read once; they must not evict the activation, which every warp of
//   an SM reads through L1).
// - No per-lane branch before a shuffle: pieces past the row end exist only in the tail, rows past N are
//   recomputed from row N - 1 and not stored.
// - The first trip's weights are loaded before griddepcontrol.wait (PDL: they are constants, pdl.cuh).
// - T rows of x (the speculative verify, short prompts) share each weight load: one pass for T <= 8 in the int
//   lanes (4 in f32; more T in equal passes over blockIdx.y), an instance per row count. In the T-row forms
//   (details at kRowsByParity and below) the two lanes of a pair split the rows of x, the PARTS partial sums of
//   a row go to PARTS warps added in order through shared memory (kWarpsPerRow), and the weights are loaded a
//   trip ahead, so the 1-piece trips that leave room for T rows of x still keep two pieces per warp in flight.
//
// Numerics. The int8 lane needs the EXACT int32 sum of a block (ggml: sumi * (d_w * d_x)): the two lanes of a
// block add their dp4a halves with one shuffle, and one lane of the pair adds sumi * (d_w * d_x) to a double
// with one DFMA. d_w * d_x is formed in fp32 and is exact there: both are fp16 values (the int8 producers store
// d rounded to fp16, as ggml's q8_0 does), so the product has at most 22 significant bits; and
// sumi * (d_w * d_x) is exact in double. So the only roundings are the double additions and the final
// conversion to float (float accumulation drifts from llama.cpp's logits: NOTES).
// The two-word lane's s = amax/127 is a full fp32 value, so its scale product stays in double (35 bits, exact);
// 127 hi + lo is exact in int32 and the 1/127 is applied once at the end. The f32 lane dequantizes in float32
// (4 FMAs per 4-byte word, four words of four blocks in four chains, each chain times its block scale) and sums
// in float; its lanes hold words 32 apart, not 16 consecutive bytes, so that its float32 x loads coalesce
// (WCursor).
// The summation order is fixed per config (q8_gemv.h: PARTS), never by T: every row of a T-row call gets the
// bits of a T = 1 call on that row, only the weight loads and the lanes doing the work are shared out
// differently (why the bits survive: at kRowsByParity and kWarpsPerRow).
#include "q8_gemv.h"

#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "common.cuh"
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

__device__ __forceinline__ int load_weights4(const int8_t* p) {
  int v;
  asm volatile("ld.global.L1::no_allocate.s32 %0, [%1];" : "=r"(v) : "l"(p));
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

// The f32 lane's four words of a piece (f32 layout at WCursor): each in its own block, so each has its scale.
// Four independent chains (one per word) for ILP, combined in a fixed order.
__device__ __forceinline__ float dot16_f32(int4 w, float4 d, const float4 (&x)[4]) {
  const float s0 = dot4_f32(static_cast<uint32_t>(w.x), x[0], 0.f);
  const float s1 = dot4_f32(static_cast<uint32_t>(w.y), x[1], 0.f);
  const float s2 = dot4_f32(static_cast<uint32_t>(w.z), x[2], 0.f);
  const float s3 = dot4_f32(static_cast<uint32_t>(w.w), x[3], 0.f);
  return fmaf(s0, d.x, s1 * d.y) + fmaf(s2, d.z, s3 * d.w);
}

// How the two lanes of a pair (the two 16-weight halves of one block) share the work of a block in the int
// lanes. Both must form a half-dot for every row of x (each holds its own half of the weights), but the exact
// block sum, its scale and the double FMA are needed once per (block, row of x):
// - T = 1: the pair splits the PARTS partial sums: the even lane holds parts 0 .. kLaneParts - 1, the odd
//   lane the rest; both form the block sum, the lane that holds the piece's part adds it, the other adds 0.
// - TOKENS >= 2: the pair splits the rows of x: the even lane owns rows 0, 2, 4, .., the odd lane rows 1, 3, ..
//   One shuffle per two rows swaps halves (each lane sends the half of the row its partner owns), and each
//   lane converts, scales and adds for its own rows only: half the shuffles, conversions and double FMAs of
//   both lanes doing every row (the conversion pipe is what the T-row forms ran out of first).
// The bits are the T = 1 call's either way: each (row, part) sum gets the same block terms in the same order
// (pieces in order, block 16p + m on a lane of pair m), and the final butterfly over the lanes of one parity
// pairs m with m ^ 8, 4, 2, 1 whichever parity holds the sum.
// The f32 lane has no pairs: every lane sums its own 16 products into every row.
template <Q8Act ACT, int TOKENS>
constexpr bool kRowsByParity = ACT != Q8Act::F32 && TOKENS >= 2;
// The rows of x whose sums a lane holds: its parity's half of them, or all.
template <Q8Act ACT, int TOKENS>
constexpr int kOwnRows = kRowsByParity<ACT, TOKENS> ? (TOKENS + 1) / 2 : TOKENS;
// Warps per weight row: 1, except in the T-row int forms, where the PARTS partial sums go to PARTS warps
// (warp q of a row adds pieces q, q + PARTS, ..; the parts meet in shared memory and are added in order, as
// within one warp). A warp then needs the registers of PARTS = 1, and the 5120-row shapes (PARTS = 4) make
// 2560 blocks instead of 640, which the fewer blocks per SM of the T-row forms would run in 1.2-2.4 waves,
// the last one too thin to keep enough loads in flight.
template <Q8Act ACT, int TOKENS, int PARTS>
constexpr int kWarpsPerRow = kRowsByParity<ACT, TOKENS> ? PARTS : 1;
// The partial sums a lane holds per row it owns: half of the parts at T = 1 in the int lanes, else all the
// parts of its warp.
template <Q8Act ACT, int TOKENS, int PARTS>
constexpr int kLaneParts =
    ACT != Q8Act::F32 && TOKENS == 1 ? (PARTS + 1) / 2 : PARTS / kWarpsPerRow<ACT, TOKENS, PARTS>;

// What a lane of an int lane holds of TOKENS rows of x for one piece: chunk c (16 activations, half of block
// c / 2) of every row, and the scale of that block in the rows it owns. The f32 lane holds one row's chunk at a
// time instead (XRows::f32_chunk).
template <Q8Act ACT, int TOKENS>
struct XPiece;
template <int TOKENS>
struct XPiece<Q8Act::Int8, TOKENS> {
  int4 q[TOKENS];
  float d[kOwnRows<Q8Act::Int8, TOKENS>];
};
template <int TOKENS>
struct XPiece<Q8Act::Int8x2, TOKENS> {
  int4 q[TOKENS], lo[TOKENS];
  float d[kOwnRows<Q8Act::Int8x2, TOKENS>];
};

// A lane's place in TOKENS rows of x: its chunk of the current piece. at(u) loads the piece u pieces on.
template <Q8Act ACT, int TOKENS>
struct XRows {
  static constexpr int kChunkInt4 = ACT == Q8Act::F32 ? 4 : 1;
  const int4* q[TOKENS];                    // Int8 lanes: x_q (16 bytes a chunk); F32: x (the float4 of word 0)
  const int4* lo[TOKENS];                   // Int8x2: x_q_lo
  const float* d[kOwnRows<ACT, TOKENS>];    // Int8 lanes: x_d of the lane's block, in the rows it owns

  __device__ __forceinline__ XPiece<ACT, TOKENS> at(int u) const {
    XPiece<ACT, TOKENS> x;
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
      x.q[t] = load_act16(q[t] + u * 32);
      if constexpr (ACT == Q8Act::Int8x2) x.lo[t] = load_act16(lo[t] + u * 32);
    }
#pragma unroll
    for (int r = 0; r < kOwnRows<ACT, TOKENS>; ++r) x.d[r] = load_act_scale(d[r] + u * 16);
    return x;
  }
  // F32: row t's four float4s of the piece u pieces on (the f32 layout at WCursor: float4 i of lane l is
  // x[4 l + 128 i ..]); `words` of them hold weights of the row, the rest are zero.
  __device__ __forceinline__ void f32_chunk(int u, int t, float4 (&v)[4], int words = 4) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (i >= words) break;
      const int4 c = load_act16(q[t] + u * 32 * kChunkInt4 + 32 * i);
      v[i] = make_float4(__int_as_float(c.x), __int_as_float(c.y), __int_as_float(c.z), __int_as_float(c.w));
    }
  }
  __device__ __forceinline__ void advance(int pieces) {
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
      q[t] += pieces * 32 * kChunkInt4;
      if constexpr (ACT == Q8Act::Int8x2) lo[t] += pieces * 32;
    }
    if constexpr (ACT != Q8Act::F32) {
#pragma unroll
      for (int r = 0; r < kOwnRows<ACT, TOKENS>; ++r) d[r] += pieces * 16;
    }
  }
};

template <Q8Act ACT>
using WScale = std::conditional_t<ACT == Q8Act::F32, float4, float>;

// The same for the weight row: the lane's 16 quants of a piece and their block scale(s).
// Int lanes: the 16 consecutive quants of chunk l (one 16-byte load, half a block; the pair's x is the 16
// bytes of int8 x at the same place: a warp's x load is 512 contiguous bytes).
// F32: the 4-byte words l, l + 32, l + 64, l + 96 of the piece (four 4-byte loads, four blocks, four scales).
// Its x is 4 bytes a weight: with 16 consecutive quants a lane's 64 bytes of x sit 64 bytes from its
// neighbour's, so each 16-byte x load of a warp touches 16 cache lines, 64 L1 wavefronts a piece where this
// layout's coalesced loads take 16 (that layout measured 39-43% of the read probe whatever the trip).
template <Q8Act ACT>
struct WCursor {
  const int8_t* q;
  const __half* d;
  __device__ WCursor(const int8_t* row_q, const __half* row_d, int lane)
      : q(row_q + (ACT == Q8Act::F32 ? 4 * lane : 16 * lane)), d(row_d + (ACT == Q8Act::F32 ? lane >> 3 : lane >> 1)) {}
  __device__ __forceinline__ int4 quants(int u, int words = 4) const {
    if constexpr (ACT == Q8Act::F32) {
      int v[4] = {0, 0, 0, 0};
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (i < words) v[i] = load_weights4(q + u * 512 + 128 * i);
      return make_int4(v[0], v[1], v[2], v[3]);
    } else {
      return load_weights16(q + u * 512);
    }
  }
  __device__ __forceinline__ WScale<ACT> scale(int u, int words = 4) const {
    if constexpr (ACT == Q8Act::F32) {
      float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (i < words) v[i] = load_weight_scale(d + u * 16 + 4 * i);
      return make_float4(v[0], v[1], v[2], v[3]);
    } else {
      return load_weight_scale(d + u * 16);
    }
  }
  __device__ __forceinline__ void advance(int pieces) {
    q += pieces * 512;
    d += pieces * 16;
  }
};

template <Q8Act ACT>
using Acc = std::conditional_t<ACT == Q8Act::F32, float, double>;

// This lane's half of the block sum of row t (exact int32). Int8x2: 127 hi + lo, exact in int32 (|a block's
// value| < 2^27), so one shuffle carries both words and the block's 127 hi + lo is the sum of the halves'.
template <Q8Act ACT, int TOKENS>
__device__ __forceinline__ int half_dot(int4 w, const XPiece<ACT, TOKENS>& x, int t) {
  const int hi = dot16_i8(w, x.q[t]);
  if constexpr (ACT == Q8Act::Int8x2) {
    return dot16_i8(w, x.lo[t]) + 127 * hi;
  } else {
    return hi;
  }
}

// Adds a block's term, its exact int32 sum s times the two scales, to a double sum: int8 forms d_w * d_x in
// fp32 (exact: two fp16 values), int8x2 in double (its d_x is a full fp32 value; 35 bits, exact).
template <Q8Act ACT>
__device__ __forceinline__ double add_block(double acc, int s, float wd, float xd) {
  if constexpr (ACT == Q8Act::Int8) {
    return fma(int_to_double(s), static_cast<double>(wd * xd), acc);
  } else {
    return fma(int_to_double(s), static_cast<double>(wd) * static_cast<double>(xd), acc);
  }
}

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

// Blocks per SM the register budget is cut for: 5 at T = 1 (<= 48 registers, 40 warps per SM). The T-row
// forms hold TOKENS chunks of x and their sums; these counts are the most blocks whose register share holds
// them (with kTrip below) without spilling in the loop (ptxas -v, CUDA 13.0).
template <Q8Act ACT, int TOKENS>
constexpr int kMinBlocks = TOKENS == 1 ? 5
                           : ACT == Q8Act::Int8 ? (TOKENS <= 4 ? 4 : 3)
                           : ACT == Q8Act::Int8x2 ? (TOKENS <= 3 ? 3 : 2)
                                                   : (TOKENS == 2 ? 4 : 3);

// The trip a config runs with (the kernel's TRIP): the config's at T = 1 and in the int lanes' T = 2 form;
// else 1 in the int lanes, which the weight prefetch of their T-row forms (below) makes 2 in flight (two
// pieces of x for more rows would cost blocks per SM). The f32 lane holds one row's chunk of x at a time and
// does not prefetch: it runs the config's trip at every T (at trip 2 its 2- and 4-row forms spill 4 and 16
// bytes, ptxas -v, CUDA 13.0). The order is PARTS', so this changes no bits.
template <Q8Act ACT, int TOKENS, int TRIP>
constexpr int kTrip = ACT == Q8Act::F32 || TOKENS <= 2 ? TRIP : 1;

// Warp w of block b owns weight row b * kRowsPerBlock + w / kWarpsPerRow (its pieces w % kWarpsPerRow,
// + kWarpsPerRow, ..), for TOKENS rows of x (t0 = TOKENS * blockIdx.y onwards).
template <Q8Act ACT, int TOKENS, int TRIP, int PARTS>
__global__ void __launch_bounds__(kThreads, (kMinBlocks<ACT, TOKENS>)) q8_0_gemv_kernel(const Q8GemvArgs a) {
  constexpr bool kByParity = kRowsByParity<ACT, TOKENS>;
  constexpr int kRows = kOwnRows<ACT, TOKENS>;
  constexpr int kSplit = kWarpsPerRow<ACT, TOKENS, PARTS>;
  constexpr int kWarpParts = PARTS / kSplit;
  constexpr int kPart = kLaneParts<ACT, TOKENS, PARTS>;
  constexpr bool kPrefetch = TOKENS >= 2 && ACT != Q8Act::F32;
  // A warp consumes its pieces in steps of kStep, in which its piece i0 + u belongs to its part u % kWarpParts
  // (i0 a multiple of kStep): the part, and so the slot, is known at compile time.
  constexpr int kStep = TRIP > kWarpParts ? TRIP : kWarpParts;
  static_assert(kStep % TRIP == 0 && kStep % kWarpParts == 0 && kWarps % kSplit == 0,
                "TRIP and PARTS must be powers of two, PARTS at most kWarps");
  pdl_allow_successor();

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int parity = ACT == Q8Act::F32 ? 0 : lane & 1;
  const int row_id = blockIdx.x * (kWarps / kSplit) + warp / kSplit;
  const size_t row = static_cast<size_t>(row_id < a.N ? row_id : a.N - 1);
  const int first = warp % kSplit;  // the warp's first piece, and its part when the row has several warps
  const int t0 = blockIdx.y * TOKENS;
  const int chunks = a.K >> 4;            // 16-byte chunks per row
  const int pieces = (chunks + 31) >> 5;  // 512-byte pieces per row; the last may be partial
  // The warp's pieces are first + kSplit * i, i < own_pieces; for i < whole_rounds they are whole in every
  // warp of the row (a count the compiler sees is warp-uniform, so the loop's shuffles need no divergence
  // check), and the tail below has at most one more each.
  const int own_pieces = (pieces - first + kSplit - 1) / kSplit;
  const int whole_rounds = (chunks >> 5) / kSplit;
  const int whole_steps_end = (whole_rounds / kStep) * kStep;  // own pieces [0, this) come in whole steps

  // Rows past T (and an odd TOKENS' missing row of the last pair) are read from row T - 1 and not stored.
  auto x_row = [&](int t) { return static_cast<size_t>(t0 + t < a.T ? t0 + t : a.T - 1); };
  WCursor<ACT> wc(a.weight_q + row * a.K, a.weight_d + row * (a.K >> 5), lane);
  XRows<ACT, TOKENS> xc;
#pragma unroll
  for (int t = 0; t < TOKENS; ++t) {
    if constexpr (ACT == Q8Act::F32) {
      xc.q[t] = reinterpret_cast<const int4*>(static_cast<const float*>(a.x) + x_row(t) * a.x_stride) + lane;
    } else {
      xc.q[t] = reinterpret_cast<const int4*>(static_cast<const int8_t*>(a.x) + x_row(t) * a.x_stride) + lane;
      if constexpr (ACT == Q8Act::Int8x2) {
        xc.lo[t] = reinterpret_cast<const int4*>(a.x_lo + x_row(t) * a.x_lo_stride) + lane;
      }
    }
  }
  if constexpr (ACT != Q8Act::F32) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      xc.d[r] = a.x_d + x_row(kByParity ? 2 * r + parity : r) * a.x_d_stride + (lane >> 1);
    }
  }
  wc.advance(first);
  xc.advance(first);

  Acc<ACT> acc[kPart][kRows];
#pragma unroll
  for (int i = 0; i < kPart; ++i)
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[i][r] = Acc<ACT>(0);
  // Adds own piece u of a step (part u % kWarpParts) for every row of x. The int lanes shuffle (all 32 lanes
  // are here).
  auto add_piece = [&](int u, int4 w, float wd, const auto& x) {  // generic: never instantiated for F32
    const int part = u % kWarpParts;
    if constexpr (!kByParity) {
      int s = half_dot<ACT>(w, x, 0);
      s += __shfl_xor_sync(kFullMask, s, 1);
      acc[part % kPart][0] = add_block<ACT>(acc[part % kPart][0], s, wd, part / kPart == parity ? x.d[0] : 0.f);
    } else {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int even = half_dot<ACT>(w, x, 2 * r);
        const int odd = 2 * r + 1 < TOKENS ? half_dot<ACT>(w, x, 2 * r + 1) : even;
        const int s = (parity ? odd : even) + __shfl_xor_sync(kFullMask, parity ? even : odd, 1);
        acc[part][r] = add_block<ACT>(acc[part][r], s, wd, x.d[r]);
      }
    }
  };
  // The f32 lane's add_piece: row t's chunk of x is loaded right before its dot (an L1 hit), so a lane holds
  // 16 floats of x whatever TRIP and TOKENS, and the registers go to weights in flight instead. `words` < 4
  // only in the row's last piece: the lane's words past the row's end are zero and their x is not read.
  auto add_piece_f32 = [&](int u, int4 w, float4 wd, int words) {
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
      float4 x[4] = {};
      xc.f32_chunk(u * kSplit, t, x, words);
      acc[u % kWarpParts][t] += dot16_f32(w, wd, x);
    }
  };

  int4 w[TRIP];
  WScale<ACT> wd[TRIP];
  auto load_weights = [&](int s, int4 (&wq)[TRIP], WScale<ACT> (&ws)[TRIP]) {
#pragma unroll
    for (int u = 0; u < TRIP; ++u) {
      wq[u] = wc.quants((s + u) * kSplit);
      ws[u] = wc.scale((s + u) * kSplit);
    }
  };
  // One step of whole pieces from the cursors' place (`last`: the warp's last whole step). T = 1 loads a trip's
  // weights with its activations (its first trip's are already in w, wd when `first_loaded`; both flags are
  // constants or uniform, so no branch is left between a trip's loads). The T-row forms hold fewer pieces of
  // x at a time, so they keep weights in flight otherwise: the next trip's weights are loaded before this
  // trip's math (after the warp's last whole step, this trip's again: a branch-free no-op).
  auto step = [&](bool first_loaded, bool last) {
#pragma unroll
    for (int s = 0; s < kStep; s += TRIP) {
      if (!kPrefetch && !(first_loaded && s == 0)) load_weights(s, w, wd);
      int4 w_next[TRIP];
      WScale<ACT> wd_next[TRIP];
      if constexpr (ACT == Q8Act::F32) {
        // A scheduling fence (no instruction in the SASS): without it ptxas sank a 4-piece trip's later
        // weight loads to just before their math (~2 pieces in flight, not 4).
        __syncwarp();
#pragma unroll
        for (int u = 0; u < TRIP; ++u) add_piece_f32(s + u, w[u], wd[u], 4);
      } else {
        XPiece<ACT, TOKENS> x[TRIP];
#pragma unroll
        for (int u = 0; u < TRIP; ++u) x[u] = xc.at((s + u) * kSplit);
        if (kPrefetch) load_weights(s + TRIP < kStep || !last ? s + TRIP : s, w_next, wd_next);
#pragma unroll
        for (int u = 0; u < TRIP; ++u) add_piece(s + u, w[u], wd[u], x[u]);
      }
      if (kPrefetch) {
#pragma unroll
        for (int u = 0; u < TRIP; ++u) {
          w[u] = w_next[u];
          wd[u] = wd_next[u];
        }
      }
    }
    wc.advance(kStep * kSplit);
    xc.advance(kStep * kSplit);
  };

  // PDL wait: before it, only the first trip's weights and scales (constants) are loaded; x, x_d and out
  // may belong to the predecessor.
  if (whole_steps_end > 0) load_weights(0, w, wd);
  pdl_wait_for_predecessor();
  if (whole_steps_end > 0) step(true, whole_steps_end == kStep);
  for (int i0 = kStep; i0 < whole_steps_end; i0 += kStep) step(false, i0 + kStep == whole_steps_end);

  // The tail: fewer than kStep whole pieces and the partial last piece, one piece at a time; lanes past the
  // row's end load nothing and add zero.
#pragma unroll
  for (int u = 0; u < kStep; ++u) {
    if (whole_steps_end + u < own_pieces) {  // warp-uniform
      const int piece = first + kSplit * (whole_steps_end + u);
      if constexpr (ACT == Q8Act::F32) {
        // The lane's words in the row: word i starts at byte 4 lane + 128 i of the piece.
        const int bytes_left = a.K - piece * 512 - 4 * lane;
        const int words = bytes_left <= 0 ? 0 : bytes_left >= 512 ? 4 : (bytes_left + 127) / 128;
        add_piece_f32(u, wc.quants(u * kSplit, words), wc.scale(u * kSplit, words), words);
      } else {
        const bool in_row = piece * 32 + lane < chunks;
        int4 wt = make_int4(0, 0, 0, 0);
        float wdt = 0.f;
        XPiece<ACT, TOKENS> xt = {};
        if (in_row) {
          wt = wc.quants(u * kSplit);
          wdt = wc.scale(u * kSplit);
          xt = xc.at(u * kSplit);
        }
        add_piece(u, wt, wdt, xt);
      }
    }
  }

  // The warp's total for row-slot r: each part's sums by an xor butterfly over the lanes that hold them (every
  // lane of a parity ends with the same total; the int lanes keep the two parities apart), then the parts in
  // order (at T = 1 the odd lanes' parts are fetched from the odd partner).
  auto warp_total = [&](int r) {
    Acc<ACT> part[kWarpParts];
#pragma unroll
    for (int i = 0; i < kPart; ++i) {
      Acc<ACT> v = acc[i][r];
#pragma unroll
      for (int o = 16; o >= (ACT == Q8Act::F32 ? 1 : 2); o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
      part[i] = v;
      if (kPart < kWarpParts) part[kPart + i] = __shfl_xor_sync(kFullMask, v, 1);
    }
    Acc<ACT> v = part[0];
#pragma unroll
    for (int q = 1; q < kWarpParts; ++q) v += part[q];
    return v;
  };
  auto store = [&](int t, Acc<ACT> v) {
    if (t < TOKENS && row_id < a.N && t0 + t < a.T) {
      a.out[static_cast<size_t>(t0 + t) * a.out_stride + row] =
          ACT == Q8Act::Int8x2 ? static_cast<float>(v / 127.0) : static_cast<float>(v);
    }
  };
  // Row t is stored by a lane that holds its total: lane t when the pair splits rows, else lane 2t (even: at
  // T = 1 the even lanes hold the sum of all parts). With several warps a row, the warps' sums (each a part)
  // meet in shared memory and the row's first warp adds them in order.
  if constexpr (kSplit == 1) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int t = kByParity ? 2 * r + parity : r;
      const Acc<ACT> v = warp_total(r);
      if (lane == (kByParity ? t : 2 * t)) store(t, v);
    }
  } else {
    __shared__ Acc<ACT> warp_sums[kWarps][TOKENS];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int t = 2 * r + parity;
      const Acc<ACT> v = warp_total(r);
      if (lane == t && t < TOKENS) warp_sums[warp][t] = v;
    }
    __syncthreads();
    if (first == 0 && lane < TOKENS) {
      Acc<ACT> v = warp_sums[warp][lane];
#pragma unroll
      for (int q = 1; q < kSplit; ++q) v += warp_sums[warp + q][lane];
      store(lane, v);
    }
  }
}

template <Q8Act ACT, int TOKENS, int TRIP, int PARTS>
cudaError_t launch(const Q8GemvArgs& a, cudaStream_t stream) {
  const unsigned grid_y = static_cast<unsigned>((a.T + TOKENS - 1) / TOKENS);
  if (grid_y > 65535u) return cudaErrorInvalidValue;
  constexpr int kRowsPerBlock = kWarps / kWarpsPerRow<ACT, TOKENS, PARTS>;
  const dim3 grid(static_cast<unsigned>((a.N + kRowsPerBlock - 1) / kRowsPerBlock), grid_y);
  return launch_pdl(q8_0_gemv_kernel<ACT, TOKENS, TRIP, PARTS>, grid, dim3(kThreads), 0, stream, a);
}

template <Q8Act ACT, int TOKENS>
cudaError_t launch_config(const Q8GemvArgs& a, Q8GemvConfig cfg, cudaStream_t stream) {
#define QWEN38_Q8_GEMV_DISPATCH(TRIP, PARTS)                                \
  if (cfg.trip == TRIP && cfg.parts == PARTS) {                             \
    return launch<ACT, TOKENS, kTrip<ACT, TOKENS, TRIP>, PARTS>(a, stream); \
  }
  QWEN38_Q8_GEMV_CONFIGS(QWEN38_Q8_GEMV_DISPATCH)
#undef QWEN38_Q8_GEMV_DISPATCH
  return cudaErrorInvalidValue;
}

// The most rows of x one pass shares each weight load among (f32: its sums and row pointers with a 2-piece trip
// fill 80 registers at 4 rows); T above it runs in ceil(T / kMaxTokens) passes of equal rows (blockIdx.y).
template <Q8Act ACT>
constexpr int kMaxTokens = ACT == Q8Act::F32 ? 4 : 8;

// The instance for `tokens` rows of x a pass, with the config's PARTS (so every row gets the T = 1 bits).
template <Q8Act ACT, int TOKENS = 1>
cudaError_t launch_tokens(int tokens, const Q8GemvArgs& a, Q8GemvConfig cfg, cudaStream_t stream) {
  if constexpr (TOKENS < kMaxTokens<ACT>) {
    if (tokens > TOKENS) return launch_tokens<ACT, TOKENS + 1>(tokens, a, cfg, stream);
  }
  return launch_config<ACT, TOKENS>(a, cfg, stream);
}

template <Q8Act ACT>
cudaError_t dispatch(const Q8GemvArgs& a, Q8GemvConfig cfg, cudaStream_t stream) {
  const int passes = (a.T + kMaxTokens<ACT> - 1) / kMaxTokens<ACT>;
  return launch_tokens<ACT>((a.T + passes - 1) / passes, a, cfg, stream);
}

}  // namespace

// trip: 2 pieces (decode-gap.md: 2-piece trips measured best in the int lanes; 4 spilled at 48 registers and
// lost 3-6 points). f32 holds four scales a piece (its WCursor layout), so 4-piece trips spill there too.
// parts: the order of the previous form of this kernel, so the int lanes keep their bits: it split the rows
// of N <= 8192 over 4 warps by piece (p % 4) and added the 4 warp sums in order; above, one warp per row.
Q8GemvConfig q8_0_gemv_default_config(Q8Act act, int N) {
  Q8GemvConfig cfg;
  cfg.trip = 2;
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

cudaError_t q8_0_gemv_launch(Q8Act act, const Q8GemvArgs& args, cudaStream_t stream) {
  if (args.N == 0 || args.T == 0) return cudaSuccess;
  if (args.K <= 0 || args.K % 32 != 0) return cudaErrorInvalidValue;
  Q8GemvConfig cfg = q8_0_gemv_default_config(act, args.N);
  q8_0_gemv_config_from_env(&cfg);
  if (act == Q8Act::Int8 && args.T >= q8_0_gemv_rows_min_rows() && q8_0_gemv_rows_supported(args, cfg.parts)) {
    return q8_0_gemv_rows_launch(args, cfg.parts, stream);  // the same bits per row, on the tensor cores
  }
  switch (act) {
    case Q8Act::F32: return dispatch<Q8Act::F32>(args, cfg, stream);
    case Q8Act::Int8: return dispatch<Q8Act::Int8>(args, cfg, stream);
    case Q8Act::Int8x2: return dispatch<Q8Act::Int8x2>(args, cfg, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace qwen38
