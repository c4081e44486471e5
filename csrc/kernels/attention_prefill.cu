// Causal flash-attention prefill (FlashAttention-2 style) over the KV cache, on tensor cores.
//
// One block serves 64 query ROWS of one kv head, a row being a (token, query head of the group) pair in
// token-major order: row i is token i / G, query head kv_head * G + i % G (G = Hq / Hkv). All query heads
// of a group share the block, so each K/V tile is read once for the group (6 heads a kv head at 27B) and a
// block spans only 64 / G tokens, which keeps the masked part of the causal diagonal small. Any G works.
//
// Positions live on the device and need not be consecutive: each row masks by its own position, and the
// block walks KV tiles up to the largest context among its rows. Tiles past a row's position cost that row
// nothing but time; cache rows past the block's largest context are never read (zero-filled instead), so
// unwritten cache rows (NaN poison in the tests) cannot leak into p * v.
//
// Each of the 4 warps owns 16 rows: one m16n8k16 row block. Per KV tile of kBlockN rows:
//   S = Q K^T          (Q from shared memory by ldmatrix, K by ldmatrix: B[k=dim][n=kv row] = K[n][k])
//   online softmax     (fp32, log2 units: q is pre-scaled by scale * log2(e), so every exponential is ex2)
//   O += P V           (P re-packed from S's accumulator layout, V by ldmatrix.trans)
// O stays in registers (16 x hd floats a warp: 128 a thread at hd = 256), and S for one tile (kBlockN / 2
// a thread). K and V have one shared-memory buffer each: V(j) streams in while S = Q K(j)^T is formed, and
// K(j+1) while O += P V(j) (FlashAttention-2's schedule; half the shared memory of a ring of K|V stages).
//
// Precision lanes, by cache dtype:
// - bfloat16: q and p rounded to bf16 for the MMAs (flash-attention's usual precision), fp32 accumulate.
// - float32 (the exactness lane): every operand is split x = hi + lo, hi = bf16(x), lo = bf16(x - hi)
//   (|x - hi - lo| <= 2^-16 |x|), and a product is hi*hi + hi*lo + lo*hi (the dropped lo*lo is <= 2^-16 of
//   it): three MMAs, ~6e-6 relative (kFloatPlanes). The float32 tile lands raw (cp.async) in a staging
//   buffer and is split once per block into bf16 hi and lo planes, so the MMA loop is the bf16 loop run
//   over pairs of planes.
//
// Shared memory rows are padded by 16 bytes (hd + 8 bf16): the 8 row addresses of an ldmatrix then fall
// on 8 distinct groups of 4 banks for every supported hd.
//
// Split-K (gridDim.z = splits > 1, chosen by attention_prefill_num_splits from the shapes): the block of
// split s walks only tiles [n s / splits, n (s + 1) / splits) of the n tiles its rows need (n is known on
// the device only, from the positions; a split may get none) and stores each row's unnormalized O with its
// running max m and sum l in the workspace. The combine kernel then forms, for each row, in split order,
//   M = max_s m_s,  out = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) l_s
// skipping splits that saw no visible cache row of the row (m_s = -inf, O_s not stored). Without a split
// the block walks all n tiles and stores O / l itself, in the float order it always had.
#include "attention_prefill.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common.cuh"

