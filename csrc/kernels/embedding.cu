// Q8_0 embedding row lookup: one 16-byte load of quants per thread, 4 float4 stores.
// out = (float)q * (float)d, one float32 rounding: the same bits as the reference's float32 product.
#include "embedding.h"

namespace qwen38 {
namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads) q8_0_embedding_kernel(const EmbeddingArgs a) {
  const int t = blockIdx.y;
  const int chunk = blockIdx.x * kThreads + threadIdx.x;  // 16 quants
  if (chunk >= a.D / 16) return;
  const int tok = a.token[t];
  float* out_row = a.out + static_cast<size_t>(t) * a.out_stride;
  float4* out = reinterpret_cast<float4*>(out_row + static_cast<size_t>(chunk) * 16);
  if (tok < 0 || tok >= a.V) {
    const float nan = __int_as_float(0x7fc00000);
    for (int i = 0; i < 4; ++i) out[i] = make_float4(nan, nan, nan, nan);
    return;
  }
  const size_t row = static_cast<size_t>(tok);
  const int4 q = __ldg(reinterpret_cast<const int4*>(a.weight_q + row * a.D) + chunk);
  const float d = __half2float(a.weight_d[row * (a.D / 32) + chunk / 2]);
  const int words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int w = words[i];
    out[i] = make_float4(static_cast<float>(static_cast<int8_t>(w)) * d,
                         static_cast<float>(static_cast<int8_t>(w >> 8)) * d,
                         static_cast<float>(static_cast<int8_t>(w >> 16)) * d,
                         static_cast<float>(static_cast<int8_t>(w >> 24)) * d);
  }
}

}  // namespace

cudaError_t q8_0_embedding(const EmbeddingArgs& a, cudaStream_t stream) {
  if (a.T == 0) return cudaSuccess;
  if (a.D <= 0 || a.D % 32 != 0 || a.T > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((a.D / 16 + kThreads - 1) / kThreads), static_cast<unsigned>(a.T));
  q8_0_embedding_kernel<<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace qwen38
