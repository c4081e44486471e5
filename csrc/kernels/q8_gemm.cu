// Q8_0 GEMM on int8 tensor cores for prompt-sized T (see q8_gemm.h for the math).
//
// Why it is shaped like this.
// - One mma.sync m16n8k32.s8 is exactly one Q8_0 block (32 weights along K) for a 16-token x 8-row tile,
//   so every block's int32 dot is exact and comes out of the tensor core ready for its two scales, with no
//   integer partial to carry across blocks. This is what llama.cpp's MMQ computes too.
// - The scaling is the cost: per block and output, the int32 dot must become a float and be scaled by
//   the two block scales on the FP32 pipe next to each MMA. They are cut to two FMAs (see mma_block and
//   compute_stage): the conversion is an exponent trick folded into the MMA's accumulator input, not I2F
//   (quarter rate). Even so the kernel reaches only 25-34% of torch._int_mm on the same shapes: ncu
//   (T = 4096, 34816 x 5120) shows it latency-bound (issue slots 50% busy, 1.1 of 4 warps eligible per
//   scheduler, FMA pipe 33%); benchmarks/NOTES.md has what was tried. The next step, wgmma with TMA and warp
//   specialization, is q8_gemm_sm90.cu; this kernel stays for other architectures and small T (q8_gemm.h).
// - A = activation tokens (M), B = weight rows (N): both are [rows, K] with K contiguous, which is what
//   ldmatrix hands to the s8 fragments (row-major A, column-major B) with no transpose; the accumulator's
//   row pairs then fall on consecutive output features of one token.
// - Block tile: 2 x 4 warps, each 16 * kMTiles tokens x 32 weight rows; K in stages of four (or two)
//   blocks through a cp.async pipeline (Stage below).
// - Grid x = token tiles, y = weight-row tiles: the blocks in flight together share weight tiles (read once
//   from HBM, then from L2) while the whole activation (T x K int8, a few MB) stays L2-resident.
// - Occupancy: the 64-token tile runs two blocks (16 warps) per SM; three blocks of the 32-token tile
//   (80 registers, small spills) measured slower (146-157 vs 208-233 TOPS at T = 512 / 4096, c875463).
// - Accumulation is float32 in block order (two roundings per block: dot * dw, then the FMA with dx): the
//   GEMV's double accumulation would halve the FP rate this kernel is bound by.
#include "q8_gemm.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common.cuh"  // cp.async, ldmatrix

