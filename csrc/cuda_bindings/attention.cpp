// CUDA bindings of the attention family: argument checks, device guard, launch on the current stream.
#include <ATen/ATen.h>
#include <cuda_bf16.h>

#include <optional>

#include "attention_checks.h"
#include "checks.h"
#include "../kernels/attention.h"

namespace qwen38 {
namespace {

void attn_qk_norm_rope_store(const at::Tensor& qgkv, const at::Tensor& q_norm, const at::Tensor& k_norm,
                             const at::Tensor& positions, double eps, double rope_theta, int64_t rotary_dim,
                             at::Tensor& q_out, at::Tensor& k_cache, at::Tensor& v_cache,
                             const std::optional<at::Tensor>& bad_position) {
  constexpr const char* op = "attn_qk_norm_rope_store";
  QWEN38_CHECK_CUDA(op, qgkv);
  QWEN38_CHECK_DTYPE(op, qgkv, at::kFloat);
  QWEN38_CHECK_ROWS(op, qgkv);
  QWEN38_CHECK_DTYPE(op, q_out, at::kFloat);
  QWEN38_CHECK_CONTIGUOUS(op, q_out);
  QWEN38_CHECK_SAME_DEVICE(op, qgkv, q_out);
  QWEN38_CHECK(q_out.dim() == 3, op, ": q_out must be [T, Hq, hd], found ", q_out.sizes());
  const int64_t num_tokens = qgkv.size(0), num_heads = q_out.size(1), head_dim = q_out.size(2);
  QWEN38_CHECK(q_out.size(0) == num_tokens, op, ": q_out must have T = ", num_tokens, " rows, found ", q_out.sizes());
  QWEN38_CHECK(head_dim > 0 && head_dim <= 1024, op, ": head_dim must be in [1, 1024], found ", head_dim);
  for (const at::Tensor* w : {&q_norm, &k_norm}) {
    QWEN38_CHECK(w->device() == qgkv.device() && w->scalar_type() == at::kFloat && w->dim() == 1 &&
                    w->size(0) == head_dim && w->is_contiguous(),
                op, ": q_norm and k_norm must be contiguous float32 [hd] = [", head_dim, "] on ", qgkv.device(),
                ", found ", w->scalar_type(), " ", w->sizes(), " on ", w->device());
  }
  const CacheLayout cache = check_row_caches(op, qgkv, k_cache, v_cache, head_dim, num_tokens);
  const int64_t num_kv_heads = cache.num_kv_heads;
  QWEN38_CHECK(qgkv.size(1) == 2 * num_heads * head_dim + 2 * num_kv_heads * head_dim, op,
              ": qgkv must be [T, Hq*2*hd + 2*Hkv*hd] = [", num_tokens, ", ",
              2 * num_heads * head_dim + 2 * num_kv_heads * head_dim, "], found ", qgkv.sizes());
  check_positions(op, qgkv, positions, num_tokens);
  QWEN38_CHECK(rotary_dim >= 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0, op,
              ": rotary_dim must be even and in [0, hd = ", head_dim, "], found ", rotary_dim);
  // One flag the rows share, or row t's own flag t (either with either cache rank).
  int32_t* bad = nullptr;
  int bad_stride = 0;
  if (bad_position.has_value()) {
    const at::Tensor& b = *bad_position;
    QWEN38_CHECK(b.device() == qgkv.device() && b.scalar_type() == at::kInt && b.is_contiguous() &&
                    (b.numel() == 1 || b.numel() == num_tokens),
                op, ": bad_position must be contiguous int32 with 1 element (shared by the rows) or T = ", num_tokens,
                " (a flag a row) on ", qgkv.device(), ", found ", b.scalar_type(), " ", b.sizes(), " on ", b.device());
    bad = b.data_ptr<int32_t>();
    bad_stride = b.numel() == 1 ? 0 : 1;
  }

  const c10::cuda::CUDAGuard guard(qgkv.device());
  launch_or_throw(op, with_cache_type(k_cache, [&](auto cache_element) {
    using CacheT = decltype(cache_element);
    AttnQkNormRopeStoreArgs<CacheT> a;
    a.qgkv = qgkv.data_ptr<float>(), a.qgkv_row_stride = qgkv.stride(0);
    a.q_norm = q_norm.data_ptr<float>(), a.k_norm = k_norm.data_ptr<float>();
    a.positions = positions.data_ptr<int32_t>();
    a.eps = (float)eps, a.rope_theta = (float)rope_theta, a.rotary_dim = (int)rotary_dim;
    a.q_out = q_out.data_ptr<float>(), a.bad_position = bad, a.bad_position_stride = bad_stride;
    a.k_cache = reinterpret_cast<CacheT*>(k_cache.data_ptr());
    a.v_cache = reinterpret_cast<CacheT*>(v_cache.data_ptr());
    a.cache_row_stride = cache.row_stride, a.rows_per_cache = (int)cache.rows_per_cache;
    a.num_tokens = (int)num_tokens, a.num_heads = (int)num_heads, a.num_kv_heads = (int)num_kv_heads;
    a.head_dim = (int)head_dim, a.max_seq = (int)cache.max_seq;
    return attn_qk_norm_rope_store_launch(a, current_stream());
  }));
}

struct AttentionSizes {
  int64_t num_tokens, num_heads, head_dim;
  CacheLayout cache;
  bool batched_rows() const { return cache.row_stride != 0; }
};

// q [T, Hq, hd], the caches (shared, or a cache a sequence), positions and the workspace of attention and
// attention_gated.
AttentionSizes check_attention_inputs(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& positions,
                                      const at::Tensor& workspace) {
  check_q(op, q, attention_head_dim_supported);
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const CacheLayout cache = check_row_caches(op, q, k_cache, v_cache, head_dim, num_tokens);
  const int64_t num_kv_heads = cache.num_kv_heads;
  QWEN38_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= kAttentionMaxGroup, op,
              ": Hq must be a multiple of Hkv with at most ", kAttentionMaxGroup, " query heads per kv head, found Hq ",
              num_heads, ", Hkv ", num_kv_heads);
  QWEN38_CHECK(aligned16(q) && aligned16(k_cache) && aligned16(v_cache), op,
              ": q, k_cache and v_cache must be 16-byte aligned (the kernel reads them with 16-byte loads)");
  check_positions(op, q, positions, num_tokens);
  QWEN38_CHECK(workspace.device() == q.device() && workspace.scalar_type() == at::kFloat && workspace.is_contiguous(),
              op, ": workspace must be contiguous float32 on ", q.device(), ", found ", workspace.scalar_type(), " on ",
              workspace.device());
  const bool batched_rows = cache.row_stride != 0;
  const int64_t needed = attention_workspace_numel((int)num_tokens, (int)num_heads, (int)head_dim, batched_rows);
  QWEN38_CHECK(workspace.numel() >= needed, op, ": workspace must hold T * splits * Hq * (hd + 2) = ", needed,
              " floats (qwen38_ops.attention.workspace_numel(T, Hq, hd, batched=",
              batched_rows ? "True" : "False", ")), found ", workspace.numel());
  return {num_tokens, num_heads, head_dim, cache};
}

// The output gate's operands for T rows of Hq heads of hd values (attn_output_gate, attention_gated): qgkv
// [T, >= Hq*2*hd] (strided rows), out [T, Hq*hd] (strided rows) or [T, Hq, hd] (contiguous), the quantized
// outputs of the GEMV's lane (check_quant_outputs), all on `device`, the device of the argument `like`.
GateOutputs check_gate_outputs(const char* op, const at::Device& device, const char* like, int64_t num_tokens,
                               int64_t num_heads, int64_t head_dim, const at::Tensor& qgkv, at::Tensor& out,
                               const std::optional<at::Tensor>& out_q, const std::optional<at::Tensor>& out_q_lo,
                               const std::optional<at::Tensor>& out_d) {
  const int64_t width = num_heads * head_dim;
  QWEN38_CHECK(qgkv.device() == device && qgkv.scalar_type() == at::kFloat && qgkv.dim() == 2 && qgkv.stride(1) == 1,
              op, ": qgkv must be float32 2-D [T, n] with a contiguous last dimension on ", device, ", found ",
              qgkv.scalar_type(), " ", qgkv.sizes(), " strides ", qgkv.strides(), " on ", qgkv.device());
  QWEN38_CHECK(qgkv.size(0) == num_tokens && qgkv.size(1) >= 2 * width, op, ": qgkv must be [T, >= Hq*2*hd] = [",
              num_tokens, ", >= ", 2 * width, "], found ", qgkv.sizes());
  QWEN38_CHECK(out.device() == device && out.scalar_type() == at::kFloat, op, ": out must be float32 on ", device,
              ", found ", out.scalar_type(), " on ", out.device());
  GateOutputs g;
  g.qgkv = qgkv.data_ptr<float>();
  g.qgkv_row_stride = qgkv.stride(0);
  if (out.dim() == 3) {  // [T, Hq, hd]
    QWEN38_CHECK(out.size(0) == num_tokens && out.size(1) == num_heads && out.size(2) == head_dim &&
                    out.is_contiguous(),
                op, ": a 3-D out must be contiguous [T, Hq, hd] = [", num_tokens, ", ", num_heads, ", ", head_dim,
                "], found ", out.sizes());
    g.out_row_stride = width;
  } else {
    QWEN38_CHECK(out.dim() == 2 && out.stride(1) == 1, op, ": out must be 2-D [rows, n] with a contiguous last "
                "dimension, found sizes ", out.sizes(), " strides ", out.strides());
    QWEN38_CHECK(out.size(0) == num_tokens && out.size(1) == width, op, ": out must be [T, Hq*hd] = [", num_tokens,
                ", ", width, "], found ", out.sizes());
    g.out_row_stride = out.stride(0);
  }
  g.out = out.data_ptr<float>();
  const QuantOutputs quant = check_quant_outputs(op, device, like, num_tokens, width, "Hq*hd", out_q, out_q_lo, out_d);
  g.out_q = quant.q;
  g.out_q_lo = quant.q_lo;
  g.out_d = quant.d;
  return g;
}

void attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& positions,
               double scale, at::Tensor& out, at::Tensor& workspace) {
  constexpr const char* op = "attention";
  const AttentionSizes n = check_attention_inputs(op, q, k_cache, v_cache, positions, workspace);
  QWEN38_CHECK_SAME_DEVICE(op, q, out);
  QWEN38_CHECK_DTYPE(op, out, at::kFloat);
  QWEN38_CHECK_CONTIGUOUS(op, out);
  QWEN38_CHECK(out.sizes() == q.sizes(), op, ": out must be shaped like q ", q.sizes(), ", found ", out.sizes());

  const c10::cuda::CUDAGuard guard(q.device());
  launch_or_throw(op, with_cache_type(k_cache, [&](auto cache_element) {
    using CacheT = decltype(cache_element);
    return attention_launch(attention_args<CacheT>(q, k_cache, v_cache, n.cache, positions, scale, &out, workspace),
                            current_stream());
  }));
}

