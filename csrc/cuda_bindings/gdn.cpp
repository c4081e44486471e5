// CUDA bindings of the gdn family: argument checks, device guard, launch on the current stream.
#include <ATen/ATen.h>

#include <optional>

#include "checks.h"
#include "../kernels/gdn.h"
#include "../kernels/gdn_prefill.h"

namespace qwen38 {
namespace {

void gdn_conv(const at::Tensor& qkv, at::Tensor& conv_state, const at::Tensor& conv_weight, int64_t num_k_heads,
              int64_t head_k_dim, at::Tensor& out, const std::optional<at::Tensor>& token_conv_states) {
  constexpr const char* op = "gdn_conv";
  QWEN38_CHECK_CUDA(op, qkv);
  QWEN38_CHECK_DTYPE(op, qkv, at::kFloat);
  QWEN38_CHECK_ROWS(op, qkv);
  const int64_t num_tokens = qkv.size(0), channels = qkv.size(1);
  QWEN38_CHECK_SAME_DEVICE(op, qkv, conv_state);
  QWEN38_CHECK_SAME_DEVICE(op, qkv, conv_weight);
  QWEN38_CHECK_SAME_DEVICE(op, qkv, out);
  QWEN38_CHECK_DTYPE(op, conv_weight, at::kFloat);
  QWEN38_CHECK_CONTIGUOUS(op, conv_weight);
  QWEN38_CHECK(conv_weight.dim() == 2 && conv_weight.size(0) == channels, op, ": conv_weight must be [C, K] = [",
              channels, ", K], found ", conv_weight.sizes());
  const int64_t taps = conv_weight.size(1);
  QWEN38_CHECK(taps >= 2 && taps <= kGdnMaxConvTaps, op, ": conv_weight's K (taps) must be in [2, ",
              kGdnMaxConvTaps, "], found ", taps);
  QWEN38_CHECK_DTYPE(op, conv_state, at::kFloat);
  QWEN38_CHECK_CONTIGUOUS(op, conv_state);
  QWEN38_CHECK(conv_state.dim() == 2 && conv_state.size(0) == taps - 1 && conv_state.size(1) == channels,
              op, ": conv_state must be [K-1, C] = [", taps - 1, ", ", channels, "], found ", conv_state.sizes());
  QWEN38_CHECK_DTYPE(op, out, at::kFloat);
  QWEN38_CHECK_ROWS(op, out);
  QWEN38_CHECK(out.size(0) == num_tokens && out.size(1) == channels, op, ": out must be [T, C] = [", num_tokens,
              ", ", channels, "], found ", out.sizes());
  QWEN38_CHECK(num_k_heads > 0 && head_k_dim > 0 && head_k_dim <= 1024 && 2 * num_k_heads * head_k_dim <= channels,
              op, ": need num_k_heads > 0, 0 < head_k_dim <= 1024 and 2*num_k_heads*head_k_dim <= C = ", channels,
              ", found num_k_heads ", num_k_heads, ", head_k_dim ", head_k_dim);
  float* token_conv_states_ptr = nullptr;
  if (token_conv_states.has_value()) {
    check_float_tensor(op, "token_conv_states", *token_conv_states, {num_tokens, taps - 1, channels},
                       qkv.device(), "qkv");  // [T, K-1, C]
    token_conv_states_ptr = token_conv_states->data_ptr<float>();
  }

  GdnConvArgs a;
  a.qkv = qkv.data_ptr<float>(), a.qkv_row_stride = qkv.stride(0);
  a.conv_state = conv_state.data_ptr<float>(), a.conv_weight = conv_weight.data_ptr<float>();
  a.out = out.data_ptr<float>(), a.out_row_stride = out.stride(0), a.token_conv_states = token_conv_states_ptr;
  a.num_tokens = (int)num_tokens, a.channels = (int)channels, a.taps = (int)taps;
  a.num_k_heads = (int)num_k_heads, a.head_k_dim = (int)head_k_dim;

  const c10::cuda::CUDAGuard guard(qkv.device());
  launch_or_throw(op, gdn_conv_launch(a, current_stream()));
}

void gdn_gates(const at::Tensor& ba, const at::Tensor& a_neg, const at::Tensor& dt_bias, at::Tensor& beta,
               at::Tensor& decay) {
  constexpr const char* op = "gdn_gates";
  QWEN38_CHECK_CUDA(op, ba);
  QWEN38_CHECK_DTYPE(op, ba, at::kFloat);
  QWEN38_CHECK_ROWS(op, ba);
  QWEN38_CHECK(ba.size(1) % 2 == 0, op, ": ba must be [T, 2*Hv], found ", ba.sizes());
  const int64_t num_tokens = ba.size(0), num_v_heads = ba.size(1) / 2;
  QWEN38_CHECK_SAME_DEVICE(op, ba, a_neg);
  QWEN38_CHECK_SAME_DEVICE(op, ba, dt_bias);
  QWEN38_CHECK_SAME_DEVICE(op, ba, beta);
  QWEN38_CHECK_SAME_DEVICE(op, ba, decay);
  for (const at::Tensor* t : {&a_neg, &dt_bias}) {
    QWEN38_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == num_v_heads && t->is_contiguous(),
                op, ": a_neg and dt_bias must be contiguous float32 [Hv] = [", num_v_heads, "], found ",
                t->scalar_type(), " ", t->sizes());
  }
  for (const at::Tensor* t : {&beta, &decay}) {
    QWEN38_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == num_tokens &&
                    t->size(1) == num_v_heads && t->is_contiguous(),
                op, ": beta and decay must be contiguous float32 [T, Hv] = [", num_tokens, ", ", num_v_heads,
                "], found ", t->scalar_type(), " ", t->sizes());
  }

