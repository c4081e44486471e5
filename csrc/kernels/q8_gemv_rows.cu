// The int8 lane's Q8_0 GEMV for many rows of x (a batched decode step, a speculative verify): every weight byte
// read once for all rows of a tile, the block dots on the tensor cores, and each row's sum in the T = 1 GEMV's
// exact order, so every row is bitwise what q8_gemv.cu computes for it alone (the batch-invariance contract).
//
// Why this shape.
// - No barrier, no ldmatrix. The form before this one staged 8 KB pieces of the block's rows in a cp.async ring
//   and took fragments by ldmatrix: ncu found it issue-bound (~135 instructions a warp and 512-byte piece, a block
//   barrier a piece, 0.46 instructions a cycle a scheduler, DRAM 30%; NOTES, "The rows kernel, round 3"). Here
//   each lane copies exactly the bytes of its own mma fragments, and reads back only what it copied itself, so
//   the ring needs no barrier (cp.async.wait_group orders a thread's own copies) and each warp runs ahead alone.
// - The ring is in shared memory, not registers: holding 3 pieces ahead in registers took 121 registers, two
//   blocks an SM, and ncu (T = 8, 34816 x 5120) showed DRAM at 53% with 0.56 eligible warps a scheduler, the warps
//   waiting on their loads (L1TEX scoreboard, 45% of the stall cycles) at 1.5 instructions a cycle an SM.
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
// - Tile: 16 weight rows x 8 NT rows of x a block (NT = 2 from 9 rows: each weight fragment then feeds two mma
//   tiles; at one tile a block, 16 rows cost twice 8, the second block's weights from L2 no cheaper than the
//   first's); more rows of x run in more blocks, x fastest, so the blocks that share a weight tile run together. Rows past N
//   and rows of x past T repeat the last row (valid addresses, cached): their outputs are not stored, and in an
//   mma a row of A or a column of B changes only its own outputs.
#include "q8_gemv.h"

#include <cooperative_groups.h>
#include <cstdlib>

#include "common.cuh"
#include "pdl.cuh"

namespace qwen38 {
namespace {

namespace cg = cooperative_groups;

constexpr int kWindows = 8;  // 64-byte windows of a 512-byte piece, a warp each
constexpr int kRowsThreads = 32 * kWindows;
constexpr int kStages = 4;   // a lane's pieces in its ring: 3 in flight beyond the one computed

// One piece of every lane of the block in shared memory, [field][thread] so that each field's accesses are
// conflict-free: its 16 bytes of weight rows group and group + 8 and of x row 8 j + group of each n8 tile j, the
// window's two block scales of those weight rows, and of x rows 8 j + 2 quad, + 1 (its outputs' columns).
template <int NT>
struct Stage {
  static constexpr int kW = 0;                                 // int4 [2][threads]
  static constexpr int kX = kW + 2 * 16 * kRowsThreads;        // int4 [NT][threads]
  static constexpr int kWd = kX + NT * 16 * kRowsThreads;      // __half2 [2][threads]
  static constexpr int kXd = kWd + 2 * 4 * kRowsThreads;       // float2 [NT][2][threads]
  static constexpr int kBytes = kXd + NT * 2 * 8 * kRowsThreads;
  static constexpr int kRingBytes = kStages * kBytes;
  static_assert(16 * 16 * 8 * NT * 8 <= kRingBytes, "the chains at the end reuse the ring");
};

// d = a . b + c for one m16n8k32 s8 tile (int32, exact).
__device__ __forceinline__ void mma_s8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                       const int (&c)[4]) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]), "r"(c[2]),
        "r"(c[3]));
}

