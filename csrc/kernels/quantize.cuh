// Device-side activation quantizers shared by every producer that emits a Q8_0 GEMV input (norm_quant,
// attention's output gate, ...): ggml's int8 lane and the two-word int8 lane, per 32-value block, exactly
// as csrc/bindings.cpp and qwen38_ops/reference/norm_quant.py define them.
//
// Every rounding step is spelled with an explicit _rn intrinsic, so it stays exact whatever the build
// flags (a fast-math build makes `a / b` and `1.0f / d` approximate, and nvcc contracts `x * y + z` into
// an FMA by default): a one-ulp difference in d or 1/d flips the rounding of some q against the reference.
// roundf (half away from zero) is ggml's rounding, not __float2int_rn (half to even).
#pragma once
#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common.cuh"
#include "op_limits.h"  // kQuantBlock: values per scale, as Q8_0 weight blocks

namespace qwen38 {

// amax of one 32-value block held by kLanes consecutive lanes (aligned to kLanes) of a warp, each lane
// holding its part's |x| maximum. Every lane of the group gets the result.
template <int kLanes>
__device__ __forceinline__ float quant_block_amax(float lane_amax) {
  return warp_max<kLanes>(lane_amax);
}

// int8 lane: d = amax/127, values rounded with the exact float 1/d (0 for an all-zero block), and the
// scale the GEMV multiplies by is d rounded to fp16 (stored as float32), as ggml's quantize_row_q8_0.
struct Int8BlockScale {
  float inv_d;     // what values are multiplied by before rounding
  float stored_d;  // what goes to out_d
};

__device__ __forceinline__ Int8BlockScale int8_block_scale(float amax) {
  const float d = __fdiv_rn(amax, 127.0f);
  Int8BlockScale scale;
  scale.inv_d = d == 0.0f ? 0.0f : __frcp_rn(d);
  scale.stored_d = __half2float(__float2half_rn(d));
  return scale;
}

__device__ __forceinline__ int8_t int8_quantize(float x, float inv_d) {
  return (int8_t)(int)roundf(__fmul_rn(x, inv_d));
}

// two-word int8 lane: s = amax/127 (kept in float32), t = x/s, q = clamp(round(t), +-127),
// q_lo = round((t - q) * 127); the value is s * (q + q_lo/127). s = 0 gives t = 0.
__device__ __forceinline__ float int8x2_block_scale(float amax) { return __fdiv_rn(amax, 127.0f); }

__device__ __forceinline__ void int8x2_quantize(float x, float s, int8_t& q, int8_t& q_lo) {
  const float t = s == 0.0f ? 0.0f : __fdiv_rn(x, s);
  const float hi = fminf(fmaxf(roundf(t), -127.0f), 127.0f);
  q = (int8_t)(int)hi;
  q_lo = (int8_t)(int)roundf(__fmul_rn(__fsub_rn(t, hi), 127.0f));
}

// A 32-value block held one value a lane by the whole calling warp (lane l: value l of the block): its int8
// lane or (kTwoWord) two-word lane, q / q_lo pointing at this lane's value and d at the block's scale (lane 0
// writes it). Elementwise the same as the float4 producers' loops: the block amax does not depend on who
// holds which value.
template <bool kTwoWord>
__device__ __forceinline__ void store_quantized_lane(float y, int8_t* q, int8_t* q_lo, float* d) {
  const float amax = quant_block_amax<32>(fabsf(y));
  float stored_d;
  if constexpr (!kTwoWord) {
    const Int8BlockScale scale = int8_block_scale(amax);
    *q = int8_quantize(y, scale.inv_d);
    stored_d = scale.stored_d;
  } else {
    stored_d = int8x2_block_scale(amax);
    int8x2_quantize(y, stored_d, *q, *q_lo);
  }
  if ((threadIdx.x & 31) == 0) *d = stored_d;
}

// Four consecutive values of a 32-value block held as a float4 by each of 8 consecutive lanes (aligned to 8)
// of the calling warp, the float producers' layout: their int8 lane (q_lo null) or two-word lane. Every lane of
// the warp calls it (the amax is a shuffle); a lane with `stores` false (past its row's end, holding zeros)
// takes part in the amax and writes nothing. q / q_lo point at the lane's first value (4-byte aligned), d at
// the block's scale, written by the first lane of the 8.
__device__ __forceinline__ void store_quantized_float4(float4 v, bool stores, int8_t* q, int8_t* q_lo, float* d) {
  const float lane_amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
  const float amax = quant_block_amax<kQuantBlock / 4>(lane_amax);
  if (!stores) return;
  const float x[4] = {v.x, v.y, v.z, v.w};
  int8_t hi[4], lo[4];
  float stored_d;
  if (q_lo == nullptr) {
    const Int8BlockScale scale = int8_block_scale(amax);
#pragma unroll
    for (int k = 0; k < 4; ++k) hi[k] = int8_quantize(x[k], scale.inv_d);
    stored_d = scale.stored_d;
  } else {
    stored_d = int8x2_block_scale(amax);
#pragma unroll
    for (int k = 0; k < 4; ++k) int8x2_quantize(x[k], stored_d, hi[k], lo[k]);
    *reinterpret_cast<char4*>(q_lo) = make_char4(lo[0], lo[1], lo[2], lo[3]);
  }
  *reinterpret_cast<char4*>(q) = make_char4(hi[0], hi[1], hi[2], hi[3]);
  if ((threadIdx.x & 7) == 0) *d = stored_d;
}

// SiLU as the producers spell it (silu_mul, the gated norms). nvcc contracts `1 + expf(-v)` into one FMA with
// expf's last product; the same expression inlined into each caller compiles the same way (the tests compare
// their bits). The GDN conv's SiLU is NOT this one: gdn_math.cuh's gdn_silu pins that add.
__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }

}  // namespace qwen38
