// Embedding row lookups.
// q8_0_embedding: one 16-byte load of quants per thread, 4 float4 stores. out = (float)q * (float)d, one
// float32 rounding: the same bits as the reference's float32 product.
// embedding: one element per thread; widening bfloat16/float16 to float32 is exact, so the same bits as the
// reference. A row is a few KB read once a token: the plain loads cost nothing worth vectorizing.
#include "embedding.h"

namespace qwen38 {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ bool bad_id(int tok, int V) { return tok < 0 || tok >= V; }

// One thread of row t's first block raises the flag, the rows' shared one or row t's own (`row_offset` =
// t * bad_token_stride); an OR: it never clears a condition another kernel flagged in the same int32.
__device__ __forceinline__ void flag_bad_token(int32_t* bad_token, int row_offset) {
  if (bad_token != nullptr && blockIdx.x == 0 && threadIdx.x == 0) atomicOr(bad_token + row_offset, kBadTokenFlag);
}

__global__ void __launch_bounds__(kThreads) q8_0_embedding_kernel(const EmbeddingArgs a) {
  const int t = blockIdx.y;
  const int chunk = blockIdx.x * kThreads + threadIdx.x;  // 16 quants
  if (chunk >= a.D / 16) return;
  const int tok = a.token[t];
  float* out_row = a.out + static_cast<size_t>(t) * a.out_stride;
  float4* out = reinterpret_cast<float4*>(out_row + static_cast<size_t>(chunk) * 16);
  if (bad_id(tok, a.V)) {
    const float nan = __int_as_float(0x7fc00000);
    for (int i = 0; i < 4; ++i) out[i] = make_float4(nan, nan, nan, nan);
    flag_bad_token(a.bad_token, t * a.bad_token_stride);
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

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }

template <typename W>
__global__ void __launch_bounds__(kThreads) embedding_kernel(const DenseEmbeddingArgs<W> a) {
  const int t = blockIdx.y;
  const int j = blockIdx.x * kThreads + threadIdx.x;
  if (j >= a.D) return;
  const int tok = a.token[t];
  float* out = a.out + static_cast<size_t>(t) * a.out_stride;
  if (bad_id(tok, a.V)) {
    out[j] = __int_as_float(0x7fc00000);
    flag_bad_token(a.bad_token, t * a.bad_token_stride);
    return;
  }
  out[j] = widen(a.weight[static_cast<size_t>(tok) * a.D + j]);
}

}  // namespace

cudaError_t q8_0_embedding_launch(const EmbeddingArgs& a, cudaStream_t stream) {
  if (a.T == 0) return cudaSuccess;
  if (a.D <= 0 || a.D % 32 != 0 || a.T > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((a.D / 16 + kThreads - 1) / kThreads), static_cast<unsigned>(a.T));
  q8_0_embedding_kernel<<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename W>
cudaError_t embedding_launch(const DenseEmbeddingArgs<W>& a, cudaStream_t stream) {
  if (a.T == 0) return cudaSuccess;
  if (a.D <= 0 || a.T > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((a.D + kThreads - 1) / kThreads), static_cast<unsigned>(a.T));
  embedding_kernel<W><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template cudaError_t embedding_launch<float>(const DenseEmbeddingArgs<float>&, cudaStream_t);
template cudaError_t embedding_launch<__nv_bfloat16>(const DenseEmbeddingArgs<__nv_bfloat16>&, cudaStream_t);
template cudaError_t embedding_launch<__half>(const DenseEmbeddingArgs<__half>&, cudaStream_t);

}  // namespace qwen38
