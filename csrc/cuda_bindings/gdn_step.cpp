// CUDA binding of gdn_step: argument checks, device guard, launch on the current stream. Sizes come from
// the tensors: conv_weight [C, K], state [Hv, dv, dk], so Hk = (C - Hv*dv) / (2*dk).
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "checks.h"
#include "../kernels/gdn_step.h"

namespace qwen38 {
namespace {

constexpr const char* kOp = "gdn_step";

void check_rows(const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t rows, int64_t width,
                int64_t align_bytes, const at::Device& device) {
  QWEN38_CHECK(t.device() == device, kOp, ": ", name, " is on ", t.device(), " but x is on ", device);
  check_row_layout(kOp, name, t, dtype, rows, width, align_bytes, "vector stores");
}

void gdn_step(const at::Tensor& x, const at::Tensor& conv_weight, const at::Tensor& a_neg, const at::Tensor& dt_bias,
              const at::Tensor& norm_weight, double eps, at::Tensor& conv_state, at::Tensor& state, at::Tensor& out,
              const std::optional<at::Tensor>& out_q, const std::optional<at::Tensor>& out_q_lo,
              const std::optional<at::Tensor>& out_d, const std::optional<at::Tensor>& token_conv_states,
              const std::optional<at::Tensor>& token_states) {
  QWEN38_CHECK_CUDA("gdn_step", x);
  QWEN38_CHECK_DTYPE("gdn_step", x, at::kFloat);
  QWEN38_CHECK_ROWS("gdn_step", x);
  const at::Device device = x.device();
  const int64_t T = x.size(0);
  QWEN38_CHECK(T <= kGdnStepMaxTokens, kOp, ": at most ", kGdnStepMaxTokens, " tokens (x's rows), found ", T,
              " (prompts run gdn_conv, gdn_gates, gdn_recurrent and gated_rms_norm)");
  QWEN38_CHECK(state.device() == device, kOp, ": state is on ", state.device(), " but x is on ", device);
  QWEN38_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 3, kOp,
              ": state must be contiguous float32 [Hv, dv, dk], found ", state.scalar_type(), " ", state.sizes());
  check_aligned16(kOp, "state", state, "16-byte loads");
  const int64_t Hv = state.size(0), dv = state.size(1), dk = state.size(2);
  QWEN38_CHECK(dk > 0 && dk <= kGdnStepMaxHeadDim && dv > 0 && dv <= kGdnStepMaxHeadDim && dv % 4 == 0, kOp,
              ": the kernel needs dk, dv in [1, ", kGdnStepMaxHeadDim, "] and dv % 4 == 0, found dk ", dk, ", dv ", dv);
  QWEN38_CHECK(conv_weight.dim() == 2, kOp, ": conv_weight must be [C, K], found ", conv_weight.sizes());
  const int64_t C = conv_weight.size(0), taps = conv_weight.size(1);
  QWEN38_CHECK(taps >= 2 && taps <= kGdnMaxConvTaps, kOp, ": conv_weight's K (taps) must be in [2, ", kGdnMaxConvTaps,
              "], found ", taps);
  check_float_tensor(kOp, "conv_weight", conv_weight, {C, taps}, device, "x");
  const int64_t qk = C - Hv * dv;
  QWEN38_CHECK(qk > 0 && qk % (2 * dk) == 0, kOp, ": conv_weight's C = ", C, " must be 2*Hk*dk + Hv*dv with Hv*dv = ",
              Hv * dv, " and dk = ", dk, " (state's sizes)");
  const int64_t Hk = qk / (2 * dk);
  QWEN38_CHECK(Hv % Hk == 0 && Hv / Hk <= kGdnStepMaxGroup, kOp, ": Hv = ", Hv, " must be a multiple of Hk = ", Hk,
              ", at most ", kGdnStepMaxGroup, " times it (the value heads of a key head run as one cluster)");
  QWEN38_CHECK(x.size(1) == C + Hv * dv + 2 * Hv, kOp, ": x must be [T, C + Hv*dv + 2*Hv] = [T, ",
              C + Hv * dv + 2 * Hv, "] (q | k | v | z | b | a), found ", x.sizes());
  check_float_tensor(kOp, "conv_state", conv_state, {taps - 1, C}, device, "x");
  check_float_tensor(kOp, "a_neg", a_neg, {Hv}, device, "x");
  check_float_tensor(kOp, "dt_bias", dt_bias, {Hv}, device, "x");
  check_float_tensor(kOp, "norm_weight", norm_weight, {dv}, device, "x");

  GdnStepArgs a;
  a.T = (int)T, a.taps = (int)taps, a.Hk = (int)Hk, a.Hv = (int)Hv, a.dk = (int)dk, a.dv = (int)dv;
  a.x = x.data_ptr<float>();
  a.x_stride = x.stride(0);
  a.conv_weight = conv_weight.data_ptr<float>();
  a.a_neg = a_neg.data_ptr<float>();
  a.dt_bias = dt_bias.data_ptr<float>();
  a.norm_weight = norm_weight.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  a.conv_state = conv_state.data_ptr<float>();
  a.state = state.data_ptr<float>();
  check_rows("out", out, at::kFloat, T, Hv * dv, 16, device);
  a.out = out.data_ptr<float>();
  a.out_stride = out.stride(0);
  QWEN38_CHECK(!out_q_lo.has_value() || out_q.has_value(), kOp, ": out_q_lo needs out_q (the two-word lane)");
  QWEN38_CHECK(out_q.has_value() == out_d.has_value(), kOp, ": out_q and out_d come together");
  if (out_q.has_value()) {
    QWEN38_CHECK(dv % 32 == 0, kOp, ": the quantized lanes need dv % 32 == 0 (32-value blocks must not straddle "
                "heads), found dv = ", dv);
    check_rows("out_q", *out_q, at::kChar, T, Hv * dv, 4, device);
    a.out_q = out_q->data_ptr<int8_t>();
    a.out_q_stride = out_q->stride(0);
    if (out_q_lo.has_value()) {
      check_rows("out_q_lo", *out_q_lo, at::kChar, T, Hv * dv, 4, device);
      a.out_q_lo = out_q_lo->data_ptr<int8_t>();
      a.out_q_lo_stride = out_q_lo->stride(0);
    }
    check_rows("out_d", *out_d, at::kFloat, T, Hv * dv / 32, 4, device);
    a.out_d = out_d->data_ptr<float>();
    a.out_d_stride = out_d->stride(0);
  }
  if (token_conv_states.has_value()) {
    check_float_tensor(kOp, "token_conv_states", *token_conv_states, {T, taps - 1, C}, device, "x");
    a.token_conv_states = token_conv_states->data_ptr<float>();
  }
  if (token_states.has_value()) {
    check_float_tensor(kOp, "token_states", *token_states, {T, Hv, dv, dk}, device, "x");
    check_aligned16(kOp, "token_states", *token_states, "16-byte stores");
    a.token_states = token_states->data_ptr<float>();
  }

  const c10::cuda::CUDAGuard guard(device);
  const cudaError_t err = gdn_step_launch(a, current_stream());
  QWEN38_CHECK(err == cudaSuccess, kOp, ": kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace qwen38

TORCH_LIBRARY_IMPL(qwen38, CUDA, m) { m.impl("gdn_step", &qwen38::gdn_step); }
