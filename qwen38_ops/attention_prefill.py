"""attention_prefill: causal GQA attention of a prompt chunk over the KV cache (tensor-core kernel on CUDA).

The `attention` op's math: q [T, Hq, hd] float32, k_cache/v_cache [max_seq, Hkv, hd] float32 or bfloat16,
positions int32 [T] on the device, out [T, Hq, hd] float32; token t attends cache rows 0..positions[t].
workspace: float32 [workspace_numel(T, Hq, Hkv, hd)] scratch (may be empty). The CUDA kernel computes in fp32
with bf16 tensor-core operands: a float32 cache is split into bf16 hi + lo (~1e-5 relative), a bfloat16
cache rounds q and the probabilities to bf16.
"""
from ._registry import register
from .limits import ATTENTION_PREFILL_MAX_SPLITS as MAX_SPLITS
from .limits import ATTENTION_PREFILL_ROWS as PREFILL_ROWS
from .limits import ATTENTION_PREFILL_TARGET_BLOCKS as TARGET_BLOCKS
from .reference import attention_prefill as ref

register("attention_prefill", ref.attention_prefill)


def num_splits(num_tokens: int, num_heads: int, num_kv_heads: int) -> int:
    """Split-K for few query rows: a launch of at most TARGET_BLOCKS / 2 blocks of PREFILL_ROWS query rows (the
    query heads of one kv head, a few tokens) deals each block's KV tiles over TARGET_BLOCKS // blocks blocks (at
    most MAX_SPLITS) and combines their partial softmax in split order. A function of the shapes only, so every
    call of a shape computes the same float order (the constants: csrc/kernels/op_limits.h; the C++ rule:
    attention_prefill_num_splits in csrc/kernels/attention_prefill.h)."""
    rows = num_tokens * (num_heads // num_kv_heads)
    blocks = num_kv_heads * -(-rows // PREFILL_ROWS)
    splits = TARGET_BLOCKS // blocks if blocks > 0 else 0
    return 1 if splits < 2 else min(splits, MAX_SPLITS)


def workspace_numel(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Floats of scratch the CUDA kernel needs: per (split, token, query head) hd partial accumulators and
    (max, sum); 0 when the call is not split."""
    splits = num_splits(num_tokens, num_heads, num_kv_heads)
    return 0 if splits == 1 else splits * num_tokens * num_heads * (head_dim + 2)
