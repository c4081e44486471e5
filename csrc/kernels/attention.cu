// Gated full attention: QK RMSNorm + partial NEOX RoPE + KV store, split-K flash-decode with a
// fixed-order combine, sigmoid output gate (+ activation quantization).
//
// Positions live on the device (int32): every kernel reads positions[t] itself and derives what depends
// on it (the cache row to store, the causal bound, each split's row range), so the grid is fixed at
// launch and one captured graph serves every decode position.
#include "attention.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "pdl.cuh"
#include "quantize.cuh"

namespace qwen38 {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

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
                                          CacheT* __restrict__ v_cache, int32_t* __restrict__ bad_position,
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
    const int64_t dst = ((int64_t)pos * num_kv_heads + kv_head) * head_dim + d;
    k_cache[dst] = from_float<CacheT>(y);
    v_cache[dst] = from_float<CacheT>(row[v_offset + kv_head * head_dim + d]);
  } else if (d == 0 && bad_position != nullptr) {
    // Nothing is written outside the cache; the position comes from the device (a graph replay), so the
    // error is raised on the host at its next sync, from this flag.
    *bad_position = 1;
  }
}

// ---------------------------------------------------------------------------------------------------
// attention: split-K flash-decode.
//
// Grid (split, kv head, token). A block streams its split's cache rows of ONE kv head and serves all G
// query heads of that group from the same bytes (GQA: the cache is read once per kv head, not G times).
// Rows come in through a kStages-deep cp.async ring of tiles (16-byte copies, L1 bypassed), so a block
// keeps two tiles (32-64 KB at the 27B shape) in flight without spending registers on them: the
// registers go to q and the accumulators of the query heads. With T = 1 the grid is 64 splits x Hkv
// blocks (256 at 27B), one wave at two blocks an SM.
//
// Inside a tile each lane owns kElems = 8 dims of a row (one 16-byte bf16 vector, or two float4 at
// hd/2 apart so the float32 shared-memory reads stay conflict-free); hd/8 lanes cover a row, so a warp
// takes 32/(hd/8) rows at once (1 at hd=256, 8 at hd=32). Each lane group keeps its own online-softmax
// state (m, l, acc) per head; scores for kRowSteps rows are formed first so the running max and the
// rescale of acc happen once per tile, not once per row. At the end the lane groups merge by shuffles
// and the warps through shared memory, always in the same order: no atomics, bit-reproducible.
//
// Groups of more than 2 query heads are split over 2 warps that read the same shared-memory rows
// (GroupSplit): q and acc of 6 heads alone take 96 registers a thread, and at ~200 registers one block
// of 8 warps filled an SM (measured, bf16 cache, 32k context: 73 us a layer, 41% of the read probe,
// about 1.6 instructions a cycle). Halved, a thread stays under 128 registers and two blocks share an
// SM; the second warp of a pair re-reads the row from shared memory, not from HBM.
//
// Scores are kept in log2 units (q pre-scaled by scale*log2(e)) so every exponential is one ex2.
constexpr int kAttnWarps = 8;
constexpr int kAttnThreads = kAttnWarps * 32;
constexpr int kElems = 8;
constexpr int kRowSteps = 4;
constexpr int kStages = 3;

template <int kGroup>
struct GroupSplit {
  static constexpr int kParts = kGroup <= 2 ? 1 : 2;        // warps sharing one row
  static constexpr int kHeadsPerWarp = kGroup / kParts;     // buckets 1, 2, 4, 6, 8 divide evenly
  static constexpr int kRowWarps = kAttnWarps / kParts;     // warps on distinct rows
  static_assert(kGroup % kParts == 0, "group bucket must split evenly");
};

// Which dims of a cache row each lane holds (independent of how many rows a tile has).
template <typename CacheT, int kHeadDim>
struct RowLayout {
  static constexpr int kLanesPerRow = kHeadDim / kElems;
  static constexpr int kRowsPerWarp = 32 / kLanesPerRow;
  static constexpr int kVecElems = 16 / (int)sizeof(CacheT);  // elements per 16-byte vector
  static constexpr int kVecs = kElems / kVecElems;            // 16-byte vectors per lane per row
  static constexpr int kChunksPerRow = kHeadDim / kVecElems;
  // dims of vector j of the lane at position `lane_in_row` of its row group
  __device__ static int dim(int j, int lane_in_row) { return j * (kHeadDim / kVecs) + lane_in_row * kVecElems; }
  static_assert(kLanesPerRow >= 1 && kLanesPerRow <= 32 && kVecs >= 1, "unsupported head_dim");
};