namespace qwen38 {
namespace {

constexpr int kWarpsM = 2, kWarpsN = 4;
constexpr int kThreads = 32 * kWarpsM * kWarpsN;
constexpr int kTileRows = 32 * kWarpsN;  // weight rows per block

// The int -> float conversion rides in the MMA: the accumulator starts at the bit pattern of
// kMagic = 1.5 * 2^23, and for |dot| < 2^22 the integer sum kMagicBits + dot is the bit pattern of the float
// kMagic + dot (unit spacing there). So the result, read as floats, is kMagic + dot exactly, and no integer
// instruction is spent on the conversion (|dot| <= 32 * 127 * 127 < 2^19).
constexpr int kMagicBits = 0x4B400000;
constexpr float kMagic = 12582912.0f;

// c = kMagic + a (16 tokens x 32) . b (32 x 8 weight rows), as floats, exact.
__device__ __forceinline__ void mma_block(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  int d[4];
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(kMagicBits));
#pragma unroll
  for (int e = 0; e < 4; ++e) c[e] = __int_as_float(d[e]);
}

// A pipeline stage holds kBlocks Q8_0 blocks (32 bytes of K each) of every row of the tile. Rows are padded
// by 16 bytes in shared memory so the eight 16-byte rows of every ldmatrix phase fall on distinct banks.
// Four blocks per stage (K % 128 == 0, every 27B shape) halve the barriers and give each warp twice the
// independent work between them; two blocks serve K % 128 == 64.
template <int kBlocks>
struct Stage {
  static constexpr int kBytesK = 32 * kBlocks;
  static constexpr int kPitch = kBytesK + 16;
  static constexpr int kChunksPerRow = kBytesK / 16;
  static constexpr int kDepth = kBlocks == 4 ? 3 : 4;  // stages in flight: two 64-token blocks fit an SM
};

template <bool kTwoWord, int kMTiles, int kBlocks>
struct Tile {
  using S = Stage<kBlocks>;
  static constexpr int kTokens = 16 * kMTiles * kWarpsM;
  static constexpr int kXBytes = kTokens * S::kPitch;
  static constexpr int kWBytes = kTileRows * S::kPitch;
  static constexpr int kWOffset = (kTwoWord ? 2 : 1) * kXBytes;        // two-word: x_lo tile at kXBytes
  static constexpr int kXdOffset = kWOffset + kWBytes;                 // float [kTokens][kBlocks]
  static constexpr int kWdOffset = kXdOffset + kTokens * 4 * kBlocks;  // half [kTileRows][kBlocks]
  static constexpr int kStageBytes = kWdOffset + kTileRows * 2 * kBlocks;
  static constexpr int kSmemBytes = S::kDepth * kStageBytes;
};

// Grid z: the K splits (q8_0_gemm_splits). Split z takes a contiguous run of stages and, with more than one,
// stores its raw float sums to partial[z][T][N] for reduce_splits_kernel; with one (partial == nullptr), the output.
template <bool kTwoWord, int kMTiles, int kBlocks>
__global__ void __launch_bounds__(kThreads, kMTiles == 4 ? 1 : 2)
    q8_0_gemm_kernel(const Q8GemvArgs a, float* __restrict__ partial) {
  using T = Tile<kTwoWord, kMTiles, kBlocks>;
  using S = Stage<kBlocks>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tok0 = blockIdx.x * T::kTokens;
  const int row0 = blockIdx.y * kTileRows;
  const int blocks_per_row = a.K / 32;
  const int stages_per_split = (a.K / S::kBytesK + gridDim.z - 1) / gridDim.z;
  const int k_first = blockIdx.z * stages_per_split;  // this split's first stage
  const int num_k = min(a.K / S::kBytesK - k_first, stages_per_split);
  const int8_t* x = static_cast<const int8_t*>(a.x) + static_cast<int64_t>(k_first) * S::kBytesK;

  // Each thread copies the same chunks at every stage, only K advances: the addresses, predicates and
  // shared-memory offsets are computed once here (per-stage recomputation was most of the kernel's integer
  // instructions, next to the FP32 scaling work that bounds it).
  constexpr int kXCopies = (T::kTokens * S::kChunksPerRow + kThreads - 1) / kThreads;  // 16-byte chunks
  constexpr int kWCopies = kTileRows * S::kChunksPerRow / kThreads;
  const int8_t* x_src[kXCopies];
  const int8_t* x_lo_src[kXCopies];
  int x_dst[kXCopies];
  bool x_copy[kXCopies], x_fill[kXCopies];
#pragma unroll
  for (int i = 0; i < kXCopies; ++i) {
    const int c = threadIdx.x + i * kThreads;
    const int r = c / S::kChunksPerRow, part = (c % S::kChunksPerRow) * 16;
    x_copy[i] = c < T::kTokens * S::kChunksPerRow;
    x_fill[i] = x_copy[i] && tok0 + r < a.T;
    const int64_t tok = x_fill[i] ? tok0 + r : 0;  // any legal address: nothing is read when not filling
    x_src[i] = x + tok * a.x_stride + part;
    x_lo_src[i] = kTwoWord ? a.x_lo + tok * a.x_lo_stride + static_cast<int64_t>(k_first) * S::kBytesK + part : nullptr;
    x_dst[i] = r * S::kPitch + part;
  }
  const int8_t* w_src[kWCopies];
  int w_dst[kWCopies];
  bool w_fill[kWCopies];
#pragma unroll
  for (int i = 0; i < kWCopies; ++i) {
    const int c = threadIdx.x + i * kThreads;
    const int r = c / S::kChunksPerRow, part = (c % S::kChunksPerRow) * 16;
    w_fill[i] = row0 + r < a.N;
    w_src[i] = a.weight_q + (w_fill[i] ? row0 + r : 0) * static_cast<int64_t>(a.K) +
               static_cast<int64_t>(k_first) * S::kBytesK + part;
    w_dst[i] = T::kWOffset + r * S::kPitch + part;
  }
  const int scale_row = threadIdx.x;  // threads < kTokens copy x_d runs, threads < kTileRows weight_d runs
  const bool xd_copy = scale_row < T::kTokens, xd_fill = xd_copy && tok0 + scale_row < a.T;
  const float* xd_src = a.x_d + (xd_fill ? tok0 + scale_row : 0) * a.x_d_stride + kBlocks * k_first;
  const bool wd_copy = scale_row < kTileRows, wd_fill = wd_copy && row0 + scale_row < a.N;
  const __half* wd_src =
      a.weight_d + (wd_fill ? row0 + scale_row : 0) * static_cast<int64_t>(blocks_per_row) + kBlocks * k_first;

  auto load_stage = [&](int kt) {
    unsigned char* s = smem + (kt % S::kDepth) * T::kStageBytes;
    const int64_t k0 = static_cast<int64_t>(kt) * S::kBytesK;
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      if (!x_copy[i]) continue;
      cp_async<16>(s + x_dst[i], x_src[i] + k0, x_fill[i]);
      if constexpr (kTwoWord) cp_async<16>(s + T::kXBytes + x_dst[i], x_lo_src[i] + k0, x_fill[i]);
    }
#pragma unroll
    for (int i = 0; i < kWCopies; ++i) cp_async<16>(s + w_dst[i], w_src[i] + k0, w_fill[i]);
    if (xd_copy) cp_async<4 * kBlocks>(s + T::kXdOffset + scale_row * 4 * kBlocks, xd_src + kBlocks * kt, xd_fill);
    if (wd_copy) cp_async<2 * kBlocks>(s + T::kWdOffset + scale_row * 2 * kBlocks, wd_src + kBlocks * kt, wd_fill);
  };

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warp_tok = (warp / kWarpsN) * 16 * kMTiles;  // this warp's first token within the tile
  const int warp_row = (warp % kWarpsN) * 32;            // and first weight row
  const int group = lane >> 2, quad = lane & 3;          // accumulator layout: token group (+8), rows 2*quad (+1)

