// attn_qk_norm_rope_store (per-head QK RMSNorm + partial NEOX RoPE + KV-cache store at the device-held position)
// and the standalone attn_output_gate (sigmoid output gate + activation quantization). The split-K decode they
// sit around is attention.cu's.
//
// Positions live on the device (int32): the store reads positions[t] itself, so the grid is fixed at launch and
// one captured graph serves every decode position. In batched rows (attention.h) row t stores into its sequence's
// cache t / rows_per_cache, cache_row_stride elements apart; the shared cache is stride 0.
#include "attention.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "attention_gate.cuh"
#include "common.cuh"
#include "pdl.cuh"

namespace qwen38 {
namespace {

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// ---------------------------------------------------------------------------------------------------
// attn_qk_norm_rope_store. One block per (head, token) over Hq query heads then Hkv key heads (a key
// block also copies its v head); one thread per dim. Latency-bound and tiny (28 blocks a decode token at
// 27B), so plainness wins over vector loads.
//
// RoPE angles are formed exactly as HF forms them in float32: inv_freq = 1 / theta^(2i/rotary_dim)
// (each step rounded to float32), angle = float(pos) * inv_freq rounded to float32, cos/sin of that
// float. Fast-math powf/sinf/cosf would lose about pos * 1e-7 rad in the angle (0.003 rad at 32k); the
// power and the cos/sin go through double precision and are rounded once to float, which matches
// torch's float32 results to an ulp whatever the build flags.
template <typename CacheT>
__global__ void qk_norm_rope_store_kernel(const float* __restrict__ qgkv, int64_t qgkv_row_stride,
                                          const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                          const int32_t* __restrict__ positions, float eps, float rope_theta,
                                          int rotary_dim, float* __restrict__ q_out, CacheT* __restrict__ k_cache,
                                          CacheT* __restrict__ v_cache, int64_t cache_row_stride,
                                          int rows_per_cache, int32_t* __restrict__ bad_position,
                                          int bad_position_stride,
                                          int num_heads, int num_kv_heads, int head_dim, int max_seq) {
  // PDL (pdl.cuh): nothing is read before the wait; qgkv is the predecessor's output.
  pdl_allow_successor();
  pdl_wait_for_predecessor();
  const int head = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
  const bool is_query = head < num_heads;
  const int kv_head = head - num_heads;
  const float* row = qgkv + t * qgkv_row_stride;
  const int k_offset = 2 * num_heads * head_dim;  // k follows the interleaved [query | gate] pairs
  const int v_offset = k_offset + num_kv_heads * head_dim;
  const float* src = is_query ? row + head * 2 * head_dim : row + k_offset + kv_head * head_dim;
  const bool active = d < head_dim;

  const float x = active ? src[d] : 0.0f;
  __shared__ float warp_sums[32];
  __shared__ float normed[1024];
  const float sum = warp_sum(x * x);
  if ((d & 31) == 0) warp_sums[d >> 5] = sum;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += warp_sums[w];
  const float weight = active ? (is_query ? q_norm[d] : k_norm[d]) : 0.0f;
  float y = x * (1.0f / sqrtf(total / (float)head_dim + eps)) * weight;
  if (active) normed[d] = y;
  __syncthreads();

  const int pos = positions[t];
  if (d < rotary_dim) {
    const int half = rotary_dim / 2;
    const bool low = d < half;
    const int i = low ? d : d - half;
    const float exponent = __fdiv_rn((float)(2 * i), (float)rotary_dim);
    const float power = (float)pow((double)rope_theta, (double)exponent);
    const float angle = __fmul_rn((float)pos, __frcp_rn(power));
    double sin_d, cos_d;
    sincos((double)angle, &sin_d, &cos_d);
    const float c = (float)cos_d, s = (float)sin_d;
    const float partner = normed[low ? d + half : d - half];
    // NEOX rotate-half: (x_i, x_{i+half}) -> (x_i c - x_{i+half} s, x_{i+half} c + x_i s)
    y = low ? __fsub_rn(__fmul_rn(y, c), __fmul_rn(partner, s)) : __fadd_rn(__fmul_rn(y, c), __fmul_rn(partner, s));
  }
  if (!active) return;
  if (is_query) {
    q_out[((int64_t)t * num_heads + head) * head_dim + d] = y;
  } else if (pos >= 0 && pos < max_seq) {
    const int64_t dst =
        (t / rows_per_cache) * cache_row_stride + ((int64_t)pos * num_kv_heads + kv_head) * head_dim + d;
    k_cache[dst] = from_float<CacheT>(y);
    v_cache[dst] = from_float<CacheT>(row[v_offset + kv_head * head_dim + d]);
  } else if (d == 0 && bad_position != nullptr) {
    // Nothing is written outside the cache; the position comes from the device (a graph replay), so the
    // error is raised on the host at its next sync, from this flag (row t's own, or the one the rows share).
    bad_position[t * bad_position_stride] = kBadPositionFlag;
  }
}

// ---------------------------------------------------------------------------------------------------
// attn_output_gate. One thread per output value and one warp per 32-value quantization block, so the
// block's amax is a warp shuffle (requires Hq*hd % 32 == 0 when quantizing, checked by the binding).
template <GateLane kLane>
__global__ void attn_output_gate_kernel(const float* __restrict__ attn, GateOutputs g, int num_tokens, int num_heads,
                                        int head_dim) {
  const int width = num_heads * head_dim;
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (int64_t)num_tokens * width) return;  // whole warps: width % 32 == 0 on the quantized lanes
  // PDL (pdl.cuh): nothing is read before the wait; attn is the predecessor's output.
  pdl_allow_successor();
  pdl_wait_for_predecessor();
  const int t = (int)(i / width), c = (int)(i - (int64_t)t * width);
  store_gated<kLane>(attn[i], gate_of(g, t, c, head_dim), t, c, i, g);
}

}  // namespace