template <typename CacheT, int kHeadDim, int kRowWarps>
struct AttnTile : RowLayout<CacheT, kHeadDim> {
  static constexpr int kRows = kRowSteps * kRowWarps * RowLayout<CacheT, kHeadDim>::kRowsPerWarp;
  static constexpr int kCacheBytes = kRows * kHeadDim * (int)sizeof(CacheT);  // K (or V) of one tile
  static constexpr int kStageBytes = 2 * kCacheBytes;
};

// Rows of one split: splits cover ceil(ctx / num_splits) rows each but never fewer than a tile, so a
// short context runs on fewer, fuller splits; blocks of splits past the last one exit at once. The
// attention kernel and the combine compute this identically from positions[t].
struct SplitRange {
  int rows_per_split;
  int active_splits;
};
__device__ __forceinline__ int context_length(const int32_t* positions, int t, int max_seq) {
  const int pos = positions[t];
  return pos < 0 ? 0 : (pos >= max_seq ? max_seq : pos + 1);
}
__device__ __forceinline__ SplitRange split_range(int ctx, int num_splits, int min_rows) {
  SplitRange r;
  r.rows_per_split = max((ctx + num_splits - 1) / num_splits, min_rows);
  r.active_splits = (ctx + r.rows_per_split - 1) / r.rows_per_split;
  return r;
}

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* global_src, bool fill) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = fill ? 16 : 0;  // 0: the 16 bytes are zero-filled, nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(global_src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

