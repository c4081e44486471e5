"""Gated attention ops: QK norm + RoPE + KV store, split-K causal attention, sigmoid output gate (alone, or
applied in the attention's combine: attention_gated)."""
from ._registry import register
from .limits import ATTENTION_SAME_SPLIT_TOKENS as SAME_SPLIT_TOKENS
from .limits import ATTENTION_SPLITS
from .limits import BAD_POSITION  # noqa: F401  (what attn_qk_norm_rope_store stores into bad_position)
from .reference import attention as ref

for _name in ("attn_qk_norm_rope_store", "attention", "attention_gated", "attn_output_gate"):
    register(_name, getattr(ref, _name))


def num_splits(num_tokens: int, batched: bool = False) -> int:
    """The CUDA kernel splits each (token, head) over the context into num_splits(T) parts and keeps (max, sum,
    acc[hd]) per part for the fixed-order combine. Up to SAME_SPLIT_TOKENS tokens each row gets the decode step's
    ATTENTION_SPLITS splits, so a speculative verify reproduces plain decode bit for bit; so does every row of a
    batched call (batched: caches [B, max_seq, Hkv, hd], T / B consecutive rows a sequence of its own), whatever T,
    so each sequence's step or verify keeps the bits of a lone T = 1 step (the constants: csrc/kernels/op_limits.h; the C++ rule:
    attention_num_splits in csrc/kernels/attention.h)."""
    if batched or num_tokens <= SAME_SPLIT_TOKENS:
        return ATTENTION_SPLITS
    return max(1, ATTENTION_SPLITS // num_tokens)


def workspace_numel(num_tokens: int, num_heads: int, head_dim: int, batched: bool = False) -> int:
    """Floats of attention's and attention_gated's workspace for T rows: batched=True for caches [B, max_seq, Hkv,
    hd] (a cache a sequence), False for one cache [max_seq, Hkv, hd] shared by the rows."""
    return num_tokens * num_splits(num_tokens, batched) * num_heads * (head_dim + 2)
