// Causal flash-attention prefill over the KV cache on tensor cores (mma.sync bf16, fp32 accumulate): the
// `attention` op's math for many query tokens at once, without a split-K workspace. The host launcher takes
// raw device pointers, sizes and a stream; it launches asynchronously and returns the cudaError_t. Layouts
// are those of csrc/bindings.cpp. The cache element type is float (operands split into bf16 hi + lo, three
// MMAs: ~1e-5 relative) or __nv_bfloat16 (q and the probabilities rounded to bf16, one MMA).
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace qwen38 {

// Query rows (token, query head of one kv group) per block; the grid has ceil(T * Hq/Hkv / 64) rows of
// blocks, at most 65535 (gridDim.y).
constexpr int kAttentionPrefillRows = 64;

// head_dim values the kernel is built for (one template instance each).
inline bool attention_prefill_head_dim_supported(int head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

// q [T, Hq, hd] float32, caches [max_seq, Hkv, hd] (rows 0..max(positions) written), positions int32 [T],
// out [T, Hq, hd] float32; q, caches and out 16-byte aligned. Token t attends rows 0..positions[t] (clamped
// to the cache); query head h reads kv head h / (Hq/Hkv). Hq % Hkv == 0, head_dim supported as above.
template <typename CacheT>
cudaError_t attention_prefill_launch(const float* q, const CacheT* k_cache, const CacheT* v_cache,
                                     const int32_t* positions, float scale, float* out, int num_tokens,
                                     int num_heads, int num_kv_heads, int head_dim, int max_seq, cudaStream_t stream);

}  // namespace qwen38