namespace qwen38 {
namespace {

constexpr int kBlockM = kAttentionPrefillRows;
constexpr int kWarps = kBlockM / 16;  // one m16 row block per warp
constexpr int kThreads = kWarps * 32;

// bf16 planes a float32 operand is split into: 2 (hi + lo, three MMAs a product) measures ~6e-6 relative
// (rel L2, CPU emulation of this kernel); 3 (six MMAs, 16-row KV tiles at hd = 256) would take it to the
// float32 accumulation's own ~1e-7.
constexpr int kFloatPlanes = 2;

template <typename CacheT, int kHeadDim>
struct PrefillTile {
  static constexpr bool kSplit = sizeof(CacheT) == 4;  // float32 cache: staged raw, split into planes
  static constexpr int kPlanes = kSplit ? kFloatPlanes : 1;
  // KV rows per tile, as shared memory allows. At hd = 256: bf16 Q + K + V planes 99 KB (two blocks an SM);
  // float32 (2 planes, 32-row tiles) Q 66 KB + K, V 33 KB each + raw staging 32 KB = 164 KB (one block).
  static constexpr int kBlockN = kPlanes * kHeadDim <= 256 ? 64 : (kPlanes * kHeadDim <= 512 ? 32 : 16);
  static constexpr int kStride = kHeadDim + 8;  // bf16 elements per shared-memory row (16-byte pad)
  static constexpr int kQPlane = kBlockM * kStride;
  static constexpr int kKVPlane = kBlockN * kStride;
  static constexpr int kRawBytes = kSplit ? kBlockN * kHeadDim * (int)sizeof(float) : 0;
  static constexpr int kSmemBytes = (kPlanes * (kQPlane + 2 * kKVPlane)) * (int)sizeof(__nv_bfloat16) + kRawBytes;
  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0, "MMA tiles are 16 deep");
};

__device__ __forceinline__ int context_length(int pos, int max_seq) {
  return pos < 0 ? 0 : (pos >= max_seq ? max_seq : pos + 1);
}

// ---- PTX wrapper (PTX ISA: mma.m16n8k16 with .bf16 operands; cp.async and ldmatrix are common.cuh's) ----------

// d[16x8] += a[16x16] b[16x8]. With g = lane / 4, c = lane % 4: a = {(g, 2c..2c+1), (g+8, 2c..), (g, 2c+8..),
// (g+8, 2c+8..)}, b = {(k 2c..2c+1, n g), (k 2c+8.., n g)}, d = {(g, 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1)}.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (x0, x1) -> kPlanes bf16x2 words: word p = bf16 of what words 0..p-1 left (each remainder is exact in
// float), so the words sum to x within 2^(-8 kPlanes) |x|: hi alone (1), hi + lo (2), ... The first element
// sits in the low half, as the MMA fragments and ldmatrix order them.
template <int kPlanes>
__device__ __forceinline__ void split_bf16x2(float x0, float x1, unsigned (&words)[kPlanes]) {
#pragma unroll
  for (int p = 0; p < kPlanes; ++p) {
    const __nv_bfloat162 w = __floats2bfloat162_rn(x0, x1);
    const float2 wf = __bfloat1622float2(w);
    words[p] = *reinterpret_cast<const unsigned*>(&w);
    x0 -= wf.x;
    x1 -= wf.y;
  }
}

// Four consecutive values into plane 0 at `dst` and plane p `p * plane` elements later.
template <int kPlanes>
__device__ __forceinline__ void store_planes(__nv_bfloat16* dst, int plane, float4 x) {
  unsigned w01[kPlanes], w23[kPlanes];
  split_bf16x2<kPlanes>(x.x, x.y, w01);
  split_bf16x2<kPlanes>(x.z, x.w, w23);
#pragma unroll
  for (int p = 0; p < kPlanes; ++p) *reinterpret_cast<uint2*>(dst + p * plane) = make_uint2(w01[p], w23[p]);
}

// Two n-tiles, d0 += a b0 and d1 += a b1 (b0 = words 0, 1 and b1 = words 2, 3 of an x4 load of B), over the
// plane products whose orders sum below kPlanes (hi*hi; + hi*lo + lo*hi for two planes): the dropped
// products are below 2^(-8 kPlanes) of the result.
template <int kPlanes>
__device__ __forceinline__ void mma_planes(float (&d0)[4], float (&d1)[4], const unsigned (&a)[kPlanes][4],
                                           const unsigned (&b)[kPlanes][4]) {
#pragma unroll
  for (int pa = 0; pa < kPlanes; ++pa)
#pragma unroll
    for (int pb = 0; pa + pb < kPlanes; ++pb) {
      mma_bf16(d0, a[pa], b[pb][0], b[pb][1]);
      mma_bf16(d1, a[pa], b[pb][2], b[pb][3]);
    }
}

// ---- tiles -----------------------------------------------------------------------------------------------

// Cache rows [first, first + kRows) of one kv head -> dst (row stride kDstStride elements), 16-byte
// cp.async chunks; rows >= end are zero-filled without being read.
template <int kRows, int kHeadDim, int kDstStride, typename CacheT>
__device__ __forceinline__ void load_tile_async(CacheT* dst, const CacheT* __restrict__ cache, int first, int end,
                                                int num_kv_heads, int kv_head) {
  constexpr int kVec = 16 / (int)sizeof(CacheT);
  constexpr int kChunksPerRow = kHeadDim / kVec;
  static_assert(kRows * kChunksPerRow % kThreads == 0, "every thread copies the same number of chunks");
  // Unrolled by 4, not fully: the 16 64-bit source addresses at hd = 256 pushed the float32 instance to
  // spills (ptxas -v), and the bf16 hd = 256 instance from 232 to 255 registers.
#pragma unroll 4
  for (int k = 0; k < kRows * kChunksPerRow / kThreads; ++k) {
    const int chunk = k * kThreads + threadIdx.x;
    const int r = chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * kVec;
    const int row = first + r;
    const bool fill = row < end;
    const CacheT* src = cache + ((int64_t)(fill ? row : 0) * num_kv_heads + kv_head) * kHeadDim + col;
    cp_async<16>(dst + r * kDstStride + col, src, fill);
  }
}

// float32 lane: the raw staged tile [kRows][hd] -> bf16 hi and lo planes (row stride kStride).
template <typename Tile, int kRows, int kHeadDim>
__device__ __forceinline__ void split_tile(__nv_bfloat16* planes, const float* raw) {
  constexpr int kQuads = kHeadDim / 4;
  static_assert(kRows * kQuads % kThreads == 0, "every thread splits the same number of quads");
  // 4 quads in flight, not all 16 (hd = 256): 64 more live registers beside O spilled (ptxas -v).
#pragma unroll 4
  for (int k = 0; k < kRows * kQuads / kThreads; ++k) {
    const int quad = k * kThreads + threadIdx.x;
    const int r = quad / kQuads, col = (quad % kQuads) * 4;
    const float4 x = *reinterpret_cast<const float4*>(raw + r * kHeadDim + col);
    store_planes<Tile::kPlanes>(planes + r * Tile::kStride + col, kRows * Tile::kStride, x);
  }
}

// ---------------------------------------------------------------------------------------------------------
// The kernel. Grid (Hkv, ceil(T * G / 64), splits); the row blocks run last-first: with increasing positions
// the last tokens have the longest contexts, and starting them first shortens the tail of the launch.
template <typename CacheT, int kHeadDim>
__global__ void __launch_bounds__(kThreads)
attention_prefill_kernel(const float* __restrict__ q,            // [T, Hq, hd]
                         const CacheT* __restrict__ k_cache,     // [max_seq, Hkv, hd]
                         const CacheT* __restrict__ v_cache,     // [max_seq, Hkv, hd]
                         const int32_t* __restrict__ positions,  // [T]
                         float scale_log2,                       // scale * log2(e)
                         float* __restrict__ out,                // [T, Hq, hd] (no split)
                         float* __restrict__ partial_o,          // [splits, T * Hq, hd] (split-K)
                         float* __restrict__ partial_ml,         // [splits, T * Hq, 2]: (m, l) (split-K)
                         int num_tokens, int num_heads, int num_kv_heads, int max_seq) {
  using Tile = PrefillTile<CacheT, kHeadDim>;
  constexpr bool kSplit = Tile::kSplit;
  constexpr int kPlanes = Tile::kPlanes, kBlockN = Tile::kBlockN, kStride = Tile::kStride;
  extern __shared__ __align__(16) unsigned char smem[];
  __nv_bfloat16* q_planes = reinterpret_cast<__nv_bfloat16*>(smem);  // [planes][64][kStride]
  __nv_bfloat16* k_planes = q_planes + kPlanes * Tile::kQPlane;        // [planes][kBlockN][kStride]
  __nv_bfloat16* v_planes = k_planes + kPlanes * Tile::kKVPlane;       // [planes][kBlockN][kStride]
  float* raw = reinterpret_cast<float*>(v_planes + kPlanes * Tile::kKVPlane);  // [kBlockN][hd], float32 lane
  __shared__ int row_ctx[kBlockM];   // cache rows each row of the block sees (0: a row past T * G)
  __shared__ int row_head[kBlockM];  // token * Hq + query head: where the row's q and out live (-1: past T * G)

  const int group = num_heads / num_kv_heads;
  const int kv_head = blockIdx.x;
  const int first_row = (gridDim.y - 1 - blockIdx.y) * kBlockM;
  if (threadIdx.x < kBlockM) {
    const int i = first_row + threadIdx.x, token = i / group;
    const bool valid = token < num_tokens;
    row_ctx[threadIdx.x] = valid ? context_length(positions[token], max_seq) : 0;
    row_head[threadIdx.x] = valid ? token * num_heads + kv_head * group + i % group : -1;
  }
  __syncthreads();
  int block_ctx = 0;
  for (int r = 0; r < kBlockM; ++r) block_ctx = max(block_ctx, row_ctx[r]);
  // This block's tiles: all of them, or the split's even share (dealt by a formula of the shapes and the
  // positions only, so the same call splits the same way every time).
  const int num_tiles = (block_ctx + kBlockN - 1) / kBlockN, split = blockIdx.z, num_splits = gridDim.z;
  const int tile_begin = (int)((int64_t)num_tiles * split / num_splits);
  const int tile_end = (int)((int64_t)num_tiles * (split + 1) / num_splits);

  // q * scale * log2(e) into the Q planes (rows past T * G are zeros).
  constexpr int kQuads = kHeadDim / 4;
  static_assert(kBlockM * kQuads % kThreads == 0, "every thread loads the same number of quads");
#pragma unroll
  for (int k = 0; k < kBlockM * kQuads / kThreads; ++k) {
    const int quad = k * kThreads + threadIdx.x;
    const int r = quad / kQuads, col = (quad % kQuads) * 4;
    float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (row_head[r] >= 0) {
      x = *reinterpret_cast<const float4*>(q + (int64_t)row_head[r] * kHeadDim + col);
      x = make_float4(x.x * scale_log2, x.y * scale_log2, x.z * scale_log2, x.w * scale_log2);
    }
    store_planes<kPlanes>(q_planes + r * kStride + col, Tile::kQPlane, x);
  }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;  // the MMA fragment's row group and column pair (see mma_bf16)
  const int ctx[2] = {row_ctx[warp * 16 + g], row_ctx[warp * 16 + g + 8]};  // this thread's two rows
  const int warp_min_ctx = __reduce_min_sync(kFullMask, min(ctx[0], ctx[1]));

  // ldmatrix row addresses of this lane. Q (A operand) and V (B operand, transposed) take matrices in the
  // order (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15) of a
  // 16x16 block: registers a0..a3 of Q, and b0, b1 of two 8-dim n-tiles of V. K (B operand, rows = kv rows
  // = n) takes (n 0-7, dims 0-7), (n 0-7, dims 8-15), (n 8-15, dims 0-7), (n 8-15, dims 8-15): b0, b1 of two
  // 8-row n-tiles.
  const int ld_row = (lane & 7) + ((lane >> 3) & 1) * 8, ld_col = (lane >> 4) * 8;
  const __nv_bfloat16* q_lane = q_planes + (warp * 16 + ld_row) * kStride + ld_col;
  const __nv_bfloat16* k_lane = k_planes + ((lane & 7) + (lane >> 4) * 8) * kStride + ((lane >> 3) & 1) * 8;
  const __nv_bfloat16* v_lane = v_planes + ld_row * kStride + ld_col;

  float o[kHeadDim / 8][4];  // O n-tile j (dims 8j..8j+7) in the accumulator layout of mma_bf16
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g and g + 8; l is this thread's part

  // Where cp.async lands K and V tiles: straight into the planes (bf16), or the raw staging buffer (float32).
  constexpr int kLandStride = kSplit ? kHeadDim : kStride;
  CacheT* k_land = kSplit ? reinterpret_cast<CacheT*>(raw) : reinterpret_cast<CacheT*>(k_planes);
  CacheT* v_land = kSplit ? reinterpret_cast<CacheT*>(raw) : reinterpret_cast<CacheT*>(v_planes);
  load_tile_async<kBlockN, kHeadDim, kLandStride>(k_land, k_cache, tile_begin * kBlockN, block_ctx, num_kv_heads,
                                                  kv_head);
  cp_async_commit();

  for (int tile = tile_begin; tile < tile_end; ++tile) {
    const int kv_first = tile * kBlockN;
    cp_async_wait<0>();
    __syncthreads();  // K(tile) landed; every warp is done with V(tile - 1)
    if constexpr (kSplit) {
      split_tile<Tile, kBlockN, kHeadDim>(k_planes, raw);
      __syncthreads();  // K planes visible, the staging buffer free
    }
    load_tile_async<kBlockN, kHeadDim, kLandStride>(v_land, v_cache, kv_first, block_ctx, num_kv_heads, kv_head);
    cp_async_commit();

    // S = Q K^T: s[j] holds kv rows kv_first + 8j.., in log2 units.
    float s[kBlockN / 8][4];
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      unsigned qa[kPlanes][4];
#pragma unroll
      for (int p = 0; p < kPlanes; ++p) ldmatrix_x4(qa[p], q_lane + p * Tile::kQPlane + kk * 16);
#pragma unroll
      for (int j = 0; j < kBlockN / 8; j += 2) {
        unsigned kb[kPlanes][4];
#pragma unroll
        for (int p = 0; p < kPlanes; ++p) ldmatrix_x4(kb[p], k_lane + p * Tile::kKVPlane + j * 8 * kStride + kk * 16);
        mma_planes<kPlanes>(s[j], s[j + 1], qa, kb);
      }
    }

    // Causal mask by each row's own context (only tiles reaching past some row's last position).
    if (kv_first + kBlockN > warp_min_ctx) {
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (kv_first + j * 8 + 2 * c + (e & 1) >= ctx[e >> 1]) s[j][e] = -INFINITY;
        }
    }

