// gdn_step: a GDN layer's whole decode step between its two GEMVs in one launch (was four: gdn_conv,
// gdn_gates, gdn_recurrent, gated_rms_norm; each costs a launch gap plus dependent DRAM round trips, ~5.8 us
// a layer for the three GDN kernels and 1.4 us for the norm, measured on the H200, against ~1.4 us of
// memory time). Same bits as those ops: the per-token float math is gdn_math.cuh's (shared with gdn.cu),
// the gated norm and its quantization follow norm_quant.cu's GatedRmsNorm producer operation for operation
// (quantize.cuh shared), and every reduction runs over the same lanes in the same order.
//
// kSplit BLOCKS PER VALUE HEAD (gdn_step_split: 2 where the cluster below stays within 8 blocks), block `part`
// owning the head's state rows [part * split_rows, (part + 1) * split_rows): one block a head put the 27B shape's
// 6.3 MB of state traffic and its serial per-row dot products on 48 of 132 SMs (8.0 us a layer measured at
// T = 1 against 3-4 predicted). Each block runs, in phases separated by barriers:
//  1. gates of the head's T tokens; the head's z (norm block only) into shared memory; its state rows into
//     registers (issued before the conv so both round trips overlap).
//  2. conv of its channels: its key head's q and k (dk each, computed by every block of every value head
//     that shares them: 2*dk*T fmas, cheaper than exchanging them) and its own rows' v channels, with SiLU;
//     q and k heads laid out on whole warps exactly as gdn_conv's blocks, so the L2 norm's partial sums are
//     the same warp butterflies added in the same order. Results in shared memory.
//  3. the recurrence of its rows, token by token, one warp per kRows state rows (gdn_recurrent's lane layout,
//     so its three dot products reduce in its order); outputs into shared memory, per-token states to memory.
//  4. in the head's norm block (part 0) only, the gated RMSNorm: one warp per token, lane g holding the head's
//     float4s g, g + 32 (GatedRmsNorm's layout), the float4s of other blocks' rows read from their shared
//     memory (distributed shared memory; split_rows is a multiple of 4, so no float4 straddles two blocks),
//     then the int8 / two-word quantization of the out projection's input.
//
// Batched rows (gdn_step.h: num_seqs sequences of T tokens, each with its own states) add the grid's y, the
// sequence: its blocks offset x, out, the states and the token states to their sequence's and run the T-token code
// unchanged.
//
// The blocks of a key head's Hv/Hk value heads form one thread-block cluster (block index = (key_head * group
// + j) * kSplit + part, value head key_head + j * Hk), and two cluster barriers order what crosses blocks. The
// first, after the recurrence: every block's reads of the key head's q/k conv state are done (cluster rank 0
// then rewrites it) and every block's outputs are in its shared memory (the norm blocks then read them). The
// second, at the end (with kSplit > 1): no block exits while a norm block may still read its shared memory.
#include "gdn_step.h"

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "common.cuh"
#include "gdn_math.cuh"
#include "pdl.cuh"
#include "quantize.cuh"