  float acc[kMTiles][4][4];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;

  auto compute_stage = [&](int kt) {
    const unsigned char* s = smem + (kt % S::kDepth) * T::kStageBytes;
    const float* xd = reinterpret_cast<const float*>(s + T::kXdOffset);
    const __half* wd = reinterpret_cast<const __half*>(s + T::kWdOffset);
#pragma unroll
    for (int blk = 0; blk < kBlocks; ++blk) {
      // A (tokens): matrices = rows 0-7 / 8-15 x bytes 0-15 / 16-31 -> registers a0..a3 of m16n8k32.
      uint32_t xa[kMTiles][4], xa_lo[kMTiles][4];
      const int a_off = (lane & 15) * S::kPitch + blk * 32 + (lane >> 4) * 16;
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
        ldmatrix_x4(xa[mi], s + (warp_tok + mi * 16) * S::kPitch + a_off);
        if constexpr (kTwoWord) ldmatrix_x4(xa_lo[mi], s + T::kXBytes + (warp_tok + mi * 16) * S::kPitch + a_off);
      }
      // B (weight rows): one x4 = two n8 tiles, (rows 0-7: bytes 0-15, 16-31), (rows 8-15: ...).
      uint32_t wb[4][2];
      const int b_off = ((lane & 7) + (lane >> 4) * 8) * S::kPitch + blk * 32 + ((lane >> 3) & 1) * 16;
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        uint32_t r[4];
        ldmatrix_x4(r, s + T::kWOffset + (warp_row + p * 16) * S::kPitch + b_off);
        wb[2 * p][0] = r[0];
        wb[2 * p][1] = r[1];
        wb[2 * p + 1][0] = r[2];
        wb[2 * p + 1][1] = r[3];
      }
      float dx[kMTiles][2], dw[4][2];
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) dx[mi][h] = xd[(warp_tok + mi * 16 + group + 8 * h) * kBlocks + blk];
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e) dw[ni][e] = __half2float(wd[(warp_row + ni * 8 + 2 * quad + e) * kBlocks + blk]);

      // int8: fmaf(kMagic + dot, dw, -kMagic * dw) = dot * dw rounded once (kMagic * dw = 3 * 2^22 * dw is
      // exact for an fp16 dw), then one FMA with dx: two FP32 instructions per output and block, where
      // convert + scale product + FMA took four (this kernel is bound by them, not by the tensor cores).
      float magic_dw[4][2];
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e) magic_dw[ni][e] = -kMagic * dw[ni][e];
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          float c[4];
          mma_block(c, xa[mi], wb[ni]);
          if constexpr (kTwoWord) {
            float c_lo[4];
            mma_block(c_lo, xa_lo[mi], wb[ni]);
            // 127 * hi + lo (exact differences, rounded once); the 1/127 is applied at the store.
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float v = fmaf(c[e] - kMagic, 127.0f, c_lo[e] - kMagic);
              acc[mi][ni][e] = fmaf(v, dx[mi][e >> 1] * dw[ni][e & 1], acc[mi][ni][e]);
            }
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float dot_dw = fmaf(c[e], dw[ni][e & 1], magic_dw[ni][e & 1]);
              acc[mi][ni][e] = fmaf(dot_dw, dx[mi][e >> 1], acc[mi][ni][e]);
            }
          }
        }
    }
  };

