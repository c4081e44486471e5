// Gated full attention kernels: per-head QK RMSNorm + partial NEOX RoPE + KV-cache store at the
// device-held position, split-K causal flash-decode over the cache (GQA) with a fixed-order combine, and
// the sigmoid output gate (with the optional int8 / two-word int8 activation outputs), alone or in the combine. Host launchers take
// raw device pointers, sizes and a stream; they launch asynchronously and return the cudaError_t.
// Layouts are those of csrc/bindings.cpp. The cache element type is float or __nv_bfloat16.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace qwen38 {

// Splits per (token, query head) of the attention kernel. Up to kAttentionSameSplitTokens tokens every
// row gets the decode step's kAttentionSplits, so a speculative verify of T <= 8 tokens computes each row
// with exactly the float order of a T = 1 step (greedy speculative output equals plain greedy, bit for
// bit); longer inputs share the 64 splits among their rows. Must equal qwen38_ops.attention.
constexpr int kAttentionSplits = 64;
constexpr int kAttentionSameSplitTokens = 8;
constexpr int kAttentionMaxGroup = 8;  // query heads per kv head

inline int attention_num_splits(int num_tokens) {
  if (num_tokens <= kAttentionSameSplitTokens) return kAttentionSplits;
  const int s = kAttentionSplits / num_tokens;
  return s > 1 ? s : 1;
}
// Per (token, query head, split): hd partial accumulators, then (max, sum) after all of them.
inline int64_t attention_workspace_numel(int num_tokens, int num_heads, int head_dim) {
  return (int64_t)num_tokens * attention_num_splits(num_tokens) * num_heads * (head_dim + 2);
}
// head_dim values the attention kernel is built for (one template instance each).
inline bool attention_head_dim_supported(int head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

// qgkv [T, Hq*2*hd + 2*Hkv*hd] (row stride qgkv_row_stride), q_norm/k_norm [hd], positions int32 [T],
// q_out [T, Hq, hd], caches [max_seq, Hkv, hd]. A position outside [0, max_seq) stores nothing.
// hd <= 1024, rotary_dim even and <= hd.
template <typename CacheT>
cudaError_t attn_qk_norm_rope_store_launch(const float* qgkv, int64_t qgkv_row_stride, const float* q_norm,
                                           const float* k_norm, const int32_t* positions, float eps,
                                           float rope_theta, int rotary_dim, float* q_out, CacheT* k_cache,
                                           CacheT* v_cache, int32_t* bad_position, int num_tokens, int num_heads,
                                           int num_kv_heads, int head_dim, int max_seq, cudaStream_t stream);

// q [T, Hq, hd], caches [max_seq, Hkv, hd] (16-byte aligned), positions int32 [T], out [T, Hq, hd],
// workspace float32 with attention_workspace_numel(T, Hq, hd) elements. Token t attends rows
// 0..positions[t] (clamped to the cache). Hq / Hkv <= kAttentionMaxGroup, head_dim supported as above.
template <typename CacheT>
cudaError_t attention_launch(const float* q, const CacheT* k_cache, const CacheT* v_cache, const int32_t* positions,
                             float scale, float* out, float* workspace, int num_tokens, int num_heads,
                             int num_kv_heads, int head_dim, int max_seq, cudaStream_t stream);

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
// the verify, T <= kAttentionSameSplitTokens (so the combine always runs), head_dim % 32 == 0.
template <typename CacheT>
cudaError_t attention_gated_launch(const float* q, const CacheT* k_cache, const CacheT* v_cache,
                                   const int32_t* positions, float scale, const GateOutputs& gate, float* workspace,
                                   int num_tokens, int num_heads, int num_kv_heads, int head_dim, int max_seq,
                                   cudaStream_t stream);

// attn [T, Hq, hd] contiguous.
cudaError_t attn_output_gate_launch(const float* attn, const GateOutputs& gate, int num_tokens, int num_heads,
                                    int head_dim, cudaStream_t stream);

}  // namespace qwen38