    // Online softmax per row h (g, g + 8): m = running max over the row (the 4 threads of a quad hold it),
    // p = 2^(s - m), l and O rescaled by 2^(m_old - m). m = -inf while a row has seen no visible cache row:
    // the reference 0 keeps p and the rescale at exactly 0 (never -inf - -inf).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = m[h];
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) tile_max = fmaxf(tile_max, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
      const float m_ref = tile_max == -INFINITY ? 0.0f : tile_max;
      const float correction = exp2f(m[h] - m_ref);
      m[h] = tile_max;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        s[j][2 * h] = exp2f(s[j][2 * h] - m_ref);
        s[j][2 * h + 1] = exp2f(s[j][2 * h + 1] - m_ref);
        sum += s[j][2 * h] + s[j][2 * h + 1];
      }
      l[h] = l[h] * correction + sum;
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) {
        o[j][2 * h] *= correction;
        o[j][2 * h + 1] *= correction;
      }
    }

    cp_async_wait<0>();
    __syncthreads();  // V(tile) landed; every warp is done with K(tile)
    if constexpr (kSplit) {
      split_tile<Tile, kBlockN, kHeadDim>(v_planes, raw);
      __syncthreads();  // V planes visible, the staging buffer free
    }
    if (tile + 1 < tile_end)
      load_tile_async<kBlockN, kHeadDim, kLandStride>(k_land, k_cache, kv_first + kBlockN, block_ctx, num_kv_heads,
                                                      kv_head);
    cp_async_commit();

    // O += P V over the tile's kv rows 16 at a time: the S accumulators of n-tiles 2kk and 2kk+1 are
    // exactly the A fragment of P for rows kv_first + 16kk.. (a0 = s[2kk] row g, a1 = row g+8, a2, a3 the
    // same of s[2kk+1]).
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      unsigned pw[4][kPlanes], pa[kPlanes][4];
      split_bf16x2<kPlanes>(s[2 * kk][0], s[2 * kk][1], pw[0]);
      split_bf16x2<kPlanes>(s[2 * kk][2], s[2 * kk][3], pw[1]);
      split_bf16x2<kPlanes>(s[2 * kk + 1][0], s[2 * kk + 1][1], pw[2]);
      split_bf16x2<kPlanes>(s[2 * kk + 1][2], s[2 * kk + 1][3], pw[3]);