#pragma unroll
  for (int kt = 0; kt < S::kDepth - 1; ++kt) {
    if (kt < num_k) load_stage(kt);
    cp_async_commit();
  }
  for (int kt = 0; kt < num_k; ++kt) {
    cp_async_wait<S::kDepth - 2>();
    __syncthreads();  // stage kt is visible to every warp, and the stage refilled below is no longer read
    if (kt + S::kDepth - 1 < num_k) load_stage(kt + S::kDepth - 1);
    cp_async_commit();
    compute_stage(kt);
  }

#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = tok0 + warp_tok + mi * 16 + group + 8 * (e >> 1);
        const int row = row0 + warp_row + ni * 8 + 2 * quad + (e & 1);
        if (tok >= a.T || row >= a.N) continue;
        if (partial != nullptr)
          partial[(static_cast<int64_t>(blockIdx.z) * a.T + tok) * a.N + row] = acc[mi][ni][e];
        else
          a.out[static_cast<int64_t>(tok) * a.out_stride + row] = kTwoWord ? acc[mi][ni][e] / 127.0f : acc[mi][ni][e];
      }
}

// out = the splits' partial sums added in split order (the same bits every run), the two-word lane's 1/127 last.
template <bool kTwoWord>
__global__ void __launch_bounds__(256) reduce_splits_kernel(const Q8GemvArgs a, const float* __restrict__ partial,
                                                            int splits) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, plane = static_cast<int64_t>(a.T) * a.N;
  if (i >= plane) return;
  float sum = partial[i];
  for (int z = 1; z < splits; ++z) sum += partial[z * plane + i];
  a.out[(i / a.N) * a.out_stride + i % a.N] = kTwoWord ? sum / 127.0f : sum;
}

// No PDL (pdl.cuh): the kernel has no griddepcontrol.wait.
template <bool kTwoWord, int kMTiles, int kBlocks>
cudaError_t launch(const Q8GemvArgs& a, int splits, float* partial, cudaStream_t stream) {
  using T = Tile<kTwoWord, kMTiles, kBlocks>;
  auto kernel = q8_0_gemm_kernel<kTwoWord, kMTiles, kBlocks>;
  static const cudaError_t attr_err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  if (attr_err != cudaSuccess) return attr_err;
  const unsigned grid_x = static_cast<unsigned>((a.T + T::kTokens - 1) / T::kTokens);
  const unsigned grid_y = static_cast<unsigned>((a.N + kTileRows - 1) / kTileRows);
  if (grid_y > 65535u || splits < 1 || (splits > 1 && partial == nullptr)) return cudaErrorInvalidValue;
  kernel<<<dim3(grid_x, grid_y, splits), kThreads, T::kSmemBytes, stream>>>(a, splits > 1 ? partial : nullptr);
  if (splits == 1) return cudaGetLastError();
  const int64_t plane = static_cast<int64_t>(a.T) * a.N;
  reduce_splits_kernel<kTwoWord><<<static_cast<unsigned>((plane + 255) / 256), 256, 0, stream>>>(a, partial, splits);
  return cudaGetLastError();
}

template <bool kTwoWord, int kBlocks>
cudaError_t dispatch(const Q8GemvArgs& a, int tile_tokens, int splits, float* partial, cudaStream_t stream) {
  switch (tile_tokens) {
    case 32: return launch<kTwoWord, 1, kBlocks>(a, splits, partial, stream);
    case 64: return launch<kTwoWord, 2, kBlocks>(a, splits, partial, stream);
    case 128: return launch<kTwoWord, 4, kBlocks>(a, splits, partial, stream);
  }
  return cudaErrorInvalidValue;
}

