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
//   (m with m ^ 8, then ^ 4, ^ 2, ^ 1), and the parts in order. Block b is in part (b / 16) mod PARTS, so the
//   512-byte piece p = b / 16 belongs to part p % PARTS whole, and a part can be summed on its own: the kernel
//   walks a unit's pieces part by part (q, q + PARTS, ..), consumer warp w computing block w of every piece (chain
//   16q + w) with exactly the GEMV's arithmetic (fma(int_to_double(s), double(wd * xd), acc), wd * xd in fp32);
//   at a part's end the 16 chains meet in shared memory and one thread per output adds them in the butterfly's
//   order, then into the parts' running total. Only one part's chains are live: 4 * NT doubles a thread.
// - Persistent, with a producer warp: one block an SM walks its units (a unit: 16 weight rows x 8 * NT rows of x,
//   its whole K), and a producer warp fills a ring of kStages pieces (16 x 512 contiguous weight bytes, the same
//   piece of the unit's rows of x, their scales) with the bulk copy engine, running ahead across part and unit
//   boundaries; each copy completes on its stage's mbarrier, the consumer warps wait on that barrier alone and
//   release the stage on another, and the part's reduction syncs the consumers only. Measured on the H200 (NOTES,
//   "Many sequences at once"), the forms before streamed at ~1.6 TB/s (a block per unit, cp.async from every thread
//   and a __syncthreads per 8 KB piece: 2.6x the T = 1 time from T = 2 on), and worse, 3.35x at T = 2, with the
//   bulk copies but still a block per unit of a few pieces (the PARTS = 4 parts as a cluster of blocks): each
//   block's ramp and drain left its share of the stream idle.
// - Loads past the edge: weight rows past N and rows of x past T are not copied, and a stage's expected bytes
//   count only what is. Weights are constants, so the first stages' weights are requested before the PDL wait,
//   under the predecessor's tail. Fragments come from shared memory by ldmatrix, rows padded by 16 bytes
//   (conflict-free, as q8_gemm.cu).
#include "q8_gemv.h"

#include <cstdlib>

#include "common.cuh"
#include "pdl.cuh"

namespace qwen38 {
namespace {

constexpr int kChainWarps = 16;                       // consumer warp w computes block w of every piece
constexpr int kRowsThreads = (kChainWarps + 1) * 32;  // + the producer warp
constexpr int kPitch = 512 + 16;        // a row's piece in shared memory, padded: ldmatrix phases hit distinct banks
constexpr int kSharedBudget = 200 * 1024;  // one block an SM (227 KB of shared memory)

template <int NT>
struct RowsTile {
  static constexpr int kCols = 8 * NT;  // rows of x a unit
  static constexpr int kXOffset = 16 * kPitch;
  static constexpr int kWdOffset = kXOffset + kCols * kPitch;  // [16 rows][16 blocks] fp16
  static constexpr int kXdOffset = kWdOffset + 16 * 16 * 2;    // [kCols][16 blocks] float
  static constexpr int kStageBytes = kXdOffset + kCols * 16 * 4;
  static constexpr int kPartialBytes = kChainWarps * 16 * kCols * 8;  // a part's chains, [warp][weight row][x row]
  static constexpr int kStages = (kSharedBudget - kPartialBytes) / (kStageBytes + 16);
  static constexpr int kPartialOffset = kStages * kStageBytes;
  static constexpr int kBarrierOffset = kPartialOffset + kPartialBytes;  // full[kStages], empty[kStages]
  static constexpr int kSharedBytes = kBarrierOffset + 2 * kStages * 8;
  static_assert(kStages >= 4, "a ring of at least four stages");
  static_assert(kStageBytes % 16 == 0 && kXdOffset % 16 == 0 && kWdOffset % 16 == 0, "16-byte aligned copies");
  static_assert(kCols <= 16, "one producer lane per row of x and per row of its scales");
};

__device__ __forceinline__ void mma_s8(int (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%10, %10, %10, %10};"
               : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0));
}

// The consumer warps' own barrier (named barrier 1): the producer never waits on it.
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kChainWarps * 32) : "memory");
}