#pragma unroll
      for (int p = 0; p < kPlanes; ++p)
#pragma unroll
        for (int r = 0; r < 4; ++r) pa[p][r] = pw[r][p];
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; j += 2) {
        unsigned vb[kPlanes][4];
#pragma unroll
        for (int p = 0; p < kPlanes; ++p)
          ldmatrix_x4_trans(vb[p], v_lane + p * Tile::kKVPlane + kk * 16 * kStride + j * 8);
        if constexpr (kSplit) {
          // The exactness lane adds each 16-row step into O with a float add: accumulated inside the MMA
          // over a whole 32k context, O drifted to rel L2 1.1e-4 (measured, e1114f6), the tensor core's
          // fp32 sums not being round-to-nearest.
          float t0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, t1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          mma_planes<kPlanes>(t0, t1, pa, vb);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            o[j][e] += t0[e];
            o[j + 1][e] += t1[e];
          }
        } else {
          mma_planes<kPlanes>(o[j], o[j + 1], pa, vb);
        }
      }
    }
  }
  cp_async_wait<0>();

  // out = O / l, l summed over the quad. l = 0 only for rows that see no cache row (past T * G: not stored).
  // Split-K: O, m and l as they are, for the combine (O only where the row saw a cache row: m > -inf; m is
  // the same in the 4 threads of the quad).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(kFullMask, l[h], 1);
    l[h] += __shfl_xor_sync(kFullMask, l[h], 2);
    const int head = row_head[warp * 16 + g + 8 * h];
    if (head < 0) continue;
    if (num_splits > 1) {
      const int64_t slot = (int64_t)split * num_tokens * num_heads + head;
      if (c == 0) *reinterpret_cast<float2*>(partial_ml + 2 * slot) = make_float2(m[h], l[h]);
      if (m[h] == -INFINITY) continue;
      float* dst = partial_o + slot * kHeadDim + 2 * c;
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j)
        *reinterpret_cast<float2*>(dst + j * 8) = make_float2(o[j][2 * h], o[j][2 * h + 1]);
      continue;
    }
    const float inv_l = 1.0f / l[h];
    float* dst = out + (int64_t)head * kHeadDim + 2 * c;
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j)
      *reinterpret_cast<float2*>(dst + j * 8) = make_float2(o[j][2 * h] * inv_l, o[j][2 * h + 1] * inv_l);
  }
}

