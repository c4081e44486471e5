// What the attention bindings (attention.cpp, attention_prefill.cpp) share: the checks of the caches and
// positions, and the packing of attention's launch arguments for the caches' element type.
//
// The caches come in two ranks (attention.h): [max_seq, Hkv, hd], one cache the T rows of a call share, or, for
// the decode-step ops (attn_qk_norm_rope_store, attention, attention_gated), [B, max_seq, Hkv, hd], a cache a
// sequence, B dividing T: T / B consecutive rows a sequence (batched rows; T / B = 1: a decode step a sequence,
// more: each sequence's verify). The rank picks the mode: there is no flag to disagree with it.
#pragma once
#include <ATen/ATen.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "checks.h"
#include "../kernels/attention.h"

namespace qwen38 {

// Where the rows find their cache: the sizes of one cache, the elements from one cache to the next (0: the rows
// share one cache; max_seq*Hkv*hd in batched rows) and the consecutive rows of each cache (batched rows).
struct CacheLayout {
  int64_t max_seq, num_kv_heads, row_stride, rows_per_cache;
};

// Both caches: contiguous, one dtype (float32 or bfloat16), shaped alike, on `like`'s device.
inline void check_cache_pair(const char* op, const at::Tensor& like, const at::Tensor& k_cache,
                             const at::Tensor& v_cache) {
  QWEN38_CHECK(k_cache.device() == like.device() && v_cache.device() == like.device(), op,
              ": k_cache and v_cache must be on ", like.device(), ", found ", k_cache.device(), " and ",
              v_cache.device());
  QWEN38_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16, op,
              ": k_cache must be float32 or bfloat16, found ", k_cache.scalar_type());
  QWEN38_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), op, ": v_cache must have k_cache's dtype ",
              k_cache.scalar_type(), ", found ", v_cache.scalar_type());
  QWEN38_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": v_cache must be shaped like k_cache ", k_cache.sizes(),
              ", found ", v_cache.sizes());
  QWEN38_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": k_cache and v_cache must be contiguous");
}

// The layout of a checked cache: [max_seq, Hkv, hd] (shared) or [B, max_seq, Hkv, hd] (a cache a sequence, of
// num_tokens / B rows each).
inline CacheLayout cache_layout(const char* op, const at::Tensor& k_cache, int64_t num_tokens) {
  const int64_t max_seq = k_cache.size(-3), num_kv_heads = k_cache.size(-2);
  QWEN38_CHECK(max_seq <= INT32_MAX, op, ": max_seq must fit in int32, found ", max_seq);
  const bool batched = k_cache.dim() == 4;
  const int64_t row_stride = batched ? max_seq * num_kv_heads * k_cache.size(-1) : 0;  // contiguous
  return {max_seq, num_kv_heads, row_stride, batched ? num_tokens / k_cache.size(0) : 1};
}

// The caches of attention_prefill: [max_seq, Hkv, hd] (check_cache_pair), the one cache every row attends.
inline CacheLayout check_caches(const char* op, const at::Tensor& like, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, int64_t head_dim) {
  check_cache_pair(op, like, k_cache, v_cache);
  QWEN38_CHECK(k_cache.dim() == 3 && k_cache.size(2) == head_dim, op, ": k_cache must be [max_seq, Hkv, hd] with hd = ",
              head_dim, ", found ", k_cache.sizes());
  return cache_layout(op, k_cache, 1);
}

