// Q8_0 GEMV, y[t, n] = sum_k W[n, k] x[t, k], for the three activation lanes of the decode step.
//
// W is Q8_0: int8 quants [N, K] (row-major, K contiguous) + fp16 block scales [N, K/32], 32 weights along K
// per scale. K must be a multiple of 32. Lanes (csrc/bindings.cpp has the exact math):
//   F32    x float32 [T, K]                                  dequantize-then-FMA in float32
//   Int8   x_q int8 [T, K] + x_d float32 [T, K/32]           exact int32 dot per 32-block (dp4a), then
//          (x_d: fp16 values, as the producers write them)   * (weight_d * x_d), summed in double
//   Int8x2 x_q, x_q_lo int8 [T, K] + x_d float32 [T, K/32]   two int32 dots per block: (hi + lo/127) * scales
#pragma once
#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "op_limits.h"  // QWEN38_Q8_GEMV_CONFIGS

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

// How a launch maps the work (template instantiations of one kernel; see q8_gemv.cu). One warp owns one
// weight row for the whole K range, in 512-byte pieces (int lanes: one 16-byte load per lane; f32: four
// 4-byte loads, so that its float32 activations load coalesced):
//   trip   pieces whose loads (weights, scales, activations) a warp issues together before any math (the
//          int T-row forms from 3 rows use 1 and load the next piece's weights ahead instead; f32 loads only
//          the trip's weights together, its activations a piece at a time, and its T-row forms cap trip at 2)
//   parts  the summation order: piece p adds into partial sum p % parts, and the parts are added in order
//          at the end. It decides the last bits of the result, and a T-row call uses the T = 1 config: each
//          row of it is bitwise the T = 1 call on that row (the int lanes' T-row forms give each part of a
//          row its own warp, and add the parts in the same order).
struct Q8GemvConfig {
  int trip = 2, parts = 1;
};

// The configs that are compiled: QWEN38_Q8_GEMV_CONFIGS (op_limits.h, exported to Python); any other is refused
// with cudaErrorInvalidValue. T > 1 runs the same config with all T rows of x in one pass, each weight load shared
// by them (up to 8 rows in the int lanes, 4 in f32; more T in equal passes).

// The config a launch uses for a shape unless QWEN38_Q8_GEMV_CONFIG overrides it.
Q8GemvConfig q8_0_gemv_default_config(Q8Act act, int N);
// Benchmarking knob: QWEN38_Q8_GEMV_CONFIG="trip,parts" replaces the default. Read once per process (a
// captured graph keeps the config it was captured with; a sweep runs one process per config). Returns false
// when unset; a malformed value gives a config that is not compiled, so the launch fails and says so.
bool q8_0_gemv_config_from_env(Q8GemvConfig* cfg);

// The int8 lane from this many rows of x runs q8_gemv_rows.cu's tensor-core form (the same bits per row; it reads
// the weights once for any T) where q8_0_gemv_rows_supported; QWEN38_Q8_GEMV_ROWS_FROM=n overrides it (a benchmarking
// knob, read once per process like QWEN38_Q8_GEMV_CONFIG). Measured over one token's 27B matrices (H200, 710e4de,
// benchmarks/ops/bench_q8_gemv_rows.py), against the T = 1 chain: the T-row forms 1.12 / 1.32 / 1.39 / 1.79 / 1.89 /
// 2.17x at T = 2 .. 7, the tensor-core form 1.79-1.82x at T = 2 .. 4 and 1.97x at T = 8; so from 7 rows, and the
// verify of speculative decoding (T <= 5 at k <= 4) keeps the T-row forms.
constexpr int kQ8GemvRowsFrom = 7;
int q8_0_gemv_rows_min_rows();
// K a multiple of 512 (whole pieces, 16-byte scale copies), x rows, weights and scales 16-byte aligned, parts 1 or 4.
bool q8_0_gemv_rows_supported(const Q8GemvArgs& args, int parts);
cudaError_t q8_0_gemv_rows_launch(const Q8GemvArgs& args, int parts, cudaStream_t stream);
// The rows kernel's two forms (q8_gemv_rows.cu), the same bits: Smem (x through the shared-memory ring with the
// weights, 8 or 16 rows of x a block; the default) and Direct (all rows of x up to 64 in one block a weight tile, x
// straight from global memory; not yet measured). Testing and benchmarking knob: QWEN38_Q8_GEMV_ROWS_KERNEL=
// smem|direct, read at every call (Unknown for another value: the launch fails). Returns false when unset or empty.
enum class Q8RowsKernel : int { Smem, Direct, Unknown };
bool q8_0_gemv_rows_kernel_from_env(Q8RowsKernel* kernel);

// Lane `act` with q8_0_gemv_default_config (or the QWEN38_Q8_GEMV_CONFIG override), on `stream`, with PDL when
// pdl_enabled() (pdl.cuh: the launch may start while the previous kernel on the stream is still draining); no
// allocation, no host sync. The lane is an argument of its own, not a field of args: args is the kernel's
// parameter as it is (a field more changed the generated code of some instances).
cudaError_t q8_0_gemv_launch(Q8Act act, const Q8GemvArgs& args, cudaStream_t stream);

}  // namespace qwen38
