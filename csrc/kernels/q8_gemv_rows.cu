// The int8 lane's Q8_0 GEMV for many rows of x (a batched decode step, a speculative verify): every weight byte
// read once for all T rows, the block dots on the tensor cores, and each row's sum in the T = 1 GEMV's exact
// order, so every row is bitwise what q8_gemv.cu computes for it alone (the batch-invariance contract).
//
// Why this shape.
// - The GEMV's T-row forms share each weight load among up to 8 rows but form every block dot on dp4a and
//   convert it on the FP64 pipe: from 8 rows they are compute-bound (T = 8 cost 2.68x T = 1), and more rows
//   ran in passes that read the weights again. Here one mma.sync m16n8k32.s8 is one Q8_0 block for 16 weight
//   rows x 8 rows of x, exact in int32, so the int8 work is nearly free and the cost left is the scaling:
//   per block and output one int -> double conversion (a DADD, int_to_double) and one DFMA, as in the GEMV.
// - The GEMV's order (q8_gemv.cu): block b of a row goes to partial sum ("chain") b mod (16 * PARTS), each chain
//   summed in block order; then for each part q the 16 chains 16q + m are added by the xor butterfly over m
//   (m with m ^ 8, then ^ 4, ^ 2, ^ 1), and the parts in order. Warp w of the 16 here owns the chains 16q + w:
//   it walks blocks w, w + 16, w + 32, .., block w + 16 i adding into its chain of part i % PARTS, so each
//   chain is summed in the GEMV's order by one thread per output, with exactly the GEMV's arithmetic
//   (fma(int_to_double(s), double(wd * xd), acc), wd * xd in fp32). At the end the warps' chains meet in
//   shared memory and one thread per output adds them in the GEMV's butterfly and part order.
// - A warp's blocks are 32 bytes of each of 16 rows every 512 bytes: its own cp.async ring of kDepth stages
//   (weights, their scales, the 8 * NT rows of x and their scales), no block-wide barrier in the main loop;
//   the 16 warps of a block together read every byte of their 16 rows.
// - The int32 dot of a block does not depend on the order of its 32 products, so a thread takes 8 contiguous
//   bytes of a row (one 8-byte shared load) as the k-halves the fragment layout puts 16 apart, in A and B alike.
// - Tile: 16 weight rows x 8 * NT rows of x a block (NT = 2 for PARTS = 1, 1 for PARTS = 4: the chains a thread
//   holds are PARTS * NT * 4 doubles); more rows of x run in more blocks, x fastest, so the blocks that share a
//   weight tile run together and read it from HBM once.
#include "q8_gemv.h"

#include <cstdlib>

#include "common.cuh"
#include "pdl.cuh"

namespace qwen38 {
namespace {

constexpr int kRowWarps = 16;  // one warp per chain of a part
constexpr int kRowsThreads = kRowWarps * 32;
constexpr int kDepth = 4;  // stages in flight per warp: 3 x 512 bytes of weights a warp, 48 KB an SM at 2 blocks

template <int NT>
struct RowsStage {
  static constexpr int kCols = 8 * NT;
  static constexpr int kWeightBytes = 16 * 32;
  static constexpr int kXOffset = kWeightBytes;
  static constexpr int kWdOffset = kXOffset + kCols * 32;  // 16 x u32: the fp16 scales of blocks b & ~1, b | 1
  static constexpr int kXdOffset = kWdOffset + 16 * 4;
  static constexpr int kBytes = kXdOffset + kCols * 4;
  static constexpr int kWarpBytes = kDepth * kBytes;
  static constexpr int kSharedBytes = kRowWarps * kWarpBytes;
  static constexpr int kPartialBytes = kRowWarps * 16 * kCols * 8;  // the chains at the end, over the ring
  static_assert(kPartialBytes <= kSharedBytes, "the partials reuse the rings");
  static_assert(kBytes % 16 == 0, "stages stay 16-byte aligned");
};

__device__ __forceinline__ void mma_s8(int (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%10, %10, %10, %10};"
               : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0));
}