void attention_gated(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& positions, double scale, const at::Tensor& qgkv, at::Tensor& workspace,
                     at::Tensor& out, const std::optional<at::Tensor>& out_q, const std::optional<at::Tensor>& out_q_lo,
                     const std::optional<at::Tensor>& out_d) {
  constexpr const char* op = "attention_gated";
  const AttentionSizes n = check_attention_inputs(op, q, k_cache, v_cache, positions, workspace);
  QWEN38_CHECK(n.batched_rows() || n.num_tokens <= kAttentionSameSplitTokens, op, ": T must be at most ",
              kAttentionSameSplitTokens, " with one cache for the rows (the decode step and the verify; longer inputs: "
              "attention_prefill, then attn_output_gate; batched rows, [B, max_seq, Hkv, hd] caches, take any T), "
              "found ", n.num_tokens);
  const GateOutputs gate =
      check_gate_outputs(op, q.device(), "q", n.num_tokens, n.num_heads, n.head_dim, qgkv, out, out_q, out_q_lo, out_d);

  const c10::cuda::CUDAGuard guard(q.device());
  launch_or_throw(op, with_cache_type(k_cache, [&](auto cache_element) {
    using CacheT = decltype(cache_element);
    AttentionGatedArgs<CacheT> a;
    static_cast<AttentionArgs<CacheT>&>(a) =
        attention_args<CacheT>(q, k_cache, v_cache, n.cache, positions, scale, nullptr, workspace);
    a.gate = gate;
    return attention_gated_launch(a, current_stream());
  }));
}

