// Q8_0 GEMM on Hopper's own instructions (sm_90a): wgmma, TMA, warp specialization, a persistent grid. Same
// arguments, same math and the same bits as the mma.sync kernel (q8_gemm.cu; q8_gemm.h has the contract).
//
// Why it is shaped like this.
// - The mma.sync kernel is latency-bound at a quarter of torch._int_mm (benchmarks/NOTES.md, Prefill): its warps
//   issue ldmatrix, MMAs and scale FMAs in one stream. Here one wgmma m64nNk32 per warpgroup and Q8_0 block
//   (k32 = one block: each int32 dot is exact) replaces 64-128 mma.sync and every ldmatrix, and a producer warp
//   feeds shared memory through TMA, so what the consumer warps issue is almost only the scale FMAs.
// - Weights are wgmma's M (64 rows a consumer warpgroup, two of them: 128 rows a tile), tokens its N (128, or 64
//   where that fills the waves better; always 64 in the two-word lane, whose hi and lo dots need twice the
//   accumulators). A thread's accumulator fragment spans
//   2 rows and N/4 tokens, so the per-row scale (fp16 weight_d, which needs a conversion and the magic product)
//   costs 2 per block and the per-token x_d N/4 loads, 4 to an LDS.128 (the permuted x_d layout below). Stores
//   still coalesce: a warp's store covers 8 consecutive rows of 4 tokens, four whole 32-byte sectors.
// - Double-buffered accumulators: block b+1's wgmma is issued before block b's scale FMAs, so the tensor cores
//   work under the FP32 pipe, which bounds this kernel (2 FMAs per output and block: NOTES.md's ceiling), across
//   runs of two stages (run_stages says why not further).
// - Registers: the consumers hold 64 float sums and 2 x 64 int32 accumulators a thread (int8; two-word 32 and
//   2 x 2 x 32); at 232 registers the stage loop spilled, so the producer warpgroup keeps 24 (setmaxnreg) and the
//   consumers get 240. The producer's few spills are off the FMA stream.
// - The int -> float conversion is the mma.sync kernel's: the accumulator starts at the bits of kMagic and
//   wgmma adds the dot to them (scale-d = 1). Resetting the accumulator to kMagic after each use is one register
//   write per output and block, a third instruction next to the two FMAs; with kResetFromShared the reset is an
//   LDS.128 of four kMagic words (a broadcast: one address for the warp), a quarter instruction. Without it the
//   wgmma overwrites (scale-d = 0) and an integer add folds kMagic in: the same instructions as a MOV reset, no
//   shared-memory traffic. Both are compiled so that one run can measure both (QWEN38_Q8_GEMM_KERNEL, q8_gemm.h).
// - A stage is 128 bytes of K (four blocks): one 128-byte swizzle row of TMA and wgmma, so the tiles need no
//   padding and every wgmma reads them conflict-free; the k32 steps advance the descriptors by 32 bytes.
//   Past K (K % 128 == 64: half a stage; K % 256 != 0: a whole stage, to make runs of two) the scale copies fill
//   zeros, and a block with zero scales adds exactly nothing (see num_k).
// - Scales (x_d, weight_d) are not TMA-able in general (TMA wants 16-byte row strides), so the producer warp
//   copies them with 4-byte cp.async that arrive on the same mbarrier as the TMA bytes.
// - Persistent: one block per SM walks tiles t = blockIdx.x, + gridDim.x, ..., token tiles fastest, so the
//   blocks in flight share a few weight tiles (read once from HBM) while the activation stays L2-resident.
#include "q8_gemm.h"

#include <cstdint>

#include <cuda.h>           // CUtensorMap
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include "common.cuh"  // cp_async, shared_address

// The host side cannot see which device architecture the kernels were compiled for: setup.py defines QWEN38_WGMMA
// with its sm_90a gencode, and the dispatch (q8_gemm.cu) picks this kernel only then and only on an sm_90 device.
// A device pass without sm_90a's features (QWEN38_CUDA_ARCH=90, or the compute_90 PTX of -arch=sm_90a) compiles
// the kernel body out (to a trap).
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QWEN38_SM90A_BODY 1
#endif