template <typename CacheT, int kVecElems>
__device__ __forceinline__ void load_vec_as_float(const CacheT* p, float* out);
template <>
__device__ __forceinline__ void load_vec_as_float<float, 4>(const float* p, float* out) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  out[0] = x.x; out[1] = x.y; out[2] = x.z; out[3] = x.w;
}
template <>
__device__ __forceinline__ void load_vec_as_float<__nv_bfloat16, 8>(const __nv_bfloat16* p, float* out) {
  const uint4 x = *reinterpret_cast<const uint4*>(p);
  const unsigned w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // bfloat16 is the high half of a float32: widening is a shift
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

template <typename CacheT, int kHeadDim>
__device__ __forceinline__ void load_row_elems(const CacheT* row, int lane_in_row, float (&out)[kElems]) {
  using Tile = RowLayout<CacheT, kHeadDim>;
#pragma unroll
  for (int j = 0; j < Tile::kVecs; ++j)
    load_vec_as_float<CacheT, Tile::kVecElems>(row + Tile::dim(j, lane_in_row), out + j * Tile::kVecElems);
}

template <typename Tile, typename CacheT, int kHeadDim>
__device__ __forceinline__ void issue_tile(CacheT* stage_k, CacheT* stage_v, const CacheT* k_cache,
                                           const CacheT* v_cache, int first_row, int end_row, int num_kv_heads,
                                           int kv_head) {
  constexpr int kChunks = Tile::kRows * Tile::kChunksPerRow;
#pragma unroll
  for (int c = threadIdx.x; c < kChunks; c += kAttnThreads) {
    const int local_row = c / Tile::kChunksPerRow;
    const int col = (c - local_row * Tile::kChunksPerRow) * Tile::kVecElems;
    const int row = first_row + local_row;
    const bool fill = row < end_row;
    const int64_t src = ((int64_t)(fill ? row : 0) * num_kv_heads + kv_head) * kHeadDim + col;
    const int dst = local_row * kHeadDim + col;
    cp_async_16(stage_k + dst, k_cache + src, fill);
    cp_async_16(stage_v + dst, v_cache + src, fill);
  }
}

template <typename CacheT, int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kAttnThreads, 2)
attention_split_kernel(const float* __restrict__ q, const CacheT* __restrict__ k_cache,
                       const CacheT* __restrict__ v_cache, const int32_t* __restrict__ positions,
                       float scale_log2, float* __restrict__ out, float* __restrict__ ws_acc,
                       float* __restrict__ ws_ml, int num_heads, int num_kv_heads, int group, int max_seq,
                       int num_splits) {
  using Split = GroupSplit<kGroup>;
  using Tile = AttnTile<CacheT, kHeadDim, Split::kRowWarps>;
  constexpr int kHeads = Split::kHeadsPerWarp;  // query heads this warp serves
  extern __shared__ __align__(16) unsigned char smem[];
  // PDL (pdl.cuh): nothing is read before the wait; q and this token's K/V rows are the predecessor's.
  pdl_allow_successor();
  pdl_wait_for_predecessor();
  const int split = blockIdx.x, kv_head = blockIdx.y, t = blockIdx.z;
  const int ctx = context_length(positions, t, max_seq);
  const SplitRange range = split_range(ctx, num_splits, Tile::kRows);
  if (split >= range.active_splits) return;  // block-uniform, before any barrier
  const int begin = split * range.rows_per_split;
  const int end = min(begin + range.rows_per_split, ctx);
  const int num_tiles = (end - begin + Tile::kRows - 1) / Tile::kRows;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row_group = lane / Tile::kLanesPerRow, lane_in_row = lane % Tile::kLanesPerRow;
  const int row_warp = warp / Split::kParts;
  const int part_first = (warp % Split::kParts) * kHeads;  // this warp's first head within the group
  const int first_head = kv_head * group;

  auto stage_k = [&](int s) { return reinterpret_cast<CacheT*>(smem + s * Tile::kStageBytes); };
  auto stage_v = [&](int s) { return reinterpret_cast<CacheT*>(smem + s * Tile::kStageBytes + Tile::kCacheBytes); };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles)
      issue_tile<Tile, CacheT, kHeadDim>(stage_k(s), stage_v(s), k_cache, v_cache, begin + s * Tile::kRows, end,
                                         num_kv_heads, kv_head);
    cp_async_commit();
  }

  float qv[kHeads][kElems];
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    if (part_first + g < group) {
      const float* qh = q + ((int64_t)t * num_heads + first_head + part_first + g) * kHeadDim;
#pragma unroll
      for (int j = 0; j < Tile::kVecs; ++j) {
        load_vec_as_float<float, 4>(qh + Tile::dim(j, lane_in_row), qv[g] + j * Tile::kVecElems);
        if constexpr (Tile::kVecElems == 8)
          load_vec_as_float<float, 4>(qh + Tile::dim(j, lane_in_row) + 4, qv[g] + j * Tile::kVecElems + 4);
      }
#pragma unroll
      for (int e = 0; e < kElems; ++e) qv[g][e] *= scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < kElems; ++e) qv[g][e] = 0.0f;
    }
  }

  float m[kHeads], l[kHeads], acc[kHeads][kElems];
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[g][e] = 0.0f;
  }

  for (int tile = 0; tile < num_tiles; ++tile) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // the tile is visible to all warps, and the stage refilled below is free
    const int next = tile + kStages - 1;
    if (next < num_tiles)
      issue_tile<Tile, CacheT, kHeadDim>(stage_k(next % kStages), stage_v(next % kStages), k_cache, v_cache,
                                         begin + next * Tile::kRows, end, num_kv_heads, kv_head);
    cp_async_commit();

    const CacheT* tk = stage_k(tile % kStages);
    const CacheT* tv = stage_v(tile % kStages);
    const int tile_first = begin + tile * Tile::kRows;
    float score[kRowSteps][kHeads];
#pragma unroll
    for (int j = 0; j < kRowSteps; ++j) {
      const int local_row = (j * Split::kRowWarps + row_warp) * Tile::kRowsPerWarp + row_group;
      float kr[kElems];
      load_row_elems<CacheT, kHeadDim>(tk + local_row * kHeadDim, lane_in_row, kr);
#pragma unroll
      for (int g = 0; g < kHeads; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < kElems; ++e) dot += qv[g][e] * kr[e];
        score[j][g] = dot;
      }
    }
