// The int8 lane's Q8_0 GEMV for many rows of x (a batched decode step, a speculative verify): every weight byte
// read once for all T rows, the block dots on the tensor cores, and each row's sum in the T = 1 GEMV's exact
// order, so every row is bitwise what q8_gemv.cu computes for it alone (the batch-invariance contract).
//
// Why this shape.
// - The GEMV's T-row forms share each weight load among up to 8 rows but form every block dot on dp4a and
//   convert it on the FP64 pipe: from 8 rows they are compute-bound (T = 8 cost 2.68x T = 1), and more rows
//   ran in passes that read the weights again. Here one mma.sync m16n8k32.s8 is one Q8_0 block for 16 weight
//   rows x 8 rows of x, exact in int32, so the int8 work is nearly free and the cost left is the scaling:
//   per block and output one I2F.F64 (int_to_double's DADD trick needs two moves a conversion here to pair the
//   mma's outputs with its constant high word; I2F measured 1-2% faster), one DMUL and one DFMA.
// - Scales as doubles, converted once per piece: wd * xd is exact in fp32 (both are fp16 values: 11 + 11
//   significant bits, as the int8 producers write them), so fma(double(s) * double(wd), double(xd), acc) is the
//   GEMV's fma(int_to_double(s), double(wd * xd), acc) bit for bit: s * wd (<= 20 + 11 bits) and s * wd * xd are
//   exact in double, and each form rounds once, in the FMA. One scale per thread of the block is converted into a
//   2-entry buffer a piece ahead of the math (the raw copies of piece p + 1 have landed when piece p is computed),
//   instead of an F2F per output. Measured (NOTES, "The rows kernel, round 3"): that alone changed nothing at
//   T = 16; the kernel is latency- and issue-bound (~135 instructions a warp and piece, one barrier a piece,
//   0.46 instructions a cycle a scheduler, the FP64 pipe 14% busy). What T <= 8 gained (2.6x -> 1.8-2.0x the T = 1
//   chain) came from one n8 tile a block there instead of two.
// - The GEMV's order (q8_gemv.cu): block b of a row goes to partial sum ("chain") b mod (16 * PARTS), each chain
//   summed in block order; then for each part q the 16 chains 16q + m are added by the xor butterfly over m
//   (m with m ^ 8, then ^ 4, ^ 2, ^ 1), and the parts in order. A block of 16 warps takes the rows' 512-byte
//   pieces in turn; warp w computes block w of every piece, piece p adding into its chain of part p % PARTS, so
//   each chain is summed in the GEMV's order by one thread per output, with exactly the GEMV's arithmetic
//   (fma(int_to_double(s), double(wd * xd), acc), wd * xd in fp32). At the end the warps' chains meet in
//   shared memory and one thread per output adds them in the GEMV's butterfly and part order.
// - Loads: the whole block copies a piece of its 16 weight rows (8 KB, 512 contiguous bytes a row, as the GEMV
//   reads them: a first version in which each warp fetched only its own 32 bytes of every piece streamed at a
//   quarter of the probe), the same piece of its rows of x, and their scales, into a kStages cp.async ring;
//   rows past N and rows of x past T are zero-filled, not read (a clamped row repeated the same addresses).
//   Fragments come from shared memory by ldmatrix, rows padded by 16 bytes (conflict-free, as q8_gemm.cu).
// - Tile: 16 weight rows x 8 * NT rows of x a block (NT = 2 for PARTS = 1 from 9 rows, else 1: the chains a
//   thread holds are PARTS * NT * 4 doubles, and an n8 tile past T is math for nothing); more rows of x run in
//   more blocks, x fastest, so the blocks that share a weight tile run together and read it from HBM once.
#include "q8_gemv.h"

#include <cstdlib>
#include <cstring>

#include "common.cuh"
#include "pdl.cuh"