// The block's work: units u = blockIdx.x, + gridDim.x, .. of units = row tiles x column tiles (column fastest, so
// the blocks that share a weight tile run side by side and read it from HBM once); a unit's pieces part by part.
template <int PARTS, int NT>
struct RowsUnits {
  int col_tiles, units, pieces;
  __device__ explicit RowsUnits(const Q8GemvArgs& a)
      : col_tiles((a.T + 8 * NT - 1) / (8 * NT)), units(col_tiles * ((a.N + 15) / 16)), pieces(a.K >> 9) {}
  __device__ int row0(int u) const { return (u / col_tiles) * 16; }
  __device__ int col0(int u) const { return (u % col_tiles) * 8 * NT; }
  // The j-th piece of a unit: part q's pieces are q, q + PARTS, .., and the parts come in order.
  __device__ int piece(int j) const {
    int q = 0;
#pragma unroll
    for (int k = 0; k < PARTS - 1; ++k) {
      const int in_part = pieces > q ? (pieces - q + PARTS - 1) / PARTS : 0;
      if (j < in_part) break;
      j -= in_part;
      ++q;
    }
    return q + j * PARTS;
  }
};

// The producer warp's copies for one unit: lane l < 16 copies weight row l's piece and, for l < kCols, row l of
// x's; lane 16 + l the scales of weight row l and, for l < kCols, of row l of x. Rows past N or T are skipped and
// the stage's expected bytes count only what is copied: their shared-memory rows keep what an earlier unit left
// (or nothing), which feeds only outputs that are not stored.
template <int NT>
struct RowsCopies {
  using S = RowsTile<NT>;
  const int8_t* w_src;
  const int8_t* x_src;
  const __half* wd_src;
  const float* xd_src;
  bool w_in, x_in, wd_in, xd_in;
  uint32_t stage_bytes;

  __device__ RowsCopies(const Q8GemvArgs& a, int lane, int row0, int col0) {
    const int r = lane & 15;
    const bool low = lane < 16;
    const int weight_rows = min(16, a.N - row0), x_rows = min(S::kCols, a.T - col0);
    w_in = low && r < weight_rows;
    x_in = low && r < x_rows;
    wd_in = !low && r < weight_rows;
    xd_in = !low && r < x_rows;
    w_src = a.weight_q + static_cast<size_t>(row0 + r) * a.K;
    x_src = static_cast<const int8_t*>(a.x) + static_cast<size_t>(col0 + r) * a.x_stride;
    wd_src = a.weight_d + static_cast<size_t>(row0 + r) * (a.K >> 5);
    xd_src = a.x_d + static_cast<size_t>(col0 + r) * a.x_d_stride;
    stage_bytes = (512 + 32) * weight_rows + (512 + 64) * x_rows;
  }
  __device__ void weights(unsigned char* s, int p, uint64_t* full, int lane) const {
    if (w_in) bulk_copy_to_shared(s + (lane & 15) * kPitch, w_src + 512 * p, 512, full);
    if (wd_in) bulk_copy_to_shared(s + S::kWdOffset + 32 * (lane & 15), wd_src + 16 * p, 32, full);
  }
  __device__ void activations(unsigned char* s, int p, uint64_t* full, int lane) const {
    if (x_in) bulk_copy_to_shared(s + S::kXOffset + (lane & 15) * kPitch, x_src + 512 * p, 512, full);
    if (xd_in) bulk_copy_to_shared(s + S::kXdOffset + 64 * (lane & 15), xd_src + 16 * p, 64, full);
  }
};

