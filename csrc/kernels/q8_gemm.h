// Q8_0 GEMM for prompt-sized T: y[t, n] = sum_k W[n, k] x[t, k] on int8 tensor cores, for the two integer
// activation lanes (the f32 lane's T-row form is dequantize-then-cuBLAS, in qwen38_model/layers.py).
//
// Same arguments and the same math as the GEMV's Int8 / Int8x2 lanes (q8_gemv.h): each 32-weight block's
// int32 dot is exact (one mma.sync m16n8k32 is exactly one Q8_0 block), then scaled by weight_d * x_d.
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

// act is Int8 or Int8x2; the tile is q8_0_gemm_default_tile's (or the QWEN38_Q8_GEMM_TILE override). Launches on
// `stream` without PDL (the kernel has no griddepcontrol.wait: pdl.cuh); no allocation, no host sync.
cudaError_t q8_0_gemm_launch(Q8Act act, const Q8GemvArgs& args, cudaStream_t stream);

}  // namespace qwen38
