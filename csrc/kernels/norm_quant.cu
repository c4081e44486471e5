// Producers: compute a row's float32 activation, optionally normalise it, write it, and quantise it into the
// lane the next Q8_0 GEMV reads. Decode-step kernels: T is 1 and the rows are 5120-17408 floats, so these
// are latency-bound (a few us, mostly DRAM/L2 round trips and the launch gap), not bandwidth-bound. Hence:
// - every input of a thread is loaded up front (float4, all items unrolled) and held in registers, so a
//   producer costs one round trip for its inputs, one reduction, and its stores;
// - the reduction scope is as small as the op allows: a whole block per row only for RmsNorm/AddRmsNorm;
//   one warp per head for GatedRmsNorm; one warp per 128 elements for the element-wise ops (SiluMul over
//   F = 17408 spreads across 34 blocks instead of queueing on one SM);
// - reductions are fixed trees (warp butterflies, then warp partials summed in index order): same bits on
//   every run and inside a graph;
// - PDL (pdl.cuh): the producer lets its successor (the GEMV) launch at once, so the GEMV's first weight
//   loads overlap this kernel.
//
// Quantisation (quantize.cuh, shared with attention's output gate) is bit for bit the reference's and ggml's
// quantize_row_q8_0: int8 rounds x * (1/d) with the exact float 1/d but stores d rounded to fp16, the scale
// the GEMV then multiplies by (ggml's behaviour); the two-word lane keeps s = amax/127 in float32.
// Rounding is C roundf (half away from zero). The reference writes sign(x)*floor(|x|+0.5), which differs
// from roundf only at |x| = 0.5 - 2^-25 exactly.
#include "norm_quant.h"

#include <cuda_fp16.h>

#include "common.cuh"
#include "pdl.cuh"
#include "quantize.cuh"  // the int8 / two-word block quantizers every producer shares

namespace qwen38 {
namespace {

// float4s a thread holds: 6 for a row held by <= 1024 threads (D <= 24576, kProducerMaxRow; within the 64
// registers a 1024-thread block allows), 8 for a head held by one warp (head_dim <= 1024).
template <bool ROW_SCOPE>
constexpr int kItems = ROW_SCOPE ? 6 : 8;
constexpr int kWarpScopeWarps = 4;   // warps per block for the warp-scope producers
constexpr int kElementwiseSegment = 128;  // elements per warp for Quantize / SiluMul

template <Producer OP>
constexpr bool kRowScope = OP == Producer::RmsNorm || OP == Producer::AddRmsNorm;
template <Producer OP>
constexpr bool kNormalises =
    OP == Producer::RmsNorm || OP == Producer::AddRmsNorm || OP == Producer::GatedRmsNorm;

__device__ __forceinline__ void prefetch_l1(const float* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

// A "group" of threads owns one segment of a row: the whole block and the whole row (kRowScope), or one warp
// and one head (GatedRmsNorm) / one 128-element slice (Quantize, SiluMul). Thread g of a group holds the
// float4s g, g + group_size, ... of its segment, so 8 consecutive threads hold one 32-element quant block.
template <Producer OP>
__global__ void __launch_bounds__(kRowScope<OP> ? 1024 : 32 * kWarpScopeWarps)
    produce_kernel(const ProducerArgs a) {
  constexpr int kHeld = kItems<kRowScope<OP>>;
  pdl_allow_successor();

  const int lane = threadIdx.x & 31;
  int t, seg_start, seg_len, group_size, g;
  if constexpr (kRowScope<OP>) {
    t = blockIdx.x;
    seg_start = 0;
    seg_len = a.D;
    group_size = blockDim.x;
    g = threadIdx.x;
  } else {
    const int seg_size = OP == Producer::GatedRmsNorm ? a.head_dim : kElementwiseSegment;
    const int segs_per_row = (a.D + seg_size - 1) / seg_size;
    const long long warp_id = static_cast<long long>(blockIdx.x) * kWarpScopeWarps + (threadIdx.x >> 5);
    if (warp_id >= static_cast<long long>(a.T) * segs_per_row) return;  // whole warp: no block barrier below
    t = static_cast<int>(warp_id / segs_per_row);
    seg_start = static_cast<int>(warp_id % segs_per_row) * seg_size;
    seg_len = min(seg_size, a.D - seg_start);
    group_size = 32;
    g = lane;
  }
  const size_t row = static_cast<size_t>(t);

  // The norm weight is constant: pull it into L1 while the predecessor drains, so the loads after the
  // reduction hit L1 instead of costing a second L2 round trip.
  if constexpr (kNormalises<OP>) {
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      const int e = seg_start + 4 * (g + group_size * i);
      if (e < seg_start + seg_len) prefetch_l1(a.weight + (OP == Producer::GatedRmsNorm ? e - seg_start : e));
    }
  }
  // PDL wait: before it, only the norm weight's L1 prefetch (a constant); x, residual, z and every output
  // may belong to the predecessor.
  pdl_wait_for_predecessor();

  float4 v[kHeld];
  float4 gate[kHeld];  // GatedRmsNorm: z
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    const int e = seg_start + 4 * (g + group_size * i);
    v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    gate[i] = v[i];
    if (e < seg_start + seg_len) {
      if constexpr (OP == Producer::SiluMul) {
        const float4 gt = ld4(a.x + row * a.x_stride + e), up = ld4(a.x + row * a.x_stride + a.D + e);
        v[i] = make_float4(silu(gt.x) * up.x, silu(gt.y) * up.y, silu(gt.z) * up.z, silu(gt.w) * up.w);
      } else if constexpr (OP == Producer::AddRmsNorm) {
        const float4 r = ld4(a.residual + row * a.residual_stride + e), x = ld4(a.x + row * a.x_stride + e);
        v[i] = make_float4(r.x + x.x, r.y + x.y, r.z + x.z, r.w + x.w);
        st4(a.residual + row * a.residual_stride + e, v[i]);
      } else {
        v[i] = ld4(a.x + row * a.x_stride + e);
        if constexpr (OP == Producer::GatedRmsNorm) gate[i] = ld4(a.z + row * a.z_stride + e);
      }
    }
  }