template <typename T>
__device__ __forceinline__ T read_shared(const unsigned char* smem, uint32_t offset) {
  return *reinterpret_cast<const T*>(smem + offset);
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

// The window's two blocks of one piece into chains acc[j][0] (block 2w) and acc[j][1] (block 2w + 1) of each n8
// tile j, from this lane's copies in the stage at `stage`.
template <int NT>
__device__ __forceinline__ void compute_piece(double (&acc)[NT][2][4], const unsigned char* smem, uint32_t stage,
                                              int tid, bool first_block) {
  using S = Stage<NT>;
  const int4 w_lo = read_shared<int4>(smem, stage + S::kW + 16 * tid);
  const int4 w_hi = read_shared<int4>(smem, stage + S::kW + 16 * (kRowsThreads + tid));
  const uint32_t a0[4] = {static_cast<uint32_t>(w_lo.x), static_cast<uint32_t>(w_hi.x), static_cast<uint32_t>(w_lo.y),
                          static_cast<uint32_t>(w_hi.y)};
  const uint32_t a1[4] = {static_cast<uint32_t>(w_lo.z), static_cast<uint32_t>(w_hi.z), static_cast<uint32_t>(w_lo.w),
                          static_cast<uint32_t>(w_hi.w)};
  const float2 wd_lo = __half22float2(read_shared<__half2>(smem, stage + S::kWd + 4 * tid));
  const float2 wd_hi = __half22float2(read_shared<__half2>(smem, stage + S::kWd + 4 * (kRowsThreads + tid)));
  constexpr int kBias = static_cast<int>(0x80000000u);
  const int bias[4] = {kBias, kBias, kBias, kBias};
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int4 xq = read_shared<int4>(smem, stage + S::kX + 16 * (j * kRowsThreads + tid));
    const uint32_t x[4] = {static_cast<uint32_t>(xq.x), static_cast<uint32_t>(xq.y), static_cast<uint32_t>(xq.z),
                           static_cast<uint32_t>(xq.w)};
    uint32_t x0[4], x1[4];  // x in the k slots of block 0 (this lane's, if first_block) and of block 1
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x0[i] = first_block ? x[i] : 0u;
      x1[i] = first_block ? 0u : x[i];
    }
    int c0[4], c1[4];
    mma_s8(c0, a0, x0[0], x0[1], bias);
    mma_s8(c0, a1, x0[2], x0[3], c0);
    mma_s8(c1, a0, x1[0], x1[1], bias);
    mma_s8(c1, a1, x1[2], x1[3], c1);
    const float2 xd0 = read_shared<float2>(smem, stage + S::kXd + 8 * ((2 * j) * kRowsThreads + tid));
    const float2 xd1 = read_shared<float2>(smem, stage + S::kXd + 8 * ((2 * j + 1) * kRowsThreads + tid));
    scale_add(acc[j][0], c0, wd_lo.x, wd_hi.x, xd0.x, xd1.x);
    scale_add(acc[j][1], c1, wd_lo.y, wd_hi.y, xd0.y, xd1.y);
  }
}

// The kernel body for the pieces of one part; PARTS > 1 runs the parts as the blocks of a cluster (blockIdx.z).
template <int PARTS, int NT>
__device__ __forceinline__ void gemv_rows(const Q8GemvArgs& a) {
  using S = Stage<NT>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ double part_sum[16][8 * NT];  // the part's butterfly total of each output
  pdl_allow_successor();
  const int tid = threadIdx.x, lane = tid & 31, window = tid >> 5, part = PARTS == 1 ? 0 : blockIdx.z;
  const int group = lane >> 2, quad = lane & 3;
  const int row0 = blockIdx.y * 16, col0 = blockIdx.x * 8 * NT;
  const int blocks = a.K >> 5, pieces = blocks >> 4;  // K % 512 == 0 (q8_0_gemv_rows_supported)
  const uint32_t ring = shared_address(smem);

  // This lane's sources in piece 0 (32-bit element offsets: q8_0_gemv_rows_supported keeps N * K and T * x_stride
  // below 2^31); piece p adds 512 p to the byte offsets and 16 p to the scale offsets.
  const auto weight_row = [&](int r) { return static_cast<uint32_t>(min(row0 + r, a.N - 1)); };
  const auto x_row = [&](int r) { return static_cast<uint32_t>(min(col0 + r, a.T - 1)); };
  const uint32_t byte = 64 * window + 16 * quad;
  const uint32_t w_lo = weight_row(group) * a.K + byte, w_hi = weight_row(group + 8) * a.K + byte;
  const uint32_t wd_lo = weight_row(group) * blocks + 2 * window, wd_hi = weight_row(group + 8) * blocks + 2 * window;
  const auto x_at = [&](int j) { return x_row(8 * j + group) * static_cast<uint32_t>(a.x_stride) + byte; };
  const auto xd_at = [&](int r) { return x_row(r) * static_cast<uint32_t>(a.x_d_stride) + 2 * window; };
  const int8_t* x = static_cast<const int8_t*>(a.x);

  const auto copy_weights = [&](uint32_t stage, int p) {
    cp_async_shared<16>(stage + S::kW + 16 * tid, a.weight_q + w_lo + 512 * p);
    cp_async_shared<16>(stage + S::kW + 16 * (kRowsThreads + tid), a.weight_q + w_hi + 512 * p);
    cp_async_shared<4>(stage + S::kWd + 4 * tid, a.weight_d + wd_lo + 16 * p);
    cp_async_shared<4>(stage + S::kWd + 4 * (kRowsThreads + tid), a.weight_d + wd_hi + 16 * p);
  };
  const auto copy_x = [&](uint32_t stage, int p) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      cp_async_shared<16>(stage + S::kX + 16 * (j * kRowsThreads + tid), x + x_at(j) + 512 * p);
      cp_async_shared<8>(stage + S::kXd + 8 * (2 * j * kRowsThreads + tid), a.x_d + xd_at(8 * j + 2 * quad) + 16 * p);
      cp_async_shared<8>(stage + S::kXd + 8 * ((2 * j + 1) * kRowsThreads + tid),
                         a.x_d + xd_at(8 * j + 2 * quad + 1) + 16 * p);
    }
  };

  double acc[NT][2][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][b][e] = 0.0;

  // The pieces of this part are p = part + PARTS i, i = 0, 1, ..; piece i goes to stage i % kStages. One commit
  // group a piece (empty past the end: the count stays uniform). The weights do not depend on the predecessor: the
  // first pieces' are issued before the wait, and land in group 0 with piece 0's x.
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i)
    if (part + PARTS * i < pieces) copy_weights(ring + i * S::kBytes, part + PARTS * i);
  pdl_wait_for_predecessor();  // x, x_d and out may belong to the predecessor
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (part + PARTS * i < pieces) copy_x(ring + i * S::kBytes, part + PARTS * i);
    cp_async_commit();
  }
  const bool first_block = quad < 2;
  uint32_t compute_at = 0, issue_at = (kStages - 1) * S::kBytes;
  const auto advance = [](uint32_t& at) { at = at + S::kBytes == S::kRingBytes ? 0 : at + S::kBytes; };
  for (int p = part; p < pieces; p += PARTS) {
    const int ahead = p + PARTS * (kStages - 1);
    if (ahead < pieces) {
      copy_weights(ring + issue_at, ahead);
      copy_x(ring + issue_at, ahead);
    }
    cp_async_commit();
    advance(issue_at);
    cp_async_wait<kStages - 1>();  // piece p's copies (this thread's own: no barrier) have landed
    compute_piece<NT>(acc, smem, compute_at, tid, first_block);
    advance(compute_at);
  }

  // One thread per output adds the part's 16 chains in the GEMV's butterfly order (m + (m ^ 8), then ^ 4, ^ 2,
  // ^ 1; float addition commutes, so each pair is the GEMV's); block 0 of the cluster then adds the parts in order.
  cp_async_wait<0>();
  __syncthreads();  // every lane done with the ring: the chains take its place
  double* partial = reinterpret_cast<double*>(smem);  // [chain m][weight row][row of x]
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        partial[((2 * window + b) * 16 + group + 8 * (e >> 1)) * 8 * NT + 8 * j + 2 * quad + (e & 1)] = acc[j][b][e];
  __syncthreads();
  const int out_row = tid & 15, out_col = tid >> 4;
  const bool owns_output = out_col < 8 * NT;
  if (owns_output) {
    double v[16];
#pragma unroll
    for (int m = 0; m < 16; ++m) v[m] = partial[(m * 16 + out_row) * 8 * NT + out_col];
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
    if (owns_output) total = part_sum[out_row][out_col];
  } else {
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every part's sums written
    if (part == 0 && owns_output) {
#pragma unroll
      for (int q = 0; q < PARTS; ++q) {
        const double v = cluster.map_shared_rank(&part_sum[0][0], q)[out_row * 8 * NT + out_col];
        total = q == 0 ? v : total + v;
      }
    }
    cluster.sync();  // no block leaves while block 0 reads its shared memory
    if (part != 0) return;
  }
  const int row = row0 + out_row, col = col0 + out_col;
  if (owns_output && row < a.N && col < a.T) a.out[static_cast<size_t>(col) * a.out_stride + row] = static_cast<float>(total);
}