namespace qwen38 {
namespace {

constexpr int kRowWarps = 16;  // one warp per chain of a part: warp w computes block w of every piece
constexpr int kRowsThreads = kRowWarps * 32;
constexpr int kStages = 5;     // pieces in flight: 3 x 8 KB of weights a block past the one computed and the one converted
constexpr int kPitch = 512 + 16;  // a row's piece in shared memory, padded: ldmatrix phases hit distinct banks

template <int NT>
struct RowsStage {
  static constexpr int kCols = 8 * NT;
  static constexpr int kXOffset = 16 * kPitch;
  static constexpr int kWdOffset = kXOffset + kCols * kPitch;  // [16 rows][16 blocks] fp16
  static constexpr int kXdOffset = kWdOffset + 16 * 16 * 2;    // [kCols][16 blocks] float
  static constexpr int kBytes = kXdOffset + kCols * 16 * 4;
  // The scales of a piece as doubles, [16 blocks][16 weight rows, then kCols rows of x, then 2 of padding]: the
  // lanes of a warp read one block's row (broadcasts, and the two rows of x of a lane as one 16-byte load); 2
  // entries, piece p in p % 2.
  static constexpr int kScaleRows = 16 + kCols;
  static constexpr int kScalePitch = kScaleRows + 2;
  static constexpr int kScaleBytes = 16 * kScalePitch * 8;
  static constexpr int kRingBytes = kStages * kBytes;
  static constexpr int kSharedBytes = kRingBytes + 2 * kScaleBytes;
  static constexpr int kPartialBytes = kRowWarps * 16 * kCols * 8;  // the chains at the end, over the ring
  static_assert(kPartialBytes <= kRingBytes, "the partials reuse the ring");
  static_assert(16 * kScaleRows <= kRowsThreads, "one scale a thread");
  static_assert(kBytes % 16 == 0 && kScaleBytes % 16 == 0, "stages stay 16-byte aligned");
};

__device__ __forceinline__ void mma_s8(int (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%10, %10, %10, %10};"
               : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0));
}

// The direct form's end, the smem form's in passes of 32 columns (up to 64 rows of x here): the chains of 16 weight
// rows x 8 NT rows of x meet in shared memory (over the ring, drained: the caller's barrier), partial[chain warp]
// [weight row][x row], and one thread per output adds the 16 chains of a part in the GEMV's butterfly order
// (m + (m ^ 8), then ^ 4, ^ 2, ^ 1; float addition commutes, so each pair is the GEMV's), then the parts in order; a
// column's 16 rows on 16 threads. The smem form keeps its own one-pass copy: calling this changed that kernel's PTX
// in its loop, and it is measured as it is.
template <int PARTS, int NT>
__device__ __forceinline__ void store_outputs(const double (&acc)[PARTS][NT][4], unsigned char* smem,
                                              const Q8GemvArgs& a, int row0, int col0) {
  constexpr int kCols = 8 * NT;
  constexpr int kPasses = (kCols + 31) / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, group = lane >> 2, quad = lane & 3;
  double* partial = reinterpret_cast<double*>(smem);
  const int out_row = threadIdx.x & 15, out_col = threadIdx.x >> 4;
  double total[kPasses];
#pragma unroll
  for (int q = 0; q < PARTS; ++q) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = group + 8 * (e >> 1), col = 8 * j + 2 * quad + (e & 1);
        partial[(warp * 16 + r) * kCols + col] = acc[q][j][e];
      }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < kPasses; ++h) {
      const int col = out_col + 32 * h;
      if (col < kCols) {
        double v[16];
#pragma unroll
        for (int m = 0; m < 16; ++m) v[m] = partial[(m * 16 + out_row) * kCols + col];
#pragma unroll
        for (int m = 0; m < 8; ++m) v[m] = v[m] + v[m + 8];
#pragma unroll
        for (int m = 0; m < 4; ++m) v[m] = v[m] + v[m + 4];
#pragma unroll
        for (int m = 0; m < 2; ++m) v[m] = v[m] + v[m + 2];
        v[0] = v[0] + v[1];
        total[h] = q == 0 ? v[0] : total[h] + v[0];
      }
    }
    __syncthreads();  // before the next part's chains overwrite the partials
  }
  const int row = row0 + out_row;
#pragma unroll
  for (int h = 0; h < kPasses; ++h) {
    const int col = out_col + 32 * h;
    if (col < kCols && row < a.N && col0 + col < a.T)
      a.out[static_cast<size_t>(col0 + col) * a.out_stride + row] = static_cast<float>(total[h]);
  }
}

