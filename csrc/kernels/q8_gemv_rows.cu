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
//   (m with m ^ 8, then ^ 4, ^ 2, ^ 1), and the parts in order. Block b is in part (b / 16) mod PARTS: the 512-byte
//   piece p = b / 16 belongs to part p % PARTS whole. So a part is a block of its own here: the PARTS blocks of a
//   tile form one thread-block cluster, block q streams only its part's pieces (q, q + PARTS, ...), and at the end
//   cluster rank 0 adds the parts in order from the others' shared memory. Within a block, consumer warp w computes
//   block w of every piece (chain 16q + w), with exactly the GEMV's arithmetic (fma(int_to_double(s),
//   double(wd * xd), acc), wd * xd in fp32); the warps' chains meet in shared memory at the end and one thread
//   per output adds them in the butterfly's order.
// - Parts as blocks (the first form of this kernel looped over the parts inside one block): the N = 5120 matrices
//   (FFN down, the attention and GDN out projections, 28% of a token's weight bytes) have PARTS = 4, and as 320
//   blocks of 16 rows they filled 1.2 waves of the H200's 2 x 132 block slots; as 1280 they fill 4.8. And a
//   block holds one part's 16 chains, so it can take 16 rows of x where the loop could take 8.
// - Loads: a producer warp copies each stage (a piece of the 16 weight rows: 16 x 512 contiguous bytes, the same
//   piece of the block's rows of x, and their scales) with the bulk copy engine, which completes on the stage's
//   mbarrier; the consumer warps wait on that barrier alone and release the stage on another. The first form did
//   the copies with cp.async from every thread and a __syncthreads per 8 KB piece: with so little math per piece
//   the barrier and the thread-issued copies set the pace (~1.6 TB/s from T = 2 on, 2.6x the T = 1 time). Weight
//   rows past N and rows of x past T are not copied: their shared-memory rows stay the zeros they were set to and
//   feed only outputs that are not stored. Weights are constants, so the first stages' weights are requested
//   before the PDL wait, under the predecessor's tail. Fragments come from shared memory by ldmatrix, rows padded
//   by 16 bytes (conflict-free, as q8_gemm.cu).
// - Tile: 16 weight rows x 8 * NT rows of x a block (NT = 1 up to 8 rows, else 2); more rows of x run in more
//   blocks, x fastest, so the blocks that share a weight tile run together and read it from HBM once.
#include "q8_gemv.h"

#include <cooperative_groups.h>

#include <cstdlib>

#include "common.cuh"
#include "pdl.cuh"

namespace qwen38 {
namespace {

namespace cg = cooperative_groups;

constexpr int kChainWarps = 16;                  // consumer warp w computes block w of every piece
constexpr int kRowsThreads = (kChainWarps + 1) * 32;  // + the producer warp
constexpr int kPitch = 512 + 16;                 // a row's piece in shared memory, padded: ldmatrix phases hit distinct banks
constexpr int kRingBytes = 100 * 1024;           // two blocks an SM (227 KB of shared memory, 64K registers)

template <int NT>
struct RowsTile {
  static constexpr int kCols = 8 * NT;  // rows of x a block
  static constexpr int kXOffset = 16 * kPitch;
  static constexpr int kWdOffset = kXOffset + kCols * kPitch;  // [16 rows][16 blocks] fp16
  static constexpr int kXdOffset = kWdOffset + 16 * 16 * 2;    // [kCols][16 blocks] float
  static constexpr int kStageBytes = kXdOffset + kCols * 16 * 4;
  static constexpr int kStages = kRingBytes / kStageBytes;
  static constexpr int kBarrierOffset = kStages * kStageBytes;  // full[kStages], empty[kStages]
  static constexpr int kPartOffset = kBarrierOffset + 2 * kStages * 8;  // this part's sums, read by cluster rank 0
  static constexpr int kSharedBytes = kPartOffset + 16 * kCols * 8;
  static constexpr int kPartialBytes = kChainWarps * 16 * kCols * 8;  // the chains at the end, over the ring
  static_assert(kStages >= 3, "a ring of at least three stages");
  static_assert(kPartialBytes <= kBarrierOffset, "the partials reuse the ring");
  static_assert(kStageBytes % 16 == 0 && kXdOffset % 16 == 0 && kWdOffset % 16 == 0, "16-byte aligned copies");
  static_assert(kCols <= 16, "one producer lane per row of x and per row of its scales");
};

__device__ __forceinline__ void mma_s8(int (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%10, %10, %10, %10};"
               : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0));
}