// Blocks an SM as the ring allows (72 KB at NT = 1, 104 KB at NT = 2 of the 227 KB).
template <int NT>
constexpr int kRowsBlocksPerSM = NT == 1 ? 3 : 2;

template <int NT>
__global__ void __launch_bounds__(kRowsThreads, kRowsBlocksPerSM<NT>) q8_0_gemv_rows_kernel(const Q8GemvArgs a) {
  gemv_rows<1, NT>(a);
}

// The 5120-row shapes' 4 parts (q8_0_gemv_default_config) as a cluster of 4 blocks, one a part: each block has the
// one part's registers and the same 8 warps, and the parts meet in block 0 through distributed shared memory.
template <int NT>
__global__ void __cluster_dims__(1, 1, 4) __launch_bounds__(kRowsThreads, kRowsBlocksPerSM<NT>)
    q8_0_gemv_rows4_kernel(const Q8GemvArgs a) {
  gemv_rows<4, NT>(a);
}

template <int NT>
cudaError_t launch_rows(const Q8GemvArgs& a, int parts, cudaStream_t stream) {
  constexpr int kSmem = Stage<NT>::kRingBytes;
  const auto kernel = parts == 1 ? q8_0_gemv_rows_kernel<NT> : q8_0_gemv_rows4_kernel<NT>;
  // The ring's size, and the whole carve-out for shared memory (the L1 the weights bypass matters less than the
  // blocks an SM).
  static const cudaError_t attributes = [] {
    for (const auto k : {q8_0_gemv_rows_kernel<NT>, q8_0_gemv_rows4_kernel<NT>}) {
      cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
      if (e == cudaSuccess) e = cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  }();
  if (attributes != cudaSuccess) return attributes;
  const dim3 grid((a.T + 8 * NT - 1) / (8 * NT), (a.N + 15) / 16, parts);
  if (grid.y > 65535u) return cudaErrorInvalidValue;
  return launch_pdl(kernel, grid, dim3(kRowsThreads), kSmem, stream, a);
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
  return a.T <= 8 ? launch_rows<1>(a, parts, stream) : launch_rows<2>(a, parts, stream);
}

}  // namespace qwen38
