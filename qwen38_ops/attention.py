"""Gated attention ops: QK norm + RoPE + KV store, split-K causal attention, sigmoid output gate."""
from ._registry import register
from .reference import attention as ref

for _name in ("attn_qk_norm_rope_store", "attention", "attn_output_gate"):
    register(_name, getattr(ref, _name))

# The CUDA kernel splits each (token, head) over the context into max(1, 64 // T) parts and keeps
# (max, sum, acc[hd]) per part for the fixed-order combine.
ATTENTION_SPLITS = 64


def workspace_numel(num_tokens: int, num_heads: int, head_dim: int) -> int:
    return max(num_tokens, ATTENTION_SPLITS) * num_heads * (head_dim + 2)
