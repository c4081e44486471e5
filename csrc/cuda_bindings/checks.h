// Argument checks shared by the CUDA bindings. Every message names the op, the argument and what was
// expected vs found, because these are the errors a user sees when a buffer is wrong.
//
// Numbers are formatted here with snprintf, never streamed: on the device image (this extension built by
// /opt/gcc against torch 2.11+cu130) a failed TORCH_CHECK whose message streamed an integer (a size, a
// stride, an address) segfaulted the process, while names, dtypes and devices streamed fine. QWEN38_CHECK
// turns every argument into a string first, so TORCH_CHECK only ever receives one std::string.
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

namespace qwen38 {

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline std::string text(const char* s) { return s; }
inline std::string text(const std::string& s) { return s; }
inline std::string text(c10::ScalarType t) { return c10::toString(t); }
inline std::string text(const c10::Device& d) { return d.str(); }
inline std::string text(const void* p) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
std::string text(T v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v));
  return buf;
}
inline std::string text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
inline std::string text(at::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + text(v[i]);
  return s + "]";
}

template <typename... Args>
std::string message(const Args&... args) {
  return (std::string() + ... + text(args));
}

// The tensor starts, and every row starts, on a multiple of `bytes` (vector loads and stores).
inline bool aligned(const at::Tensor& t, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0 &&
         (t.dim() < 2 || t.size(0) <= 1 || (t.stride(0) * t.element_size()) % bytes == 0);
}

// `name` is `dtype` [rows, width] with a contiguous last dimension (rows may be strided), each row starting
// `align_bytes`-aligned; `why` says what needs the alignment. The device checks stay with the caller,
// which names the argument the device must match.
inline void check_row_layout(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype,
                             int64_t rows, int64_t width, int64_t align_bytes, const char* why) {
  TORCH_CHECK(t.scalar_type() == dtype, message(op, ": ", name, " must be ", dtype, ", found ", t.scalar_type()));
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1,
              message(op, ": ", name, " must be 2-D [rows, n] with a contiguous last dimension, found sizes ",
                      t.sizes(), " strides ", t.strides()));
  TORCH_CHECK(t.size(0) == rows && t.size(1) == width,
              message(op, ": ", name, " must be [", rows, ", ", width, "], found ", t.sizes()));
  TORCH_CHECK(aligned(t, align_bytes), message(op, ": ", name, "'s rows must start ", align_bytes, "-byte aligned (",
                                               why, "), found address ", t.data_ptr(), " row stride ", t.stride(0)));
}

// `name` is contiguous float32 of exactly `shape`, on the device of the argument `like` names.
inline void check_float_tensor(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape,
                               const at::Device& device, const char* like) {
  TORCH_CHECK(t.device() == device, message(op, ": ", name, " is on ", t.device(), " but ", like, " is on ", device));
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.sizes() == shape,
              message(op, ": ", name, " must be contiguous float32 ", shape, ", found ", t.scalar_type(), " ",
                      t.sizes(), " strides ", t.strides()));
}

inline bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// `name` starts 16-byte aligned; `why` says what needs it.
inline void check_aligned16(const char* op, const char* name, const at::Tensor& t, const char* why) {
  TORCH_CHECK(aligned16(t),
              message(op, ": ", name, " must start 16-byte aligned (", why, "), found address ", t.data_ptr()));
}

inline void check_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), message(op, ": ", name, " must be contiguous (strides ", t.strides(), ")"));
}

}  // namespace qwen38

#define QWEN38_CHECK(cond, ...) TORCH_CHECK(cond, ::qwen38::message(__VA_ARGS__))

#define QWEN38_CHECK_CUDA(op, t) QWEN38_CHECK((t).is_cuda(), op ": " #t " must be a CUDA tensor, found device ", (t).device())
#define QWEN38_CHECK_DTYPE(op, t, dt) \
  QWEN38_CHECK((t).scalar_type() == (dt), op ": " #t " must be ", dt, ", found ", (t).scalar_type())
#define QWEN38_CHECK_CONTIGUOUS(op, t) \
  QWEN38_CHECK((t).is_contiguous(), op ": " #t " must be contiguous (strides ", (t).strides(), ")")
// Rows may be strided (slices of a fused projection), the last dimension may not.
#define QWEN38_CHECK_ROWS(op, t)                                                                            \
  QWEN38_CHECK((t).dim() == 2 && (t).stride(1) == 1, op ": " #t " must be 2-D [rows, n] with a contiguous " \
               "last dimension, found sizes ", (t).sizes(), " strides ", (t).strides())
#define QWEN38_CHECK_SAME_DEVICE(op, a, b) \
  QWEN38_CHECK((a).device() == (b).device(), op ": " #a " is on ", (a).device(), " but " #b " is on ", (b).device())
