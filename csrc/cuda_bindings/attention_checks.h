// Argument checks shared by the attention bindings (attention.cpp, attention_prefill.cpp).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#include "checks.h"

namespace qwen38 {

// Both caches: [max_seq, Hkv, hd], contiguous, one dtype (float32 or bfloat16), on `like`'s device.
inline void check_caches(const char* op, const at::Tensor& like, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         int64_t head_dim) {
  QWEN38_CHECK(k_cache.device() == like.device() && v_cache.device() == like.device(), op,
              ": k_cache and v_cache must be on ", like.device(), ", found ", k_cache.device(), " and ",
              v_cache.device());
  QWEN38_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16, op,
              ": k_cache must be float32 or bfloat16, found ", k_cache.scalar_type());
  QWEN38_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), op, ": v_cache must have k_cache's dtype ",
              k_cache.scalar_type(), ", found ", v_cache.scalar_type());
  QWEN38_CHECK(k_cache.dim() == 3 && k_cache.size(2) == head_dim, op, ": k_cache must be [max_seq, Hkv, hd] with hd = ",
              head_dim, ", found ", k_cache.sizes());
  QWEN38_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": v_cache must be shaped like k_cache ", k_cache.sizes(),
              ", found ", v_cache.sizes());
  QWEN38_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": k_cache and v_cache must be contiguous");
  QWEN38_CHECK(k_cache.size(0) <= INT32_MAX, op, ": max_seq must fit in int32, found ", k_cache.size(0));
}

inline void check_positions(const char* op, const at::Tensor& like, const at::Tensor& positions, int64_t num_tokens) {
  QWEN38_CHECK(positions.device() == like.device(), op, ": positions must be on ", like.device(), ", found ",
              positions.device());
  QWEN38_CHECK(positions.scalar_type() == at::kInt && positions.dim() == 1 && positions.size(0) == num_tokens &&
                  positions.is_contiguous(),
              op, ": positions must be contiguous int32 [T] = [", num_tokens, "], found ", positions.scalar_type(),
              " ", positions.sizes());
}

}  // namespace qwen38
