// attention and attention_gated: split-K causal flash-decode over the KV cache with a fixed-order combine, the
// sigmoid output gate (+ activation quantization) optionally applied in the combine. attn_qk_norm_rope_store and
// the standalone attn_output_gate are attention_rope_gate.cu's.
//
// Positions live on the device (int32): every kernel reads positions[t] itself and derives what depends
// on it (the causal bound, each split's row range), so the grid is fixed at launch and one captured graph
// serves every decode position.
//
// Batched rows (attention.h: rows_per_cache consecutive rows a sequence, each sequence with its own cache) run the
// same kernels on the same grid: the blocks of token t read their cache from
// k_cache + (t / rows_per_cache) * cache_row_stride, and every row gets the decode step's kAttentionSplits splits
// whatever T, so each row computes exactly what a T = 1 call on its cache computes (a verify row's causal bound is
// its own position, read as in every mode).
#include "attention.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "attention_gate.cuh"
#include "common.cuh"
#include "pdl.cuh"

namespace qwen38 {
namespace {

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

// Rows [first_row, end_row) of a tile of the cache's head `cache_head`: rows of num_kv_heads heads of kHeadDim
// values, (row, cache_head) at (row * num_kv_heads + cache_head) * kHeadDim elements from k_cache/v_cache.
template <typename Tile, typename CacheT, int kHeadDim>
__device__ __forceinline__ void issue_tile(CacheT* stage_k, CacheT* stage_v, const CacheT* k_cache,
                                           const CacheT* v_cache, int first_row, int end_row, int num_kv_heads,
                                           int64_t cache_head) {
  constexpr int kChunks = Tile::kRows * Tile::kChunksPerRow;
#pragma unroll
  for (int c = threadIdx.x; c < kChunks; c += kAttnThreads) {
    const int local_row = c / Tile::kChunksPerRow;
    const int col = (c - local_row * Tile::kChunksPerRow) * Tile::kVecElems;
    const int row = first_row + local_row;
    const bool fill = row < end_row;
    const int64_t src = ((int64_t)(fill ? row : 0) * num_kv_heads + cache_head) * kHeadDim + col;
    const int dst = local_row * kHeadDim + col;
    cp_async<16>(stage_k + dst, k_cache + src, fill);
    cp_async<16>(stage_v + dst, v_cache + src, fill);
  }
}

template <typename CacheT, int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kAttnThreads, 2)
attention_split_kernel(const float* __restrict__ q, const CacheT* __restrict__ k_cache,
                       const CacheT* __restrict__ v_cache, int64_t cache_row_stride, int rows_per_cache,
                       const int32_t* __restrict__ positions, float scale_log2, float* __restrict__ out,
                       float* __restrict__ ws_acc, float* __restrict__ ws_ml, int num_heads, int num_kv_heads,
                       int group, int max_seq, int num_splits) {
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
  // kv_head of token t's own cache in batched rows (of the shared one at stride 0) as one head index from the
  // caches' start: (t / rows_per_cache) * max_seq * Hkv + kv_head. Folded into the index issue_tile forms anyway; as
  // a pointer offset of its own it cost an add per 16-byte copy.
  const int64_t cache_head = (int64_t)(t / rows_per_cache) * (cache_row_stride / kHeadDim) + kv_head;
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
                                         num_kv_heads, cache_head);
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
                                         begin + next * Tile::kRows, end, num_kv_heads, cache_head);
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
  return launch_pdl(attention_combine_kernel<kHeadDim, kLane>, grid, dim3(kCombineThreads), 0, stream, positions,
                    ws_acc, ws_ml, out, gate, num_heads, max_seq, num_splits, tile_rows);
}