// Split-K combine: one row (token, query head) per kHeadDim / 4 threads, a float4 of out each; the splits
// in order 0, 1, ..., so the sums are formed the same way every call.
constexpr int kCombineThreads = 128;

template <int kHeadDim>
__global__ void __launch_bounds__(kCombineThreads)
attention_prefill_combine_kernel(const float* __restrict__ partial_o,   // [splits, T * Hq, hd]
                                 const float* __restrict__ partial_ml,  // [splits, T * Hq, 2]
                                 float* __restrict__ out,               // [T * Hq, hd]
                                 int num_rows, int num_splits) {
  constexpr int kRowThreads = kHeadDim / 4;
  const int row = blockIdx.x * (kCombineThreads / kRowThreads) + threadIdx.x / kRowThreads;
  if (row >= num_rows) return;
  const int col = (threadIdx.x % kRowThreads) * 4;
  const float2* ml = reinterpret_cast<const float2*>(partial_ml) + row;
  float m_max = -INFINITY;
  for (int s = 0; s < num_splits; ++s) m_max = fmaxf(m_max, ml[(int64_t)s * num_rows].x);
  float l = 0.0f;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int s = 0; s < num_splits; ++s) {
    const float2 part = ml[(int64_t)s * num_rows];
    if (part.x == -INFINITY) continue;  // no visible cache row in this split: O_s was not stored
    const float w = exp2f(part.x - m_max);
    const float4 o = *reinterpret_cast<const float4*>(partial_o + ((int64_t)s * num_rows + row) * kHeadDim + col);
    l += w * part.y;
    acc = make_float4(acc.x + w * o.x, acc.y + w * o.y, acc.z + w * o.z, acc.w + w * o.w);
  }
  // l = 0 only for a row that sees no cache row at all (a negative position): NaN, as without a split.
  const float inv_l = 1.0f / l;
  *reinterpret_cast<float4*>(out + (int64_t)row * kHeadDim + col) =
      make_float4(acc.x * inv_l, acc.y * inv_l, acc.z * inv_l, acc.w * inv_l);
}