  GdnGatesArgs a;
  a.ba = ba.data_ptr<float>(), a.ba_row_stride = ba.stride(0);
  a.a_neg = a_neg.data_ptr<float>(), a.dt_bias = dt_bias.data_ptr<float>();
  a.beta = beta.data_ptr<float>(), a.decay = decay.data_ptr<float>();
  a.num_tokens = (int)num_tokens, a.num_v_heads = (int)num_v_heads;

  const c10::cuda::CUDAGuard guard(ba.device());
  launch_or_throw(op, gdn_gates_launch(a, current_stream()));
}

// From this many tokens gdn_recurrent runs a chunked kernel (gdn_prefill.h: the float32 one, a pass over the state
// for 16 tokens, and from 32 tokens at the 27B shape the tensor-core one) instead of the token-by-token one
// (gdn.cu), which stays the decode kernel. Estimated
// crossover, not yet measured: at the 27B shape the per-token kernel costs ~2.7 us a layer plus ~1 us a
// token, a chunk of up to 16 tokens ~3 us plus the state's read and write; bench_gdn's prefill row at
// T = 8 against its decode rows at T = 1 and 4 places it. With token_states the per-token kernel runs for
// any T: the chunked kernel's float order differs, and a verify must reproduce plain decode steps bitwise.
constexpr int64_t kGdnPrefillMinTokens = 8;

void gdn_recurrent(const at::Tensor& qkv, const at::Tensor& beta, const at::Tensor& decay, at::Tensor& state,
                   at::Tensor& out, const std::optional<at::Tensor>& token_states) {
  constexpr const char* op = "gdn_recurrent";
  QWEN38_CHECK_CUDA(op, qkv);
  QWEN38_CHECK_DTYPE(op, qkv, at::kFloat);
  QWEN38_CHECK_ROWS(op, qkv);
  QWEN38_CHECK_SAME_DEVICE(op, qkv, beta);
  QWEN38_CHECK_SAME_DEVICE(op, qkv, decay);
  QWEN38_CHECK_SAME_DEVICE(op, qkv, state);
  QWEN38_CHECK_SAME_DEVICE(op, qkv, out);
  QWEN38_CHECK_DTYPE(op, state, at::kFloat);
  QWEN38_CHECK_CONTIGUOUS(op, state);
  QWEN38_CHECK(state.dim() == 3, op, ": state must be [Hv, dv, dk], found ", state.sizes());
  const int64_t num_tokens = qkv.size(0), channels = qkv.size(1);
  const int64_t num_v_heads = state.size(0), dv = state.size(1), dk = state.size(2);
  QWEN38_CHECK(dk > 0 && dk <= kGdnMaxHeadKDim, op, ": state's dk must be in [1, ", kGdnMaxHeadKDim,
              "], found ", dk);
  const int64_t qk_channels = channels - num_v_heads * dv;
  QWEN38_CHECK(qk_channels > 0 && qk_channels % (2 * dk) == 0,
              op, ": qkv must be [T, 2*Hk*dk + Hv*dv] with Hv*dv = ", num_v_heads * dv, " and dk = ", dk,
              ", found ", qkv.sizes());
  const int64_t num_k_heads = qk_channels / (2 * dk);
  for (const at::Tensor* t : {&beta, &decay}) {
    QWEN38_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == num_tokens &&
                    t->size(1) == num_v_heads && t->is_contiguous(),
                op, ": beta and decay must be contiguous float32 [T, Hv] = [", num_tokens, ", ", num_v_heads,
                "], found ", t->scalar_type(), " ", t->sizes());
  }
  QWEN38_CHECK_DTYPE(op, out, at::kFloat);
  QWEN38_CHECK_CONTIGUOUS(op, out);
  QWEN38_CHECK(out.dim() == 3 && out.size(0) == num_tokens && out.size(1) == num_v_heads && out.size(2) == dv,
              op, ": out must be [T, Hv, dv] = [", num_tokens, ", ", num_v_heads, ", ", dv, "], found ",
              out.sizes());
  float* token_states_ptr = nullptr;
  if (token_states.has_value()) {
    check_float_tensor(op, "token_states", *token_states, {num_tokens, num_v_heads, dv, dk},
                       qkv.device(), "qkv");  // [T, Hv, dv, dk]
    check_aligned16(op, "token_states", *token_states, "written with 16-byte stores");
    token_states_ptr = token_states->data_ptr<float>();
  }

  GdnRecurrentArgs a;
  a.qkv = qkv.data_ptr<float>(), a.qkv_row_stride = qkv.stride(0);
  a.beta = beta.data_ptr<float>(), a.decay = decay.data_ptr<float>();
  a.state = state.data_ptr<float>(), a.out = out.data_ptr<float>(), a.token_states = token_states_ptr;
  a.num_tokens = (int)num_tokens, a.num_k_heads = (int)num_k_heads, a.num_v_heads = (int)num_v_heads;
  a.head_k_dim = (int)dk, a.head_v_dim = (int)dv;

  const c10::cuda::CUDAGuard guard(qkv.device());
  // Shapes the chunked kernel does not take (see gdn_prefill_supported: no token_states, ...) run token by token.
  const bool chunked = num_tokens >= kGdnPrefillMinTokens && gdn_prefill_supported(a);
  launch_or_throw(op, chunked ? gdn_prefill_launch(a, current_stream()) : gdn_recurrent_launch(a, current_stream()));
}

}  // namespace
}  // namespace qwen38

TORCH_LIBRARY_IMPL(qwen38, CUDA, m) {
  m.impl("gdn_conv", &qwen38::gdn_conv);
  m.impl("gdn_gates", &qwen38::gdn_gates);
  m.impl("gdn_recurrent", &qwen38::gdn_recurrent);
}
