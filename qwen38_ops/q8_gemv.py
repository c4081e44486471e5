"""Q8_0 GEMV, y = x W^T, in three activation lanes, and the tensor-core GEMM of the two integer lanes for
prompt-sized T (q8_0_gemm_int8, q8_0_gemm_int8x2: same arguments, same math, same references).

weight_q int8 [N, K] and weight_d fp16 [N, K/32] (one scale per 32 values along K), x rows [T, K]:
- f32 lane: x float32; equals dequantize-then-matmul.
- int8 lane: x_q int8 [T, K] + x_d float32 [T, K/32] from an int8 producer (ggml's q8_0 rounding).
- two-word lane: x_q, x_q_lo int8 + x_d: x = x_d * (x_q + x_q_lo / 127).
"""
from ._registry import register
from .reference import q8_gemv as ref

for _name in ("q8_0_gemv", "q8_0_gemv_int8", "q8_0_gemv_int8x2"):
    register(_name, getattr(ref, _name))
register("q8_0_gemm_int8", ref.q8_0_gemv_int8)
register("q8_0_gemm_int8x2", ref.q8_0_gemv_int8x2)

