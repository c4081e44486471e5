// CUDA bindings of the norm_quant family: argument checks, device guard, launch on the current stream.
// The kernels move float rows as float4 and int8 rows 4 bytes at a time, hence the alignment checks.
#include <ATen/ATen.h>

#include <climits>
#include <cstdint>
#include <optional>

#include "checks.h"
#include "../kernels/norm_quant.h"

namespace qwen38 {
namespace {

// A float row tensor [rows, width] (contiguous last dimension, rows 16-byte aligned for float4 accesses) on
// `device`, the first argument's; `first`: it is the first argument, so it must be on a CUDA device.
void check_float_rows(const char* op, const char* name, const at::Tensor& t, int64_t rows, int64_t width,
                      const at::Device& device, bool first = false) {
  if (first) QWEN38_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, found device ", t.device());
  check_rows(op, name, t, at::kFloat, rows, width, 16, "vector accesses", device, "the first argument");
}

void check_vector(const char* op, const char* name, const at::Tensor& t, int64_t n, const at::Device& device) {
  check_same_device(op, name, t, device, "the first argument");
  QWEN38_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, found ", t.scalar_type());
  QWEN38_CHECK(t.dim() == 1 && t.size(0) == n && t.is_contiguous(), op, ": ", name, " must be a contiguous [", text(n),
              "], found sizes ", text(t.sizes()));
  QWEN38_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name,
              " must be 16-byte aligned (float4 loads), found address ", text(t.data_ptr()));
}

// The first float input x [T, D]: returns T after checking device, dtype, layout and D % 4.
int check_input(const char* op, const at::Tensor& x, int64_t width) {
  QWEN38_CHECK(x.dim() == 2 && x.size(0) <= INT_MAX && x.size(1) <= INT_MAX, op, ": x must be 2-D [T, D], found ",
              text(x.sizes()));
  check_float_rows(op, "x", x, x.size(0), width, x.device(), true);
  return static_cast<int>(x.size(0));
}

// out (optional for quantize_act) and the optional quantized lane (checks.h: check_quant_outputs).
void set_outputs(const char* op, ProducerArgs& a, const at::Tensor* out, const std::optional<at::Tensor>& out_q,
                 const std::optional<at::Tensor>& out_q_lo, const std::optional<at::Tensor>& out_d,
                 const at::Device& device) {
  QWEN38_CHECK(a.D % 4 == 0, op, ": the CUDA kernel needs the row width D % 4 == 0 (float4 rows), found D = ",
              text(a.D));
  if (out != nullptr) {
    check_float_rows(op, "out", *out, a.T, a.D, device);
    a.out = out->data_ptr<float>();
    a.out_stride = out->stride(0);
  }
  set_quant_outputs(a, check_quant_outputs(op, device, "the first argument", a.T, a.D, "D", out_q, out_q_lo, out_d));
}

void run(const char* op, Producer producer, const ProducerArgs& a, const at::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  const cudaError_t err = produce_activation_launch(producer, a, current_stream());
  launch_or_throw(op, err, err == cudaErrorInvalidValue ? " (row or head size beyond the kernel's limits?)" : "");
}

void quantize_act(const at::Tensor& x, at::Tensor& out_q, const std::optional<at::Tensor>& out_q_lo,
                  at::Tensor& out_d) {
  constexpr const char* op = "quantize_act";
  ProducerArgs a;
  QWEN38_CHECK(x.dim() == 2, op, ": x must be 2-D [T, K], found ", text(x.sizes()));
  a.D = static_cast<int>(x.size(1));
  a.T = check_input(op, x, x.size(1));
  a.x = x.data_ptr<float>();
  a.x_stride = x.stride(0);
  set_outputs(op, a, nullptr, out_q, out_q_lo, out_d, x.device());
  run(op, Producer::Quantize, a, x.device());
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out,
              const std::optional<at::Tensor>& out_q, const std::optional<at::Tensor>& out_q_lo,
              const std::optional<at::Tensor>& out_d) {
  constexpr const char* op = "rms_norm";
  ProducerArgs a;
  QWEN38_CHECK(x.dim() == 2, op, ": x must be 2-D [T, D], found ", text(x.sizes()));
  a.D = static_cast<int>(x.size(1));
  a.T = check_input(op, x, x.size(1));
  QWEN38_CHECK(a.D <= kProducerMaxRow, op, ": the CUDA kernel handles D <= ", text(kProducerMaxRow), ", found ",
              text(a.D));
  check_vector(op, "weight", weight, a.D, x.device());
  a.x = x.data_ptr<float>();
  a.x_stride = x.stride(0);
  a.weight = weight.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  set_outputs(op, a, &out, out_q, out_q_lo, out_d, x.device());
  run(op, Producer::RmsNorm, a, x.device());
}

void add_rms_norm(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out,
                  const std::optional<at::Tensor>& out_q, const std::optional<at::Tensor>& out_q_lo,
                  const std::optional<at::Tensor>& out_d) {
  constexpr const char* op = "add_rms_norm";
  ProducerArgs a;
  QWEN38_CHECK(residual.dim() == 2, op, ": residual must be 2-D [T, D], found ", text(residual.sizes()));
  a.D = static_cast<int>(residual.size(1));
  QWEN38_CHECK(residual.size(0) <= INT_MAX, op, ": too many rows, found ", text(residual.size(0)));
  a.T = static_cast<int>(residual.size(0));
  check_float_rows(op, "residual", residual, a.T, a.D, residual.device(), true);
  check_float_rows(op, "x", x, a.T, a.D, residual.device());
  QWEN38_CHECK(a.D <= kProducerMaxRow, op, ": the CUDA kernel handles D <= ", text(kProducerMaxRow), ", found ",
              text(a.D));
  check_vector(op, "weight", weight, a.D, residual.device());
  a.residual = residual.data_ptr<float>();
  a.residual_stride = residual.stride(0);
  a.x = x.data_ptr<float>();
  a.x_stride = x.stride(0);
  a.weight = weight.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  set_outputs(op, a, &out, out_q, out_q_lo, out_d, residual.device());
  run(op, Producer::AddRmsNorm, a, residual.device());
}

void silu_mul(const at::Tensor& gate_up, at::Tensor& out, const std::optional<at::Tensor>& out_q,
              const std::optional<at::Tensor>& out_q_lo, const std::optional<at::Tensor>& out_d) {
  constexpr const char* op = "silu_mul";
  ProducerArgs a;
  QWEN38_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, op, ": gate_up must be 2-D [T, 2F], found ",
              text(gate_up.sizes()));
  a.D = static_cast<int>(gate_up.size(1) / 2);
  QWEN38_CHECK(gate_up.size(0) <= INT_MAX, op, ": too many rows, found ", text(gate_up.size(0)));
  a.T = static_cast<int>(gate_up.size(0));
  check_float_rows(op, "gate_up", gate_up, a.T, 2 * static_cast<int64_t>(a.D), gate_up.device(), true);
  a.x = gate_up.data_ptr<float>();
  a.x_stride = gate_up.stride(0);
  set_outputs(op, a, &out, out_q, out_q_lo, out_d, gate_up.device());
  run(op, Producer::SiluMul, a, gate_up.device());
}