#pragma unroll
    for (int offset = Tile::kLanesPerRow / 2; offset > 0; offset >>= 1) {
#pragma unroll
      for (int j = 0; j < kRowSteps; ++j)
#pragma unroll
        for (int g = 0; g < kHeads; ++g) score[j][g] += __shfl_xor_sync(kFullMask, score[j][g], offset);
    }
#pragma unroll
    for (int j = 0; j < kRowSteps; ++j) {
      const int local_row = (j * Split::kRowWarps + row_warp) * Tile::kRowsPerWarp + row_group;
      if (tile_first + local_row >= end) {
#pragma unroll
        for (int g = 0; g < kHeads; ++g) score[j][g] = -INFINITY;
      }
    }
#pragma unroll
    for (int g = 0; g < kHeads; ++g) {
      float tile_max = score[0][g];
#pragma unroll
      for (int j = 1; j < kRowSteps; ++j) tile_max = fmaxf(tile_max, score[j][g]);
      const float m_new = fmaxf(m[g], tile_max);
      // m_new = -inf only while this lane group has seen no visible row: keep everything at zero.
      const float m_ref = m_new == -INFINITY ? 0.0f : m_new;
      const float correction = exp2f(m[g] - m_ref);
      m[g] = m_new;
      l[g] *= correction;
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[g][e] *= correction;
#pragma unroll
      for (int j = 0; j < kRowSteps; ++j) score[j][g] = exp2f(score[j][g] - m_ref);
    }
#pragma unroll
    for (int j = 0; j < kRowSteps; ++j) {
      const int local_row = (j * Split::kRowWarps + row_warp) * Tile::kRowsPerWarp + row_group;
      float vr[kElems];
      load_row_elems<CacheT, kHeadDim>(tv + local_row * kHeadDim, lane_in_row, vr);
#pragma unroll
      for (int g = 0; g < kHeads; ++g) {
        l[g] += score[j][g];
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[g][e] += score[j][g] * vr[e];
      }
    }
  }
  cp_async_wait<0>();

  // Merge the row groups of the warp (butterfly; lanes of group 0 end with the warp's result).
