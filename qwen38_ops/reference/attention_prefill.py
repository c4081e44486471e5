"""attention_prefill: the `attention` op's math (float64, query t sees cache rows 0..positions[t]) without
the workspace, which only the decode kernel's split-K needs."""
from .attention import attention


def attention_prefill(q, k_cache, v_cache, positions, scale, out) -> None:
    attention(q, k_cache, v_cache, positions, scale, out, None)