namespace qwen38 {
namespace {

constexpr int kRows = 128;  // weight rows per tile: two consumer warpgroups of wgmma's M = 64
constexpr int kStageK = 128;
constexpr int kStageBlocks = kStageK / 32;
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kProducerRegs = 24, kConsumerRegs = 240;  // see "Registers" above
static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= 65536, "register file");

constexpr int kMagicBits = 0x4B400000;  // 1.5 * 2^23: see q8_gemm.cu's mma_block
constexpr float kMagic = 12582912.0f;

template <bool kTwoWord, int kTokenTile>
struct Sm90Tile {
  static_assert(kTokenTile == 128 || kTokenTile == 64, "compiled token tiles: 128, 64");
  static_assert(!kTwoWord || kTokenTile == 64, "two-word: hi and lo accumulators, double-buffered, fit 64 tokens");
  static constexpr int kTokens = kTokenTile;
  static constexpr int kFrag = kTokens / 2;  // accumulator registers per thread and matrix
  static constexpr int kWBytes = kRows * kStageK;
  static constexpr int kXBytes = kTokens * kStageK;
  static constexpr int kXOffset = kWBytes;
  static constexpr int kXdOffset = kXOffset + (kTwoWord ? 2 : 1) * kXBytes;  // x_lo (two-word) at kXOffset + kXBytes
  static constexpr int kWdOffset = kXdOffset + 4 * kStageBlocks * kTokens;    // x_d: float [kStageBlocks][kTokens]
  static constexpr int kStageBytes = kWdOffset + 2 * kStageBlocks * kRows;   // weight_d: half [kRows][kStageBlocks]
  static constexpr int kStages = 6;
  static constexpr int kBarOffset = kStages * kStageBytes;  // full[kStages], empty[kStages], 4 x kMagicBits
  static constexpr int kSmemBytes = 1024 + kBarOffset + 16 * kStages + 16;  // 1024: aligning the base
  static constexpr uint32_t kTmaBytes = kWBytes + (kTwoWord ? 2 : 1) * kXBytes;
  static_assert(kStageBytes % 1024 == 0, "128-byte swizzled tiles must start 1024-byte aligned");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

// x_d of token n (within the tile) sits at pos(n) of its block's run: the 4 tokens of one of a thread's
// LDS.128, {16J + 2q, +1, 16J + 8 + 2q, +1} (the fragment's token pairs j = 2J, 2J + 1), are adjacent.
__host__ __device__ constexpr int xd_position(int n) {
  return (n & ~15) | ((n & 6) << 1) | ((n & 8) >> 2) | (n & 1);
}

struct Sm90Params {
  CUtensorMap w, x, x_lo;  // weight_q [N, K], x [T, K], x_lo [T, K] (two-word): boxes of 128 bytes of K
  Q8GemvArgs a;
};

#ifdef QWEN38_SM90A_BODY
// ---- PTX wrappers (PTX ISA: mbarrier, cp.async.bulk.tensor, wgmma, setmaxnreg) -----------------------------
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// The calling thread's earlier cp.async arrive on `bar` when they complete (counted in the barrier's init count).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int k, int row, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(map), "r"(k), "r"(row), "r"(bar)
      : "memory");
}

// K-major operand, 128-byte swizzle, rows 128 bytes apart: 8-row groups 1024 bytes apart (stride byte offset),
// the leading byte offset unused for a K extent within one swizzle row (1 by convention).
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t address) {
  return (uint64_t{1} << 62) | (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 16) | ((address & 0x3FFFF) >> 4);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Pins a register to this point of the instruction stream: its reads cannot move above a wgmma wait, nor its
// writes below a wgmma issue (the compiler does not know that the wgmma writes the accumulators asynchronously).
template <int kN>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// d (+)= A (64 x 32, smem) . B (32 x kN, smem), s8 x s8 -> s32; kScaleD = 0 overwrites d.
template <int kN, int kScaleD>
__device__ __forceinline__ void wgmma_s8(uint32_t (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (kN == 128) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
          "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
          "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]),
          "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]),
          "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]),
          "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]),
          "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
        : "l"(desc_a), "l"(desc_b), "n"(kScaleD));
  } else {
    static_assert(kN == 64, "compiled widths: 128 (int8), 64 (two-word)");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
          "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
          "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
        : "l"(desc_a), "l"(desc_b), "n"(kScaleD));
  }
}