// Fills the ring with every step of the block's units, running ahead of the consumers by up to kStages pieces
// across part and unit boundaries (the first form of this kernel launched a block per unit, and each block's ramp
// and drain idled its share of the stream). Weights are constants, so the first stages' weights are requested
// before the PDL wait, under the predecessor's tail.
template <int PARTS, int NT>
__device__ void produce(const Q8GemvArgs& a, const RowsUnits<PARTS, NT>& w, unsigned char* smem, uint64_t* full,
                        uint64_t* empty, int lane) {
  using S = RowsTile<NT>;
  const int ahead = blockIdx.x < w.units ? min(S::kStages, w.pieces) : 0;
  if (ahead > 0) {
    const RowsCopies<NT> copy(a, lane, w.row0(blockIdx.x), w.col0(blockIdx.x));
    for (int i = 0; i < ahead; ++i) {
      if (lane == 0) mbarrier_arrive_expect_tx(&full[i], copy.stage_bytes);
      __syncwarp();
      copy.weights(smem + i * S::kStageBytes, w.piece(i), &full[i], lane);
    }
  }
  pdl_wait_for_predecessor();  // x and x_d may be the predecessor's output
  int i = 0;
  for (int u = blockIdx.x; u < w.units; u += gridDim.x) {
    const RowsCopies<NT> copy(a, lane, w.row0(u), w.col0(u));
    for (int j = 0; j < w.pieces; ++j, ++i) {
      const int s = i % S::kStages, p = w.piece(j);
      unsigned char* stage = smem + s * S::kStageBytes;
      if (i >= ahead) {
        if (i >= S::kStages) mbarrier_wait(&empty[s], ((i / S::kStages) - 1) & 1);  // step i - kStages read
        if (lane == 0) mbarrier_arrive_expect_tx(&full[s], copy.stage_bytes);
        __syncwarp();
        copy.weights(stage, p, &full[s], lane);
      }
      copy.activations(stage, p, &full[s], lane);
    }
  }
}

template <int PARTS, int NT>
__global__ void __launch_bounds__(kRowsThreads, 1) q8_0_gemv_rows_kernel(const Q8GemvArgs a) {
  using S = RowsTile<NT>;
  extern __shared__ __align__(16) unsigned char smem[];
  pdl_allow_successor();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const RowsUnits<PARTS, NT> w(a);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S::kBarrierOffset);
  uint64_t* empty = full + S::kStages;
  if (tid == 0) {
    for (int s = 0; s < S::kStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], kChainWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the copy engine
  }
  __syncthreads();
  if (warp == kChainWarps) {
    produce(a, w, smem, full, empty, lane);
    return;
  }
  pdl_wait_for_predecessor();  // this thread writes out, which the predecessor may still read

  // ldmatrix row addresses of this lane (q8_gemm.cu's A and B patterns): A = the 16 weight rows (matrices rows
  // 0-7 / 8-15 x bytes 0-15 / 16-31 of block `warp`), B = 16 rows of x as two n8 tiles.
  const int group = lane >> 2, quad = lane & 3;
  const int a_off = (lane & 15) * kPitch + warp * 32 + (lane >> 4) * 16;
  const int b_off = S::kXOffset + ((lane & 7) + (NT == 2 ? (lane >> 4) * 8 : 0)) * kPitch + warp * 32 +
                    ((lane >> 3) & 1) * 16;
  double* partial = reinterpret_cast<double*>(smem + S::kPartialOffset);
  const int out_row = tid & 15, out_col = tid >> 4;  // a column's 16 rows on 16 threads
  const bool owns_output = out_col < S::kCols;
  int i = 0;
  for (int u = blockIdx.x; u < w.units; u += gridDim.x) {
    double total = 0.0;
    for (int q = 0; q < PARTS; ++q) {
      double acc[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.0;
      for (int p = q; p < w.pieces; p += PARTS, ++i) {
        const int s = i % S::kStages;
        mbarrier_wait(&full[s], (i / S::kStages) & 1);
        const unsigned char* stage = smem + s * S::kStageBytes;
        uint32_t frag_a[4];
        ldmatrix_x4(frag_a, stage + a_off);
        uint32_t frag_b[4];  // NT == 1: matrices 2 and 3 repeat 0 and 1 (rows 0-7)
        ldmatrix_x4(frag_b, stage + b_off);
        const __half* wd = reinterpret_cast<const __half*>(stage + S::kWdOffset);
        const float* xd = reinterpret_cast<const float*>(stage + S::kXdOffset);
        const float wd_lo = __half2float(wd[group * 16 + warp]), wd_hi = __half2float(wd[(group + 8) * 16 + warp]);
        float xds[NT][2];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          xds[j][0] = xd[(8 * j + 2 * quad) * 16 + warp];
          xds[j][1] = xd[(8 * j + 2 * quad + 1) * 16 + warp];
        }
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&empty[s]);  // the warp's reads of the stage are done (ordered by the syncwarp)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint32_t b[2] = {frag_b[2 * j], frag_b[2 * j + 1]};
          int c[4];
          mma_s8(c, frag_a, b);
          // c0, c1: weight row `group`, x rows 2 quad, 2 quad + 1; c2, c3: weight row group + 8.
          acc[j][0] = fma(int_to_double(c[0]), static_cast<double>(wd_lo * xds[j][0]), acc[j][0]);
          acc[j][1] = fma(int_to_double(c[1]), static_cast<double>(wd_lo * xds[j][1]), acc[j][1]);
          acc[j][2] = fma(int_to_double(c[2]), static_cast<double>(wd_hi * xds[j][0]), acc[j][2]);
          acc[j][3] = fma(int_to_double(c[3]), static_cast<double>(wd_hi * xds[j][1]), acc[j][3]);
        }
      }
      // The part's 16 chains meet in shared memory; one thread per output adds them in the GEMV's butterfly order
      // (m + (m ^ 8), then ^ 4, ^ 2, ^ 1; float addition commutes, so each pair is the GEMV's), then the parts in
      // order. The producer streams on meanwhile.
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = group + 8 * (e >> 1), col = 8 * j + 2 * quad + (e & 1);
          partial[(warp * 16 + r) * S::kCols + col] = acc[j][e];
        }
      consumers_sync();
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
      consumers_sync();  // the partials read before the next part's chains overwrite them
    }
    const int row = w.row0(u) + out_row, col = w.col0(u) + out_col;
    if (owns_output && row < a.N && col < a.T) a.out[static_cast<size_t>(col) * a.out_stride + row] = static_cast<float>(total);
  }
}

