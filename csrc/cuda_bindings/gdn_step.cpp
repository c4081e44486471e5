// CUDA binding of gdn_step: argument checks, device guard, launch on the current stream. Sizes come from
// the tensors: conv_weight [C, K], state [Hv, dv, dk], so Hk = (C - Hv*dv) / (2*dk). The states' rank picks the
// mode: state [Hv, dv, dk] and conv_state [K-1, C], one sequence of T <= kGdnStepMaxTokens tokens; state
// [B, Hv, dv, dk] and conv_state [B, K-1, C], batched rows (B sequences of T / B tokens each, consecutive rows of x;
// one token a sequence: any B, the decode step; more: at most kGdnStepMaxTokens, the verify).
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "checks.h"
#include "../kernels/gdn_step.h"

namespace qwen38 {
namespace {

void gdn_step(const at::Tensor& x, const at::Tensor& conv_weight, const at::Tensor& a_neg, const at::Tensor& dt_bias,
              const at::Tensor& norm_weight, double eps, at::Tensor& conv_state, at::Tensor& state, at::Tensor& out,
              const std::optional<at::Tensor>& out_q, const std::optional<at::Tensor>& out_q_lo,
              const std::optional<at::Tensor>& out_d, const std::optional<at::Tensor>& token_conv_states,
              const std::optional<at::Tensor>& token_states) {
  constexpr const char* op = "gdn_step";
  QWEN38_CHECK_CUDA(op, x);
  QWEN38_CHECK_DTYPE(op, x, at::kFloat);
  QWEN38_CHECK_ROWS(op, x);
  const at::Device device = x.device();
  const int64_t T = x.size(0);
  check_same_device(op, "state", state, device, "x");
  QWEN38_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && (state.dim() == 3 || state.dim() == 4),
              op, ": state must be contiguous float32 [Hv, dv, dk], or [B, Hv, dv, dk] with a state a sequence, found ",
              state.scalar_type(), " ", state.sizes());
  const bool batched_rows = state.dim() == 4;
  const int64_t num_seqs = batched_rows ? state.size(0) : 1;
  if (batched_rows) {
    QWEN38_CHECK(num_seqs >= 1 && num_seqs <= kGdnStepMaxSeqs && T % num_seqs == 0, op,
                ": a 4-D state holds a sequence's state a row: [B, Hv, dv, dk] with B (at most ", kGdnStepMaxSeqs,
                ") dividing x's rows T = ", T, " (T / B consecutive rows a sequence), found ", state.sizes());
  }
  const int64_t tokens = T / num_seqs;  // of each sequence
  QWEN38_CHECK(tokens <= kGdnStepMaxTokens, op, ": at most ", kGdnStepMaxTokens, " tokens (x's rows) of a sequence, "
              "found ", tokens, batched_rows ? " (x's rows / the states' B)" : "", " (prompts run gdn_conv, gdn_gates, "
              "gdn_recurrent and gated_rms_norm; sequences of one token each: state [T, Hv, dv, dk], conv_state "
              "[T, K-1, C])");
  check_aligned16(op, "state", state, "16-byte loads");
  const int64_t Hv = state.size(-3), dv = state.size(-2), dk = state.size(-1);
  QWEN38_CHECK(dk > 0 && dk <= kGdnStepMaxHeadDim && dv > 0 && dv <= kGdnStepMaxHeadDim && dv % 4 == 0, op,
              ": the kernel needs dk, dv in [1, ", kGdnStepMaxHeadDim, "] and dv % 4 == 0, found dk ", dk, ", dv ", dv);
  QWEN38_CHECK(conv_weight.dim() == 2, op, ": conv_weight must be [C, K], found ", conv_weight.sizes());
  const int64_t C = conv_weight.size(0), taps = conv_weight.size(1);
  QWEN38_CHECK(taps >= 2 && taps <= kGdnMaxConvTaps, op, ": conv_weight's K (taps) must be in [2, ", kGdnMaxConvTaps,
              "], found ", taps);
  check_float_tensor(op, "conv_weight", conv_weight, {C, taps}, device, "x");
  const int64_t qk = C - Hv * dv;
  QWEN38_CHECK(qk > 0 && qk % (2 * dk) == 0, op, ": conv_weight's C = ", C, " must be 2*Hk*dk + Hv*dv with Hv*dv = ",
              Hv * dv, " and dk = ", dk, " (state's sizes)");
  const int64_t Hk = qk / (2 * dk);
  QWEN38_CHECK(Hv % Hk == 0 && Hv / Hk <= kGdnStepMaxGroup, op, ": Hv = ", Hv, " must be a multiple of Hk = ", Hk,
              ", at most ", kGdnStepMaxGroup, " times it (the value heads of a key head run as one cluster)");
  QWEN38_CHECK(x.size(1) == C + Hv * dv + 2 * Hv, op, ": x must be [T, C + Hv*dv + 2*Hv] = [T, ",
              C + Hv * dv + 2 * Hv, "] (q | k | v | z | b | a), found ", x.sizes());
  if (batched_rows) {
    check_float_tensor(op, "conv_state", conv_state, {num_seqs, taps - 1, C}, device, "x");
  } else {
    check_float_tensor(op, "conv_state", conv_state, {taps - 1, C}, device, "x");
  }
  check_float_tensor(op, "a_neg", a_neg, {Hv}, device, "x");
  check_float_tensor(op, "dt_bias", dt_bias, {Hv}, device, "x");
  check_float_tensor(op, "norm_weight", norm_weight, {dv}, device, "x");

  GdnStepArgs a;
  a.T = (int)tokens, a.num_seqs = (int)num_seqs;
  a.taps = (int)taps, a.Hk = (int)Hk, a.Hv = (int)Hv, a.dk = (int)dk, a.dv = (int)dv;
  a.x = x.data_ptr<float>();
  a.x_stride = x.stride(0);
  a.conv_weight = conv_weight.data_ptr<float>();
  a.a_neg = a_neg.data_ptr<float>();
  a.dt_bias = dt_bias.data_ptr<float>();
  a.norm_weight = norm_weight.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  a.conv_state = conv_state.data_ptr<float>();
  a.state = state.data_ptr<float>();
  check_rows(op, "out", out, at::kFloat, T, Hv * dv, 16, "vector stores", device, "x");
  a.out = out.data_ptr<float>();
  a.out_stride = out.stride(0);
  QWEN38_CHECK(!out_q.has_value() || dv % 32 == 0, op, ": the quantized lanes need dv % 32 == 0 (32-value blocks "
              "must not straddle heads), found dv = ", dv);
  set_quant_outputs(a, check_quant_outputs(op, device, "x", T, Hv * dv, "Hv*dv", out_q, out_q_lo, out_d));
  if (token_conv_states.has_value()) {
    check_float_tensor(op, "token_conv_states", *token_conv_states, {T, taps - 1, C}, device, "x");
    a.token_conv_states = token_conv_states->data_ptr<float>();
  }
  if (token_states.has_value()) {
    check_float_tensor(op, "token_states", *token_states, {T, Hv, dv, dk}, device, "x");
    check_aligned16(op, "token_states", *token_states, "16-byte stores");
    a.token_states = token_states->data_ptr<float>();
  }

  const c10::cuda::CUDAGuard guard(device);
  launch_or_throw(op, gdn_step_launch(a, current_stream()));
}

}  // namespace
}  // namespace qwen38

TORCH_LIBRARY_IMPL(qwen38, CUDA, m) { m.impl("gdn_step", &qwen38::gdn_step); }
