// The kernels' limits and constants that Python needs too, written once, here. Plain C++ (no CUDA headers): the
// kernel headers include it, and so does csrc/bindings.cpp, the one file every build compiles (the CPU-only one
// too), which exports these values as torch.ops.qwen38.limits(); qwen38_ops/limits.py reads them once and the
// Python modules take them from there. The references keep their own spec constants (they never load the
// extension); tests/ops/test_limits.py checks that they agree with these.
#pragma once
#include <cstdint>

namespace qwen38 {

// Values per scale of a Q8_0 block, for the weights and for the int8 activation lanes.
constexpr int kQuantBlock = 32;

// attention: splits per (token, query head). Up to kAttentionSameSplitTokens tokens every row gets the decode
// step's kAttentionSplits, so a speculative verify of T <= 8 tokens computes each row with exactly the float
// order of a T = 1 step (greedy speculative output equals plain greedy, bit for bit); longer inputs share the 64
// splits among their rows (attention_num_splits, attention.h; qwen38_ops.attention.num_splits). Batched rows (a
// cache a row, T sequences) keep kAttentionSplits a row at any T: each is a sequence's decode step.
constexpr int kAttentionSplits = 64;
constexpr int kAttentionSameSplitTokens = 8;

// attention_prefill: query rows (token, query head of one kv group) per block, and the split-K for launches too
// small to fill the GPU: as many splits as fit kAttentionPrefillTargetBlocks blocks (two blocks on each of the
// H200's 132 SMs), none below 2, at most kAttentionPrefillMaxSplits (attention_prefill_num_splits,
// attention_prefill.h; qwen38_ops.attention_prefill.num_splits).
constexpr int kAttentionPrefillRows = 64;
constexpr int kAttentionPrefillTargetBlocks = 264;
constexpr int kAttentionPrefillMaxSplits = 64;

// gdn_step: the most tokens of one sequence one call takes (a decode step, or a speculative verify of k + 1 <= 8
// tokens). Batched rows (a state a row, T sequences of one token) are not limited by it.
constexpr int kGdnStepMaxTokens = 8;

// The flags the device raises in the state's one error int32 (the host reads it at its next sync):
// attn_qk_norm_rope_store stores kBadPositionFlag for a position outside the cache, the embeddings OR in
// kBadTokenFlag for a token id outside the vocabulary.
constexpr int32_t kBadPositionFlag = 1;
constexpr int32_t kBadTokenFlag = 2;

// The GEMV configs that are compiled, X(trip, parts) (q8_gemv.h: what they mean); any other is refused with
// cudaErrorInvalidValue.
#define QWEN38_Q8_GEMV_CONFIGS(X) X(2, 1) X(2, 4) X(1, 1) X(1, 4)

}  // namespace qwen38