// Four registers = kMagicBits from shared memory in one instruction; ld.volatile so that neither NVVM nor ptxas
// merges the 16 loads of a fragment into one load and 64 register moves (ptxas did, with a plain ld.shared).
__device__ __forceinline__ void load_magic4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, uint32_t magic) {
  asm volatile("ld.volatile.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(magic));
}
#endif  // QWEN38_SM90A_BODY

// The accumulators of one Q8_0 block: the dot (two-word: hi and lo dots) of the warpgroup's 64 rows x kTokens.
template <bool kTwoWord, int kFrag>
struct BlockAcc {
  uint32_t hi[kFrag];
  uint32_t lo[kTwoWord ? kFrag : 1];
};

template <bool kTwoWord, int kTokenTile, bool kResetFromShared>
__global__ void __launch_bounds__(kThreads, 1) q8_0_gemm_sm90_kernel(const __grid_constant__ Sm90Params p) {
#ifdef QWEN38_SM90A_BODY
  using L = Sm90Tile<kTwoWord, kTokenTile>;
  constexpr int kFrag = L::kFrag;
  constexpr int kScaleD = kResetFromShared ? 1 : 0;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t smem = (shared_address(smem_raw) + 1023u) & ~1023u;
  unsigned char* smem_ptr = smem_raw + (smem - shared_address(smem_raw));
  const uint32_t full_bar = smem + L::kBarOffset, empty_bar = full_bar + 8 * L::kStages;
  const uint32_t magic4 = empty_bar + 8 * L::kStages;
  const Q8GemvArgs& a = p.a;

  if (threadIdx.x == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      mbar_init(full_bar + 8 * s, 1 + 32);                // the TMA thread's expect_tx + the producer warp's copies
      mbar_init(empty_bar + 8 * s, 128 * kConsumers);  // every consumer thread, after its last read of the stage
    }
    uint32_t* m = reinterpret_cast<uint32_t*>(smem_ptr + L::kBarOffset + 16 * L::kStages);
    m[0] = m[1] = m[2] = m[3] = kMagicBits;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  // Stages in runs of two (run_stages): a stage past K has zero scales, so it adds exactly nothing whatever its
  // tiles hold (fma(c, 0, -0) = +0, and acc + 0 == acc: the sums start at +0 and never become -0).
  const int blocks = a.K / 32, num_k = 2 * ((a.K + 2 * kStageK - 1) / (2 * kStageK));
  const int tok_tiles = (a.T + L::kTokens - 1) / L::kTokens;
  const int num_tiles = tok_tiles * ((a.N + kRows - 1) / kRows);
  const int warpgroup = threadIdx.x / 128, lane = threadIdx.x & 31;

  if (warpgroup == 0) {
    // Producer: warp 0 alone; the other three give their registers back and leave.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    if (threadIdx.x >= 32) return;
    if (lane == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(&p.w) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(&p.x) : "memory");
      if constexpr (kTwoWord) asm volatile("prefetch.tensormap [%0];" ::"l"(&p.x_lo) : "memory");
    }
    int stage = 0;
    uint32_t phase = 0;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const int row0 = (tile / tok_tiles) * kRows, tok0 = (tile % tok_tiles) * L::kTokens;
      for (int kt = 0; kt < num_k; ++kt) {
        mbar_wait(empty_bar + 8 * stage, phase ^ 1);  // the first pass finds every stage free
        const uint32_t s = smem + stage * L::kStageBytes, bar = full_bar + 8 * stage;
        if (lane == 0 && kt * kStageK < a.K) {
          mbar_arrive_expect_tx(bar, L::kTmaBytes);
          tma_load_2d(s, &p.w, kt * kStageK, row0, bar);
          tma_load_2d(s + L::kXOffset, &p.x, kt * kStageK, tok0, bar);
          if constexpr (kTwoWord) tma_load_2d(s + L::kXOffset + L::kXBytes, &p.x_lo, kt * kStageK, tok0, bar);
        } else if (lane == 0) {
          mbar_arrive(bar);  // a stage past K: its scales alone (zeros) matter
        }
        unsigned char* sp = smem_ptr + stage * L::kStageBytes;
        // x_d: a lane per token (its four blocks are one 16-byte run in global memory), zeros past T and K.
#pragma unroll
        for (int i = 0; i < L::kTokens / 32; ++i) {
          const int n = lane + 32 * i;
          const bool tok_in = tok0 + n < a.T;
          const float* src = a.x_d + (tok_in ? tok0 + n : 0) * a.x_d_stride;
#pragma unroll
          for (int b = 0; b < kStageBlocks; ++b) {
            const int blk = kt * kStageBlocks + b;
            const bool fill = tok_in && blk < blocks;
            cp_async<4>(sp + L::kXdOffset + 4 * (b * L::kTokens + xd_position(n)), src + (fill ? blk : 0), fill);
          }
        }
        // weight_d: [row][4 blocks], two 4-byte copies a row (rows are only 4-byte aligned when K % 128 == 64).
#pragma unroll
        for (int i = 0; i < 2 * kRows / 32; ++i) {
          const int c = lane + 32 * i, r = c / 2, pair = c % 2;
          const int blk = kt * kStageBlocks + 2 * pair;
          const bool fill = row0 + r < a.N && blk < blocks;
          const __half* src = a.weight_d + (fill ? (row0 + r) * static_cast<int64_t>(blocks) + blk : 0);
          cp_async<4>(sp + L::kWdOffset + 2 * (r * kStageBlocks + 2 * pair), src, fill);
        }
        cp_async_mbar_arrive(bar);
        if (++stage == L::kStages) stage = 0, phase ^= 1;
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");  // no copy outlives its thread
    return;
  }

  // Consumers: warpgroup 1 + c owns weight rows [64 c, 64 c + 64) of the tile.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));
  const int c = warpgroup - 1, warp = (threadIdx.x / 32) % 4, g = lane / 4, q = lane % 4;
  const int frag_row = 64 * c + 16 * warp + g;  // and frag_row + 8: the fragment's two rows

  BlockAcc<kTwoWord, kFrag> acc_buf[2];
  // Every accumulator starts reset: kMagic for scale-d = 1, anything for scale-d = 0 (overwritten).
#pragma unroll
  for (int bi = 0; bi < 2; ++bi) {
#pragma unroll
    for (int i = 0; i < kFrag; ++i) acc_buf[bi].hi[i] = kMagicBits;
#pragma unroll
    for (int i = 0; i < (kTwoWord ? kFrag : 1); ++i) acc_buf[bi].lo[i] = kMagicBits;
  }

  auto issue = [&](BlockAcc<kTwoWord, kFrag>& d, int stage, int b) {
    const uint32_t s = smem + stage * L::kStageBytes + 32 * b;
    const uint64_t da = smem_descriptor(s + 64 * c * kStageK);
    fence_registers(d.hi);
    if constexpr (kTwoWord) fence_registers(d.lo);
    wgmma_fence();
    wgmma_s8<L::kTokens, kScaleD>(d.hi, da, smem_descriptor(s + L::kXOffset));
    if constexpr (kTwoWord) wgmma_s8<L::kTokens, kScaleD>(d.lo, da, smem_descriptor(s + L::kXOffset + L::kXBytes));
    wgmma_commit();
  };
  // The dot as kMagic + dot in float (exact): free with scale-d = 1, one integer add with scale-d = 0.
  auto magic_dot = [](uint32_t d) {
    return kResetFromShared ? __uint_as_float(d) : __int_as_float(static_cast<int>(d) + kMagicBits);
  };

  // Two consecutive stages of one tile as one pipeline: block j + 1's wgmma goes in before block j's FMAs, across
  // the stage boundary too. A run ends with no wgmma in flight: ptxas serializes every wgmma of a loop whose back
  // edge carries one (measured in its SASS: every wait became "all"), so each run's first block is waited for with
  // nothing to do; runs of two stages halve that, and the other consumer warpgroup's FMAs (the same four
  // schedulers) cover some of it.
  constexpr int kRun = 2, kRunBlocks = kRun * kStageBlocks;
  auto run_stages = [&](int& stage, uint32_t& phase, float (&acc)[kFrag]) {
    int stages[kRun];
    uint32_t phases[kRun];
#pragma unroll
    for (int r = 0; r < kRun; ++r) {
      stages[r] = stage, phases[r] = phase;
      if (++stage == L::kStages) stage = 0, phase ^= 1;
    }
    mbar_wait(full_bar + 8 * stages[0], phases[0]);
    issue(acc_buf[0], stages[0], 0);
    uint2 wd_lo, wd_hi;  // weight_d of the fragment's rows in the current stage: fp16 [4 blocks]
#pragma unroll
    for (int j = 0; j < kRunBlocks; ++j) {
      const int r = j / kStageBlocks, b = j % kStageBlocks;
      if (j + 1 < kRunBlocks) {
        if ((j + 1) % kStageBlocks == 0) mbar_wait(full_bar + 8 * stages[r + 1], phases[r + 1]);
        issue(acc_buf[(j + 1) & 1], stages[(j + 1) / kStageBlocks], (j + 1) % kStageBlocks);
        wgmma_wait<1>();
      } else {
        wgmma_wait<0>();
      }
      BlockAcc<kTwoWord, kFrag>& d = acc_buf[j & 1];
      fence_registers(d.hi);
      if constexpr (kTwoWord) fence_registers(d.lo);

      const unsigned char* sp = smem_ptr + stages[r] * L::kStageBytes;
      if (b == 0) {
        wd_lo = *reinterpret_cast<const uint2*>(sp + L::kWdOffset + 2 * kStageBlocks * frag_row);
        wd_hi = *reinterpret_cast<const uint2*>(sp + L::kWdOffset + 2 * kStageBlocks * (frag_row + 8));
      }
      float dw[2];  // block b's: fp16 pairs, blocks 0-1 in .x, 2-3 in .y
      {
        const uint32_t w0 = b < 2 ? wd_lo.x : wd_lo.y, w1 = b < 2 ? wd_hi.x : wd_hi.y;
        const int sh = (b & 1) * 16;
        dw[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(w0 >> sh)));
        dw[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w1 >> sh)));
      }
      const float4* xd4 = reinterpret_cast<const float4*>(sp + L::kXdOffset) + b * (L::kTokens / 4) + q;
#pragma unroll
      for (int J = 0; J < L::kTokens / 16; ++J) {
        const float4 f = xd4[4 * J];
        const float dx[2][2] = {{f.x, f.y}, {f.z, f.w}};  // [token pair j - 2J][token within the pair]
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          // Fragment register i = 4j + 2 h + t: row frag_row + 8 h, token 8 j + 2 q + t (PTX ISA, wgmma D).
          const int i = 8 * J + e, h = (e >> 1) & 1, t = e & 1;
          const float x = dx[e >> 2][t];
          if constexpr (kTwoWord) {
            // The mma.sync kernel's order: 127 hi + lo rounded once, then the FMA with the scale product.
            const float v = fmaf(magic_dot(d.hi[i]) - kMagic, 127.0f, magic_dot(d.lo[i]) - kMagic);
            acc[i] = fmaf(v, x * dw[h], acc[i]);
          } else {
            // dot * dw rounded once (kMagic * dw is exact), then the FMA with x_d: the mma.sync kernel's bits.
            acc[i] = fmaf(fmaf(magic_dot(d.hi[i]), dw[h], -kMagic * dw[h]), x, acc[i]);
          }
        }
      }
      if constexpr (kResetFromShared) {
#pragma unroll
        for (int i = 0; i < kFrag; i += 4) load_magic4(d.hi[i], d.hi[i + 1], d.hi[i + 2], d.hi[i + 3], magic4);
        if constexpr (kTwoWord) {
#pragma unroll
          for (int i = 0; i < kFrag; i += 4) load_magic4(d.lo[i], d.lo[i + 1], d.lo[i + 2], d.lo[i + 3], magic4);
        }
      }
      if (b + 1 == kStageBlocks) mbar_arrive(empty_bar + 8 * stages[r]);  // its wgmmas done, its scales read
    }
  };

  int stage = 0;
  uint32_t phase = 0;
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    float acc[kFrag];
#pragma unroll
    for (int i = 0; i < kFrag; ++i) acc[i] = 0.0f;
    for (int kt = 0; kt < num_k; kt += kRun) run_stages(stage, phase, acc);
    const int row0 = (tile / tok_tiles) * kRows, tok0 = (tile % tok_tiles) * L::kTokens;