// The caches of the decode-step ops (check_cache_pair): [max_seq, Hkv, hd], shared by the T = `num_tokens` rows,
// or [B, max_seq, Hkv, hd], a cache a sequence of T / B consecutive rows (batched rows; max_seq, Hkv >= 1, so that
// the row stride, which tells the kernels the mode, is never 0).
inline CacheLayout check_row_caches(const char* op, const at::Tensor& like, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache, int64_t head_dim, int64_t num_tokens) {
  check_cache_pair(op, like, k_cache, v_cache);
  QWEN38_CHECK((k_cache.dim() == 3 || k_cache.dim() == 4) && k_cache.size(-1) == head_dim, op,
              ": k_cache must be [max_seq, Hkv, hd], or [B, max_seq, Hkv, hd] with a cache a sequence, with hd = ",
              head_dim, ", found ", k_cache.sizes());
  QWEN38_CHECK(k_cache.dim() == 3 || (k_cache.size(0) >= 1 && num_tokens % k_cache.size(0) == 0 &&
                                      k_cache.size(1) >= 1 && k_cache.size(2) >= 1),
              op, ": a 4-D k_cache holds a cache a sequence: [B, max_seq >= 1, Hkv >= 1, hd] with B dividing T = ",
              num_tokens, " rows (T / B consecutive rows a sequence), found ", k_cache.sizes());
  return cache_layout(op, k_cache, num_tokens);
}

// q: contiguous float32 [T, Hq, hd] on a CUDA device, hd one the kernel is built for (`head_dim_supported`).
inline void check_q(const char* op, const at::Tensor& q, bool (*head_dim_supported)(int)) {
  QWEN38_CHECK_CUDA(op, q);
  QWEN38_CHECK_DTYPE(op, q, at::kFloat);
  QWEN38_CHECK_CONTIGUOUS(op, q);
  QWEN38_CHECK(q.dim() == 3, op, ": q must be [T, Hq, hd], found ", q.sizes());
  QWEN38_CHECK(head_dim_supported(static_cast<int>(q.size(2))), op,
              ": head_dim must be one of 32, 64, 128, 256 (one kernel instance each), found ", q.size(2));
}

inline void check_positions(const char* op, const at::Tensor& like, const at::Tensor& positions, int64_t num_tokens) {
  QWEN38_CHECK(positions.device() == like.device(), op, ": positions must be on ", like.device(), ", found ",
              positions.device());
  QWEN38_CHECK(positions.scalar_type() == at::kInt && positions.dim() == 1 && positions.size(0) == num_tokens &&
                  positions.is_contiguous(),
              op, ": positions must be contiguous int32 [T] = [", num_tokens, "], found ", positions.scalar_type(),
              " ", positions.sizes());
}

// launch(CacheT{}) with CacheT the caches' element type: float or __nv_bfloat16 (check_caches' two dtypes).
template <typename Launch>
cudaError_t with_cache_type(const at::Tensor& k_cache, Launch&& launch) {
  if (k_cache.scalar_type() == at::kFloat) return launch(float{});
  return launch(__nv_bfloat16{});
}

// attention's arguments from checked tensors: q [T, Hq, hd], the caches and their layout, positions [T], out
// (null: not written, attention_gated) and the workspace.
template <typename CacheT>
AttentionArgs<CacheT> attention_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const CacheLayout& cache, const at::Tensor& positions, double scale,
                                     at::Tensor* out, at::Tensor& workspace) {
  AttentionArgs<CacheT> a;
  a.q = q.data_ptr<float>();
  a.k_cache = reinterpret_cast<const CacheT*>(k_cache.data_ptr());
  a.v_cache = reinterpret_cast<const CacheT*>(v_cache.data_ptr());
  a.cache_row_stride = cache.row_stride;
  a.rows_per_cache = static_cast<int>(cache.rows_per_cache);
  a.positions = positions.data_ptr<int32_t>();
  a.scale = static_cast<float>(scale);
  a.out = out != nullptr ? out->data_ptr<float>() : nullptr;
  a.workspace = workspace.data_ptr<float>();
  a.num_tokens = static_cast<int>(q.size(0));
  a.num_heads = static_cast<int>(q.size(1));
  a.head_dim = static_cast<int>(q.size(2));
  a.num_kv_heads = static_cast<int>(cache.num_kv_heads);
  a.max_seq = static_cast<int>(cache.max_seq);
  return a;
}

}  // namespace qwen38