// No PDL (pdl.cuh): the kernels have no griddepcontrol.wait.
template <typename CacheT, int kHeadDim>
cudaError_t launch_prefill(const AttentionArgs<CacheT>& a, cudaStream_t stream) {
  using Tile = PrefillTile<CacheT, kHeadDim>;
  auto kernel = attention_prefill_kernel<CacheT, kHeadDim>;
  // Not a stream operation, so legal while a graph is being captured; idempotent, so cheap to repeat.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int64_t rows = (int64_t)a.num_tokens * (a.num_heads / a.num_kv_heads);
  const int64_t row_blocks = (rows + kBlockM - 1) / kBlockM;
  if (row_blocks > 65535) return cudaErrorInvalidValue;
  const int splits = attention_prefill_num_splits(a.num_tokens, a.num_heads, a.num_kv_heads);
  const int64_t num_rows = (int64_t)a.num_tokens * a.num_heads;  // (token, query head) rows of out
  float* partial_o = splits > 1 ? a.workspace : nullptr;
  float* partial_ml = splits > 1 ? a.workspace + splits * num_rows * kHeadDim : nullptr;
  const dim3 grid(a.num_kv_heads, (unsigned)row_blocks, splits);
  kernel<<<grid, kThreads, Tile::kSmemBytes, stream>>>(a.q, a.k_cache, a.v_cache, a.positions, a.scale * kLog2e,
                                                       a.out, partial_o, partial_ml, a.num_tokens, a.num_heads,
                                                       a.num_kv_heads, a.max_seq);
  err = cudaGetLastError();
  if (err != cudaSuccess || splits == 1) return err;
  constexpr int kRowsPerBlock = kCombineThreads / (kHeadDim / 4);
  const int64_t combine_blocks = (num_rows + kRowsPerBlock - 1) / kRowsPerBlock;
  attention_prefill_combine_kernel<kHeadDim><<<(unsigned)combine_blocks, kCombineThreads, 0, stream>>>(
      partial_o, partial_ml, a.out, (int)num_rows, splits);
  return cudaGetLastError();
}

}  // namespace

template <typename CacheT>
cudaError_t attention_prefill_launch(const AttentionArgs<CacheT>& args, cudaStream_t stream) {
  if (args.num_tokens <= 0) return cudaSuccess;
  if (args.cache_row_stride != 0 || args.num_kv_heads <= 0 || args.num_heads % args.num_kv_heads != 0)
    return cudaErrorInvalidValue;
  switch (args.head_dim) {
    case 32: return launch_prefill<CacheT, 32>(args, stream);
    case 64: return launch_prefill<CacheT, 64>(args, stream);
    case 128: return launch_prefill<CacheT, 128>(args, stream);
    case 256: return launch_prefill<CacheT, 256>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

template cudaError_t attention_prefill_launch<float>(const AttentionArgs<float>&, cudaStream_t);
template cudaError_t attention_prefill_launch<__nv_bfloat16>(const AttentionArgs<__nv_bfloat16>&, cudaStream_t);

}  // namespace qwen38