#pragma unroll
  for (int offset = Tile::kLanesPerRow; offset < 32; offset <<= 1) {
#pragma unroll
    for (int g = 0; g < kHeads; ++g) {
      const float m_other = __shfl_xor_sync(kFullMask, m[g], offset);
      const float l_other = __shfl_xor_sync(kFullMask, l[g], offset);
      const float m_new = fmaxf(m[g], m_other);
      const float m_ref = m_new == -INFINITY ? 0.0f : m_new;
      const float mine = exp2f(m[g] - m_ref), theirs = exp2f(m_other - m_ref);
      m[g] = m_new;
      l[g] = l[g] * mine + l_other * theirs;
#pragma unroll
      for (int e = 0; e < kElems; ++e) {
        const float acc_other = __shfl_xor_sync(kFullMask, acc[g][e], offset);
        acc[g][e] = acc[g][e] * mine + acc_other * theirs;
      }
    }
  }

  // Merge the warps through shared memory (the ring is free once every warp is past its last tile).
  __syncthreads();
  float* merge_acc = reinterpret_cast<float*>(smem);                      // [row warps][kGroup][hd]
  float* merge_ml = merge_acc + Split::kRowWarps * kGroup * kHeadDim;     // [row warps][kGroup][2]
  if (row_group == 0) {
#pragma unroll
    for (int g = 0; g < kHeads; ++g) {
      const int slot = row_warp * kGroup + part_first + g;
      float* dst = merge_acc + slot * kHeadDim;
#pragma unroll
      for (int j = 0; j < Tile::kVecs; ++j)
#pragma unroll
        for (int e = 0; e < Tile::kVecElems; ++e) dst[Tile::dim(j, lane_in_row) + e] = acc[g][j * Tile::kVecElems + e];
      if (lane_in_row == 0) {
        merge_ml[slot * 2] = m[g];
        merge_ml[slot * 2 + 1] = l[g];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < group * kHeadDim; idx += kAttnThreads) {
    const int g = idx / kHeadDim, d = idx - g * kHeadDim;
    float m_all = -INFINITY;
    for (int w = 0; w < Split::kRowWarps; ++w) m_all = fmaxf(m_all, merge_ml[(w * kGroup + g) * 2]);
    const float m_ref = m_all == -INFINITY ? 0.0f : m_all;
    float l_all = 0.0f, acc_all = 0.0f;
    for (int w = 0; w < Split::kRowWarps; ++w) {
      const float weight = exp2f(merge_ml[(w * kGroup + g) * 2] - m_ref);
      l_all += merge_ml[(w * kGroup + g) * 2 + 1] * weight;
      acc_all += merge_acc[(w * kGroup + g) * kHeadDim + d] * weight;
    }
    const int head = first_head + g;
    if (num_splits == 1) {
      out[((int64_t)t * num_heads + head) * kHeadDim + d] = acc_all / l_all;
    } else {
      const int64_t part = ((int64_t)t * num_heads + head) * num_splits + split;
      ws_acc[part * kHeadDim + d] = acc_all;
      if (d == 0) {
        ws_ml[part * 2] = m_all;
        ws_ml[part * 2 + 1] = l_all;
      }
    }
  }
}

// The sigmoid output gate (attn_output_gate, and fused into the combine by attention_gated): out = attn *
// sigmoid(gate), gate from qgkv's interleaved [query_h | gate_h] rows, plus the int8 / two-word int8 form the
// o_proj GEMV reads. kNone: the combine writes attention's plain output.
enum class GateLane { kNone, kFloat, kInt8, kInt8x2 };

__device__ __forceinline__ float gate_of(const GateOutputs& g, int t, int c, int head_dim) {
  const int head = c / head_dim, d = c - head * head_dim;
  return g.qgkv[t * g.qgkv_row_stride + (int64_t)head * 2 * head_dim + head_dim + d];
}

// Value c of row t (flat index i = t * Hq*hd + c). The 32 lanes of the calling warp must hold one quantization
// block (32 consecutive c of one row): its amax is a warp shuffle.
template <GateLane kLane>
__device__ __forceinline__ void store_gated(float attn, float gate, int t, int c, int64_t i, const GateOutputs& g) {
  const float y = attn * (1.0f / (1.0f + expf(-gate)));
  g.out[t * g.out_row_stride + c] = y;
  if constexpr (kLane == GateLane::kInt8 || kLane == GateLane::kInt8x2) {
    store_quantized_lane<kLane == GateLane::kInt8x2>(y, &g.out_q[i], kLane == GateLane::kInt8x2 ? &g.out_q_lo[i] : nullptr,
                                                    &g.out_d[i / kQuantBlock]);
  }
}

// The fixed-order combine of the splits of one (token, query head): weights 2^(m_s - max m), summed in
// split order. The per-split (m, l) pairs are fetched by one thread each into shared memory first, and
// every partial accumulator a thread needs is in flight at once: the combine is latency-bound (its
// data, <= 64 x Hq x hd floats, was just written to L2), so what counts is round trips to L2.
constexpr int kCombineThreads = 256;

// With a gate lane it also applies the output gate (attention_gated: one launch fewer a layer); a warp's 32
// values of d are then one quantization block (head_dim % 32 == 0).
template <int kHeadDim, GateLane kLane>
__global__ void __launch_bounds__(kCombineThreads)
attention_combine_kernel(const int32_t* __restrict__ positions, const float* __restrict__ ws_acc,
                         const float* __restrict__ ws_ml, float* __restrict__ out, GateOutputs gate, int num_heads,
                         int max_seq, int num_splits, int tile_rows) {
  constexpr int head_dim = kHeadDim;  // compile-time, so the 64 partial addresses are immediate offsets
  __shared__ float split_max[kAttentionSplits], split_sum[kAttentionSplits], split_weight[kAttentionSplits];
  // PDL (pdl.cuh): nothing is read before the wait; the splits' partials are the predecessor's.
  pdl_allow_successor();
  pdl_wait_for_predecessor();
  const int head = blockIdx.x, t = blockIdx.y;
  const int ctx = context_length(positions, t, max_seq);
  const int active = split_range(ctx, num_splits, tile_rows).active_splits;  // <= num_splits <= 64
  const int64_t first = ((int64_t)t * num_heads + head) * num_splits;
  for (int s = threadIdx.x; s < active; s += blockDim.x) {
    split_max[s] = ws_ml[(first + s) * 2];
    split_sum[s] = ws_ml[(first + s) * 2 + 1];
  }
  __syncthreads();
  float m_all = -INFINITY;
  for (int s = 0; s < active; ++s) m_all = fmaxf(m_all, split_max[s]);
  const float m_ref = m_all == -INFINITY ? 0.0f : m_all;
  for (int s = threadIdx.x; s < active; s += blockDim.x) split_weight[s] = exp2f(split_max[s] - m_ref);
  __syncthreads();
  float l_all = 0.0f;
  for (int s = 0; s < active; ++s) l_all += split_sum[s] * split_weight[s];
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    // All of a thread's partials are loaded before the first is used: one L2 round trip, not one per
    // handful of splits. (With a loop unrolled by 8, a 1k-context decode measured 17.6 us once short
    // contexts used all 64 splits, against 11.1 us with 32; this form was not yet measured.)
    const float* partials = ws_acc + first * head_dim + d;
    float part[kAttentionSplits];
#pragma unroll
    for (int s = 0; s < kAttentionSplits; ++s) part[s] = s < active ? partials[s * head_dim] : 0.0f;
    const int64_t i = ((int64_t)t * num_heads + head) * head_dim + d;
    const float gate_value = kLane == GateLane::kNone ? 0.0f : gate_of(gate, t, head * head_dim + d, head_dim);
    float acc_all = 0.0f;
#pragma unroll
    for (int s = 0; s < kAttentionSplits; ++s) {
      if (s < active) acc_all += part[s] * split_weight[s];
    }
    if constexpr (kLane == GateLane::kNone) {
      out[i] = acc_all / l_all;
    } else {
      store_gated<kLane>(acc_all / l_all, gate_value, t, head * head_dim + d, i, gate);
    }
  }
}

