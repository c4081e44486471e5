"""attention_prefill: causal GQA attention of a prompt chunk over the KV cache (tensor-core kernel on CUDA).

The `attention` op's math without its workspace: q [T, Hq, hd] float32, k_cache/v_cache [max_seq, Hkv, hd]
float32 or bfloat16, positions int32 [T] on the device, out [T, Hq, hd] float32; token t attends cache rows
0..positions[t]. The CUDA kernel computes in fp32 with bf16 tensor-core operands: a float32 cache is split
into bf16 hi + lo (~1e-5 relative), a bfloat16 cache rounds q and the probabilities to bf16.
"""
from ._registry import register
from .reference import attention_prefill as ref

register("attention_prefill", ref.attention_prefill)