template <typename CacheT>
cudaError_t attn_qk_norm_rope_store_launch(const AttnQkNormRopeStoreArgs<CacheT>& a, cudaStream_t stream) {
  if (a.num_tokens <= 0) return cudaSuccess;
  if (a.head_dim <= 0 || a.head_dim > 1024 || a.rotary_dim < 0 || a.rotary_dim > a.head_dim || a.rotary_dim % 2 != 0 ||
      a.rows_per_cache <= 0 || a.num_tokens % a.rows_per_cache != 0)
    return cudaErrorInvalidValue;
  const int threads = (a.head_dim + 31) / 32 * 32;
  return launch_pdl(qk_norm_rope_store_kernel<CacheT>, dim3(a.num_heads + a.num_kv_heads, a.num_tokens),
                    dim3(threads), 0, stream, a.qgkv, a.qgkv_row_stride, a.q_norm, a.k_norm, a.positions, a.eps,
                    a.rope_theta, a.rotary_dim, a.q_out, a.k_cache, a.v_cache, a.cache_row_stride, a.rows_per_cache,
                    a.bad_position, a.bad_position_stride, a.num_heads, a.num_kv_heads, a.head_dim, a.max_seq);
}

cudaError_t attn_output_gate_launch(const AttnOutputGateArgs& a, cudaStream_t stream) {
  const int64_t n = (int64_t)a.num_tokens * a.num_heads * a.head_dim;
  if (n <= 0) return cudaSuccess;
  const int threads = 256;
  const unsigned blocks = (unsigned)((n + threads - 1) / threads);
  auto kernel = a.gate.out_q == nullptr      ? attn_output_gate_kernel<GateLane::kFloat>
                : a.gate.out_q_lo == nullptr ? attn_output_gate_kernel<GateLane::kInt8>
                                             : attn_output_gate_kernel<GateLane::kInt8x2>;
  return launch_pdl(kernel, dim3(blocks), dim3(threads), 0, stream, a.attn, a.gate, a.num_tokens, a.num_heads,
                    a.head_dim);
}

template cudaError_t attn_qk_norm_rope_store_launch<float>(const AttnQkNormRopeStoreArgs<float>&, cudaStream_t);
template cudaError_t attn_qk_norm_rope_store_launch<__nv_bfloat16>(const AttnQkNormRopeStoreArgs<__nv_bfloat16>&,
                                                                   cudaStream_t);

}  // namespace qwen38