// The producer warp: lane l < 16 copies weight row l's piece and, for l < kCols, row l of x's; lane 16 + l the
// scales of weight row l and, for l < kCols, of row l of x. Rows past N or T are skipped, and the stage's
// expected bytes count only what is copied.
template <int NT>
struct RowsProducer {
  using S = RowsTile<NT>;
  const int8_t* w_src;
  const int8_t* x_src;
  const __half* wd_src;
  const float* xd_src;
  bool w_in, x_in, wd_in, xd_in;
  uint32_t stage_bytes;

  __device__ RowsProducer(const Q8GemvArgs& a, int lane, int row0, int col0) {
    const int r = lane & 15;
    const bool low = lane < 16;
    const int weight_rows = min(16, a.N - row0), x_rows = min(S::kCols, a.T - col0);
    w_in = low && r < weight_rows;
    x_in = low && r < x_rows;
    wd_in = !low && r < weight_rows;
    xd_in = !low && r < x_rows;
    const int blocks = a.K >> 5;
    w_src = a.weight_q + static_cast<size_t>(row0 + r) * a.K;
    x_src = static_cast<const int8_t*>(a.x) + static_cast<size_t>(col0 + r) * a.x_stride;
    wd_src = a.weight_d + static_cast<size_t>(row0 + r) * blocks;
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

template <int PARTS, int NT>
__global__ void __launch_bounds__(kRowsThreads, 2) q8_0_gemv_rows_kernel(const Q8GemvArgs a) {
  using S = RowsTile<NT>;
  extern __shared__ __align__(16) unsigned char smem[];
  pdl_allow_successor();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int part = blockIdx.x % PARTS;  // the cluster's rank: clusters are PARTS consecutive blocks along x
  const int col0 = (blockIdx.x / PARTS) * S::kCols, row0 = blockIdx.y * 16;
  const int pieces = a.K >> 9;  // K % 512 == 0 (q8_0_gemv_rows_supported)
  const int steps = pieces > part ? (pieces - part + PARTS - 1) / PARTS : 0;  // pieces part, part + PARTS, ..
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S::kBarrierOffset);
  uint64_t* empty = full + S::kStages;

  // Zero the ring once: rows that are never copied then read as zeros, not as whatever was left there.
  for (int i = tid; i < S::kBarrierOffset / 16; i += kRowsThreads) reinterpret_cast<uint4*>(smem)[i] = uint4{};
  if (tid == 0) {
    for (int s = 0; s < S::kStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], kChainWarps);
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // this thread's zeros before any bulk copy
  __syncthreads();

  if (warp == kChainWarps) {
    const RowsProducer<NT> copy(a, lane, row0, col0);
    const int first = min(steps, S::kStages);
    for (int i = 0; i < first; ++i) {  // the ring's first fill: weights before the PDL wait, x after it
      if (lane == 0) mbarrier_arrive_expect_tx(&full[i], copy.stage_bytes);
      __syncwarp();
      copy.weights(smem + i * S::kStageBytes, part + i * PARTS, &full[i], lane);
    }
    pdl_wait_for_predecessor();  // x and x_d may be the predecessor's output
    for (int i = 0; i < first; ++i) copy.activations(smem + i * S::kStageBytes, part + i * PARTS, &full[i], lane);
    for (int i = first; i < steps; ++i) {
      const int s = i % S::kStages;
      mbarrier_wait(&empty[s], ((i / S::kStages) - 1) & 1);  // every consumer is done with step i - kStages
      if (lane == 0) mbarrier_arrive_expect_tx(&full[s], copy.stage_bytes);
      __syncwarp();
      unsigned char* stage = smem + s * S::kStageBytes;
      copy.weights(stage, part + i * PARTS, &full[s], lane);
      copy.activations(stage, part + i * PARTS, &full[s], lane);
    }
  } else {
    pdl_wait_for_predecessor();  // this thread writes out, which the predecessor may still read
  }

  double acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0;
  const int group = lane >> 2, quad = lane & 3;
  if (warp < kChainWarps) {
    // ldmatrix row addresses of this lane (q8_gemm.cu's A and B patterns): A = the 16 weight rows (matrices rows
    // 0-7 / 8-15 x bytes 0-15 / 16-31 of block `warp`), B = 16 rows of x as two n8 tiles.
    const int a_off = (lane & 15) * kPitch + warp * 32 + (lane >> 4) * 16;
    const int b_off = S::kXOffset + ((lane & 7) + (NT == 2 ? (lane >> 4) * 8 : 0)) * kPitch + warp * 32 +
                      ((lane >> 3) & 1) * 16;
    for (int i = 0; i < steps; ++i) {
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
      if (lane == 0) mbarrier_arrive(&empty[s]);  // this warp's reads of the stage are done
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
  }
  __syncthreads();  // every stage consumed, so every copy landed: the partials take the ring's place
  // partial[chain warp][weight row][x row]; one thread per output adds the 16 chains in the GEMV's butterfly
  // order (m + (m ^ 8), then ^ 4, ^ 2, ^ 1; float addition commutes, so each pair is the GEMV's).
  double* partial = reinterpret_cast<double*>(smem);
  if (warp < kChainWarps) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = group + 8 * (e >> 1), col = 8 * j + 2 * quad + (e & 1);
        partial[(warp * 16 + r) * S::kCols + col] = acc[j][e];
      }
  }
  __syncthreads();
  const int out_row = tid & 15, out_col = tid >> 4;  // a column's 16 rows on 16 threads
  const bool owns_output = out_col < S::kCols;
  double total = 0.0;
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
    total = v[0] + v[1];
  }
  if constexpr (PARTS > 1) {
    double* part_sum = reinterpret_cast<double*>(smem + S::kPartOffset);
    if (owns_output) part_sum[out_col * 16 + out_row] = total;
    const cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every part's sums written
    if (part == 0 && owns_output) {
#pragma unroll
      for (int q = 1; q < PARTS; ++q) total = total + load_cluster_shared(&part_sum[out_col * 16 + out_row], q);
    }
    cluster.sync();  // rank 0 has read them: the other blocks' shared memory may go
  }
  const int row = row0 + out_row, col = col0 + out_col;
  if (part == 0 && owns_output && row < a.N && col < a.T) {
    a.out[static_cast<size_t>(col) * a.out_stride + row] = static_cast<float>(total);
  }
}