// Blocks resident per SM for a tile (what the launch bounds and shared memory allow), read once.
template <bool kTwoWord, int kMTiles, int kBlocks>
int resident_blocks() {
  static const int blocks = [] {
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, q8_0_gemm_kernel<kTwoWord, kMTiles, kBlocks>, kThreads,
                                                  Tile<kTwoWord, kMTiles, kBlocks>::kSmemBytes);
    return n > 0 ? n : 1;
  }();
  return blocks;
}

template <int kMTiles>
int resident_blocks(bool two_word, bool four_blocks) {
  if (two_word) return four_blocks ? resident_blocks<true, kMTiles, 4>() : resident_blocks<true, kMTiles, 2>();
  return four_blocks ? resident_blocks<false, kMTiles, 4>() : resident_blocks<false, kMTiles, 2>();
}

int multiprocessors() {
  static const int count = [] {
    int device = 0, n = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    return n > 0 ? n : 1;
  }();
  return count;
}

// Four blocks per stage need K % 128 == 0 and x_d runs of four floats in one 16-byte copy.
bool four_blocks_per_stage(const Q8GemvArgs& a) {
  return a.K % 128 == 0 && reinterpret_cast<uintptr_t>(a.x_d) % 16 == 0 && (a.T <= 1 || a.x_d_stride % 4 == 0);
}

}  // namespace

// Small T: the smallest tile (the weights are streamed once whatever the tile; less work is wasted).
// Otherwise 64 or 128 tokens, whichever needs less time in whole waves: a wave of resident blocks takes
// about tile * resident time units, and a partial last wave costs a whole one (at T = 512 the 5120-row
// projections make 160 blocks of 128 tokens for 132 SMs: a second wave 21% full).
int q8_0_gemm_default_tile(Q8Act act, const Q8GemvArgs& a) {
  if (a.T <= 32) return 32;
  if (a.T <= 64) return 64;
  const bool two_word = act == Q8Act::Int8x2, four = four_blocks_per_stage(a);
  const int sms = multiprocessors();
  auto cost = [&](int tile, int resident) {
    const long blocks = static_cast<long>((a.T + tile - 1) / tile) * ((a.N + kTileRows - 1) / kTileRows);
    const long slots = static_cast<long>(sms) * resident;
    return ((blocks + slots - 1) / slots) * tile * resident;
  };
  const long c64 = cost(64, resident_blocks<2>(two_word, four));
  const long c128 = cost(128, resident_blocks<4>(two_word, four));
  return c64 <= c128 ? 64 : 128;  // ties: 64 (two blocks per SM, twice the warps to hide latency)
}

// Small T: a token tile of K times the N / 128 weight-row tiles leaves most SMs idle or ends in a thin second wave
// (T = 16: 40 blocks for the 5120-row projections, 272 for the 34816-row one on 132 SMs x 2 resident; the trunk's
// matrices ran at 3.0x the T = 1 GEMV's time, H200, db5657b). So up to kSplitMaxTokens rows of x the K range is
// cut into the splits that minimise the modelled time: the weight stream stretched by its wave quantization
// (ceil(blocks / slots) whole waves for blocks / slots of work), plus the partial sums' round trip (8 bytes per
// split and output), each split at least kSplitMinStages stages so its pipeline fills. Prefill-sized T is never
// split: its bits stay those of one block order.
constexpr int kSplitMaxTokens = 64;
constexpr int kSplitMinStages = 8;
constexpr int kMaxSplits = 16;

int q8_0_gemm_default_splits(Q8Act act, const Q8GemvArgs& a, int tile_tokens) {
  const bool four = four_blocks_per_stage(a), two_word = act == Q8Act::Int8x2;
  const int stages = a.K / (four ? 128 : 64);
  if (a.T > kSplitMaxTokens || stages < 2 * kSplitMinStages) return 1;
  const int resident = tile_tokens == 32   ? resident_blocks<1>(two_word, four)
                       : tile_tokens == 64 ? resident_blocks<2>(two_word, four)
                                           : resident_blocks<4>(two_word, four);
  const double blocks = static_cast<double>((a.T + tile_tokens - 1) / tile_tokens) * ((a.N + kTileRows - 1) / kTileRows);
  const double slots = static_cast<double>(multiprocessors()) * resident;
  const double weight_bytes_per_row = a.K * (1.0 + 2.0 / 32);  // quants and scales of one weight row
  int best = 1;
  double best_cost = 0.0;
  for (int splits = 1; splits <= kMaxSplits && splits * kSplitMinStages <= stages; ++splits) {
    const double work = blocks * splits / slots;  // in waves
    const double cost = weight_bytes_per_row * std::ceil(work) / work + (splits > 1 ? 8.0 * splits * a.T : 0.0);
    if (splits == 1 || cost < best_cost) best = splits, best_cost = cost;
  }
  return best;
}