namespace qwen38 {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;  // 2*dk + dv = 384 conv channels at the 27B shape: one pass
constexpr int kWarps = kThreads / 32;
constexpr int kMaxT = kGdnStepMaxTokens;
constexpr int kMaxDim = kGdnStepMaxHeadDim;
constexpr int kMaxTaps = kGdnMaxConvTaps;
constexpr int kNormItems = kMaxDim / (4 * 32);  // float4s of a head a lane holds in the gated norm


// From this many sequences a launch runs the instance capped at 64 registers, two blocks an SM: a block's phases
// are a serial chain of latencies (7 us a layer at one sequence), so with one block an SM the batch's blocks
// ran in waves that added those latencies up (B = 16: 117 us a layer, 5x its state traffic at the read probe;
// H200, 8debcf9, benchmarks.batch's split). Two blocks an SM overlap them, for some spills (150-200 bytes a
// thread at the 27B shape); one sequence keeps the spill-free instance. Registers change no bits.
constexpr int kGdnStepManySeqs = 4;

// Blocks a value head's state rows are spread over: 2 (twice the SMs) where the cluster of a key head's
// value heads stays within the portable cluster size, 8 blocks.
constexpr int gdn_step_split(int group) { return 2 * group <= 8 ? 2 : 1; }

// The float4 at p's shared-memory address in block `rank` of the cluster (distributed shared memory). Not
// cooperative_groups' map_shared_rank: its generic pointer put 32 bytes of the kernel on the stack.
__device__ __forceinline__ float4 load_cluster_shared(const float* p, int rank) {
  const uint32_t local = shared_address(p);
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

template <int kVec, int kChunks, int kSplit, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) gdn_step_kernel(const GdnStepArgs a) {
  // State rows a warp holds at once: <= 32 floats a lane in one block a head, so that a pass of 16 warps
  // covers dv = 128 at dk = 128; half as many in two (the same pass covers the block's 64 rows).
  constexpr int kRows = (kVec * kChunks <= 4 ? 8 : 4) / kSplit;
  __shared__ __align__(16) float s_q[kMaxT][kMaxDim];  // conv outputs of the key head's q, k and the rows' v
  __shared__ __align__(16) float s_k[kMaxT][kMaxDim];
  __shared__ __align__(16) float s_v[kMaxT][kMaxDim];
  __shared__ __align__(16) float s_z[kMaxT][kMaxDim];  // the gate of the norm (norm block)
  __shared__ __align__(16) float s_o[kMaxT][kMaxDim];  // the recurrence's outputs of this block's rows
  __shared__ float s_sumsq[kMaxT][2 * kMaxDim / 32];   // per token: q's warp partials of y^2, then k's
  __shared__ float s_beta[kMaxT], s_decay[kMaxT];
  __shared__ __align__(16) float s_norm_weight[kMaxDim];

  const int T = a.T, dk = a.dk, dv = a.dv, taps = a.taps, Hk = a.Hk, Hv = a.Hv;
  const int group = Hv / Hk;
  const int key_head = blockIdx.x / (group * kSplit);
  const int rank = blockIdx.x % (group * kSplit);  // rank in the cluster
  const int part = rank % kSplit;                  // this block's share of the head's rows
  const int head = key_head + rank / kSplit * Hk;  // ggml's tiled order: value head h reads key head h % Hk
  const bool norm_block = part == 0;
  const int split_rows = (dv + 4 * kSplit - 1) / (4 * kSplit) * 4;  // whole float4s of the norm's layout
  const int row_begin = min(dv, part * split_rows), row_end = min(dv, row_begin + split_rows);
  const int C = 2 * Hk * dk + Hv * dv;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // The sequence of this block (blockIdx.y; batched rows: sequence seq's token t is x's and out's row seq*T + t)
  // and its states. One sequence of T tokens: seq 0. The state's offset is one index, (seq, head): with a separate
  // seq * stride term nvcc no longer merged the final state write-back into 16-byte stores (H200, 27B, T = 1:
  // 8.7 us a layer against 7.2).
  const int seq = blockIdx.y;
  const int seq_row = seq * T;  // x's, out's and the token states' row of the sequence's first token
  const float* const seq_x = a.x + seq_row * a.x_stride;
  float* const seq_conv_state = a.conv_state + (int64_t)seq * (taps - 1) * C;
  float* const head_state = a.state + ((int64_t)seq * Hv + head) * dv * dk;

  bool owns[kChunks];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) owns[i] = (i * 32 + lane) * kVec < dk;
  // PDL wait below. Before it: the L2 prefetch of this warp's first state rows and the norm weight's copy
  // (a constant); everything else may belong to the predecessor.
  const int warp_first_row = row_begin + warp * kRows;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = warp_first_row + r;
#pragma unroll
    for (int i = 0; i < kChunks; ++i)
      if (row < row_end && owns[i]) gdn_prefetch_l2(head_state + (int64_t)row * dk + (i * 32 + lane) * kVec);
  }
  if (norm_block)
    for (int e = threadIdx.x; e < dv; e += kThreads) s_norm_weight[e] = a.norm_weight[e];
  gdn_wait_then_release();

  // ---- 1. gates, z, and the first state rows in flight.
  if (threadIdx.x < T) {
    const float* ba = seq_x + threadIdx.x * a.x_stride + C + Hv * dv;
    s_beta[threadIdx.x] = gdn_beta(ba[head]);
    s_decay[threadIdx.x] = gdn_decay(ba[Hv + head], a.a_neg[head], a.dt_bias[head]);
  }
  if (norm_block)
    for (int i = threadIdx.x; i < T * dv; i += kThreads)
      s_z[i / dv][i % dv] = seq_x[(i / dv) * a.x_stride + C + head * dv + i % dv];

  float s[kRows][kChunks][kVec];
  auto load_rows = [&](int first_row) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int row = first_row + r, key = (i * 32 + lane) * kVec;
        if (row < row_end && owns[i]) {
          gdn_load_vec<kVec>(head_state + (int64_t)row * dk + key, s[r][i]);
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e) s[r][i][e] = 0.0f;
        }
      }
    }
  };
  load_rows(warp_first_row);

  // ---- 2. conv. Slots [0, 2*qk_width) are the q then k head on whole warps (gdn_conv's q/k blocks: lanes
  // past dk compute an exact 0 and add it to the butterfly, as there), then the v channels of this block's rows.
  const int qk_width = (dk + 31) / 32 * 32;
  const int qk_warps = qk_width / 32;
  float qk_window[kMaxTaps - 1];  // the new conv state of this thread's q/k channel, written after phase 3
  int qk_state_channel = -1;      // that channel when this block writes it (cluster rank 0)
  for (int slot = threadIdx.x; slot < 2 * qk_width + row_end - row_begin; slot += kThreads) {
    const bool is_qk = slot < 2 * qk_width;  // whole warps: the shuffles below are warp-uniform
    const int which = is_qk ? slot / qk_width : 2;  // 0 q, 1 k, 2 v
    const int i = is_qk ? slot % qk_width : row_begin + slot - 2 * qk_width;
    const bool active = i < (is_qk ? dk : dv);
    const int channel = is_qk ? (which * Hk + key_head) * dk + i : 2 * Hk * dk + head * dv + i;
    const bool writes = active && (!is_qk || rank == 0);  // one block per key head writes its q/k channels
    float weight[kMaxTaps], window[kMaxTaps - 1], x[kMaxT];
#pragma unroll
    for (int tap = 0; tap < kMaxTaps; ++tap)
      weight[tap] = active && tap < taps ? a.conv_weight[(int64_t)channel * taps + tap] : 0.0f;
#pragma unroll
    for (int tap = 0; tap < kMaxTaps - 1; ++tap)
      window[tap] = active && tap < taps - 1 ? seq_conv_state[(int64_t)tap * C + channel] : 0.0f;
#pragma unroll
    for (int t = 0; t < kMaxT; ++t) x[t] = active && t < T ? seq_x[t * a.x_stride + channel] : 0.0f;
    float* const conv_out = which == 0 ? &s_q[0][i] : which == 1 ? &s_k[0][i] : &s_v[0][i];
#pragma unroll
    for (int t = 0; t < kMaxT; ++t) {
      if (t >= T) break;
      const float y = gdn_silu(gdn_conv_token<kMaxTaps>(weight, window, x[t], taps));
      if (writes && a.token_conv_states != nullptr) {
#pragma unroll
        for (int tap = 0; tap < kMaxTaps - 1; ++tap)
          if (tap < taps - 1)
            a.token_conv_states[((int64_t)(seq_row + t) * (taps - 1) + tap) * C + channel] = window[tap];
      }
      if (is_qk) {
        const float sum = warp_sum(__fmul_rn(y, y));
        if (lane == 0) s_sumsq[t][slot / 32] = sum;
      }
      if (active) conv_out[t * kMaxDim] = y;
    }
    if (is_qk) {
#pragma unroll
      for (int tap = 0; tap < kMaxTaps - 1; ++tap) qk_window[tap] = window[tap];
      qk_state_channel = writes ? channel : -1;
    } else if (writes) {  // v channels: only this thread reads or writes them
#pragma unroll
      for (int tap = 0; tap < kMaxTaps - 1; ++tap)
        if (tap < taps - 1) seq_conv_state[(int64_t)tap * C + channel] = window[tap];
    }
  }
  __syncthreads();
  if (threadIdx.x < 2 * qk_width && threadIdx.x % qk_width < dk) {  // L2 norm: gdn_conv's sum over warps
    const int which = threadIdx.x / qk_width, i = threadIdx.x % qk_width;
    float* const conv_out = which == 0 ? &s_q[0][i] : &s_k[0][i];
    for (int t = 0; t < T; ++t) {
      float total = 0.0f;
      for (int w = 0; w < qk_warps; ++w) total += s_sumsq[t][which * qk_warps + w];
      conv_out[t * kMaxDim] = gdn_l2_normalize(conv_out[t * kMaxDim], total);
    }
  }
  __syncthreads();

  // ---- 3. recurrence: gdn_recurrent's per-row token loop, kRows rows a warp.
  for (int first_row = warp_first_row; first_row < row_end; first_row += kWarps * kRows) {
    if (first_row != warp_first_row) load_rows(first_row);
    for (int t = 0; t < T; ++t) {
      float k[kChunks][kVec], q[kChunks][kVec];
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int key = (i * 32 + lane) * kVec;
        if (owns[i]) {
          gdn_load_vec<kVec>(&s_k[t][key], k[i]);
          gdn_load_vec<kVec>(&s_q[t][key], q[i]);
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e) k[i][e] = q[i][e] = 0.0f;
        }
      }
      const float beta = s_beta[t], decay = s_decay[t];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int row = first_row + r;
        if (row >= row_end) break;  // warp-uniform
        float sk, sq, kq;
        gdn_row_dots<kVec, kChunks>(s[r], k, q, sk, sq, kq);
        const float delta = gdn_delta(beta, decay, sk, s_v[t][row]);
        if (lane == 0) s_o[t][row] = gdn_row_out(decay, sq, delta, kq, a.q_scale);
        gdn_row_update<kVec, kChunks>(s[r], k, decay, delta);
        if (a.token_states != nullptr) {
          float* const token_row = a.token_states + (((int64_t)(seq_row + t) * Hv + head) * dv + row) * dk;
#pragma unroll
          for (int i = 0; i < kChunks; ++i)
            if (owns[i]) gdn_store_vec<kVec>(token_row + (i * 32 + lane) * kVec, s[r][i]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = first_row + r;
#pragma unroll
      for (int i = 0; i < kChunks; ++i)
        if (row < row_end && owns[i])
          gdn_store_vec<kVec>(head_state + (int64_t)row * dk + (i * 32 + lane) * kVec, s[r][i]);
    }
  }

  // Every thread of every block of the cluster passes both cluster barriers (none returns early). This one
  // orders every block's conv_state reads before rank 0's rewrite, and its s_o writes before the norm
  // block's reads (its own block's too: it is a block barrier as well).
  const cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();

  // ---- the key head's new q/k conv state, now that every block of the cluster has read the old one.
  if (qk_state_channel >= 0) {
#pragma unroll
    for (int tap = 0; tap < kMaxTaps - 1; ++tap)
      if (tap < taps - 1) seq_conv_state[(int64_t)tap * C + qk_state_channel] = qk_window[tap];
  }

  // ---- 4. gated RMSNorm of token `warp`, as norm_quant.cu's GatedRmsNorm: x * rsqrt(mean(x^2) + eps)
  // * weight * silu(z), the lane's float4s summed as ((0 + |v0|^2) + |v1|^2) with |v|^2 =
  // fma(w, w, fma(z, z, fma(x, x, y*y))) (nvcc's contraction of x*x + y*y + z*z + w*w there), then the
  // warp butterfly; 1/sqrt rounded twice.
  if (norm_block && warp < T) {
    const int t = warp, row = seq_row + t;  // out's row of token t
    float4 v[kNormItems];
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < kNormItems; ++i) {
      const int e = 4 * (lane + 32 * i);
      v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (e < dv) {
        const int owner = kSplit == 1 ? 0 : e / split_rows;  // the block of the head (rank + owner) holding e
        v[i] = owner == 0 ? *reinterpret_cast<const float4*>(&s_o[t][e])
                          : load_cluster_shared(&s_o[t][e], rank + owner);
        ss = __fadd_rn(ss, fmaf(v[i].w, v[i].w, fmaf(v[i].z, v[i].z, fmaf(v[i].x, v[i].x, __fmul_rn(v[i].y, v[i].y)))));
      }
    }
    ss = warp_sum(ss);
    const float scale = __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)dv), a.eps)));
    float* const out_row = a.out + row * a.out_stride + head * dv;
