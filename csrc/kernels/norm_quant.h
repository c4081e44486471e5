// Producers of the Q8_0 GEMV's activation: fused residual add + RMSNorm, SwiGLU, the GDN gated RMSNorm and
// a standalone quantizer, each optionally emitting the int8 or two-word int8 lane (csrc/bindings.cpp has the
// exact math). One kernel template; the op is a template parameter.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace qwen38 {

enum class Producer : int { Quantize = 0, RmsNorm = 1, AddRmsNorm = 2, SiluMul = 3, GatedRmsNorm = 4 };

// Every float row is read/written as float4: D % 4 == 0, float row strides % 4 == 0, 16-byte aligned bases;
// int8 rows are written 4 bytes at a time (strides % 4 == 0, 4-byte aligned). Strides are in elements.
struct ProducerArgs {
  const float* x = nullptr;  // [T, D] (SiluMul: gate_up [T, 2D], gate first)
  int64_t x_stride = 0;
  const float* z = nullptr;  // GatedRmsNorm: gate [T, D]
  int64_t z_stride = 0;
  float* residual = nullptr;  // AddRmsNorm: [T, D], += x in place
  int64_t residual_stride = 0;
  const float* weight = nullptr;  // norms: [D] (GatedRmsNorm: [head_dim], shared by the heads)
  float eps = 0.f;
  float* out = nullptr;  // [T, D]; unused by Quantize
  int64_t out_stride = 0;
  int8_t* out_q = nullptr;  // optional [T, D]: int8 lane (or the high word of the two-word lane)
  int64_t out_q_stride = 0;
  int8_t* out_q_lo = nullptr;  // optional [T, D]: the two-word lane's low word
  int64_t out_q_lo_stride = 0;
  float* out_d = nullptr;  // [T, D/32], with out_q
  int64_t out_d_stride = 0;
  int T = 0, D = 0;
  int head_dim = 0;  // GatedRmsNorm
};

// Largest D a row-normalising producer (RmsNorm, AddRmsNorm) keeps in registers; head_dim limit of
// GatedRmsNorm. Larger sizes are refused with cudaErrorInvalidValue.
constexpr int kProducerMaxRow = 24576;
constexpr int kProducerMaxHead = 1024;

// Producer `op` on `stream`, with PDL when pdl_enabled() (pdl.cuh). The op is an argument of its own, not a field
// of args: args is the kernel's parameter as it is.
cudaError_t produce_activation_launch(Producer op, const ProducerArgs& args, cudaStream_t stream);

}  // namespace qwen38
