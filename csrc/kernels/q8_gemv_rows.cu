// The int8 lane's Q8_0 GEMV for many rows of x (a batched decode step, a speculative verify): every weight byte
// read once for all rows of a tile, the block dots on the tensor cores, and each row's sum in the T = 1 GEMV's
// exact order, so every row is bitwise what q8_gemv.cu computes for it alone (the batch-invariance contract).
//
// Why this shape.
// - Registers, not shared memory. The form before this one staged 8 KB pieces in a cp.async ring and took
//   fragments by ldmatrix: ncu found it issue-bound (~135 instructions a warp and 512-byte piece, a block barrier
//   a piece, 0.46 instructions a cycle a scheduler, DRAM 30%), and no pipe was busy (NOTES, "The rows kernel,
//   round 3"). Here each lane loads its weight bytes straight into the mma's A registers, as the T = 1 GEMV
//   loads them (it streams at 88% of the read probe without a barrier): no copy, no ldmatrix, no barrier in
//   the loop, and each warp runs ahead on its own.
// - The k order is ours to choose: a block's int32 dot is the same whatever order its 32 products are summed in,
//   so A and B may hold any permutation of k as long as it is the same one. Lane (group, quad) loads 16
//   contiguous bytes at 16 quad of its warp's 64-byte window (two blocks) of weight rows group and group + 8,
//   and the same 16 bytes of x row group; its first 8 bytes go to one mma's k slots (quad * 4, 16 + quad * 4),
//   the next 8 to a second mma's. The lanes with quad < 2 then hold the window's first block, the others the
//   second, so the B operand of block 0's two mmas is zeroed in lanes quad >= 2 and block 1's in quad < 2: four
//   mmas for two blocks, each half used. The tensor cores have that to spare; the issue slots do not.
// - Each output then costs what the GEMV spends on it: fma(int_to_double(s), double(wd * xd), acc), with the
//   int -> double by one DADD (the bias 2^31 of int_to_double's trick rides in the mma's accumulator input) and
//   wd * xd exact in fp32 (both are fp16 values: 11 + 11 significant bits, as the int8 producers write them).
// - The GEMV's order (q8_gemv.cu): block b of a row goes to partial sum ("chain") b mod (16 * PARTS), each chain
//   summed in block order; then for each part q the 16 chains 16q + m are added by the xor butterfly over m
//   (m with m ^ 8, then ^ 4, ^ 2, ^ 1), and the parts in order. Warp (part q, window w) takes the pieces p = q,
//   q + PARTS, .. in order, and blocks 2w and 2w + 1 of each: it owns chains 16q + 2w and 16q + 2w + 1, summed in
//   the GEMV's order by one lane per output. At the end the chains meet in shared memory and one thread per
//   output adds them in the GEMV's butterfly and part order.
// - Tile: 16 weight rows x 8 rows of x a block (one m16n8 tile); more rows of x run in more blocks, x fastest, so
//   the blocks that share a weight tile run together and read it from HBM once, the others from L2. Rows past N
//   and rows of x past T repeat the last row (valid addresses, cached): their outputs are not stored, and in an
//   mma a row of A or a column of B changes only its own outputs.
#include "q8_gemv.h"

#include <cooperative_groups.h>
#include <cstdlib>

#include "common.cuh"
#include "pdl.cuh"
#include "q8_loads.cuh"

namespace qwen38 {
namespace {

namespace cg = cooperative_groups;

constexpr int kWindows = 8;  // 64-byte windows of a 512-byte piece, a warp each

constexpr int kRowsThreads = 32 * kWindows;

// d = a . b + c for one m16n8k32 s8 tile (int32, exact).
__device__ __forceinline__ void mma_s8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                       const int (&c)[4]) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]), "r"(c[2]),
        "r"(c[3]));
}

// What a lane holds of one piece: its 16 bytes of weight rows group and group + 8 and of x row group, the
// window's two block scales of those weight rows and of x rows 2 quad and 2 quad + 1 (its outputs' columns).
struct Piece {
  int4 w_lo, w_hi, x;
  __half2 wd_lo, wd_hi;
  float2 xd0, xd1;
};