template <int kHeadDim, GateLane kLane>
cudaError_t launch_combine(dim3 grid, cudaStream_t stream, const int32_t* positions, const float* ws_acc,
                           const float* ws_ml, float* out, const GateOutputs& gate, int num_heads, int max_seq,
                           int num_splits, int tile_rows) {
  return launch_maybe_pdl(attention_combine_kernel<kHeadDim, kLane>, grid, dim3(kCombineThreads), 0, stream,
                          pdl_enabled(), positions, ws_acc, ws_ml, out, gate, num_heads, max_seq, num_splits,
                          tile_rows);
}

// gate: null for attention's plain output, else the output gate fused into the combine (which then must run:
// the caller guarantees more than one split).
template <typename CacheT, int kHeadDim, int kGroup>
cudaError_t launch_attention(const float* q, const CacheT* k_cache, const CacheT* v_cache, const int32_t* positions,
                             float scale, float* out, const GateOutputs* gate, float* workspace, int num_tokens,
                             int num_heads, int num_kv_heads, int max_seq, cudaStream_t stream) {
  using Split = GroupSplit<kGroup>;
  using Tile = AttnTile<CacheT, kHeadDim, Split::kRowWarps>;
  const int num_splits = attention_num_splits(num_tokens);
  constexpr int kRingBytes = kStages * Tile::kStageBytes;
  constexpr int kMergeBytes = Split::kRowWarps * kGroup * (kHeadDim + 2) * (int)sizeof(float);
  constexpr int kSmemBytes = kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes;
  auto kernel = attention_split_kernel<CacheT, kHeadDim, kGroup>;
  // Not a stream operation, so legal while a graph is being captured; idempotent, so cheap to repeat.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  float* ws_acc = workspace;
  float* ws_ml = workspace + (int64_t)num_tokens * num_heads * num_splits * kHeadDim;
  const dim3 grid(num_splits, num_kv_heads, num_tokens);
  err = launch_maybe_pdl(kernel, grid, dim3(kAttnThreads), kSmemBytes, stream, pdl_enabled(), q, k_cache, v_cache,
                         positions, scale * kLog2e, out, ws_acc, ws_ml, num_heads, num_kv_heads,
                         num_heads / num_kv_heads, max_seq, num_splits);
  if (err != cudaSuccess || num_splits == 1) return err;
  const dim3 combine_grid(num_heads, num_tokens);
  const GateOutputs g = gate != nullptr ? *gate : GateOutputs{};
#define QWEN38_COMBINE(LANE) \
  launch_combine<kHeadDim, LANE>(combine_grid, stream, positions, ws_acc, ws_ml, out, g, num_heads, max_seq, \
                                 num_splits, Tile::kRows)
  if (gate == nullptr) return QWEN38_COMBINE(GateLane::kNone);
  if (g.out_q == nullptr) return QWEN38_COMBINE(GateLane::kFloat);
  if (g.out_q_lo == nullptr) return QWEN38_COMBINE(GateLane::kInt8);
  return QWEN38_COMBINE(GateLane::kInt8x2);
#undef QWEN38_COMBINE
}