  if constexpr (kNormalises<OP>) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kHeld; ++i)
      ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
    ss = warp_sum(ss);
    if constexpr (kRowScope<OP>) {
      __shared__ float warp_sums[32];
      if (lane == 0) warp_sums[threadIdx.x >> 5] = ss;
      __syncthreads();
      ss = 0.f;
      const int warps = blockDim.x >> 5;
      for (int w = 0; w < warps; ++w) ss += warp_sums[w];  // index order: every thread gets the same bits
    }
    // 1/sqrt rounded twice, as ggml computes it (rsqrtf is a 2-ulp approximation).
    const float scale = 1.0f / sqrtf(__fdiv_rn(ss, static_cast<float>(seg_len)) + a.eps);
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      const int e = seg_start + 4 * (g + group_size * i);
      if (e < seg_start + seg_len) {
        const float4 w = ld4(a.weight + (OP == Producer::GatedRmsNorm ? e - seg_start : e));
        float4 n = make_float4(v[i].x * scale * w.x, v[i].y * scale * w.y, v[i].z * scale * w.z, v[i].w * scale * w.w);
        if constexpr (OP == Producer::GatedRmsNorm)
          n = make_float4(n.x * silu(gate[i].x), n.y * silu(gate[i].y), n.z * silu(gate[i].z), n.w * silu(gate[i].w));
        v[i] = n;
      }
    }
  }

  if constexpr (OP != Producer::Quantize) {
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      const int e = seg_start + 4 * (g + group_size * i);
      if (e < seg_start + seg_len) st4(a.out + row * a.out_stride + e, v[i]);
    }
  }

  if (a.out_q == nullptr) return;
  const bool two_word = a.out_q_lo != nullptr;
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    // Warp-uniform: skip items no lane of this warp holds (the shuffles need the whole warp).
    if (seg_start + 4 * ((g & ~31) + group_size * i) >= seg_start + seg_len) break;
    const int e = seg_start + 4 * (g + group_size * i);
    store_quantized_float4(v[i], e < seg_start + seg_len, a.out_q + row * a.out_q_stride + e,
                           two_word ? a.out_q_lo + row * a.out_q_lo_stride + e : nullptr,
                           a.out_d + row * a.out_d_stride + e / kQuantBlock);
  }
}

template <Producer OP>
cudaError_t launch(const ProducerArgs& a, cudaStream_t stream) {
  const int vecs = a.D / 4;
  if constexpr (kRowScope<OP>) {
    if (a.D > kProducerMaxRow) return cudaErrorInvalidValue;
    // ~2 float4s per thread: the quantisation after the reduction is a serial chain per item (shuffles,
    // IEEE divisions), and one block is all the parallelism a row has. From ~4 per thread, this and the
    // weight prefetch took rms_norm from 2.5 to 1.9 us and add_rms_norm + int8 from 4.5 to 3.3 us (H200).
    int threads = ((vecs + 1) / 2 + 31) / 32 * 32;
    threads = threads < 32 ? 32 : threads > 1024 ? 1024 : threads;
    if (vecs > threads * kItems<kRowScope<OP>>) return cudaErrorInvalidValue;
    return launch_pdl(produce_kernel<OP>, dim3(static_cast<unsigned>(a.T)), dim3(threads), 0, stream, a);
  } else {
    const int seg_size = OP == Producer::GatedRmsNorm ? a.head_dim : kElementwiseSegment;
    if (seg_size <= 0 || seg_size > 32 * 4 * kItems<kRowScope<OP>>) return cudaErrorInvalidValue;
    const long long warps = static_cast<long long>(a.T) * ((a.D + seg_size - 1) / seg_size);
    const long long blocks = (warps + kWarpScopeWarps - 1) / kWarpScopeWarps;
    if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
    return launch_pdl(produce_kernel<OP>, dim3(static_cast<unsigned>(blocks)), dim3(32 * kWarpScopeWarps), 0, stream,
                      a);
  }
}

}  // namespace

cudaError_t produce_activation_launch(Producer op, const ProducerArgs& args, cudaStream_t stream) {
  if (args.T == 0 || args.D == 0) return cudaSuccess;
  if (args.D % 4 != 0) return cudaErrorInvalidValue;
  if (args.out_q != nullptr && args.D % 32 != 0) return cudaErrorInvalidValue;
  if (op == Producer::GatedRmsNorm &&
      (args.head_dim <= 0 || args.head_dim % 4 != 0 || args.D % args.head_dim != 0 ||
       args.head_dim > kProducerMaxHead || (args.out_q != nullptr && args.head_dim % 32 != 0)))
    return cudaErrorInvalidValue;
  switch (op) {
    case Producer::Quantize: return launch<Producer::Quantize>(args, stream);
    case Producer::RmsNorm: return launch<Producer::RmsNorm>(args, stream);
    case Producer::AddRmsNorm: return launch<Producer::AddRmsNorm>(args, stream);
    case Producer::SiluMul: return launch<Producer::SiluMul>(args, stream);
    case Producer::GatedRmsNorm: return launch<Producer::GatedRmsNorm>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace qwen38