#pragma unroll
    for (int i = 0; i < kFrag; ++i) {
      const int row = row0 + frag_row + 8 * ((i >> 1) & 1);
      const int tok = tok0 + 8 * (i >> 2) + 2 * q + (i & 1);
      if (row < a.N && tok < a.T)
        a.out[static_cast<int64_t>(tok) * a.out_stride + row] = kTwoWord ? acc[i] / 127.0f : acc[i];
    }
  }
#else
  __trap();  // a device pass without sm_90a: loud if a build ever launched it (the dispatch never does)
#endif  // QWEN38_SM90A_BODY
}

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &found);
#endif
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f)
               : nullptr;
  }();
  return fn;
}

// An int8 [rows, K] matrix with `stride` bytes between rows, in boxes of 128 bytes of K x box_rows rows, 128-byte
// swizzled (wgmma's K-major layout); reads past the matrix fill zeros.
bool encode_matrix(CUtensorMap* map, const void* base, int64_t rows, int64_t K, int64_t stride, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride)};
  const cuuint32_t box[2] = {kStageK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box, unit,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

int multiprocessors(int device) {
  static int count[64] = {};
  if (device < 0 || device >= 64) return 1;
  if (count[device] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    count[device] = n > 0 ? n : 1;
  }
  return count[device];
}

template <bool kTwoWord, int kTokenTile, bool kResetFromShared>
cudaError_t launch(const Q8GemvArgs& a, cudaStream_t stream) {
  using L = Sm90Tile<kTwoWord, kTokenTile>;
  auto kernel = q8_0_gemm_sm90_kernel<kTwoWord, kTokenTile, kResetFromShared>;
  static const cudaError_t attr_err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kSmemBytes);
  if (attr_err != cudaSuccess) return attr_err;
  Sm90Params p;
  p.a = a;
  if (!encode_matrix(&p.w, a.weight_q, a.N, a.K, a.K, kRows) ||
      !encode_matrix(&p.x, a.x, a.T, a.K, a.x_stride, L::kTokens) ||
      (kTwoWord && !encode_matrix(&p.x_lo, a.x_lo, a.T, a.K, a.x_lo_stride, L::kTokens)))
    return cudaErrorInvalidValue;
  if (!kTwoWord) p.x_lo = p.x;
  int device = 0;
  cudaGetDevice(&device);
  const long tiles = static_cast<long>((a.T + L::kTokens - 1) / L::kTokens) * ((a.N + kRows - 1) / kRows);
  const unsigned grid = static_cast<unsigned>(tiles < multiprocessors(device) ? tiles : multiprocessors(device));
  kernel<<<grid, kThreads, L::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

bool q8_0_gemm_sm90_supported(const Q8GemvArgs& a) {
#ifndef QWEN38_WGMMA
  (void)a;
  return false;
#else
  static int capability[64] = {};  // major * 10 + minor, 0 = not read yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return false;
  if (capability[device] == 0) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    capability[device] = 10 * major + minor;
  }
  const auto aligned = [](const void* ptr, uintptr_t n) { return reinterpret_cast<uintptr_t>(ptr) % n == 0; };
  // TMA: 16-byte aligned bases and row strides (the bindings check the activations' already); 4-byte scale copies.
  return capability[device] == 90 && a.K % 64 == 0 && aligned(a.weight_q, 16) && aligned(a.x, 16) &&
         a.x_stride % 16 == 0 && (a.x_lo == nullptr || (aligned(a.x_lo, 16) && a.x_lo_stride % 16 == 0)) &&
         aligned(a.weight_d, 4);
#endif
}