#pragma unroll
    for (int i = 0; i < kNormItems; ++i) {
      const int e = 4 * (lane + 32 * i);
      if (e < dv) {
        const float4 w = *reinterpret_cast<const float4*>(&s_norm_weight[e]);
        const float4 z = *reinterpret_cast<const float4*>(&s_z[t][e]);
        v[i] = make_float4(__fmul_rn(__fmul_rn(__fmul_rn(v[i].x, scale), w.x), silu(z.x)),
                           __fmul_rn(__fmul_rn(__fmul_rn(v[i].y, scale), w.y), silu(z.y)),
                           __fmul_rn(__fmul_rn(__fmul_rn(v[i].z, scale), w.z), silu(z.z)),
                           __fmul_rn(__fmul_rn(__fmul_rn(v[i].w, scale), w.w), silu(z.w)));
        *reinterpret_cast<float4*>(out_row + e) = v[i];
      }
    }
    if (a.out_q != nullptr) {  // norm_quant.cu's quantization loop, over the head's columns of row t
      const bool two_word = a.out_q_lo != nullptr;
#pragma unroll
      for (int i = 0; i < kNormItems; ++i) {
        if (4 * 32 * i >= dv) break;  // warp-uniform: items no lane holds (the shuffles need the whole warp)
        const int e = 4 * (lane + 32 * i), column = head * dv + e;
        store_quantized_float4(v[i], e < dv, a.out_q + row * a.out_q_stride + column,
                               two_word ? a.out_q_lo + row * a.out_q_lo_stride + column : nullptr,
                               a.out_d + row * a.out_d_stride + column / kQuantBlock);
      }
    }
  }
  if (kSplit > 1) cluster.sync();  // keep every block's s_o alive until its head's norm block has read it
}