template <typename CacheT, int kHeadDim>
cudaError_t dispatch_group(const float* q, const CacheT* k_cache, const CacheT* v_cache, const int32_t* positions,
                           float scale, float* out, const GateOutputs* gate, float* workspace, int num_tokens,
                           int num_heads, int num_kv_heads, int max_seq, cudaStream_t stream) {
  // Group sizes share an instance rounded up (the surplus heads are computed on zeros and never written):
  // 1, 2, 4 (3, 4), 6 (5, 6: the 27B model), 8 (7, 8).
  const int group = num_heads / num_kv_heads;
#define QWEN38_ATTN_GROUP(G)                                                                                 \
  return launch_attention<CacheT, kHeadDim, G>(q, k_cache, v_cache, positions, scale, out, gate, workspace, \
                                               num_tokens, num_heads, num_kv_heads, max_seq, stream)
  if (group <= 1) QWEN38_ATTN_GROUP(1);
  if (group <= 2) QWEN38_ATTN_GROUP(2);
  if (group <= 4) QWEN38_ATTN_GROUP(4);
  if (group <= 6) QWEN38_ATTN_GROUP(6);
  QWEN38_ATTN_GROUP(8);
#undef QWEN38_ATTN_GROUP
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
cudaError_t attn_qk_norm_rope_store_launch(const float* qgkv, int64_t qgkv_row_stride, const float* q_norm,
                                           const float* k_norm, const int32_t* positions, float eps,
                                           float rope_theta, int rotary_dim, float* q_out, CacheT* k_cache,
                                           CacheT* v_cache, int32_t* bad_position, int num_tokens, int num_heads,
                                           int num_kv_heads, int head_dim, int max_seq, cudaStream_t stream) {
  if (num_tokens <= 0) return cudaSuccess;
  if (head_dim <= 0 || head_dim > 1024 || rotary_dim < 0 || rotary_dim > head_dim || rotary_dim % 2 != 0)
    return cudaErrorInvalidValue;
  const int threads = (head_dim + 31) / 32 * 32;
  return launch_maybe_pdl(qk_norm_rope_store_kernel<CacheT>, dim3(num_heads + num_kv_heads, num_tokens),
                          dim3(threads), 0, stream, pdl_enabled(), qgkv, qgkv_row_stride, q_norm, k_norm, positions,
                          eps, rope_theta, rotary_dim, q_out, k_cache, v_cache, bad_position, num_heads,
                          num_kv_heads, head_dim, max_seq);
}

// attention_launch and attention_gated_launch: gate null for the plain output.
template <typename CacheT>
cudaError_t dispatch_head_dim(const float* q, const CacheT* k_cache, const CacheT* v_cache, const int32_t* positions,
                              float scale, float* out, const GateOutputs* gate, float* workspace, int num_tokens,
                              int num_heads, int num_kv_heads, int head_dim, int max_seq, cudaStream_t stream) {
  if (num_tokens <= 0) return cudaSuccess;
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > kAttentionMaxGroup)
    return cudaErrorInvalidValue;
#define QWEN38_ATTN_HEAD_DIM(D)                                                                              \
  case D:                                                                                                     \
    return dispatch_group<CacheT, D>(q, k_cache, v_cache, positions, scale, out, gate, workspace, num_tokens,\
                                     num_heads, num_kv_heads, max_seq, stream);
  switch (head_dim) {
    QWEN38_ATTN_HEAD_DIM(32)
    QWEN38_ATTN_HEAD_DIM(64)
    QWEN38_ATTN_HEAD_DIM(128)
    QWEN38_ATTN_HEAD_DIM(256)
#undef QWEN38_ATTN_HEAD_DIM
    default: return cudaErrorInvalidValue;
  }
}

