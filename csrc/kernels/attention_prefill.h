// Causal flash-attention prefill over the KV cache on tensor cores (mma.sync bf16, fp32 accumulate): the
// `attention` op's math for many query tokens at once. The host launcher takes attention's Args and a stream; it
// launches asynchronously and returns the cudaError_t. Layouts are those of
// csrc/bindings.cpp. The cache element type is float (operands split into bf16 hi + lo, three MMAs: ~1e-5
// relative) or __nv_bfloat16 (q and the probabilities rounded to bf16, one MMA).
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "attention.h"  // AttentionArgs: attention's arguments, which attention_prefill shares
#include "op_limits.h"  // kAttentionPrefillRows, kAttentionPrefillTargetBlocks, kAttentionPrefillMaxSplits

namespace qwen38 {

// kAttentionPrefillRows query rows (token, query head of one kv group) per block; the grid has
// ceil(T * Hq/Hkv / 64) rows of blocks, at most 65535 (gridDim.y).
//
// Split-K (flash-decoding) for launches too small to fill the GPU: a few query rows over a long cache, e.g.
// a 101-token turn after a 16k history is 10 row blocks x 4 kv heads = 40 blocks on 132 SMs, each walking
// the whole cache. Each block's KV tiles are then dealt over `splits` blocks, whose partial (max, sum, acc)
// a second kernel combines in split order. The split count depends on the shapes only (positions live on
// the device), so a call is bitwise reproducible: as many splits as fit kAttentionPrefillTargetBlocks blocks
// (two blocks on each of the H200's 132 SMs: the bf16 hd = 256 instance fits two an SM, the float32 one
// runs two full waves), none below 2, at most kAttentionPrefillMaxSplits (op_limits.h).
inline int attention_prefill_num_splits(int num_tokens, int num_heads, int num_kv_heads) {
  const int64_t rows = (int64_t)num_tokens * (num_heads / num_kv_heads);
  const int64_t blocks = num_kv_heads * ((rows + kAttentionPrefillRows - 1) / kAttentionPrefillRows);
  const int64_t splits = blocks > 0 ? kAttentionPrefillTargetBlocks / blocks : 0;
  if (splits < 2) return 1;
  return splits < kAttentionPrefillMaxSplits ? (int)splits : kAttentionPrefillMaxSplits;
}
// Per (split, token, query head): hd partial accumulators, then (max, sum) after all of them. None without
// a split.
inline int64_t attention_prefill_workspace_numel(int num_tokens, int num_heads, int num_kv_heads, int head_dim) {
  const int splits = attention_prefill_num_splits(num_tokens, num_heads, num_kv_heads);
  return splits == 1 ? 0 : (int64_t)splits * num_tokens * num_heads * (head_dim + 2);
}

// head_dim values the kernel is built for (one template instance each).
inline bool attention_prefill_head_dim_supported(int head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

// attention's arguments (AttentionArgs, attention.h): q [T, Hq, hd] float32, caches [max_seq, Hkv, hd] (rows
// 0..max(positions) written), positions int32 [T], out [T, Hq, hd] float32, workspace float32 with
// attention_prefill_workspace_numel(T, Hq, Hkv, hd) elements (unused, may be null, when that is 0); q, caches, out
// and workspace 16-byte aligned. Token t attends rows 0..positions[t] (clamped to the cache); query head h reads
// kv head h / (Hq/Hkv). Hq % Hkv == 0, head_dim supported as above. One cache shared by the rows only
// (cache_row_stride 0; batched rows are decode steps: attention_launch), else cudaErrorInvalidValue. Launched
// without PDL (pdl.cuh).
template <typename CacheT>
cudaError_t attention_prefill_launch(const AttentionArgs<CacheT>& args, cudaStream_t stream);

}  // namespace qwen38