// Blocks a launch runs: one per SM (the kernel is persistent), fewer when there are fewer units.
template <int PARTS, int NT>
cudaError_t rows_grid(const Q8GemvArgs& a, int* blocks) {
  static int per_sm = -1, sms = 0;
  static cudaError_t err = [] {
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e == cudaSuccess) {
      e = cudaFuncSetAttribute(q8_0_gemv_rows_kernel<PARTS, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               RowsTile<NT>::kSharedBytes);
    }
    if (e == cudaSuccess) {
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, q8_0_gemv_rows_kernel<PARTS, NT>, kRowsThreads,
                                                        RowsTile<NT>::kSharedBytes);
    }
    return e == cudaSuccess && per_sm < 1 ? cudaErrorInvalidConfiguration : e;
  }();
  if (err != cudaSuccess) return err;
  const int units = (a.T + 8 * NT - 1) / (8 * NT) * ((a.N + 15) / 16);
  *blocks = units < sms * per_sm ? units : sms * per_sm;
  return cudaSuccess;
}

template <int PARTS, int NT>
cudaError_t launch_rows(const Q8GemvArgs& a, cudaStream_t stream) {
  int blocks = 0;
  const cudaError_t err = rows_grid<PARTS, NT>(a, &blocks);
  if (err != cudaSuccess) return err;
  return launch_pdl(q8_0_gemv_rows_kernel<PARTS, NT>, dim3(blocks), dim3(kRowsThreads), RowsTile<NT>::kSharedBytes,
                    stream, a);
}

// 8 rows of x a unit up to 8 rows, else 16; up to 16 rows for the PARTS = 4 shapes (N <= 8192): at 16 rows a
// unit their 320 units of the N = 5120 matrices would give the 132 blocks 2.4 each (3 for some, 2 for most), at 8
// rows 640 give 4.8; the second column tile reads its weights from L2, fetched by the block beside it.
template <int PARTS>
cudaError_t launch_parts(const Q8GemvArgs& a, cudaStream_t stream) {
  return a.T <= (PARTS > 1 ? 16 : 8) ? launch_rows<PARTS, 1>(a, stream) : launch_rows<PARTS, 2>(a, stream);
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
         aligned(a.weight_q, 16) && aligned(a.x, 16) && aligned(a.weight_d, 16) && aligned(a.x_d, 16);
}

cudaError_t q8_0_gemv_rows_launch(const Q8GemvArgs& a, int parts, cudaStream_t stream) {
  return parts == 1 ? launch_parts<1>(a, stream) : launch_parts<4>(a, stream);
}

}  // namespace qwen38