// gate: null for attention's plain output (a.out), else the output gate fused into the combine (which then must
// run: the caller guarantees more than one split; a.out is not written). Batched rows (a.cache_row_stride != 0)
// take the same path with kAttentionSplits splits a row, any rows_per_cache.
template <typename CacheT, int kHeadDim, int kGroup>
cudaError_t launch_attention(const AttentionArgs<CacheT>& a, const GateOutputs* gate, cudaStream_t stream) {
  using Split = GroupSplit<kGroup>;
  using Tile = AttnTile<CacheT, kHeadDim, Split::kRowWarps>;
  const int num_splits = attention_num_splits(a.num_tokens, a.cache_row_stride != 0);
  constexpr int kRingBytes = kStages * Tile::kStageBytes;
  constexpr int kMergeBytes = Split::kRowWarps * kGroup * (kHeadDim + 2) * (int)sizeof(float);
  constexpr int kSmemBytes = kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes;
  auto kernel = attention_split_kernel<CacheT, kHeadDim, kGroup>;
  // Not a stream operation, so legal while a graph is being captured; idempotent, so cheap to repeat.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  float* out = gate != nullptr ? nullptr : a.out;
  float* ws_acc = a.workspace;
  float* ws_ml = a.workspace + (int64_t)a.num_tokens * a.num_heads * num_splits * kHeadDim;
  const dim3 grid(num_splits, a.num_kv_heads, a.num_tokens);
  err = launch_pdl(kernel, grid, dim3(kAttnThreads), kSmemBytes, stream, a.q, a.k_cache, a.v_cache,
                   a.cache_row_stride, a.rows_per_cache, a.positions, a.scale * kLog2e, out, ws_acc, ws_ml, a.num_heads,
                   a.num_kv_heads, a.num_heads / a.num_kv_heads, a.max_seq, num_splits);
  if (err != cudaSuccess || num_splits == 1) return err;
  const dim3 combine_grid(a.num_heads, a.num_tokens);
  const GateOutputs g = gate != nullptr ? *gate : GateOutputs{};
#define QWEN38_COMBINE(LANE)                                                                                     \
  launch_combine<kHeadDim, LANE>(combine_grid, stream, a.positions, ws_acc, ws_ml, out, g, a.num_heads, a.max_seq, \
                                 num_splits, Tile::kRows)
  if (gate == nullptr) return QWEN38_COMBINE(GateLane::kNone);
  if (g.out_q == nullptr) return QWEN38_COMBINE(GateLane::kFloat);
  if (g.out_q_lo == nullptr) return QWEN38_COMBINE(GateLane::kInt8);
  return QWEN38_COMBINE(GateLane::kInt8x2);
#undef QWEN38_COMBINE
}

template <typename CacheT, int kHeadDim>
cudaError_t dispatch_group(const AttentionArgs<CacheT>& a, const GateOutputs* gate, cudaStream_t stream) {
  // Group sizes share an instance rounded up (the surplus heads are computed on zeros and never written):
  // 1, 2, 4 (3, 4), 6 (5, 6: the 27B model), 8 (7, 8).
  const int group = a.num_heads / a.num_kv_heads;
  if (group <= 1) return launch_attention<CacheT, kHeadDim, 1>(a, gate, stream);
  if (group <= 2) return launch_attention<CacheT, kHeadDim, 2>(a, gate, stream);
  if (group <= 4) return launch_attention<CacheT, kHeadDim, 4>(a, gate, stream);
  if (group <= 6) return launch_attention<CacheT, kHeadDim, 6>(a, gate, stream);
  return launch_attention<CacheT, kHeadDim, 8>(a, gate, stream);
}

// attention_launch and attention_gated_launch: gate null for the plain output.
template <typename CacheT>
cudaError_t dispatch_head_dim(const AttentionArgs<CacheT>& a, const GateOutputs* gate, cudaStream_t stream) {
  if (a.num_tokens <= 0) return cudaSuccess;
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0 || a.num_heads / a.num_kv_heads > kAttentionMaxGroup ||
      a.rows_per_cache <= 0 || a.num_tokens % a.rows_per_cache != 0)
    return cudaErrorInvalidValue;
  switch (a.head_dim) {
    case 32: return dispatch_group<CacheT, 32>(a, gate, stream);
    case 64: return dispatch_group<CacheT, 64>(a, gate, stream);
    case 128: return dispatch_group<CacheT, 128>(a, gate, stream);
    case 256: return dispatch_group<CacheT, 256>(a, gate, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

template <typename CacheT>
cudaError_t attention_launch(const AttentionArgs<CacheT>& args, cudaStream_t stream) {
  return dispatch_head_dim(args, nullptr, stream);
}

template <typename CacheT>
cudaError_t attention_gated_launch(const AttentionGatedArgs<CacheT>& args, cudaStream_t stream) {
  const bool batched_rows = args.cache_row_stride != 0;  // any T: every row has kAttentionSplits splits
  if ((!batched_rows && args.num_tokens > kAttentionSameSplitTokens) || args.head_dim % 32 != 0)
    return cudaErrorInvalidValue;
  return dispatch_head_dim<CacheT>(args, &args.gate, stream);
}

template cudaError_t attention_launch<float>(const AttentionArgs<float>&, cudaStream_t);
template cudaError_t attention_launch<__nv_bfloat16>(const AttentionArgs<__nv_bfloat16>&, cudaStream_t);
template cudaError_t attention_gated_launch<float>(const AttentionGatedArgs<float>&, cudaStream_t);
template cudaError_t attention_gated_launch<__nv_bfloat16>(const AttentionGatedArgs<__nv_bfloat16>&, cudaStream_t);

}  // namespace qwen38