template <int PARTS, int NT>
cudaError_t launch_rows(const Q8GemvArgs& a, cudaStream_t stream) {
  using S = RowsTile<NT>;
  static const cudaError_t attribute = cudaFuncSetAttribute(
      q8_0_gemv_rows_kernel<PARTS, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSharedBytes);
  if (attribute != cudaSuccess) return attribute;
  const dim3 grid((a.T + S::kCols - 1) / S::kCols * PARTS, (a.N + 15) / 16);
  if (grid.y > 65535u) return cudaErrorInvalidValue;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(kRowsThreads);
  config.dynamicSmemBytes = S::kSharedBytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = PARTS;
  attributes[0].val.clusterDim.y = 1;
  attributes[0].val.clusterDim.z = 1;
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  const int first = PARTS > 1 ? 0 : 1;  // one part: no cluster
  config.attrs = attributes + first;
  config.numAttrs = (pdl_enabled() ? 2 : 1) - first;
  const cudaError_t err = cudaLaunchKernelEx(&config, q8_0_gemv_rows_kernel<PARTS, NT>, a);
  return err != cudaSuccess ? err : cudaGetLastError();
}

template <int PARTS>
cudaError_t launch_parts(const Q8GemvArgs& a, cudaStream_t stream) {
  return a.T <= 8 ? launch_rows<PARTS, 1>(a, stream) : launch_rows<PARTS, 2>(a, stream);
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