// 64-token tiles give twice the tiles, for the shapes whose 128-token tiles leave a wave mostly empty (T = 512 on
// the 5120-row projections: 160 tiles on 132 SMs); a wave of 64-token tiles is costed at 55% of one of 128 (the
// per-block wgmma, wait and scale loads are spread over half the outputs; an estimate, not measured).
int q8_0_gemm_sm90_default_tile(Q8Act act, const Q8GemvArgs& a) {
  if (act == Q8Act::Int8x2) return 64;
  int device = 0;
  cudaGetDevice(&device);
  const long sms = multiprocessors(device), row_tiles = (a.N + kRows - 1) / kRows;
  auto waves = [&](int tile) { return ((a.T + tile - 1) / tile * row_tiles + sms - 1) / sms; };
  return 55 * waves(64) < 100 * waves(128) ? 64 : 128;
}

cudaError_t q8_0_gemm_sm90_launch(Q8Act act, const Q8GemvArgs& a, int tile_tokens, bool reset_from_shared,
                                  cudaStream_t stream) {
  if (a.N == 0 || a.T == 0) return cudaSuccess;
  if (!q8_0_gemm_sm90_supported(a) || act == Q8Act::F32) return cudaErrorNotSupported;
  if (act == Q8Act::Int8x2) {
    if (tile_tokens != 64) return cudaErrorInvalidValue;
    return reset_from_shared ? launch<true, 64, true>(a, stream) : launch<true, 64, false>(a, stream);
  }
  switch (tile_tokens) {
    case 64: return reset_from_shared ? launch<false, 64, true>(a, stream) : launch<false, 64, false>(a, stream);
    case 128: return reset_from_shared ? launch<false, 128, true>(a, stream) : launch<false, 128, false>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace qwen38
