// One Gated DeltaNet layer's decode step in one kernel: conv (+ state update, SiLU, q/k L2 norm), both
// gates, the delta-rule recurrence and the gated RMSNorm (+ the out projection's quantized activation), for
// T <= kGdnStepMaxTokens tokens of one sequence. Every output is bitwise what gdn_conv -> gdn_gates ->
// gdn_recurrent (token by token) -> gated_rms_norm write on the same inputs. Layouts are those of
// csrc/bindings.cpp.
//
// Batched rows: num_seqs sequences of T tokens each, x's rows s*T .. s*T+T-1 sequence s's, with its own conv state and
// recurrent state (no recurrence across sequences), all in one launch: the grid's y is the sequence, and each
// sequence's blocks run exactly a T-token call's code on its rows and states, so sequence s's rows are bitwise a
// call of its T tokens alone. T = 1 is B sequences' decode steps; T > 1 each sequence's speculative verify, with the
// state after each of its tokens kept (token states [num_seqs * T, ...], sequence s's token t at row s*T + t).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "gdn.h"        // kGdnMaxConvTaps
#include "op_limits.h"  // kGdnStepMaxTokens: a decode step, or a speculative verify of k + 1 <= 8 tokens

namespace qwen38 {

constexpr int kGdnStepMaxHeadDim = 256;  // dk and dv (q, k, v, z and the outputs of a head sit in shared memory)
constexpr int kGdnStepMaxGroup = 8;      // Hv / Hk: value heads sharing a key head form one thread-block cluster
constexpr int kGdnStepMaxSeqs = 65535;   // batched rows: sequences in one launch (the grid's y), any T

struct GdnStepArgs {
  const float* x = nullptr;  // [T, C + Hv*dv + 2*Hv] = [q | k | v | z | b | a], C = 2*Hk*dk + Hv*dv
  int64_t x_stride = 0;      // row stride in floats
  const float* conv_weight = nullptr;  // [C, taps]
  const float* a_neg = nullptr;        // [Hv]
  const float* dt_bias = nullptr;      // [Hv]
  const float* norm_weight = nullptr;  // [dv], 16-byte aligned
  float eps = 0.f;
  float* conv_state = nullptr;  // [taps-1, C] (batched rows: [num_seqs, taps-1, C]), in place
  float* state = nullptr;       // [Hv, dv, dk] (batched rows: [num_seqs, Hv, dv, dk]), in place, 16-byte aligned
  float* out = nullptr;         // [T, Hv*dv], rows 16-byte aligned
  int64_t out_stride = 0;
  int8_t* out_q = nullptr;  // optional [T, Hv*dv]: int8 lane (or the two-word lane's high word)
  int64_t out_q_stride = 0;
  int8_t* out_q_lo = nullptr;  // optional [T, Hv*dv]: the two-word lane's low word
  int64_t out_q_lo_stride = 0;
  float* out_d = nullptr;  // [T, Hv*dv/32], with out_q
  int64_t out_d_stride = 0;
  float* token_conv_states = nullptr;  // optional [num_seqs * T, taps-1, C] contiguous
  float* token_states = nullptr;       // optional [num_seqs * T, Hv, dv, dk] contiguous, 16-byte aligned
  int T = 0, taps = 0, Hk = 0, Hv = 0, dk = 0, dv = 0;  // T: tokens of each sequence
  // Batched rows: num_seqs sequences of T tokens, sequence s reading x's rows s*T .. s*T+T-1 and writing out's (and
  // the quantized outputs' and token states') rows s*T + t, its states conv_state[s] and state[s] (contiguous
  // [num_seqs, ...]). One sequence of T tokens: num_seqs = 1.
  int num_seqs = 1;
  float q_scale = 0.f;  // set by gdn_step_launch: 1/sqrt(dk), computed as gdn_recurrent's launcher does
};

// cudaErrorInvalidValue for sizes beyond the limits above (T <= kGdnStepMaxTokens, taps in [2, kGdnMaxConvTaps],
// dv % 4 == 0, Hv a multiple of Hk, dv % 32 == 0 with out_q) or a misaligned state;
// the binding checks them first with clear messages. Launched with PDL when pdl_enabled() (pdl.cuh), as a cluster
// of a key head's value heads.
cudaError_t gdn_step_launch(const GdnStepArgs& args, cudaStream_t stream);

}  // namespace qwen38
