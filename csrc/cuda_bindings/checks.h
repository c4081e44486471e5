// Argument checks shared by the CUDA bindings, and the one launch epilogue (launch_or_throw). Every message
// names the op, the argument and what was expected vs found, because these are the errors a user sees when a
// buffer is wrong. A binding names its op once (`constexpr const char* op = "...";`) and passes it to every check.
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
#include <optional>
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

// `name` is on `device`, the device of the argument `like` names.
inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Device& device,
                              const char* like) {
  TORCH_CHECK(t.device() == device, message(op, ": ", name, " is on ", t.device(), " but ", like, " is on ", device));
}

// An activation-side tensor: `dtype` [rows, width] with a contiguous last dimension (rows may be strided), each
// row starting `align_bytes`-aligned (`why` says what needs it), on `device`, the device of the argument `like`.
inline void check_rows(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t rows,
                       int64_t width, int64_t align_bytes, const char* why, const at::Device& device,
                       const char* like) {
  check_same_device(op, name, t, device, like);
  check_row_layout(op, name, t, dtype, rows, width, align_bytes, why);
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

// The optional quantized lane of an activation output of `rows` x `width` values (csrc/bindings.cpp): none,
// the int8 lane (out_q + out_d) or the two-word lane (out_q + out_q_lo + out_d). Pointers are null where absent;
// strides in elements.
struct QuantOutputs {
  int8_t* q = nullptr;
  int64_t q_stride = 0;
  int8_t* q_lo = nullptr;
  int64_t q_lo_stride = 0;
  float* d = nullptr;
  int64_t d_stride = 0;
};

// One rule for every op that writes the quantized lane (norm_quant's producers, gdn_step, attention's output
// gate): out_q and out_q_lo contiguous int8 [rows, width] starting 4-byte aligned (the float4 producers store 4
// bytes at a time), out_d contiguous float32 [rows, width/32], all on `device`, the device of the argument `like`;
// width % 32 == 0 (`width_name` names the width in the message). Contiguous, because the output gate indexes
// these rows flat; the producers, which take row strides, get them from these tensors (a one-row tensor may
// still carry any row stride).
inline QuantOutputs check_quant_outputs(const char* op, const at::Device& device, const char* like, int64_t rows,
                                        int64_t width, const char* width_name,
                                        const std::optional<at::Tensor>& out_q,
                                        const std::optional<at::Tensor>& out_q_lo,
                                        const std::optional<at::Tensor>& out_d) {
  TORCH_CHECK(!out_q_lo.has_value() || out_q.has_value(), message(op, ": out_q_lo needs out_q (the two-word lane)"));
  TORCH_CHECK(out_q.has_value() == out_d.has_value(), message(op, ": out_q and out_d come together"));
  QuantOutputs o;
  if (!out_q.has_value()) return o;
  TORCH_CHECK(width % 32 == 0, message(op, ": the quantized lanes need ", width_name, " % 32 == 0 (32-value blocks), "
                                       "found ", width_name, " = ", width));
  auto check = [&](const char* name, const at::Tensor& t, at::ScalarType dtype, const char* dtype_name, int64_t n) {
    check_same_device(op, name, t, device, like);
    TORCH_CHECK(t.scalar_type() == dtype && t.dim() == 2 && t.size(0) == rows && t.size(1) == n && t.is_contiguous(),
                message(op, ": ", name, " must be contiguous ", dtype_name, " [", rows, ", ", n, "], found ",
                        t.scalar_type(), " sizes ", t.sizes(), " strides ", t.strides()));
    TORCH_CHECK(aligned(t, 4),
                message(op, ": ", name, " must start 4-byte aligned (4-byte stores), found address ", t.data_ptr()));
  };
  check("out_q", *out_q, at::kChar, "int8", width);
  o.q = out_q->data_ptr<int8_t>();
  o.q_stride = out_q->stride(0);
  if (out_q_lo.has_value()) {
    check("out_q_lo", *out_q_lo, at::kChar, "int8", width);
    o.q_lo = out_q_lo->data_ptr<int8_t>();
    o.q_lo_stride = out_q_lo->stride(0);
  }
  check("out_d", *out_d, at::kFloat, "float32", width / 32);
  o.d = out_d->data_ptr<float>();
  o.d_stride = out_d->stride(0);
  return o;
}

// The quantized lane into an Args struct with the producers' fields (out_q, out_q_lo, out_d and their strides).
template <typename Args>
void set_quant_outputs(Args& a, const QuantOutputs& q) {
  a.out_q = q.q, a.out_q_stride = q.q_stride;
  a.out_q_lo = q.q_lo, a.out_q_lo_stride = q.q_lo_stride;
  a.out_d = q.d, a.out_d_stride = q.d_stride;
}

// The one launch epilogue: a launcher's error as the op's RuntimeError; `hint` (may be empty) says what the
// caller can change.
inline void launch_or_throw(const char* op, cudaError_t err, const char* hint = "") {
  TORCH_CHECK(err == cudaSuccess, message(op, ": kernel launch failed: ", cudaGetErrorString(err), hint));
}

}  // namespace qwen38

#define QWEN38_CHECK(cond, ...) TORCH_CHECK(cond, ::qwen38::message(__VA_ARGS__))

// `op` is the binding's op name (a const char*); #t names the argument.
#define QWEN38_CHECK_CUDA(op, t) \
  QWEN38_CHECK((t).is_cuda(), op, ": " #t " must be a CUDA tensor, found device ", (t).device())
#define QWEN38_CHECK_DTYPE(op, t, dt) \
  QWEN38_CHECK((t).scalar_type() == (dt), op, ": " #t " must be ", dt, ", found ", (t).scalar_type())
#define QWEN38_CHECK_CONTIGUOUS(op, t) \
  QWEN38_CHECK((t).is_contiguous(), op, ": " #t " must be contiguous (strides ", (t).strides(), ")")
// Rows may be strided (slices of a fused projection), the last dimension may not.
#define QWEN38_CHECK_ROWS(op, t)                                                                             \
  QWEN38_CHECK((t).dim() == 2 && (t).stride(1) == 1, op, ": " #t " must be 2-D [rows, n] with a contiguous " \
               "last dimension, found sizes ", (t).sizes(), " strides ", (t).strides())
#define QWEN38_CHECK_SAME_DEVICE(op, a, b) \
  QWEN38_CHECK((a).device() == (b).device(), op, ": " #a " is on ", (a).device(), " but " #b " is on ", (b).device())
