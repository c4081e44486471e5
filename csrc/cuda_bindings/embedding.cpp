// CUDA binding of q8_0_embedding: argument checks, device guard, launch on the current stream.
#include <ATen/ATen.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <string>

#include "checks.h"
#include "../kernels/embedding.h"

namespace qwen38 {
namespace {

void q8_0_embedding_cuda(const at::Tensor& token, const at::Tensor& weight_q, const at::Tensor& weight_d,
                         at::Tensor& out) {
  constexpr const char* op = "q8_0_embedding";
  QWEN38_CHECK_CUDA("q8_0_embedding", token);
  QWEN38_CHECK_DTYPE("q8_0_embedding", token, at::kInt);
  check_contiguous(op, "token", token);
  QWEN38_CHECK(token.dim() == 1 && token.size(0) <= 65535, op, ": token must be 1-D [T] with T <= 65535, found ",
              text(token.sizes()));
  const int64_t T = token.size(0);
  QWEN38_CHECK_SAME_DEVICE("q8_0_embedding", token, weight_q);
  QWEN38_CHECK_SAME_DEVICE("q8_0_embedding", token, weight_d);
  QWEN38_CHECK_SAME_DEVICE("q8_0_embedding", token, out);
  QWEN38_CHECK_DTYPE("q8_0_embedding", weight_q, at::kChar);
  check_contiguous(op, "weight_q", weight_q);
  QWEN38_CHECK(weight_q.dim() == 2 && weight_q.size(1) % 32 == 0 && weight_q.size(1) > 0 &&
                  weight_q.size(0) <= INT_MAX && weight_q.size(1) <= INT_MAX,
              op, ": weight_q must be [V, D] with D a positive multiple of 32, found ", text(weight_q.sizes()));
  const int64_t V = weight_q.size(0), D = weight_q.size(1);
  QWEN38_CHECK(reinterpret_cast<uintptr_t>(weight_q.data_ptr()) % 16 == 0, op,
              ": weight_q must be 16-byte aligned (16-byte loads), found address ", text(weight_q.data_ptr()));
  QWEN38_CHECK_DTYPE("q8_0_embedding", weight_d, at::kHalf);
  check_contiguous(op, "weight_d", weight_d);
  QWEN38_CHECK(weight_d.dim() == 2 && weight_d.size(0) == V && weight_d.size(1) == D / 32, op,
              ": weight_d must be [V, D/32] = [", text(V), ", ", text(D / 32), "], found ", text(weight_d.sizes()));
  QWEN38_CHECK_DTYPE("q8_0_embedding", out, at::kFloat);
  QWEN38_CHECK(out.dim() == 2 && out.stride(1) == 1, op,
              ": out must be 2-D [rows, n] with a contiguous last dimension, found sizes ", text(out.sizes()),
              " strides ", text(out.strides()));
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
  const cudaError_t err = q8_0_embedding(a, current_stream());
  QWEN38_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace qwen38

TORCH_LIBRARY_IMPL(qwen38, CUDA, m) { m.impl("q8_0_embedding", &qwen38::q8_0_embedding_cuda); }