void gated_rms_norm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, double eps, at::Tensor& out,
                    const std::optional<at::Tensor>& out_q, const std::optional<at::Tensor>& out_q_lo,
                    const std::optional<at::Tensor>& out_d) {
  constexpr const char* op = "gated_rms_norm";
  ProducerArgs a;
  QWEN38_CHECK(x.dim() == 2, op, ": x must be 2-D [T, H*dv], found ", text(x.sizes()));
  a.D = static_cast<int>(x.size(1));
  a.T = check_input(op, x, x.size(1));
  check_float_rows(op, "z", z, a.T, a.D, x.device());
  QWEN38_CHECK(weight.dim() == 1, op, ": weight must be 1-D [dv], found ", text(weight.sizes()));
  const int64_t head_dim = weight.size(0);
  QWEN38_CHECK(head_dim > 0 && a.D % head_dim == 0, op, ": x's width ", text(a.D), " must be a multiple of dv = ",
              text(head_dim));
  QWEN38_CHECK(head_dim % 4 == 0 && head_dim <= kProducerMaxHead, op,
              ": the CUDA kernel needs dv % 4 == 0 and dv <= ", text(kProducerMaxHead), ", found dv = ",
              text(head_dim));
  QWEN38_CHECK(!out_q.has_value() || head_dim % 32 == 0, op,
              ": the quantized lanes need dv % 32 == 0 (32-value blocks must not straddle heads), found dv = ",
              text(head_dim));
  check_vector(op, "weight", weight, head_dim, x.device());
  a.x = x.data_ptr<float>();
  a.x_stride = x.stride(0);
  a.z = z.data_ptr<float>();
  a.z_stride = z.stride(0);
  a.weight = weight.data_ptr<float>();
  a.head_dim = static_cast<int>(head_dim);
  a.eps = static_cast<float>(eps);
  set_outputs(op, a, &out, out_q, out_q_lo, out_d, x.device());
  run(op, Producer::GatedRmsNorm, a, x.device());
}

}  // namespace
}  // namespace qwen38

TORCH_LIBRARY_IMPL(qwen38, CUDA, m) {
  m.impl("quantize_act", &qwen38::quantize_act);
  m.impl("rms_norm", &qwen38::rms_norm);
  m.impl("add_rms_norm", &qwen38::add_rms_norm);
  m.impl("silu_mul", &qwen38::silu_mul);
  m.impl("gated_rms_norm", &qwen38::gated_rms_norm);
}