template <typename CacheT>
cudaError_t attention_launch(const float* q, const CacheT* k_cache, const CacheT* v_cache, const int32_t* positions,
                             float scale, float* out, float* workspace, int num_tokens, int num_heads,
                             int num_kv_heads, int head_dim, int max_seq, cudaStream_t stream) {
  return dispatch_head_dim(q, k_cache, v_cache, positions, scale, out, nullptr, workspace, num_tokens, num_heads,
                           num_kv_heads, head_dim, max_seq, stream);
}

template <typename CacheT>
cudaError_t attention_gated_launch(const float* q, const CacheT* k_cache, const CacheT* v_cache,
                                   const int32_t* positions, float scale, const GateOutputs& gate, float* workspace,
                                   int num_tokens, int num_heads, int num_kv_heads, int head_dim, int max_seq,
                                   cudaStream_t stream) {
  if (num_tokens > kAttentionSameSplitTokens || head_dim % 32 != 0) return cudaErrorInvalidValue;
  return dispatch_head_dim(q, k_cache, v_cache, positions, scale, nullptr, &gate, workspace, num_tokens, num_heads,
                           num_kv_heads, head_dim, max_seq, stream);
}

cudaError_t attn_output_gate_launch(const float* attn, const GateOutputs& gate, int num_tokens, int num_heads,
                                    int head_dim, cudaStream_t stream) {
  const int64_t n = (int64_t)num_tokens * num_heads * head_dim;
  if (n <= 0) return cudaSuccess;
  const int threads = 256;
  const unsigned blocks = (unsigned)((n + threads - 1) / threads);
  auto kernel = gate.out_q == nullptr      ? attn_output_gate_kernel<GateLane::kFloat>
                : gate.out_q_lo == nullptr ? attn_output_gate_kernel<GateLane::kInt8>
                                           : attn_output_gate_kernel<GateLane::kInt8x2>;
  return launch_maybe_pdl(kernel, dim3(blocks), dim3(threads), 0, stream, pdl_enabled(), attn, gate, num_tokens,
                          num_heads, head_dim);
}

template cudaError_t attn_qk_norm_rope_store_launch<float>(const float*, int64_t, const float*, const float*,
                                                           const int32_t*, float, float, int, float*, float*,
                                                           float*, int32_t*, int, int, int, int, int, cudaStream_t);
template cudaError_t attn_qk_norm_rope_store_launch<__nv_bfloat16>(const float*, int64_t, const float*,
                                                                   const float*, const int32_t*, float, float, int,
                                                                   float*, __nv_bfloat16*, __nv_bfloat16*, int32_t*,
                                                                   int, int, int, int, int, cudaStream_t);
template cudaError_t attention_launch<float>(const float*, const float*, const float*, const int32_t*, float, float*,
                                             float*, int, int, int, int, int, cudaStream_t);
template cudaError_t attention_launch<__nv_bfloat16>(const float*, const __nv_bfloat16*, const __nv_bfloat16*,
                                                     const int32_t*, float, float*, float*, int, int, int, int, int,
                                                     cudaStream_t);
template cudaError_t attention_gated_launch<float>(const float*, const float*, const float*, const int32_t*, float,
                                                   const GateOutputs&, float*, int, int, int, int, int, cudaStream_t);
template cudaError_t attention_gated_launch<__nv_bfloat16>(const float*, const __nv_bfloat16*, const __nv_bfloat16*,
                                                           const int32_t*, float, const GateOutputs&, float*, int, int,
                                                           int, int, int, cudaStream_t);

}  // namespace qwen38