// This lane's element offsets of piece 0 (32-bit: q8_0_gemv_rows_supported keeps N * K and T * x_stride below
// 2^31); piece p adds 512 p to the byte offsets and 16 p to the scale offsets.
struct LaneOffsets {
  uint32_t w_lo, w_hi, x, wd_lo, wd_hi, xd0, xd1;
};

__device__ __forceinline__ void load_weights(Piece& s, const Q8GemvArgs& a, const LaneOffsets& o, int p) {
  s.w_lo = load_weights16(a.weight_q + o.w_lo + 512 * p);
  s.w_hi = load_weights16(a.weight_q + o.w_hi + 512 * p);
  s.wd_lo = load_weight_scales2(a.weight_d + o.wd_lo + 16 * p);
  s.wd_hi = load_weight_scales2(a.weight_d + o.wd_hi + 16 * p);
}

__device__ __forceinline__ void load_x(Piece& s, const Q8GemvArgs& a, const LaneOffsets& o, int p) {
  s.x = load_act16(reinterpret_cast<const int4*>(static_cast<const int8_t*>(a.x) + o.x + 512 * p));
  s.xd0 = load_act_scales2(a.x_d + o.xd0 + 16 * p);
  s.xd1 = load_act_scales2(a.x_d + o.xd1 + 16 * p);
}

// acc += the GEMV's terms of one block for this lane's four outputs: c from an mma biased by 2^31 (see
// int_to_double), wd the block's scales of weight rows group and group + 8, xd those of its two rows of x.
__device__ __forceinline__ void scale_add(double (&acc)[4], const int (&c)[4], float wd_lo, float wd_hi, float xd0,
                                          float xd1) {
  const auto to_double = [](int biased) { return __hiloint2double(0x43300000, biased) - 4503601774854144.0; };
  acc[0] = fma(to_double(c[0]), static_cast<double>(wd_lo * xd0), acc[0]);
  acc[1] = fma(to_double(c[1]), static_cast<double>(wd_lo * xd1), acc[1]);
  acc[2] = fma(to_double(c[2]), static_cast<double>(wd_hi * xd0), acc[2]);
  acc[3] = fma(to_double(c[3]), static_cast<double>(wd_hi * xd1), acc[3]);
}

// The window's two blocks of one piece into chains acc[0] (block 2w) and acc[1] (block 2w + 1).
__device__ __forceinline__ void compute_piece(double (&acc)[2][4], const Piece& s, bool first_block) {
  const uint32_t x[4] = {static_cast<uint32_t>(s.x.x), static_cast<uint32_t>(s.x.y), static_cast<uint32_t>(s.x.z),
                         static_cast<uint32_t>(s.x.w)};
  uint32_t x0[4], x1[4];  // x in the k slots of block 0 (this lane's, if first_block) and of block 1
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x0[i] = first_block ? x[i] : 0u;
    x1[i] = first_block ? 0u : x[i];
  }
  const uint32_t a0[4] = {static_cast<uint32_t>(s.w_lo.x), static_cast<uint32_t>(s.w_hi.x),
                          static_cast<uint32_t>(s.w_lo.y), static_cast<uint32_t>(s.w_hi.y)};
  const uint32_t a1[4] = {static_cast<uint32_t>(s.w_lo.z), static_cast<uint32_t>(s.w_hi.z),
                          static_cast<uint32_t>(s.w_lo.w), static_cast<uint32_t>(s.w_hi.w)};
  constexpr int kBias = static_cast<int>(0x80000000u);
  const int bias[4] = {kBias, kBias, kBias, kBias};
  int c0[4], c1[4];
  mma_s8(c0, a0, x0[0], x0[1], bias);
  mma_s8(c0, a1, x0[2], x0[3], c0);
  mma_s8(c1, a0, x1[0], x1[1], bias);
  mma_s8(c1, a1, x1[2], x1[3], c1);
  const float2 wd_lo = __half22float2(s.wd_lo), wd_hi = __half22float2(s.wd_hi);
  scale_add(acc[0], c0, wd_lo.x, wd_hi.x, s.xd0.x, s.xd1.x);
  scale_add(acc[1], c1, wd_lo.y, wd_hi.y, s.xd0.y, s.xd1.y);
}

