// CUDA binding of argmax_advance (and the sampler's bookkeeping): argument checks, device guard, launch on the
// current stream.
#include <ATen/ATen.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "checks.h"
#include "../kernels/sampling.h"

namespace qwen38 {
namespace {

// An optional bookkeeping tensor: dtype, numel, contiguous, on the logits' device; its pointer or null.
template <typename T>
T* book(const char* name, const std::optional<at::Tensor>& t, at::ScalarType dtype, int64_t numel,
        const at::Tensor& logits) {
  constexpr const char* op = "argmax_advance";
  if (!t.has_value()) return nullptr;
  QWEN38_CHECK(t->device() == logits.device(), op, ": ", name, " must be on ", logits.device(), ", found ",
              t->device());
  QWEN38_CHECK(t->scalar_type() == dtype && t->numel() == numel && t->is_contiguous(), op, ": ", name,
              " must be contiguous ", dtype, " with ", numel, " values, found ", t->scalar_type(), " ",
              text(t->sizes()));
  return t->data_ptr<T>();
}

void argmax_advance_cuda(const at::Tensor& logits, at::Tensor& token, at::Tensor& position,
                         const std::optional<at::Tensor>& seen, const std::optional<at::Tensor>& generated,
                         const std::optional<at::Tensor>& num_generated, const std::optional<at::Tensor>& nonfinite) {
  constexpr const char* op = "argmax_advance";
  QWEN38_CHECK_CUDA(op, logits);
  QWEN38_CHECK_DTYPE(op, logits, at::kFloat);
  check_contiguous(op, "logits", logits);
  QWEN38_CHECK(logits.numel() >= 1 && logits.numel() <= INT_MAX, op, ": logits must hold 1..2^31-1 values [V], found ",
              text(logits.sizes()));
  QWEN38_CHECK_SAME_DEVICE(op, logits, token);
  QWEN38_CHECK_SAME_DEVICE(op, logits, position);
  QWEN38_CHECK_DTYPE(op, token, at::kInt);
  QWEN38_CHECK_DTYPE(op, position, at::kInt);
  QWEN38_CHECK(token.numel() == 1, op, ": token must hold one value, found sizes ", text(token.sizes()));
  QWEN38_CHECK(position.numel() == 1, op, ": position must hold one value, found sizes ", text(position.sizes()));
  ArgmaxAdvanceArgs a;
  a.logits = logits.data_ptr<float>();
  a.V = static_cast<int>(logits.numel());
  a.token = token.data_ptr<int32_t>();
  a.position = position.data_ptr<int32_t>();
  a.books.seen = book<bool>("seen", seen, at::kBool, logits.numel(), logits);
  a.books.generated = book<bool>("generated", generated, at::kBool, logits.numel(), logits);
  a.books.num_generated = book<int32_t>("num_generated", num_generated, at::kInt, 1, logits);
  a.books.nonfinite = book<bool>("nonfinite", nonfinite, at::kBool, 1, logits);

  const c10::cuda::CUDAGuard guard(logits.device());
  launch_or_throw(op, argmax_advance_launch(a, current_stream()));
}

}  // namespace
}  // namespace qwen38

TORCH_LIBRARY_IMPL(qwen38, CUDA, m) { m.impl("argmax_advance", &qwen38::argmax_advance_cuda); }
