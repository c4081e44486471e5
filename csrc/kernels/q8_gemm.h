// Q8_0 GEMM for prompt-sized T: y[t, n] = sum_k W[n, k] x[t, k] on int8 tensor cores, for the two integer
// activation lanes (the f32 lane's T-row form is dequantize-then-cuBLAS, in qwen38_model/layers.py).
//
// Same arguments and the same math as the GEMV's Int8 / Int8x2 lanes (q8_gemv.h): each 32-weight block's
// int32 dot is exact (one mma.sync m16n8k32, or one wgmma m64nNk32, is exactly one Q8_0 block), then scaled by
// weight_d * x_d.
// What differs from the GEMV is only how the scaled block sums are added: in float32, in block order, where
// the GEMV adds them in double. Extra requirements: K % 64 == 0 (at least two blocks per pipeline stage, and
// 4-byte aligned scale pairs), x_d rows 8-byte aligned.
#pragma once
#include "q8_gemv.h"

namespace qwen38 {

// Token rows per block tile, chosen from T, N, K and occupancy (q8_gemm.cu). 32, 64 and 128 are compiled.
int q8_0_gemm_default_tile(Q8Act act, const Q8GemvArgs& args);
// Benchmarking knob: QWEN38_Q8_GEMM_TILE=32|64|128 replaces the default tile, read at every call. Returns false
// when unset or empty; another value is not compiled, so the launch fails.
bool q8_0_gemm_tile_from_env(int* tile);

// Two kernels compute the same bits: MmaSync (q8_gemm.cu, any sm_80+ build) and Wgmma (q8_gemm_sm90.cu: wgmma, TMA,
// warp specialization; only in an sm_90a build, setup.py's default, and only on an sm_90 device). WgmmaIadd is the
// wgmma kernel with its other accumulator reset (q8_gemm_sm90.cu's header), compiled so that one run measures both.
enum class Q8GemmKernel : int { MmaSync, Wgmma, WgmmaIadd, Unknown };

// The default is MmaSync: the wgmma kernel, the same bits, measured slower on the H200 (5e2d493, bench_q8_gemm, the
// trunk matrices: 2202 against 4099 tok/s at T = 512, 2947 against 4961 at 4096; NOTES, "The wgmma GEMM"). It
// runs only when QWEN38_Q8_GEMM_KERNEL asks for it, until it measures faster.
// Testing and benchmarking knob: QWEN38_Q8_GEMM_KERNEL=mma|wgmma|wgmma_iadd forces a kernel, read at every call
// (Unknown for another value: the launch fails). Returns false when unset or empty.
bool q8_0_gemm_kernel_from_env(Q8GemmKernel* kernel);
// The kernel a call runs: the QWEN38_Q8_GEMM_KERNEL override, else MmaSync.
Q8GemmKernel q8_0_gemm_kernel();

// The build has the sm_90a kernel, the current device is sm_90, and the arguments suit TMA (16-byte aligned
// weight_q, x and x_lo with 16-byte row strides; weight_d 4-byte aligned).
bool q8_0_gemm_sm90_supported(const Q8GemvArgs& args);
// The wgmma kernel's token tile: 128 or 64 (int8, by wave count, q8_0_gemm_sm90.cu), 64 (two-word). With the wgmma
// kernel forced, QWEN38_Q8_GEMM_TILE replaces it (int8: 64 or 128; two-word: 64; another value fails the launch).
int q8_0_gemm_sm90_default_tile(Q8Act act, const Q8GemvArgs& args);
// reset_from_shared: Wgmma (true) or WgmmaIadd (false). cudaErrorNotSupported where not q8_0_gemm_sm90_supported,
// cudaErrorInvalidValue for a tile that is not compiled.
cudaError_t q8_0_gemm_sm90_launch(Q8Act act, const Q8GemvArgs& args, int tile_tokens, bool reset_from_shared,
                                  cudaStream_t stream);

// K splits of the mma.sync kernel for a call: 1 above 64 rows of x and for the wgmma kernel; below, the count that
// keeps the GPU's resident blocks busy (q8_gemm.cu). With more than one, each split sums its share of K's blocks
// in order and a second kernel adds the splits in order: the same bits every run, but not the unsplit bits.
// Testing and benchmarking knob: QWEN38_Q8_GEMM_SPLITS=n forces n (read at every call; 1: no split).
int q8_0_gemm_splits(Q8Act act, const Q8GemvArgs& args);
bool q8_0_gemm_splits_from_env(int* splits);

// act is Int8 or Int8x2; the kernel is q8_0_gemm_kernel's, the mma.sync kernel's tile q8_0_gemm_default_tile's (or
// the QWEN38_Q8_GEMM_TILE override). splits: q8_0_gemm_splits(act, args), which the caller asks once to size
// partial, splits x T x N floats of scratch when splits > 1 (else unused). Launches on `stream` without PDL
// (neither kernel has griddepcontrol.wait: pdl.cuh); no allocation, no host sync.
cudaError_t q8_0_gemm_launch(Q8Act act, const Q8GemvArgs& args, int splits, float* partial, cudaStream_t stream);

}  // namespace qwen38
