// CUDA bindings of the q8_gemv family (the GEMV and, for prompt-sized T, the tensor-core GEMM of
// q8_gemm.cu, which takes the same arguments): argument checks, device guard, launch on the current stream.
// The kernels read weights and activations with 16-byte loads, hence the alignment checks.
#include <ATen/ATen.h>

#include <climits>
#include <cstdint>

#include "checks.h"
#include "../kernels/q8_gemm.h"

namespace qwen38 {
namespace {

// weight_q int8 [N, K] + weight_d fp16 [N, K/32], both contiguous; fills N, K and the pointers.
void check_weights(const char* op, const at::Tensor& weight_q, const at::Tensor& weight_d, Q8GemvArgs& a) {
  QWEN38_CHECK(weight_q.is_cuda(), op, ": weight_q must be a CUDA tensor, found device ", weight_q.device());
  QWEN38_CHECK(weight_q.scalar_type() == at::kChar, op, ": weight_q must be int8, found ", weight_q.scalar_type());
  QWEN38_CHECK(weight_q.dim() == 2 && weight_q.is_contiguous(), op,
              ": weight_q must be a contiguous [N, K], found sizes ", text(weight_q.sizes()), " strides ",
              text(weight_q.strides()));
  const int64_t N = weight_q.size(0), K = weight_q.size(1);
  QWEN38_CHECK(K > 0 && K % 32 == 0 && K <= INT_MAX && N <= INT_MAX, op,
              ": weight_q's K must be a positive multiple of 32 (Q8_0 blocks), found [N, K] = ",
              text(weight_q.sizes()));
  QWEN38_CHECK(reinterpret_cast<uintptr_t>(weight_q.data_ptr()) % 16 == 0, op,
              ": weight_q must be 16-byte aligned (16-byte loads), found address ", text(weight_q.data_ptr()));
  check_same_device(op, "weight_d", weight_d, weight_q.device(), "weight_q");
  QWEN38_CHECK(weight_d.scalar_type() == at::kHalf, op, ": weight_d must be float16, found ", weight_d.scalar_type());
  QWEN38_CHECK(weight_d.dim() == 2 && weight_d.size(0) == N && weight_d.size(1) == K / 32 &&
                  weight_d.is_contiguous(),
              op, ": weight_d must be a contiguous [N, K/32] = [", text(N), ", ", text(K / 32), "], found sizes ",
              text(weight_d.sizes()), " strides ", text(weight_d.strides()));
  a.weight_q = weight_q.data_ptr<int8_t>();
  a.weight_d = reinterpret_cast<const __half*>(weight_d.data_ptr<at::Half>());
  a.N = static_cast<int>(N);
  a.K = static_cast<int>(K);
}

// An activation-side tensor: [T, width] rows with a contiguous last dimension, on weight_q's device.
void check_act(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t rows,
               int64_t width, int64_t align_bytes, const at::Tensor& weight_q) {
  check_rows(op, name, t, dtype, rows, width, align_bytes, "vector loads", weight_q.device(), "weight_q");
}

void check_out(const char* op, const at::Tensor& out, Q8GemvArgs& a, const at::Tensor& weight_q) {
  check_act(op, "out", out, at::kFloat, a.T, a.N, 4, weight_q);
  a.out = out.data_ptr<float>();
  a.out_stride = out.stride(0);
}

int64_t token_rows(const char* op, const at::Tensor& x) {
  QWEN38_CHECK(x.dim() == 2, op, ": x must be 2-D [T, K], found sizes ", text(x.sizes()));
  QWEN38_CHECK(x.size(0) <= INT_MAX, op, ": too many rows, found ", text(x.size(0)));
  return x.size(0);
}

void run(const char* op, Q8Act act, const Q8GemvArgs& a, const at::Tensor& weight_q) {
  const c10::cuda::CUDAGuard guard(weight_q.device());
  const cudaError_t err = q8_0_gemv_launch(act, a, current_stream());
  Q8GemvConfig env;
  Q8RowsKernel rows_kernel;
  launch_or_throw(op, err,
                  q8_0_gemv_rows_kernel_from_env(&rows_kernel) && rows_kernel == Q8RowsKernel::Unknown
                      ? " (QWEN38_Q8_GEMV_ROWS_KERNEL must be smem or direct)"
                  : q8_0_gemv_config_from_env(&env)
                      ? " (QWEN38_Q8_GEMV_CONFIG must name a compiled \"trip,parts\" config, see q8_gemv.h)"
                      : "");
}

// The GEMM's extra requirements (q8_gemm.h): K in whole 64-byte stages, 8-byte scale pairs.
void run_gemm(const char* op, Q8Act act, const Q8GemvArgs& a, const at::Tensor& weight_q) {
  QWEN38_CHECK(a.K % 64 == 0, op, ": K must be a multiple of 64 (two Q8_0 blocks per stage), found K = ", a.K);
  QWEN38_CHECK(reinterpret_cast<uintptr_t>(a.x_d) % 8 == 0 && (a.T <= 1 || a.x_d_stride % 2 == 0), op,
              ": x_d's rows must start 8-byte aligned (scale pairs), found address ", text(a.x_d), " row stride ",
              a.x_d_stride);
  const c10::cuda::CUDAGuard guard(weight_q.device());
  const int splits = q8_0_gemm_splits(act, a);
  int forced_splits;
  QWEN38_CHECK(splits >= 1 && splits <= 64, op, ": QWEN38_Q8_GEMM_SPLITS must be 1 .. 64, found ", splits);
  // the splits' partial sums: from the caching allocator (inside a graph capture, the graph's pool)
  const at::Tensor partial = splits > 1 ? at::empty({splits * static_cast<int64_t>(a.T) * a.N},
                                                    weight_q.options().dtype(at::kFloat))
                                        : at::Tensor();
  const cudaError_t err = q8_0_gemm_launch(act, a, splits, splits > 1 ? partial.data_ptr<float>() : nullptr,
                                             current_stream());
  Q8GemmKernel kernel;
  int tile;
  launch_or_throw(op, err,
                  q8_0_gemm_splits_from_env(&forced_splits) ? " (QWEN38_Q8_GEMM_SPLITS forced)"
                  : q8_0_gemm_kernel_from_env(&kernel)
                      ? " (QWEN38_Q8_GEMM_KERNEL must be mma, wgmma or wgmma_iadd; the wgmma kernels need an sm_90a "
                        "build, QWEN38_CUDA_ARCH=90a, on an sm_90 device, and 16-byte aligned operands, and take "
                        "QWEN38_Q8_GEMM_TILE 64 or 128 (int8), 64 (int8x2))"
                  : q8_0_gemm_tile_from_env(&tile) ? " (QWEN38_Q8_GEMM_TILE must be 32, 64 or 128)"
                                                   : "");
}

void q8_0_gemv_f32(const at::Tensor& x, const at::Tensor& weight_q, const at::Tensor& weight_d, at::Tensor& out) {
  constexpr const char* op = "q8_0_gemv";
  Q8GemvArgs a;
  check_weights(op, weight_q, weight_d, a);
  a.T = static_cast<int>(token_rows(op, x));
  check_act(op, "x", x, at::kFloat, a.T, a.K, 16, weight_q);
  a.x = x.data_ptr<float>();
  a.x_stride = x.stride(0);
  check_out(op, out, a, weight_q);
  run(op, Q8Act::F32, a, weight_q);
}

// The int lanes' activation: x_q (+ x_q_lo, the two-word lane) int8 [T, K] and x_d float32 [T, K/32].
void set_int_x(const char* op, Q8GemvArgs& a, const at::Tensor& x_q, const at::Tensor* x_q_lo, const at::Tensor& x_d,
               const at::Tensor& weight_q) {
  a.T = static_cast<int>(token_rows(op, x_q));
  check_act(op, "x_q", x_q, at::kChar, a.T, a.K, 16, weight_q);
  if (x_q_lo != nullptr) check_act(op, "x_q_lo", *x_q_lo, at::kChar, a.T, a.K, 16, weight_q);
  check_act(op, "x_d", x_d, at::kFloat, a.T, a.K / 32, 4, weight_q);
  a.x = x_q.data_ptr<int8_t>();
  a.x_stride = x_q.stride(0);
  if (x_q_lo != nullptr) {
    a.x_lo = x_q_lo->data_ptr<int8_t>();
    a.x_lo_stride = x_q_lo->stride(0);
  }
  a.x_d = x_d.data_ptr<float>();
  a.x_d_stride = x_d.stride(0);
}

template <bool kGemm>
void q8_0_int8(const at::Tensor& x_q, const at::Tensor& x_d, const at::Tensor& weight_q, const at::Tensor& weight_d,
               at::Tensor& out) {
  const char* op = kGemm ? "q8_0_gemm_int8" : "q8_0_gemv_int8";
  Q8GemvArgs a;
  check_weights(op, weight_q, weight_d, a);
  set_int_x(op, a, x_q, nullptr, x_d, weight_q);
  check_out(op, out, a, weight_q);
  (kGemm ? run_gemm : run)(op, Q8Act::Int8, a, weight_q);
}

template <bool kGemm>
void q8_0_int8x2(const at::Tensor& x_q, const at::Tensor& x_q_lo, const at::Tensor& x_d, const at::Tensor& weight_q,
                 const at::Tensor& weight_d, at::Tensor& out) {
  const char* op = kGemm ? "q8_0_gemm_int8x2" : "q8_0_gemv_int8x2";
  Q8GemvArgs a;
  check_weights(op, weight_q, weight_d, a);
  set_int_x(op, a, x_q, &x_q_lo, x_d, weight_q);
  check_out(op, out, a, weight_q);
  (kGemm ? run_gemm : run)(op, Q8Act::Int8x2, a, weight_q);
}

}  // namespace
}  // namespace qwen38

TORCH_LIBRARY_IMPL(qwen38, CUDA, m) {
  m.impl("q8_0_gemv", &qwen38::q8_0_gemv_f32);
  m.impl("q8_0_gemv_int8", &qwen38::q8_0_int8<false>);
  m.impl("q8_0_gemv_int8x2", &qwen38::q8_0_int8x2<false>);
  m.impl("q8_0_gemm_int8", &qwen38::q8_0_int8<true>);
  m.impl("q8_0_gemm_int8x2", &qwen38::q8_0_int8x2<true>);
}