// The kernel body for the pieces of one part; PARTS > 1 runs the parts as the blocks of a cluster (blockIdx.z).
template <int PARTS, int kAhead>
__device__ __forceinline__ void gemv_rows(const Q8GemvArgs& a) {
  __shared__ double partial[16][16][8];  // [chain m of the part][weight row][row of x]
  __shared__ double part_sum[16][8];     // the part's butterfly total of each output
  pdl_allow_successor();
  const int lane = threadIdx.x & 31, window = threadIdx.x >> 5, part = PARTS == 1 ? 0 : blockIdx.z;
  const int group = lane >> 2, quad = lane & 3;
  const int row0 = blockIdx.y * 16, col0 = blockIdx.x * 8;
  const int blocks = a.K >> 5, pieces = blocks >> 4;  // K % 512 == 0 (q8_0_gemv_rows_supported)

  const auto weight_row = [&](int r) { return static_cast<uint32_t>(min(row0 + r, a.N - 1)); };
  const auto x_row = [&](int r) { return static_cast<uint32_t>(min(col0 + r, a.T - 1)); };
  const uint32_t byte = 64 * window + 16 * quad;
  LaneOffsets o;
  o.w_lo = weight_row(group) * a.K + byte;
  o.w_hi = weight_row(group + 8) * a.K + byte;
  o.x = x_row(group) * static_cast<uint32_t>(a.x_stride) + byte;
  o.wd_lo = weight_row(group) * blocks + 2 * window;
  o.wd_hi = weight_row(group + 8) * blocks + 2 * window;
  o.xd0 = x_row(2 * quad) * static_cast<uint32_t>(a.x_d_stride) + 2 * window;
  o.xd1 = x_row(2 * quad + 1) * static_cast<uint32_t>(a.x_d_stride) + 2 * window;
  const bool first_block = quad < 2;

  double acc[2][4];
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[b][e] = 0.0;

  // kAhead pieces in flight a warp beyond the one computed, weights and x alike (measured at 1 ahead, x loaded when
  // computed: 1.5-1.9x the T = 1 time at T = 2, the warps waiting on each piece's x from L2 and on too few weight
  // bytes in flight). The weights do not depend on the predecessor: the first pieces' are issued before the wait.
  Piece ring[kAhead + 1];
#pragma unroll
  for (int u = 0; u < kAhead; ++u)
    if (part + u * PARTS < pieces) load_weights(ring[u], a, o, part + u * PARTS);
  pdl_wait_for_predecessor();  // x, x_d and out may belong to the predecessor
#pragma unroll
  for (int u = 0; u < kAhead; ++u)
    if (part + u * PARTS < pieces) load_x(ring[u], a, o, part + u * PARTS);
  for (int p0 = part; p0 < pieces; p0 += (kAhead + 1) * PARTS) {
#pragma unroll
    for (int u = 0; u <= kAhead; ++u) {
      const int p = p0 + u * PARTS, ahead = p + kAhead * PARTS;
      if (p >= pieces) break;  // warp-uniform
      if (ahead < pieces) {
        load_weights(ring[(u + kAhead) % (kAhead + 1)], a, o, ahead);
        load_x(ring[(u + kAhead) % (kAhead + 1)], a, o, ahead);
      }
      compute_piece(acc, ring[u], first_block);
    }
  }

  // One thread per output adds the part's 16 chains in the GEMV's butterfly order (m + (m ^ 8), then ^ 4, ^ 2,
  // ^ 1; float addition commutes, so each pair is the GEMV's); block 0 of the cluster then adds the parts in order.
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int e = 0; e < 4; ++e) partial[2 * window + b][group + 8 * (e >> 1)][2 * quad + (e & 1)] = acc[b][e];
  __syncthreads();
  const int out_row = threadIdx.x & 15, out_col = threadIdx.x >> 4;
  const bool owns_output = threadIdx.x < 16 * 8;
  if (owns_output) {
    double v[16];
#pragma unroll
    for (int m = 0; m < 16; ++m) v[m] = partial[m][out_row][out_col];
#pragma unroll
    for (int m = 0; m < 8; ++m) v[m] = v[m] + v[m + 8];
#pragma unroll
    for (int m = 0; m < 4; ++m) v[m] = v[m] + v[m + 4];
#pragma unroll
    for (int m = 0; m < 2; ++m) v[m] = v[m] + v[m + 2];
    part_sum[out_row][out_col] = v[0] + v[1];
  }
  double total = 0.0;
  if constexpr (PARTS == 1) {
    __syncthreads();
    total = part_sum[out_row][out_col];
  } else {
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every part's sums written
    if (part == 0 && owns_output) {
#pragma unroll
      for (int q = 0; q < PARTS; ++q) {
        const double v = cluster.map_shared_rank(&part_sum[0][0], q)[out_row * 8 + out_col];
        total = q == 0 ? v : total + v;
      }
    }
    cluster.sync();  // no block leaves while block 0 reads its shared memory
    if (part != 0) return;
  }
  const int row = row0 + out_row, col = col0 + out_col;
  if (owns_output && row < a.N && col < a.T) a.out[static_cast<size_t>(col) * a.out_stride + row] = static_cast<float>(total);
}

