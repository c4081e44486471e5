// Argument checks shared by the CUDA bindings. Every message names the op, the argument and what was
// expected vs found, because these are the errors a user sees when a buffer is wrong.
#pragma once
#include <torch/library.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#define QWEN38_CHECK_CUDA(op, t)                                                                   \
  TORCH_CHECK((t).is_cuda(), op ": " #t " must be a CUDA tensor, found device ", (t).device())
#define QWEN38_CHECK_DTYPE(op, t, dt)                                                              \
  TORCH_CHECK((t).scalar_type() == (dt), op ": " #t " must be ", dt, ", found ", (t).scalar_type())
#define QWEN38_CHECK_CONTIGUOUS(op, t)                                                             \
  TORCH_CHECK((t).is_contiguous(), op ": " #t " must be contiguous (strides ", (t).strides(), ")")
// Rows may be strided (slices of a fused projection), the last dimension may not.
#define QWEN38_CHECK_ROWS(op, t)                                                                   \
  TORCH_CHECK((t).dim() == 2 && (t).stride(1) == 1, op ": " #t " must be 2-D [rows, n] with a "  \
              "contiguous last dimension, found sizes ", (t).sizes(), " strides ", (t).strides())
#define QWEN38_CHECK_SAME_DEVICE(op, a, b)                                                         \
  TORCH_CHECK((a).device() == (b).device(), op ": " #a " is on ", (a).device(), " but " #b " is on ", \
              (b).device())

namespace qwen38 {
inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
}  // namespace qwen38
