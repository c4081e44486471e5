// CUDA bindings of q8_0_embedding and embedding: argument checks, device guard, launch on the current stream.
#include <ATen/ATen.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "checks.h"
#include "../kernels/embedding.h"

namespace qwen38 {
namespace {

// token int32 [T] (T <= 65535: the grid's y), contiguous, on a CUDA device.
void check_token(const char* op, const at::Tensor& token) {
  QWEN38_CHECK(token.is_cuda(), op, ": token must be a CUDA tensor, found device ", token.device());
  QWEN38_CHECK(token.scalar_type() == at::kInt, op, ": token must be ", at::kInt, ", found ", token.scalar_type());
  check_contiguous(op, "token", token);
  QWEN38_CHECK(token.dim() == 1 && token.size(0) <= 65535, op, ": token must be 1-D [T] with T <= 65535, found ",
              text(token.sizes()));
}

// The flag an out-of-range id raises: none, or contiguous int32 on the token's device with 1 element (shared by
// the rows: row stride 0) or T (row t's own, batched rows: row stride 1).
struct BadTokenFlag {
  int32_t* flag = nullptr;
  int row_stride = 0;
};
BadTokenFlag bad_token_flag(const char* op, const at::Tensor& token, const std::optional<at::Tensor>& bad_token) {
  if (!bad_token.has_value()) return {};
  const at::Tensor& b = *bad_token;
  const int64_t T = token.size(0);
  QWEN38_CHECK(b.device() == token.device() && b.scalar_type() == at::kInt && b.is_contiguous() &&
                  (b.numel() == 1 || b.numel() == T),
              op, ": bad_token must be contiguous int32 with 1 element (shared by the rows) or T = ", T,
              " (a flag a row) on ", token.device(), ", found ", b.scalar_type(), " ", b.sizes(), " on ", b.device());
  return {b.data_ptr<int32_t>(), b.numel() == 1 ? 0 : 1};
}

void q8_0_embedding_cuda(const at::Tensor& token, const at::Tensor& weight_q, const at::Tensor& weight_d,
                         at::Tensor& out, const std::optional<at::Tensor>& bad_token) {
  constexpr const char* op = "q8_0_embedding";
  check_token(op, token);
  const int64_t T = token.size(0);
  QWEN38_CHECK_SAME_DEVICE(op, token, weight_q);
  QWEN38_CHECK_SAME_DEVICE(op, token, weight_d);
  QWEN38_CHECK_SAME_DEVICE(op, token, out);
  QWEN38_CHECK_DTYPE(op, weight_q, at::kChar);
  check_contiguous(op, "weight_q", weight_q);
  QWEN38_CHECK(weight_q.dim() == 2 && weight_q.size(1) % 32 == 0 && weight_q.size(1) > 0 &&
                  weight_q.size(0) <= INT_MAX && weight_q.size(1) <= INT_MAX,
              op, ": weight_q must be [V, D] with D a positive multiple of 32, found ", text(weight_q.sizes()));
  const int64_t V = weight_q.size(0), D = weight_q.size(1);
  QWEN38_CHECK(reinterpret_cast<uintptr_t>(weight_q.data_ptr()) % 16 == 0, op,
              ": weight_q must be 16-byte aligned (16-byte loads), found address ", text(weight_q.data_ptr()));
  QWEN38_CHECK_DTYPE(op, weight_d, at::kHalf);
  check_contiguous(op, "weight_d", weight_d);
  QWEN38_CHECK(weight_d.dim() == 2 && weight_d.size(0) == V && weight_d.size(1) == D / 32, op,
              ": weight_d must be [V, D/32] = [", text(V), ", ", text(D / 32), "], found ", text(weight_d.sizes()));
  QWEN38_CHECK_DTYPE(op, out, at::kFloat);
  QWEN38_CHECK_ROWS(op, out);
  QWEN38_CHECK(out.size(0) == T && out.size(1) == D, op, ": out must be [T, D] = [", text(T), ", ", text(D),
              "], found ", text(out.sizes()));
  QWEN38_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 && (T <= 1 || out.stride(0) % 4 == 0), op,
              ": out's rows must start 16-byte aligned (float4 stores), found address ", text(out.data_ptr()),
              " row stride ", text(out.stride(0)));

  const c10::cuda::CUDAGuard guard(token.device());
  EmbeddingArgs a;
  a.token = token.data_ptr<int32_t>();
  a.weight_q = weight_q.data_ptr<int8_t>();
  a.weight_d = reinterpret_cast<const __half*>(weight_d.data_ptr<at::Half>());
  a.out = out.data_ptr<float>();
  a.out_stride = out.stride(0);
  a.T = static_cast<int>(T);
  a.V = static_cast<int>(V);
  a.D = static_cast<int>(D);
  const BadTokenFlag flag = bad_token_flag(op, token, bad_token);
  a.bad_token = flag.flag, a.bad_token_stride = flag.row_stride;
  launch_or_throw(op, q8_0_embedding_launch(a, current_stream()));
}

template <typename W>
cudaError_t launch_dense(const at::Tensor& token, const at::Tensor& weight, at::Tensor& out, const BadTokenFlag& bad) {
  DenseEmbeddingArgs<W> a;
  a.token = token.data_ptr<int32_t>();
  a.weight = reinterpret_cast<const W*>(weight.data_ptr());
  a.out = out.data_ptr<float>();
  a.out_stride = out.stride(0);
  a.bad_token = bad.flag, a.bad_token_stride = bad.row_stride;
  a.T = static_cast<int>(token.size(0));
  a.V = static_cast<int>(weight.size(0));
  a.D = static_cast<int>(weight.size(1));
  return embedding_launch<W>(a, current_stream());
}

void embedding_cuda(const at::Tensor& token, const at::Tensor& weight, at::Tensor& out,
                    const std::optional<at::Tensor>& bad_token) {
  constexpr const char* op = "embedding";
  check_token(op, token);
  const int64_t T = token.size(0);
  QWEN38_CHECK_SAME_DEVICE(op, token, weight);
  QWEN38_CHECK_SAME_DEVICE(op, token, out);
  const at::ScalarType dtype = weight.scalar_type();
  QWEN38_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": weight must be float32, bfloat16 or float16, found ", dtype);
  check_contiguous(op, "weight", weight);
  QWEN38_CHECK(weight.dim() == 2 && weight.size(1) > 0 && weight.size(0) <= INT_MAX && weight.size(1) <= INT_MAX, op,
              ": weight must be [V, D] with D > 0, found ", text(weight.sizes()));
  const int64_t D = weight.size(1);
  QWEN38_CHECK_DTYPE(op, out, at::kFloat);
  QWEN38_CHECK_ROWS(op, out);
  QWEN38_CHECK(out.size(0) == T && out.size(1) == D, op, ": out must be [T, D] = [", text(T), ", ", text(D),
              "], found ", text(out.sizes()));
  const BadTokenFlag bad = bad_token_flag(op, token, bad_token);

  const c10::cuda::CUDAGuard guard(token.device());
  cudaError_t err;
  if (dtype == at::kFloat) {
    err = launch_dense<float>(token, weight, out, bad);
  } else if (dtype == at::kBFloat16) {
    err = launch_dense<__nv_bfloat16>(token, weight, out, bad);
  } else {
    err = launch_dense<__half>(token, weight, out, bad);
  }
  launch_or_throw(op, err);
}

}  // namespace
}  // namespace qwen38

TORCH_LIBRARY_IMPL(qwen38, CUDA, m) {
  m.impl("q8_0_embedding", &qwen38::q8_0_embedding_cuda);
  m.impl("embedding", &qwen38::embedding_cuda);
}