bool q8_0_gemm_splits_from_env(int* splits) {
  const char* env = std::getenv("QWEN38_Q8_GEMM_SPLITS");
  if (env == nullptr || env[0] == '\0') return false;
  *splits = std::atoi(env);
  return true;
}

int q8_0_gemm_splits(Q8Act act, const Q8GemvArgs& args) {
  if (q8_0_gemm_kernel() != Q8GemmKernel::MmaSync || args.N == 0 || args.T == 0) return 1;
  int splits = 0;
  if (q8_0_gemm_splits_from_env(&splits)) return splits;
  int tile_tokens = 0;
  if (!q8_0_gemm_tile_from_env(&tile_tokens)) tile_tokens = q8_0_gemm_default_tile(act, args);
  return q8_0_gemm_default_splits(act, args, tile_tokens);
}

bool q8_0_gemm_tile_from_env(int* tile) {
  const char* env = std::getenv("QWEN38_Q8_GEMM_TILE");
  if (env == nullptr || env[0] == '\0') return false;
  *tile = std::atoi(env);
  return true;
}

bool q8_0_gemm_kernel_from_env(Q8GemmKernel* kernel) {
  const char* env = std::getenv("QWEN38_Q8_GEMM_KERNEL");
  if (env == nullptr || env[0] == '\0') return false;
  *kernel = std::strcmp(env, "mma") == 0          ? Q8GemmKernel::MmaSync
            : std::strcmp(env, "wgmma") == 0      ? Q8GemmKernel::Wgmma
            : std::strcmp(env, "wgmma_iadd") == 0 ? Q8GemmKernel::WgmmaIadd
                                                  : Q8GemmKernel::Unknown;
  return true;
}

Q8GemmKernel q8_0_gemm_kernel() {
  Q8GemmKernel kernel;
  return q8_0_gemm_kernel_from_env(&kernel) ? kernel : Q8GemmKernel::MmaSync;
}

cudaError_t q8_0_gemm_launch(Q8Act act, const Q8GemvArgs& args, int splits, float* partial, cudaStream_t stream) {
  if (args.N == 0 || args.T == 0) return cudaSuccess;
  if (args.K <= 0 || args.K % 64 != 0 || act == Q8Act::F32) return cudaErrorInvalidValue;
  int tile_tokens = 0;
  const bool tile_from_env = q8_0_gemm_tile_from_env(&tile_tokens);
  const Q8GemmKernel kernel = q8_0_gemm_kernel();
  if (kernel == Q8GemmKernel::Wgmma || kernel == Q8GemmKernel::WgmmaIadd) {
    if (splits != 1) return cudaErrorInvalidValue;  // the wgmma kernel does not split K (q8_0_gemm_splits)
    if (!tile_from_env) tile_tokens = q8_0_gemm_sm90_default_tile(act, args);
    return q8_0_gemm_sm90_launch(act, args, tile_tokens, kernel == Q8GemmKernel::Wgmma, stream);
  }
  if (kernel != Q8GemmKernel::MmaSync) return cudaErrorInvalidValue;
  if (!tile_from_env) tile_tokens = q8_0_gemm_default_tile(act, args);
  const bool two_word = act == Q8Act::Int8x2;
  if (four_blocks_per_stage(args))
    return two_word ? dispatch<true, 4>(args, tile_tokens, splits, partial, stream)
                    : dispatch<false, 4>(args, tile_tokens, splits, partial, stream);
  return two_word ? dispatch<true, 2>(args, tile_tokens, splits, partial, stream)
                  : dispatch<false, 2>(args, tile_tokens, splits, partial, stream);
}

}  // namespace qwen38
