// Gated full attention kernels, in two files by strategy: attention.cu holds the split-K causal flash-decode over
// the cache (GQA) with its fixed-order combine, plain (attention) or with the sigmoid output gate applied in the
// combine (attention_gated); attention_rope_gate.cu holds the per-head QK RMSNorm + partial NEOX RoPE + KV-cache
// store at the device-held position (attn_qk_norm_rope_store) and the standalone output gate (attn_output_gate).
// The gate's optional int8 / two-word int8 activation outputs are attention_gate.cuh's, shared by both. Each
// launcher takes its op's Args and a stream, launches asynchronously (with PDL when pdl_enabled(): pdl.cuh) and
// returns the cudaError_t. Layouts are those of csrc/bindings.cpp. The cache element type is float or
// __nv_bfloat16.
//
// Two modes, the same kernels (the Args' cache_row_stride tells them apart): the T rows of a call are T tokens of
// ONE sequence sharing one cache [max_seq, Hkv, hd] (cache_row_stride 0: a decode step, a speculative verify, a
// prompt), or rows of B sequences, each with its own cache of [B, max_seq, Hkv, hd] (batched rows, cache_row_stride
// = max_seq*Hkv*hd): rows_per_cache consecutive rows a sequence, T = B * rows_per_cache. rows_per_cache 1 is B
// sequences' decode steps in one launch; more is each sequence's speculative verify (its tokens at consecutive
// positions, causal through positions[t] as in the shared cache). In both, row t finds its cache at
// k_cache + (t / rows_per_cache) * cache_row_stride; nothing else differs but the attention's split count
// (attention_num_splits).
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "op_limits.h"  // kAttentionSplits, kAttentionSameSplitTokens, kBadPositionFlag

namespace qwen38 {

constexpr int kAttentionMaxGroup = 8;  // query heads per kv head

// Splits per (token, query head) of the attention kernel (op_limits.h says why). Batched rows always get the decode
// step's kAttentionSplits, whatever T: each row is a sequence's decode step (or a row of its verify) and keeps a
// T = 1 call's float order.
inline int attention_num_splits(int num_tokens, bool batched_rows) {
  if (batched_rows || num_tokens <= kAttentionSameSplitTokens) return kAttentionSplits;
  const int s = kAttentionSplits / num_tokens;
  return s > 1 ? s : 1;
}
// Per (token, query head, split): hd partial accumulators, then (max, sum) after all of them.
inline int64_t attention_workspace_numel(int num_tokens, int num_heads, int head_dim, bool batched_rows) {
  return (int64_t)num_tokens * attention_num_splits(num_tokens, batched_rows) * num_heads * (head_dim + 2);
}
// head_dim values the attention kernel is built for (one template instance each).
inline bool attention_head_dim_supported(int head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

// qgkv [T, Hq*2*hd + 2*Hkv*hd] (row stride qgkv_row_stride), q_norm/k_norm [hd], positions int32 [T],
// q_out [T, Hq, hd], caches [max_seq, Hkv, hd] (cache_row_stride 0) or [B, max_seq, Hkv, hd] (batched rows:
// cache_row_stride = max_seq*Hkv*hd, T = B * rows_per_cache), row t storing its k, v at row positions[t] of its
// cache (t / rows_per_cache). A position outside
// [0, max_seq) stores nothing and stores kBadPositionFlag into bad_position[t * bad_position_stride] (when not null:
// stride 0, one flag shared by the rows; 1, a flag a row). hd <= 1024, rotary_dim even and <= hd.
template <typename CacheT>
struct AttnQkNormRopeStoreArgs {
  const float* qgkv = nullptr;
  int64_t qgkv_row_stride = 0;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  const int32_t* positions = nullptr;
  float eps = 0.f, rope_theta = 0.f;
  int rotary_dim = 0;
  float* q_out = nullptr;
  CacheT* k_cache = nullptr;
  CacheT* v_cache = nullptr;
  int64_t cache_row_stride = 0;
  int rows_per_cache = 1;  // batched rows: consecutive rows of one cache
  int32_t* bad_position = nullptr;
  int bad_position_stride = 0;
  int num_tokens = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, max_seq = 0;
};
template <typename CacheT>
cudaError_t attn_qk_norm_rope_store_launch(const AttnQkNormRopeStoreArgs<CacheT>& args, cudaStream_t stream);

// q [T, Hq, hd], caches [max_seq, Hkv, hd] (cache_row_stride 0) or [B, max_seq, Hkv, hd] (batched rows:
// cache_row_stride = max_seq*Hkv*hd, never 0: max_seq >= 1; T = B * rows_per_cache), 16-byte aligned, positions
// int32 [T], out [T, Hq, hd], workspace float32 with attention_workspace_numel(T, Hq, hd, cache_row_stride != 0)
// elements. Token t attends rows 0..positions[t] (clamped to the cache) of its cache (t / rows_per_cache). Hq / Hkv <= kAttentionMaxGroup, head_dim supported as
// above. attention_prefill_launch (attention_prefill.h) takes the same arguments (one shared cache only), with its
// own workspace size.
template <typename CacheT>
struct AttentionArgs {
  const float* q = nullptr;
  const CacheT* k_cache = nullptr;
  const CacheT* v_cache = nullptr;
  int64_t cache_row_stride = 0;  // elements from one cache to the next: 0 shares one cache
  int rows_per_cache = 1;        // batched rows: consecutive rows of one cache
  const int32_t* positions = nullptr;
  float scale = 0.f;
  float* out = nullptr;  // unused by attention_gated_launch (the gate's out is its output)
  float* workspace = nullptr;
  int num_tokens = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, max_seq = 0;
};
template <typename CacheT>
cudaError_t attention_launch(const AttentionArgs<CacheT>& args, cudaStream_t stream);

// The sigmoid output gate's operands: out [T, Hq*hd] = attn * sigmoid(gate), the gate read from qgkv's
// interleaved [query_h | gate_h] halves (row stride qgkv_row_stride); out row stride out_row_stride. out_q (and
// out_q_lo for the two-word lane) int8 [T, Hq*hd] and out_d float32 [T, Hq*hd/32], contiguous, when not null;
// Hq*hd % 32 == 0 then.
struct GateOutputs {
  const float* qgkv = nullptr;
  int64_t qgkv_row_stride = 0;
  float* out = nullptr;
  int64_t out_row_stride = 0;
  int8_t* out_q = nullptr;
  int8_t* out_q_lo = nullptr;
  float* out_d = nullptr;
};

// attention_launch, then the output gate applied in its split-K combine (one launch fewer): the decode step and
// the verify, T <= kAttentionSameSplitTokens, or batched rows of any T (so the combine always runs: every row has
// kAttentionSplits splits), head_dim % 32 == 0.
template <typename CacheT>
struct AttentionGatedArgs : AttentionArgs<CacheT> {
  GateOutputs gate;
};
template <typename CacheT>
cudaError_t attention_gated_launch(const AttentionGatedArgs<CacheT>& args, cudaStream_t stream);

// attn [T, Hq, hd] contiguous.
struct AttnOutputGateArgs {
  const float* attn = nullptr;
  GateOutputs gate;
  int num_tokens = 0, num_heads = 0, head_dim = 0;
};
cudaError_t attn_output_gate_launch(const AttnOutputGateArgs& args, cudaStream_t stream);

}  // namespace qwen38
