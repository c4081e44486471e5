// Deterministic arg-max over the 248320 logits of the LM head, in ONE launch and with no workspace (the op
// has none): a cluster of 8 blocks, each reducing an eighth of the vector into its shared memory, then block
// 0 of the cluster combines the 8 results through distributed shared memory. One block alone would pull the
// whole 1 MB through one SM (~10 us); the cluster spreads it over 8 SMs.
//
// The comparison is a total order on (value, index) -- larger value first, NaN above all numbers, then the
// lower index -- so every reduction order yields the same winner: no reliance on traversal order, no atomics.
#include "sampling.h"

#include <climits>

#include <cooperative_groups.h>

#include "common.cuh"

namespace qwen38 {
namespace {

namespace cg = cooperative_groups;

constexpr int kClusterBlocks = 8;
constexpr int kThreads = 1024;
constexpr int kUnroll = 4;

struct Best {
  float value;
  int index;
};

__device__ __forceinline__ bool beats(float v, int i, const Best& b) {
  const bool v_nan = isnan(v), b_nan = isnan(b.value);
  if (v_nan || b_nan) return v_nan && (!b_nan || i < b.index);
  return v > b.value || (v == b.value && i < b.index);
}

__device__ __forceinline__ void offer(Best& b, float v, int i) {
  if (beats(v, i, b)) b = {v, i};
}

// offer, and note a value that is NaN or infinite.
__device__ __forceinline__ void scan(Best& b, bool& nonfinite, float v, int i) {
  offer(b, v, i);
  nonfinite |= !isfinite(v);
}

__device__ __forceinline__ Best warp_best(Best b) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(kFullMask, b.value, o);
    const int i = __shfl_xor_sync(kFullMask, b.index, o);
    offer(b, v, i);
  }
  return b;
}

__global__ void __cluster_dims__(kClusterBlocks, 1, 1) __launch_bounds__(kThreads)
    argmax_advance_kernel(const float* __restrict__ logits, int V, int32_t* token, int32_t* position,
                          SamplerBooks books) {
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  Best best = {-__int_as_float(0x7f800000), INT_MAX};
  bool nonfinite = false;

  // Scalar head up to a 16-byte boundary, float4 body split evenly over the cluster, scalar tail.
  const int head = min(V, static_cast<int>((16 - (reinterpret_cast<uintptr_t>(logits) & 15)) & 15) / 4);
  const int vecs = (V - head) / 4;
  const int tail_start = head + 4 * vecs;
  if (rank == 0 && static_cast<int>(threadIdx.x) < head) scan(best, nonfinite, logits[threadIdx.x], threadIdx.x);
  if (rank == kClusterBlocks - 1 && tail_start + static_cast<int>(threadIdx.x) < V)
    scan(best, nonfinite, logits[tail_start + threadIdx.x], tail_start + threadIdx.x);
  const float4* body = reinterpret_cast<const float4*>(logits + head);
  const int begin = static_cast<int>(static_cast<long long>(vecs) * rank / kClusterBlocks);
  const int end = static_cast<int>(static_cast<long long>(vecs) * (rank + 1) / kClusterBlocks);
  for (int base = begin + threadIdx.x; base < end; base += kThreads * kUnroll) {
    float4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * kThreads;
      v[u] = j < end ? __ldg(body + j) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * kThreads;
      if (j < end) {
        const int i = head + 4 * j;
        scan(best, nonfinite, v[u].x, i);
        scan(best, nonfinite, v[u].y, i + 1);
        scan(best, nonfinite, v[u].z, i + 2);
        scan(best, nonfinite, v[u].w, i + 3);
      }
    }
  }

  __shared__ Best warp_results[kThreads / 32];
  __shared__ Best block_result;
  __shared__ int block_nonfinite;
  best = warp_best(best);
  if ((threadIdx.x & 31) == 0) warp_results[threadIdx.x >> 5] = best;
  const int any_nonfinite = __syncthreads_or(nonfinite);
  if (threadIdx.x < 32) {
    best = warp_best(warp_results[threadIdx.x]);
    if (threadIdx.x == 0) {
      block_result = best;
      block_nonfinite = any_nonfinite;
    }
  }
  cluster.sync();
  if (rank == 0 && threadIdx.x == 0) {
    Best total = block_result;
    int total_nonfinite = block_nonfinite;
    for (int r = 1; r < kClusterBlocks; ++r) {
      const Best other = *cluster.map_shared_rank(&block_result, r);
      offer(total, other.value, other.index);
      total_nonfinite |= *cluster.map_shared_rank(&block_nonfinite, r);
    }
    token[0] = total.index;
    position[0] += 1;
    if (books.seen != nullptr) books.seen[total.index] = true;
    if (books.generated != nullptr) books.generated[total.index] = true;
    if (books.num_generated != nullptr) books.num_generated[0] += 1;
    if (books.nonfinite != nullptr && total_nonfinite) books.nonfinite[0] = true;
  }
  cluster.sync();  // keep every block's shared memory alive until block 0 has read it
}

}  // namespace

cudaError_t argmax_advance_launch(const ArgmaxAdvanceArgs& a, cudaStream_t stream) {
  if (a.V <= 0) return cudaErrorInvalidValue;
  argmax_advance_kernel<<<kClusterBlocks, kThreads, 0, stream>>>(a.logits, a.V, a.token, a.position, a.books);
  return cudaGetLastError();
}

}  // namespace qwen38
