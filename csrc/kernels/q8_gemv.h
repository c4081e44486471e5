// Q8_0 GEMV, y[t, n] = sum_k W[n, k] x[t, k], for the three activation lanes of the decode step, and the
// programmatic-dependent-launch (PDL) plumbing the decode-step kernels share.
//
// W is Q8_0: int8 quants [N, K] (row-major, K contiguous) + fp16 block scales [N, K/32], 32 weights along K
// per scale. K must be a multiple of 32. Lanes (csrc/bindings.cpp has the exact math):
//   F32    x float32 [T, K]                                  dequantize-then-FMA in float32
//   Int8   x_q int8 [T, K] + x_d float32 [T, K/32]           exact int32 dot per 32-block (dp4a), then
//                                                            * (weight_d * x_d) in float (ggml's q8_0 x q8_0)
//   Int8x2 x_q, x_q_lo int8 [T, K] + x_d float32 [T, K/32]   two int32 dots per block: (hi + lo/127) * scales
#pragma once
#include <cstdint>
#include <cstdlib>
#include <utility>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace qwen38 {

enum class Q8Act : int { F32 = 0, Int8 = 1, Int8x2 = 2 };

struct Q8GemvArgs {
  const int8_t* weight_q = nullptr;  // [N, K], rows 16-byte aligned (base aligned, K % 32 == 0)
  const __half* weight_d = nullptr;  // [N, K/32]
  const void* x = nullptr;           // F32: float [T, x_stride]; Int8 lanes: int8 [T, x_stride]; 16-byte aligned rows
  const int8_t* x_lo = nullptr;      // Int8x2 only: int8 [T, x_lo_stride], 16-byte aligned rows
  const float* x_d = nullptr;        // Int8 lanes: float [T, x_d_stride]
  float* out = nullptr;              // [T, out_stride]
  int64_t x_stride = 0, x_lo_stride = 0, x_d_stride = 0, out_stride = 0;  // in elements
  int N = 0, K = 0, T = 0;
};

// How one launch splits the work (template instantiations of one kernel; see q8_gemv.cu):
//   pieces  512-byte weight pieces (one 16-byte load per lane) each warp loads per row before using them
//   split   warps of a 4-warp block that share one row's K range (combined in shared memory, fixed order)
//   rows    rows one warp streams together (they share each activation load)
struct Q8GemvConfig {
  int pieces = 4, split = 1, rows = 2;
};

// The decode (T == 1) configs that are compiled; any other is refused with cudaErrorInvalidValue. T > 1
// always runs one fixed config that keeps 4 tokens per pass (weights loaded once for the 4).
#define QWEN38_Q8_GEMV_CONFIGS(X) X(4, 1, 2) X(4, 4, 1) X(8, 1, 1) X(16, 1, 1) X(8, 2, 1) X(4, 2, 2) X(2, 1, 4)

// The config the bindings use for a shape unless QWEN38_Q8_GEMV_CONFIG overrides it.
Q8GemvConfig q8_0_gemv_default_config(Q8Act act, int N, int K, int T);
// Benchmarking knob: QWEN38_Q8_GEMV_CONFIG="pieces,split,rows" replaces the default (read at every call,
// so a benchmark can sweep configs in one process). Returns false when unset or malformed.
bool q8_0_gemv_config_from_env(Q8GemvConfig* cfg);

// Launches on `stream`; no allocation, no host sync. With pdl, the launch may start while the previous
// kernel on the stream is still draining (see below).
cudaError_t q8_0_gemv(Q8Act act, const Q8GemvArgs& args, Q8GemvConfig cfg, bool pdl, cudaStream_t stream);

// ---- programmatic dependent launch ---------------------------------------------------------------------
// A decode step is a chain of short kernels; between two of them the GPU idles for the launch gap plus the
// first loads' DRAM latency, which is 10-25% of a 7-20 us GEMV. With PDL a kernel is launched while its
// predecessor still runs: it issues its first WEIGHT loads (constant data) at once and only then waits
// (griddepcontrol.wait) for the predecessor to complete and flush before it touches activations or writes
// anything. Every kernel launched with PDL must therefore wait before its first dependent access; kernels
// call griddepcontrol.launch_dependents early so their successor can start filling idle SMs.
// QWEN38_PDL=0 turns it off (read at every call; a captured graph keeps what was set at capture).
inline bool pdl_enabled() {
  const char* v = std::getenv("QWEN38_PDL");
  return !(v != nullptr && v[0] == '0');
}

#ifdef __CUDACC__
// Both are no-ops for a kernel launched without the PDL attribute.
__device__ __forceinline__ void pdl_wait_for_predecessor() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_allow_successor() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

template <typename... KernelParams, typename... Args>
cudaError_t launch_maybe_pdl(void (*kernel)(KernelParams...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t stream, bool pdl, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  return err != cudaSuccess ? err : cudaGetLastError();
}
#endif

}  // namespace qwen38