// EXPLORATION (to be removed once measured): QWEN38_Q8_GEMV_ROWS_AHEAD = 1, 2 or 3 pieces in flight a warp.
template <int kAhead>
__global__ void __launch_bounds__(kRowsThreads, kAhead == 1 ? 3 : 2) q8_0_gemv_rows_kernel(const Q8GemvArgs a) {
  gemv_rows<1, kAhead>(a);
}

// The 5120-row shapes' 4 parts (q8_0_gemv_default_config) as a cluster of 4 blocks, one a part: each block has the
// one part's registers and the same 8 warps, and the parts meet in block 0 through distributed shared memory.
template <int kAhead>
__global__ void __cluster_dims__(1, 1, 4) __launch_bounds__(kRowsThreads, kAhead == 1 ? 3 : 2)
    q8_0_gemv_rows4_kernel(const Q8GemvArgs a) {
  gemv_rows<4, kAhead>(a);
}

int rows_ahead() {
  static const int ahead = [] {
    const char* v = std::getenv("QWEN38_Q8_GEMV_ROWS_AHEAD");
    return v != nullptr && v[0] != '\0' ? std::atoi(v) : 3;
  }();
  return ahead;
}

template <int kAhead>
cudaError_t launch_rows_ahead(const Q8GemvArgs& a, int parts, cudaStream_t stream) {
  const dim3 grid((a.T + 7) / 8, (a.N + 15) / 16, parts);
  if (grid.y > 65535u) return cudaErrorInvalidValue;
  return launch_pdl(parts == 1 ? q8_0_gemv_rows_kernel<kAhead> : q8_0_gemv_rows4_kernel<kAhead>, grid,
                    dim3(kRowsThreads), 0, stream, a);
}

cudaError_t launch_rows(const Q8GemvArgs& a, int parts, cudaStream_t stream) {
  switch (rows_ahead()) {
    case 1: return launch_rows_ahead<1>(a, parts, stream);
    case 2: return launch_rows_ahead<2>(a, parts, stream);
    case 3: return launch_rows_ahead<3>(a, parts, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

int q8_0_gemv_rows_min_rows() {
  static const int rows = [] {
    const char* v = std::getenv("QWEN38_Q8_GEMV_ROWS_FROM");
    return v != nullptr && v[0] != '\0' ? std::atoi(v) : kQ8GemvRowsFrom;
  }();
  return rows;
}

bool q8_0_gemv_rows_supported(const Q8GemvArgs& a, int parts) {
  const auto aligned = [](const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; };
  return (parts == 1 || parts == 4) && a.K % 512 == 0 && a.x_stride % 16 == 0 && a.x_d_stride % 2 == 0 &&
         static_cast<int64_t>(a.N) * a.K < (int64_t{1} << 31) && static_cast<int64_t>(a.T) * a.x_stride < (int64_t{1} << 31) &&
         static_cast<int64_t>(a.T) * a.x_d_stride < (int64_t{1} << 31) && aligned(a.weight_q, 16) && aligned(a.x, 16) &&
         aligned(a.weight_d, 4) && aligned(a.x_d, 8);
}

cudaError_t q8_0_gemv_rows_launch(const Q8GemvArgs& a, int parts, cudaStream_t stream) {
  return launch_rows(a, parts, stream);
}

}  // namespace qwen38
