// Device helpers every kernel family shares, one copy each (ggml keeps the same in common.cuh, cp-async.cuh and
// mma.cuh): the full warp mask, warp reductions, the shared-memory address of a pointer, the cp.async family
// and ldmatrix. Pure CUDA, like every file here.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace qwen38 {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;

// Host and device: p starts on a multiple of 16 bytes (16-byte vector loads and stores).
__host__ __device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

#ifdef __CUDACC__
// Sum over each aligned group of kWidth lanes, by an xor butterfly: every lane of the group ends with the same
// total, summed in the same order on every run (offsets kWidth/2, ..., 2, 1).
template <int kWidth = 32>
__device__ __forceinline__ float warp_sum(float v) {
  static_assert(kWidth >= 1 && kWidth <= 32 && (kWidth & (kWidth - 1)) == 0, "kWidth must be a power of 2");
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// The same butterfly for the maximum.
template <int kWidth = 32>
__device__ __forceinline__ float warp_max(float v) {
  static_assert(kWidth >= 1 && kWidth <= 32 && (kWidth & (kWidth - 1)) == 0, "kWidth must be a power of 2");
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// int32 -> double by one DADD on the FP64 pipe instead of an I2F.F64 on the quarter-rate conversion pipe
// (the Q8_0 GEMV's T-row forms' busiest): 2^52 + 2^31 + s is exact in double, and so is the subtraction.
__device__ __forceinline__ double int_to_double(int s) {
  return __hiloint2double(0x43300000, s ^ static_cast<int>(0x80000000u)) - 4503601774854144.0;  // 2^52 + 2^31
}

// The shared-memory (state space .shared) address of a generic pointer into shared memory, for PTX operands.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- cp.async (PTX ISA: cp.async, cp.async.commit_group, cp.async.wait_group) -------------------------------
// kBytes (4, 8 or 16) from global to shared memory, asynchronously; with fill == false the destination is
// zero-filled and src is not read. 16-byte copies bypass L1 (.cg); smaller ones can only go through it (.ca).
//
// Every one of the three carries a "memory" clobber (the copies used to differ: only q8_gemm.cu's had it). Without
// it the compiler sees an asm statement that touches no memory and may move ordinary shared-memory loads and
// stores across it: a read of a tile hoisted above the wait that makes it valid, or a read of a stage's old data
// sunk below the copy that overwrites it. Each kernel's barriers happen to prevent that today; with the clobber it
// cannot happen whatever the code around them becomes, at the cost of a scheduling freedom the compiler could
// only use wrongly here. (Adding it where it was missing changed no instruction: the sm_90 code of every kernel
// that uses these is byte-identical to what the four private copies gave.)
// Dst and Src stay the caller's pointer types: with void* parameters nvcc selected different, if equivalent,
// integer instructions around gdn_prefill's 4-byte copies than its typed helpers did.
template <int kBytes, typename Dst, typename Src>
__device__ __forceinline__ void cp_async(Dst* dst, const Src* src, bool fill) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  const int src_bytes = fill ? kBytes : 0;
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(dst)), "l"(src),
                 "r"(src_bytes)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(shared_address(dst)), "l"(src),
                 "n"(kBytes), "r"(src_bytes)
                 : "memory");
  }
}
// The same copy to a shared-memory address already in the .shared state space (a kernel that computes its stage
// addresses once, not a generic-to-shared conversion per copy).
template <typename Src>
__device__ __forceinline__ void cp_async16_shared(uint32_t dst, const Src* src, bool fill) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(fill ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most kPending of this thread's committed groups are still in flight (0: all have landed). Other
// threads' copies are visible only after a barrier that follows their waits.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// ---- ldmatrix (PTX ISA: ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16) ------------------------------------
// Four 8x8 matrices of 16-bit elements; lane l gives the row address of matrix l / 8, row l % 8, and receives from
// matrix m the elements (row l / 4, columns 2 (l % 4) and +1) as register m (transposed: rows 2 (l % 4) and +1,
// column l / 4). The shared memory it reads must be made visible by a barrier first, as for any shared load.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}
__device__ __forceinline__ void ldmatrix_x4_shared(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}
#endif

}  // namespace qwen38
