// The loads of the Q8_0 GEMV family (q8_gemv.cu, q8_gemv_rows.cu), one copy each.
#pragma once
#include <cstdint>

#include <cuda_fp16.h>

namespace qwen38 {

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

// Two adjacent block scales of a weight row (4-byte aligned: an even block of a row of K / 32 scales, K % 64 == 0).
__device__ __forceinline__ __half2 load_weight_scales2(const __half* p) {
  uint32_t bits;
  asm volatile("ld.global.L1::no_allocate.b32 %0, [%1];" : "=r"(bits) : "l"(p));
  return *reinterpret_cast<const __half2*>(&bits);
}

// Two adjacent block scales of a row of x (8-byte aligned).
__device__ __forceinline__ float2 load_act_scales2(const float* p) {
  float2 v;
  asm volatile("ld.global.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
  return v;
}

}  // namespace qwen38