template <int PARTS, int NT>
__global__ void __launch_bounds__(kRowsThreads, 2) q8_0_gemv_rows_kernel(const Q8GemvArgs a) {
  using S = RowsStage<NT>;
  extern __shared__ __align__(16) unsigned char smem[];
  pdl_allow_successor();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = lane >> 2, quad = lane & 3;
  const int row0 = blockIdx.y * 16, col0 = blockIdx.x * S::kCols;
  const int blocks = a.K >> 5;
  const int pieces = blocks >> 4;  // K % 512 == 0 (q8_0_gemv_rows_supported)
  const uint32_t ring = shared_address(smem);

  // This thread's copies into a stage (16 bytes each): weight row tid / 32, bytes 16 (tid % 32) of the piece;
  // x row tid / 32 likewise (threads below 32 kCols); the 32 scale bytes of weight row tid (tid < 16) and the 64
  // of x row tid - 16 as four copies (16 <= tid < 16 + 4 kCols). Sources as 32-bit element offsets from the
  // kernel's pointer arguments (registers; q8_0_gemv_rows_supported keeps N * K below 2^31).
  const int copy_row = tid >> 5, copy_chunk = tid & 31;
  const bool copies_x = copy_row < S::kCols;
  const bool w_in = row0 + copy_row < a.N, x_in = col0 + copy_row < a.T && copies_x;
  const uint32_t w_off = static_cast<uint32_t>(w_in ? row0 + copy_row : 0) * a.K + 16 * copy_chunk;
  const uint32_t x_off = static_cast<uint32_t>(x_in ? col0 + copy_row : 0) * a.x_stride + 16 * copy_chunk;
  const uint32_t copy_dst = copy_row * kPitch + 16 * copy_chunk;
  const int scale_row = tid < 16 ? tid : (tid - 16) >> 2;
  const bool wd_copy = tid < 16, xd_copy = tid >= 16 && tid < 16 + 4 * S::kCols;
  const bool wd_in = wd_copy && row0 + scale_row < a.N, xd_in = xd_copy && col0 + scale_row < a.T;
  const uint32_t wd_off = static_cast<uint32_t>(wd_in ? row0 + scale_row : 0) * blocks;
  const uint32_t xd_off = static_cast<uint32_t>(xd_in ? col0 + scale_row : 0) * a.x_d_stride + 4 * ((tid - 16) & 3);
  const uint32_t scale_dst = wd_copy ? S::kWdOffset + 32 * tid : S::kXdOffset + 16 * (tid - 16);

  // This thread's scale conversion: scale row tid / 16 (weight rows, then rows of x), block tid % 16.
  const int convert_row = tid >> 4;
  const bool converts = convert_row < S::kScaleRows, converts_wd = convert_row < 16;  // both warp-uniform
  const uint32_t convert_src = converts_wd ? S::kWdOffset + 2 * tid : S::kXdOffset + 4 * (tid - 256);
  const uint32_t convert_dst = ((tid & 15) * S::kScalePitch + convert_row) * 8;

  // Stage offsets (from the ring's start) of the next piece to copy, to convert and to compute: advanced by one
  // stage a piece, wrapping (no modulo of the piece index in the loop).
  uint32_t issue_at = 0, convert_at = 0, compute_at = 0;
  const auto advance = [](uint32_t& at) { at = at + S::kBytes == S::kRingBytes ? 0 : at + S::kBytes; };
  auto issue = [&](int p) {  // piece p into its stage (a commit group either way: the count stays uniform)
    if (p < pieces) {
      const uint32_t s = ring + issue_at;
      cp_async16_shared(s + copy_dst, a.weight_q + w_off + 512 * p, w_in);
      if (copies_x) cp_async16_shared(s + S::kXOffset + copy_dst, static_cast<const int8_t*>(a.x) + x_off + 512 * p, x_in);
      // Scales: 16 blocks a piece (K % 512 == 0: pieces are whole), 32 bytes a weight row, 64 a row of x.
      if (wd_copy) {
        cp_async16_shared(s + scale_dst, a.weight_d + wd_off + 16 * p, wd_in);
        cp_async16_shared(s + scale_dst + 16, a.weight_d + wd_off + 16 * p + 8, wd_in);
      } else if (xd_copy) {
        cp_async16_shared(s + scale_dst, a.x_d + xd_off + 16 * p, xd_in);
      }
    }
    cp_async_commit();
    advance(issue_at);
  };
  auto convert = [&](int p) {  // piece p's landed fp16 / fp32 scales into doubles, entry p % 2
    if (converts && p < pieces) {
      const unsigned char* src = smem + convert_at + convert_src;
      const double v = converts_wd ? static_cast<double>(__half2float(*reinterpret_cast<const __half*>(src)))
                                   : static_cast<double>(*reinterpret_cast<const float*>(src));
      *reinterpret_cast<double*>(smem + S::kRingBytes + (p & 1) * S::kScaleBytes + convert_dst) = v;
    }
    advance(convert_at);
  };

  double acc[PARTS][NT][4];
#pragma unroll
  for (int q = 0; q < PARTS; ++q)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[q][j][e] = 0.0;

  // ldmatrix row addresses of this lane (q8_gemm.cu's A and B patterns): A = the 16 weight rows (matrices rows
  // 0-7 / 8-15 x bytes 0-15 / 16-31 of block `warp`), B = 16 rows of x as two n8 tiles.
  const uint32_t a_off = (lane & 15) * kPitch + warp * 32 + (lane >> 4) * 16;
  const uint32_t b_off = S::kXOffset + ((lane & 7) + (NT == 2 ? (lane >> 4) * 8 : 0)) * kPitch + warp * 32 +
                         ((lane >> 3) & 1) * 16;
  // This lane's scales in an entry: weight rows group and group + 8 of block `warp`, rows of x 2 quad and + 1.
  const uint32_t wd_at = (warp * S::kScalePitch + group) * 8, xd_at = (warp * S::kScalePitch + 16 + 2 * quad) * 8;

  pdl_wait_for_predecessor();  // x, x_d and out may belong to the predecessor
#pragma unroll
  for (int p = 0; p < kStages - 1; ++p) issue(p);
  cp_async_wait<kStages - 2>();
  __syncthreads();
  convert(0);
  for (int p0 = 0; p0 < pieces; p0 += PARTS) {
#pragma unroll
    for (int u = 0; u < PARTS; ++u) {
      const int p = p0 + u;
      if (p >= pieces) break;  // block-uniform
      cp_async_wait<kStages - 3>();
      // Piece p + 1 landed for every thread, piece p's scales are converted; every warp is done with piece p - 1
      // (its stage is refilled next) and with entry (p + 1) % 2 of the scales.
      __syncthreads();
      issue(p + kStages - 1);
      convert(p + 1);
      uint32_t frag_a[4];
      ldmatrix_x4_shared(frag_a, ring + compute_at + a_off);
      uint32_t frag_b[4];  // NT == 1: matrices 2 and 3 repeat 0 and 1 (rows 0-7)
      ldmatrix_x4_shared(frag_b, ring + compute_at + b_off);
      advance(compute_at);
      const unsigned char* entry = smem + S::kRingBytes + (p & 1) * S::kScaleBytes;
      const double wd_lo = *reinterpret_cast<const double*>(entry + wd_at);
      const double wd_hi = *reinterpret_cast<const double*>(entry + wd_at + 64);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint32_t b[2] = {frag_b[2 * j], frag_b[2 * j + 1]};
        int c[4];
        mma_s8(c, frag_a, b);
        const double2 xd = *reinterpret_cast<const double2*>(entry + xd_at + 64 * j);
        // c0, c1: weight row `group`, x rows 2 quad, 2 quad + 1; c2, c3: weight row group + 8.
        acc[u][j][0] = fma(__int2double_rn(c[0]) * wd_lo, xd.x, acc[u][j][0]);
        acc[u][j][1] = fma(__int2double_rn(c[1]) * wd_lo, xd.y, acc[u][j][1]);
        acc[u][j][2] = fma(__int2double_rn(c[2]) * wd_hi, xd.x, acc[u][j][2]);
        acc[u][j][3] = fma(__int2double_rn(c[3]) * wd_hi, xd.y, acc[u][j][3]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring drained and read: the partials take its place
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

// ---- The direct form (QWEN38_Q8_GEMV_ROWS_KERNEL=direct; not yet measured) ---------------------------------------
// Why: past 16 rows of x the form above runs more blocks over each 16-row weight tile, each redoing the piece's loads,
// scale conversions and barrier (~135 instructions a warp and piece) for one or two mmas, so its cost grows linearly
// in T (NOTES, "Where a batch step's time goes"). Here one block takes all rows of x up to 64 (NT n8 tiles; PARTS = 4
// holds 4x the chains and so stops at NT = 2, more rows in more blocks), so each weight byte is read once and the
// per-piece overhead is paid once for all rows. The ring holds only the weights and the raw scales: x at 64 rows
// would be 4x the weights in it and crowd them out, so each lane loads its B fragments of x straight from global
// memory (x is small and stays in L2), one piece ahead into registers. Same chains, same order, same bits.
//
// The block dot's scaling, exact (the GEMV's term is round(acc + s * wd * xd), s * wd * xd exact: see the header):
// (1) the mma's int32 s (|s| <= 32 * 127 * 127 < 2^19) as the double v with high word 0x43380000 and low word
//     s ^ 0x80000000: exponent 2^52, so the low word counts units, and its value is 2^52 + 2^51 + (s + 2^31) =
//     C + s with C = 2^52 + 2^51 + 2^31, exactly (0 <= s + 2^31 < 2^32 is what the xor makes of the sign bit);
// (2) -C * wd, per weight row and block when the scales are converted: C's significand spans 22 bits, wd's (an fp16
//     value) 11, so the product has <= 33 and is exact in double;
// (3) fma(v, wd, -C * wd) rounds (C + s) wd - C wd = s * wd once; s * wd has <= 19 + 11 bits, so it is exact;
// (4) fma(s * wd, xd, acc) = round(acc + s * wd * xd): one rounding of the same real number as the GEMV's
//     fma(double(s), double(wd * xd), acc). So every step but the last is exact and the last is the GEMV's.
// It moves the conversion off the quarter-rate conversion pipe (I2F.F64), which the T-row forms ran out of first,
// onto the FP64 pipe (a DFMA for the DMUL and the conversion) and an integer op.
constexpr double kDirectBias = 6755401588539392.0;  // C = 2^52 + 2^51 + 2^31

// Two blocks an SM where the kernel fits 64 registers without spills (ptxas -v: PARTS = 1 to NT = 2 and PARTS = 4 at
// NT = 1; PARTS = 1 at NT = 4 spilled 20 bytes), else one with 128 registers. 8 stages: 6 pieces (48 KB) of weights
// in flight a block past the one computed and the one converted, 48-96 KB an SM (the probe's rate times ~1 us of
// DRAM latency is ~34 KB an SM); two blocks of 8 stages still fit the shared memory (<= 185 KB).
template <int PARTS, int NT>
struct DirectStage {
  static constexpr int kMinBlocks = NT <= 2 && PARTS * NT <= 4 ? 2 : 1;
  static constexpr int kStages = 8;
  static constexpr int kCols = 8 * NT;
  static constexpr int kWdOffset = 16 * kPitch;                // [16 rows][16 blocks] fp16
  static constexpr int kXdOffset = kWdOffset + 16 * 16 * 2;    // [kCols][16 blocks] float
  static constexpr int kBytes = kXdOffset + kCols * 16 * 4;
  static constexpr int kScaleCopies = 32 + 4 * kCols;          // 16-byte copies: 2 a weight row, 4 a row of x
  // The scales of a piece as doubles, [16 blocks][16 weight rows wd, their 16 -C * wd, kCols rows of x, 2 of
  // padding], 2 entries, piece p in p % 2; 16 (16 + kCols) conversions, up to 3 a thread.
  static constexpr int kNegCRow = 16, kXdRow = 32;
  static constexpr int kScalePitch = kXdRow + kCols + 2;
  static constexpr int kScaleBytes = 16 * kScalePitch * 8;
  static constexpr int kConversions = 16 * (16 + kCols);
  static constexpr int kRingBytes = kStages * kBytes;
  static constexpr int kPartialBytes = kRowWarps * 16 * kCols * 8;  // the chains at the end, over ring and entries
  static constexpr int kSharedBytes =
      kRingBytes + 2 * kScaleBytes > kPartialBytes ? kRingBytes + 2 * kScaleBytes : kPartialBytes;
  static_assert(kScaleCopies <= kRowsThreads, "one scale copy a thread at most");
  static_assert(kBytes % 16 == 0 && kScaleBytes % 16 == 0 && kScalePitch % 2 == 0, "16-byte aligned stages, xd pairs");
};

template <int PARTS, int NT>
__global__ void __launch_bounds__(kRowsThreads, DirectStage<PARTS, NT>::kMinBlocks)
    q8_0_gemv_rows_direct_kernel(const Q8GemvArgs a) {
  using S = DirectStage<PARTS, NT>;
  extern __shared__ __align__(16) unsigned char smem[];
  pdl_allow_successor();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = lane >> 2, quad = lane & 3;
  const int row0 = blockIdx.y * 16, col0 = blockIdx.x * S::kCols;
  const int blocks = a.K >> 5;
  const int pieces = blocks >> 4;  // K % 512 == 0 (q8_0_gemv_rows_supported)
  const uint32_t ring = shared_address(smem);

  // This thread's copies into a stage (16 bytes each): weight row tid / 32, bytes 16 (tid % 32) of the piece; the
  // 32 scale bytes of weight row tid / 2 as two threads' copies (tid < 32), the 64 of x row (tid - 32) / 4 as four
  // (32 <= tid < kScaleCopies). 32-bit element offsets, as in the form above.
  const int copy_row = tid >> 5, copy_chunk = tid & 31;
  const bool w_in = row0 + copy_row < a.N;
  const uint32_t w_off = static_cast<uint32_t>(w_in ? row0 + copy_row : 0) * a.K + 16 * copy_chunk;
  const uint32_t copy_dst = copy_row * kPitch + 16 * copy_chunk;
  const bool wd_copy = tid < 32, xd_copy = tid >= 32 && tid < S::kScaleCopies;  // both warp-uniform
  const int scale_row = wd_copy ? tid >> 1 : (tid - 32) >> 2;
  const bool wd_in = wd_copy && row0 + scale_row < a.N, xd_in = xd_copy && col0 + scale_row < a.T;
  const uint32_t wd_src = static_cast<uint32_t>(wd_in ? row0 + scale_row : 0) * blocks + 8 * (tid & 1);
  const uint32_t xd_src =
      static_cast<uint32_t>(static_cast<uint32_t>(xd_in ? col0 + scale_row : 0) * a.x_d_stride) + 4 * (tid & 3);
  const uint32_t scale_dst = wd_copy ? S::kWdOffset + 16 * tid : S::kXdOffset + 16 * (tid - 32);

  uint32_t issue_at = 0, convert_at = 0, compute_at = 0;
  const auto advance = [](uint32_t& at) { at = at + S::kBytes == S::kRingBytes ? 0 : at + S::kBytes; };
  auto issue = [&](int p) {  // piece p into its stage (a commit group either way: the count stays uniform)
    if (p < pieces) {
      const uint32_t s = ring + issue_at;
      cp_async16_shared(s + copy_dst, a.weight_q + w_off + 512 * p, w_in);
      if (wd_copy) {
        cp_async16_shared(s + scale_dst, a.weight_d + wd_src + 16 * p, wd_in);
      } else if (xd_copy) {
        cp_async16_shared(s + scale_dst, a.x_d + xd_src + 16 * p, xd_in);
      }
    }
    cp_async_commit();
    advance(issue_at);
  };
  // Piece p's landed scales into doubles, entry p % 2: conversion u = tid + 512 i is weight row u / 16 (u < 256:
  // wd and -C * wd) or row of x (u - 256) / 16, block u % 16 (a warp-uniform split: 256 and 512 are whole warps).
  auto convert = [&](int p) {
    if (p < pieces) {
      const unsigned char* stage = smem + convert_at;
      double* entry = reinterpret_cast<double*>(smem + S::kRingBytes + (p & 1) * S::kScaleBytes);
#pragma unroll
      for (int u0 = 0; u0 < S::kConversions; u0 += kRowsThreads) {
        const int u = u0 + tid;
        if (u < 256) {
          const __half h = *reinterpret_cast<const __half*>(stage + S::kWdOffset + 2 * u);
          const double wd = static_cast<double>(__half2float(h));
          double* dst = entry + (u & 15) * S::kScalePitch + (u >> 4);
          dst[0] = wd;
          dst[S::kNegCRow] = -(kDirectBias * wd);
        } else if (u < S::kConversions) {
          const int v = u - 256;
          entry[(v & 15) * S::kScalePitch + S::kXdRow + (v >> 4)] =
              static_cast<double>(*reinterpret_cast<const float*>(stage + S::kXdOffset + 4 * v));
        }
      }
    }
    advance(convert_at);
  };

  // This lane's B fragments of x (m16n8k32, B column-major): n8 tile j's row col0 + 8 j + group, bytes 4 quad .. + 3
  // (b0) and 16 + 4 quad .. + 3 (b1) of block `warp` of the piece; rows past T are zero, not read. Two 4-byte loads
  // in one 32-byte sector: the second is an L1 hit.
  const int x_rows = a.T - col0 - group;  // tile j's row is in when 8 j < x_rows
  const uint32_t x_off = static_cast<uint32_t>(static_cast<uint32_t>(x_rows > 0 ? col0 + group : 0) * a.x_stride) +
                         32 * warp + 4 * quad;
  const uint32_t x_tile = static_cast<uint32_t>(8 * a.x_stride);
  const int8_t* const x = static_cast<const int8_t*>(a.x);
  auto load_x = [&](int p, uint32_t (&b)[NT][2]) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const bool in = 8 * j < x_rows && p < pieces;
      const int8_t* src = x + (x_off + j * x_tile + 512 * p);
      b[j][0] = in ? *reinterpret_cast<const uint32_t*>(src) : 0u;
      b[j][1] = in ? *reinterpret_cast<const uint32_t*>(src + 16) : 0u;
    }
  };

  double acc[PARTS][NT][4];
#pragma unroll
  for (int q = 0; q < PARTS; ++q)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[q][j][e] = 0.0;

  const uint32_t a_off = (lane & 15) * kPitch + warp * 32 + (lane >> 4) * 16;  // as the form above
  // This lane's scales in an entry: weight rows group and group + 8 of block `warp`, rows of x 2 quad and + 1.
  const int wd_at = warp * S::kScalePitch + group, xd_at = warp * S::kScalePitch + S::kXdRow + 2 * quad;

  pdl_wait_for_predecessor();  // x, x_d and out may belong to the predecessor
  uint32_t frag_b[NT][2];
  load_x(0, frag_b);
#pragma unroll
  for (int p = 0; p < S::kStages - 1; ++p) issue(p);
  cp_async_wait<S::kStages - 2>();
  __syncthreads();
  convert(0);
  for (int p0 = 0; p0 < pieces; p0 += PARTS) {
#pragma unroll
    for (int u = 0; u < PARTS; ++u) {
      const int p = p0 + u;
      if (p >= pieces) break;  // block-uniform
      cp_async_wait<S::kStages - 3>();
      // Piece p + 1 landed for every thread, piece p's scales are converted; every warp is done with piece p - 1
      // (its stage is refilled next) and with entry (p + 1) % 2 of the scales.
      __syncthreads();
      issue(p + S::kStages - 1);
      convert(p + 1);
      uint32_t frag_a[4];
      ldmatrix_x4_shared(frag_a, ring + compute_at + a_off);
      advance(compute_at);
      const double* entry = reinterpret_cast<const double*>(smem + S::kRingBytes + (p & 1) * S::kScaleBytes);
      const double wd_lo = entry[wd_at], wd_hi = entry[wd_at + 8];
      const double neg_c_lo = entry[wd_at + S::kNegCRow], neg_c_hi = entry[wd_at + S::kNegCRow + 8];
      const auto term = [](int s, double wd, double neg_c) {  // s * wd, exactly (the proof above)
        return fma(__hiloint2double(0x43380000, s ^ static_cast<int>(0x80000000u)), wd, neg_c);
      };
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        int c[4];
        mma_s8(c, frag_a, frag_b[j]);
        const double2 xd = *reinterpret_cast<const double2*>(entry + xd_at + 8 * j);
        // c0, c1: weight row `group`, x rows 2 quad, 2 quad + 1; c2, c3: weight row group + 8.
        acc[u][j][0] = fma(term(c[0], wd_lo, neg_c_lo), xd.x, acc[u][j][0]);
        acc[u][j][1] = fma(term(c[1], wd_lo, neg_c_lo), xd.y, acc[u][j][1]);
        acc[u][j][2] = fma(term(c[2], wd_hi, neg_c_hi), xd.x, acc[u][j][2]);
        acc[u][j][3] = fma(term(c[3], wd_hi, neg_c_hi), xd.y, acc[u][j][3]);
      }
      load_x(p + 1, frag_b);  // the mmas have read piece p's fragments
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring drained and read: the partials take its place
  store_outputs<PARTS, NT>(acc, smem, a, row0, col0);
}

// All rows of x up to 8 NT in one block a weight tile, more in more blocks (x fastest: the blocks of a tile run
// together and read it from HBM once).
template <int PARTS, int NT>
cudaError_t launch_rows_direct(const Q8GemvArgs& a, cudaStream_t stream) {
  using S = DirectStage<PARTS, NT>;
  static const cudaError_t attribute = cudaFuncSetAttribute(
      q8_0_gemv_rows_direct_kernel<PARTS, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSharedBytes);
  if (attribute != cudaSuccess) return attribute;
  const dim3 grid((a.T + S::kCols - 1) / S::kCols, (a.N + 15) / 16);
  if (grid.y > 65535u) return cudaErrorInvalidValue;
  return launch_pdl(q8_0_gemv_rows_direct_kernel<PARTS, NT>, grid, dim3(kRowsThreads), S::kSharedBytes, stream, a);
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
  return (parts == 1 || parts == 4) && a.K % 512 == 0 && a.x_stride % 16 == 0 && a.x_d_stride % 4 == 0 &&
         static_cast<int64_t>(a.N) * a.K < (int64_t{1} << 31) && static_cast<int64_t>(a.T) * a.x_stride < (int64_t{1} << 31) &&
         aligned(a.weight_q, 16) && aligned(a.x, 16) && aligned(a.weight_d, 16) && aligned(a.x_d, 16);
}

bool q8_0_gemv_rows_kernel_from_env(Q8RowsKernel* kernel) {
  const char* env = std::getenv("QWEN38_Q8_GEMV_ROWS_KERNEL");
  if (env == nullptr || env[0] == '\0') return false;
  *kernel = std::strcmp(env, "smem") == 0     ? Q8RowsKernel::Smem
            : std::strcmp(env, "direct") == 0 ? Q8RowsKernel::Direct
                                              : Q8RowsKernel::Unknown;
  return true;
}

cudaError_t q8_0_gemv_rows_launch(const Q8GemvArgs& a, int parts, cudaStream_t stream) {
  Q8RowsKernel kernel = Q8RowsKernel::Smem;
  q8_0_gemv_rows_kernel_from_env(&kernel);
  if (kernel == Q8RowsKernel::Unknown) return cudaErrorInvalidValue;
  if (kernel == Q8RowsKernel::Direct) {
    if (parts != 1) return a.T <= 8 ? launch_rows_direct<4, 1>(a, stream) : launch_rows_direct<4, 2>(a, stream);
    return a.T <= 8    ? launch_rows_direct<1, 1>(a, stream)
           : a.T <= 16 ? launch_rows_direct<1, 2>(a, stream)
           : a.T <= 32 ? launch_rows_direct<1, 4>(a, stream)
                       : launch_rows_direct<1, 8>(a, stream);
  }
  if (parts != 1) return launch_rows<4, 1>(a, stream);
  return a.T <= 8 ? launch_rows<1, 1>(a, stream) : launch_rows<1, 2>(a, stream);
}

}  // namespace qwen38
