"""attention_prefill: the `attention` op's math (float64, query t sees cache rows 0..positions[t]); the
workspace only serves the CUDA kernel's split-K."""
from .attention import attention


def attention_prefill(q, k_cache, v_cache, positions, scale, out, workspace) -> None:
    attention(q, k_cache, v_cache, positions, scale, out, workspace)
