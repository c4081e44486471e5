// Programmatic dependent launch (PDL): the one copy of the plumbing every decode-step kernel shares.
//
// A decode step is a chain of short kernels; between two of them the GPU idles for the launch gap plus the
// first loads' DRAM latency (a fixed ~1.4 us a launch in a captured graph on the H200, as much as a GDN
// step's whole memory time, and 10-25% of a 7-20 us GEMV). Launched with programmatic stream serialization,
// a kernel's blocks are scheduled while its predecessor still runs, and park in griddepcontrol.wait, which
// returns once the predecessor has completed and its writes are visible.
//
// The invariant that keeps this correct whatever the predecessor is. Before its pdl_wait_for_predecessor(),
// a kernel touches nothing an earlier kernel of the stream may write: it may load constants (weights, norm
// weights) and prefetch into L1/L2 (L2 is the GPU's point of coherence, so a prefetched line is simply
// updated by a write the predecessor still makes); no activation, state or output is read or written.
// Every thread that does any work runs the wait (a thread with nothing to do may return before it), so a
// grid completes only after its predecessor did. That makes the order transitive: a kernel may release its
// own successor (pdl_allow_successor) before its wait, because the successor's wait then waits for this
// kernel's completion, which comes after its predecessor's. Each kernel says at its wait what it does
// before it.
// Without the launch attribute both instructions are no-ops.
//
// Who launches with the attribute: every launcher decides it itself (`<op>_launch(const Args&, cudaStream_t)`; the
// GEMV, the GEMM and the norm_quant producers take their lane or producer as a leading argument, their Args being
// the kernel's parameter as it is), never a flag from the binding. A kernel that runs pdl_wait_for_predecessor()
// launches through launch_pdl() below (or, with more launch attributes, adds the attribute itself when
// pdl_enabled(), as gdn_step.cu does); a kernel without the wait (embedding, sampling, the prefill GEMM and
// attention) launches plainly: with the attribute it could start reading before its predecessor's writes are
// visible.
//
// QWEN38_PDL=0 in the environment launches without the attribute. It is read once per process, at the first
// launch: a captured CUDA graph keeps the launches it recorded, so a value that could change later would
// silently not apply to them; a test or benchmark that compares both runs each in its own process.
#pragma once
#include <cstdlib>
#include <utility>

#include <cuda_runtime.h>

namespace qwen38 {

inline bool pdl_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("QWEN38_PDL");
    return !(v != nullptr && v[0] == '0');
  }();
  return enabled;
}

#ifdef __CUDACC__
__device__ __forceinline__ void pdl_wait_for_predecessor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_allow_successor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// cudaLaunchKernelEx with the programmatic-serialization attribute when pdl_enabled(); returns the launch's
// error, else any earlier asynchronous one.
template <typename... KernelParams, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KernelParams...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl_enabled() ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  return err != cudaSuccess ? err : cudaGetLastError();
}
#endif

}  // namespace qwen38
