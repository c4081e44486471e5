// CUDA binding of attention_prefill: argument checks, device guard, launch on the current stream.
#include <ATen/ATen.h>
#include <cuda_bf16.h>

#include "attention_checks.h"
#include "checks.h"
#include "../kernels/attention_prefill.h"

namespace qwen38 {
namespace {

void attention_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& positions, double scale, at::Tensor& out, at::Tensor& workspace) {
  constexpr const char* op = "attention_prefill";
  check_q(op, q, attention_prefill_head_dim_supported);
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const CacheLayout cache = check_caches(op, q, k_cache, v_cache, head_dim);
  const int64_t num_kv_heads = cache.num_kv_heads;
  QWEN38_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, op,
              ": Hq must be a multiple of Hkv, found Hq ", num_heads, ", Hkv ", num_kv_heads);
  const int64_t row_blocks = (num_tokens * (num_heads / num_kv_heads) + kAttentionPrefillRows - 1) /
                             kAttentionPrefillRows;
  QWEN38_CHECK(row_blocks <= 65535, op, ": T * Hq / Hkv must be at most 65535 * ", kAttentionPrefillRows,
              " (one grid row of blocks per ", kAttentionPrefillRows, " query rows), found T ", num_tokens);

  check_positions(op, q, positions, num_tokens);

  QWEN38_CHECK_SAME_DEVICE(op, q, out);
  QWEN38_CHECK_DTYPE(op, out, at::kFloat);
  QWEN38_CHECK_CONTIGUOUS(op, out);
  QWEN38_CHECK(out.sizes() == q.sizes(), op, ": out must be shaped like q ", q.sizes(), ", found ", out.sizes());
  QWEN38_CHECK(aligned16(q) && aligned16(k_cache) && aligned16(v_cache) && aligned16(out), op,
              ": q, k_cache, v_cache and out must be 16-byte aligned (the kernel moves them in 16-byte pieces)");
  QWEN38_CHECK_SAME_DEVICE(op, q, workspace);
  QWEN38_CHECK_DTYPE(op, workspace, at::kFloat);
  QWEN38_CHECK_CONTIGUOUS(op, workspace);
  const int64_t needed =
      attention_prefill_workspace_numel((int)num_tokens, (int)num_heads, (int)num_kv_heads, (int)head_dim);
  QWEN38_CHECK(workspace.numel() >= needed, op, ": workspace must hold splits * T * Hq * (hd + 2) = ", needed,
              " floats (qwen38_ops.attention_prefill.workspace_numel), found ", workspace.numel());
  QWEN38_CHECK(needed == 0 || aligned16(workspace), op,
              ": workspace must be 16-byte aligned (the split-K combine reads it in 16-byte pieces)");

  const c10::cuda::CUDAGuard guard(q.device());
  launch_or_throw(op, with_cache_type(k_cache, [&](auto cache_element) {
    using CacheT = decltype(cache_element);
    return attention_prefill_launch(
        attention_args<CacheT>(q, k_cache, v_cache, cache, positions, scale, &out, workspace), current_stream());
  }));
}

}  // namespace
}  // namespace qwen38

TORCH_LIBRARY_IMPL(qwen38, CUDA, m) { m.impl("attention_prefill", &qwen38::attention_prefill); }