void attn_output_gate(const at::Tensor& attn, const at::Tensor& qgkv, at::Tensor& out,
                      const std::optional<at::Tensor>& out_q, const std::optional<at::Tensor>& out_q_lo,
                      const std::optional<at::Tensor>& out_d) {
  constexpr const char* op = "attn_output_gate";
  QWEN38_CHECK_CUDA(op, attn);
  QWEN38_CHECK_DTYPE(op, attn, at::kFloat);
  QWEN38_CHECK_CONTIGUOUS(op, attn);
  QWEN38_CHECK(attn.dim() == 3, op, ": attn must be [T, Hq, hd], found ", attn.sizes());
  const int64_t num_tokens = attn.size(0), num_heads = attn.size(1), head_dim = attn.size(2);
  AttnOutputGateArgs a;
  a.gate = check_gate_outputs(op, attn.device(), "attn", num_tokens, num_heads, head_dim, qgkv, out, out_q, out_q_lo,
                              out_d);
  a.attn = attn.data_ptr<float>();
  a.num_tokens = static_cast<int>(num_tokens);
  a.num_heads = static_cast<int>(num_heads);
  a.head_dim = static_cast<int>(head_dim);

  const c10::cuda::CUDAGuard guard(attn.device());
  launch_or_throw(op, attn_output_gate_launch(a, current_stream()));
}

}  // namespace
}  // namespace qwen38

TORCH_LIBRARY_IMPL(qwen38, CUDA, m) {
  m.impl("attn_qk_norm_rope_store", &qwen38::attn_qk_norm_rope_store);
  m.impl("attention", &qwen38::attention);
  m.impl("attention_gated", &qwen38::attention_gated);
  m.impl("attn_output_gate", &qwen38::attn_output_gate);
}
