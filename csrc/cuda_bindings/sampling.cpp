// CUDA binding of argmax_advance: argument checks, device guard, launch on the current stream.
#include <ATen/ATen.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <string>

#include "checks.h"
#include "../kernels/sampling.h"

namespace qwen38 {
namespace {

void argmax_advance_cuda(const at::Tensor& logits, at::Tensor& token, at::Tensor& position) {
  constexpr const char* op = "argmax_advance";
  QWEN38_CHECK_CUDA("argmax_advance", logits);
  QWEN38_CHECK_DTYPE("argmax_advance", logits, at::kFloat);
  check_contiguous(op, "logits", logits);
  QWEN38_CHECK(logits.numel() >= 1 && logits.numel() <= INT_MAX, op, ": logits must hold 1..2^31-1 values [V], found ",
              text(logits.sizes()));
  QWEN38_CHECK_SAME_DEVICE("argmax_advance", logits, token);
  QWEN38_CHECK_SAME_DEVICE("argmax_advance", logits, position);
  QWEN38_CHECK_DTYPE("argmax_advance", token, at::kInt);
  QWEN38_CHECK_DTYPE("argmax_advance", position, at::kInt);
  QWEN38_CHECK(token.numel() == 1, op, ": token must hold one value, found sizes ", text(token.sizes()));
  QWEN38_CHECK(position.numel() == 1, op, ": position must hold one value, found sizes ", text(position.sizes()));

  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaError_t err = argmax_advance(logits.data_ptr<float>(), static_cast<int>(logits.numel()),
                                         token.data_ptr<int32_t>(), position.data_ptr<int32_t>(), current_stream());
  QWEN38_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace qwen38

TORCH_LIBRARY_IMPL(qwen38, CUDA, m) { m.impl("argmax_advance", &qwen38::argmax_advance_cuda); }