template <int kVec, int kChunks>
cudaError_t launch(const GdnStepArgs& a, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  const int split = gdn_step_split(a.Hv / a.Hk);
  const bool many = a.num_seqs >= kGdnStepManySeqs;
  void (*const kernel)(GdnStepArgs) =
      split == 2 ? (many ? gdn_step_kernel<kVec, kChunks, 2, 2> : gdn_step_kernel<kVec, kChunks, 2, 1>)
                 : (many ? gdn_step_kernel<kVec, kChunks, 1, 2> : gdn_step_kernel<kVec, kChunks, 1, 1>);
  config.gridDim = dim3(a.Hv * split, a.num_seqs);  // clusters along x only: a sequence's blocks share none
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = a.Hv / a.Hk * split;
  attributes[0].val.clusterDim.y = 1;
  attributes[0].val.clusterDim.z = 1;
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attributes;
  config.numAttrs = pdl_enabled() ? 2 : 1;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, a);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace

cudaError_t gdn_step_launch(const GdnStepArgs& args, cudaStream_t stream) {
  if (args.T <= 0 || args.num_seqs <= 0) return cudaSuccess;
  const GdnStepArgs& a = args;
  if (a.T > kGdnStepMaxTokens || a.num_seqs > kGdnStepMaxSeqs || a.taps < 2 || a.taps > kGdnMaxConvTaps || a.Hk <= 0 || a.Hv % a.Hk != 0 || a.Hv / a.Hk > kGdnStepMaxGroup || a.dk <= 0 ||
      a.dk > kGdnStepMaxHeadDim || a.dv <= 0 || a.dv > kGdnStepMaxHeadDim || a.dv % 4 != 0 ||
      (a.out_q != nullptr && a.dv % kQuantBlock != 0) || !aligned16(a.state))
    return cudaErrorInvalidValue;
  GdnStepArgs b = args;
  b.q_scale = 1.0f / sqrtf((float)a.dk);
  // gdn_recurrent_launch's layout for its qkv = gdn_conv's contiguous out [T, C] and a 16-byte-aligned state:
  // the lanes, and so the order of every dot product, are those it picks.
  const int C = 2 * a.Hk * a.dk + a.Hv * a.dv;
  if (a.dk % 4 == 0 && C % 4 == 0) return a.dk <= 128 ? launch<4, 1>(b, stream) : launch<4, 2>(b, stream);
  if (a.dk <= 32) return launch<1, 1>(b, stream);
  if (a.dk <= 64) return launch<1, 2>(b, stream);
  if (a.dk <= 128) return launch<1, 4>(b, stream);
  return launch<1, 8>(b, stream);
}

}  // namespace qwen38