template <int PARTS, int NT>
__global__ void __launch_bounds__(kRowsThreads, 2) q8_0_gemv_rows_kernel(const Q8GemvArgs a) {
  using S = RowsStage<NT>;
  extern __shared__ __align__(16) unsigned char smem[];
  pdl_allow_successor();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = lane >> 2, quad = lane & 3;
  const int row0 = blockIdx.y * 16, col0 = blockIdx.x * S::kCols;
  const int blocks = a.K >> 5;
  const int own = (blocks - warp + kRowWarps - 1) / kRowWarps;  // blocks warp, warp + 16, .. below `blocks`
  unsigned char* ring = smem + warp * S::kWarpBytes;

  // This lane's copies into a stage: A (16 rows x 32 bytes) as 32 16-byte halves, lane l -> row l / 2; the x rows
  // likewise (lanes below 2 * kCols); the weight scales of 16 rows (lanes < 16) and the x scales (lanes < kCols).
  const int copy_row = lane >> 1, copy_half = lane & 1;
  const int8_t* w_src = a.weight_q + static_cast<size_t>(min(row0 + copy_row, a.N - 1)) * a.K + 16 * copy_half;
  const int8_t* x_src = static_cast<const int8_t*>(a.x) +
                        static_cast<size_t>(min(col0 + (lane >> 1) % S::kCols, a.T - 1)) * a.x_stride + 16 * copy_half;
  const __half* wd_src = a.weight_d + static_cast<size_t>(min(row0 + (lane & 15), a.N - 1)) * blocks;
  const float* xd_src = a.x_d + static_cast<size_t>(min(col0 + lane % S::kCols, a.T - 1)) * a.x_d_stride;
  auto issue = [&](int i) {  // own block i into its stage (a commit group either way: the count stays uniform)
    if (i < own) {
      const int b = warp + kRowWarps * i;
      unsigned char* s = ring + (i % kDepth) * S::kBytes;
      cp_async<16>(s + 16 * lane, w_src + 32 * b, true);
      if (lane < 2 * S::kCols) cp_async<16>(s + S::kXOffset + 16 * lane, x_src + 32 * b, true);
      if (lane < 16) cp_async<4>(s + S::kWdOffset + 4 * lane, wd_src + (b & ~1), true);
      if (lane < S::kCols) cp_async<4>(s + S::kXdOffset + 4 * lane, xd_src + b, true);
    }
    cp_async_commit();
  };

  double acc[PARTS][NT][4];
#pragma unroll
  for (int q = 0; q < PARTS; ++q)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[q][j][e] = 0.0;

  pdl_wait_for_predecessor();  // x, x_d and out may belong to the predecessor
#pragma unroll
  for (int i = 0; i < kDepth - 1; ++i) issue(i);
  for (int i0 = 0; i0 < own; i0 += PARTS) {
#pragma unroll
    for (int u = 0; u < PARTS; ++u) {
      const int i = i0 + u;
      if (i >= own) break;  // warp-uniform
      issue(i + kDepth - 1);
      cp_async_wait<kDepth - 1>();
      __syncwarp();
      const unsigned char* s = ring + (i % kDepth) * S::kBytes;
      const int b = warp + kRowWarps * i;
      const uint2 lo = *reinterpret_cast<const uint2*>(s + group * 32 + 8 * quad);
      const uint2 hi = *reinterpret_cast<const uint2*>(s + (group + 8) * 32 + 8 * quad);
      const uint32_t frag_a[4] = {lo.x, hi.x, lo.y, hi.y};
      const uint32_t wd_pair_lo = reinterpret_cast<const uint32_t*>(s + S::kWdOffset)[group];
      const uint32_t wd_pair_hi = reinterpret_cast<const uint32_t*>(s + S::kWdOffset)[group + 8];
      const int shift = (b & 1) * 16;
      const float wd_lo = __half2float(__ushort_as_half(static_cast<unsigned short>(wd_pair_lo >> shift)));
      const float wd_hi = __half2float(__ushort_as_half(static_cast<unsigned short>(wd_pair_hi >> shift)));
      const float* xd = reinterpret_cast<const float*>(s + S::kXdOffset);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint2 xv = *reinterpret_cast<const uint2*>(s + S::kXOffset + (8 * j + group) * 32 + 8 * quad);
        const uint32_t frag_b[2] = {xv.x, xv.y};
        int c[4];
        mma_s8(c, frag_a, frag_b);
        const float xd0 = xd[8 * j + 2 * quad], xd1 = xd[8 * j + 2 * quad + 1];
        // c0, c1: weight row `group`, x rows 2 quad, 2 quad + 1; c2, c3: weight row group + 8.
        acc[u][j][0] = fma(int_to_double(c[0]), static_cast<double>(wd_lo * xd0), acc[u][j][0]);
        acc[u][j][1] = fma(int_to_double(c[1]), static_cast<double>(wd_lo * xd1), acc[u][j][1]);
        acc[u][j][2] = fma(int_to_double(c[2]), static_cast<double>(wd_hi * xd0), acc[u][j][2]);
        acc[u][j][3] = fma(int_to_double(c[3]), static_cast<double>(wd_hi * xd1), acc[u][j][3]);
      }
      __syncwarp();  // the stage is refilled by the next issue
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every ring drained: the partials take their place

  // partial[chain warp][weight row][x row]; one thread per output adds the 16 chains of a part in the GEMV's
  // butterfly order (m + (m ^ 8), then ^ 4, ^ 2, ^ 1; float addition commutes, so each pair is the GEMV's), then
  // the parts in order.
  double* partial = reinterpret_cast<double*>(smem);
  const int out_row = threadIdx.x & 15, out_col = threadIdx.x >> 4;  // a column's 16 rows on 16 threads
  const bool owns_output = out_col < S::kCols;
  double total = 0.0;
#pragma unroll
  for (int q = 0; q < PARTS; ++q) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = group + 8 * (e >> 1), col = 8 * j + 2 * quad + (e & 1);
        partial[(warp * 16 + r) * S::kCols + col] = acc[q][j][e];
      }
    __syncthreads();
    if (owns_output) {
      double v[16];
#pragma unroll
      for (int m = 0; m < 16; ++m) v[m] = partial[(m * 16 + out_row) * S::kCols + out_col];
#pragma unroll
      for (int m = 0; m < 8; ++m) v[m] = v[m] + v[m + 8];
#pragma unroll
      for (int m = 0; m < 4; ++m) v[m] = v[m] + v[m + 4];
#pragma unroll
      for (int m = 0; m < 2; ++m) v[m] = v[m] + v[m + 2];
      v[0] = v[0] + v[1];
      total = q == 0 ? v[0] : total + v[0];
    }
    __syncthreads();  // before the next part's chains overwrite the partials
  }
  const int row = row0 + out_row, col = col0 + out_col;
  if (owns_output && row < a.N && col < a.T) a.out[static_cast<size_t>(col) * a.out_stride + row] = static_cast<float>(total);
}

template <int PARTS, int NT>
cudaError_t launch_rows(const Q8GemvArgs& a, cudaStream_t stream) {
  using S = RowsStage<NT>;
  static const cudaError_t attribute = cudaFuncSetAttribute(
      q8_0_gemv_rows_kernel<PARTS, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSharedBytes);
  if (attribute != cudaSuccess) return attribute;
  const dim3 grid((a.T + S::kCols - 1) / S::kCols, (a.N + 15) / 16);
  if (grid.y > 65535u) return cudaErrorInvalidValue;
  return launch_pdl(q8_0_gemv_rows_kernel<PARTS, NT>, grid, dim3(kRowsThreads), S::kSharedBytes, stream, a);
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
  return (parts == 1 || parts == 4) && a.K % 64 == 0 && a.x_stride % 16 == 0 && aligned(a.weight_q, 16) &&
         aligned(a.x, 16) && aligned(a.weight_d, 4);
}

cudaError_t q8_0_gemv_rows_launch(const Q8GemvArgs& a, int parts, cudaStream_t stream) {
  return parts == 1 ? launch_rows<1, 2>(a, stream) : launch_rows<4, 1>(a, stream);
}

}  // namespace qwen38
