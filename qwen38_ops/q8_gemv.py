"""Q8_0 GEMV, y = x W^T, in three activation lanes.

weight_q int8 [N, K] and weight_d fp16 [N, K/32] (one scale per 32 values along K), x rows [T, K]:
- f32 lane: x float32; equals dequantize-then-matmul.
- int8 lane: x_q int8 [T, K] + x_d float32 [T, K/32] from an int8 producer (ggml's q8_0 rounding).
- two-word lane: x_q, x_q_lo int8 + x_d: x = x_d * (x_q + x_q_lo / 127).
"""
import torch

from ._registry import register
from .reference import q8_gemv as ref

for _name in ("q8_0_gemv", "q8_0_gemv_int8", "q8_0_gemv_int8x2"):
    register(_name, getattr(ref, _name))


def _out(rows: torch.Tensor, weight_q: torch.Tensor, out):
    if out is None:
        out = torch.empty(rows.shape[0], weight_q.shape[0], dtype=torch.float32, device=rows.device)
    return out


def q8_0_gemv(x, weight_q, weight_d, out=None) -> torch.Tensor:
    out = _out(x, weight_q, out)
    torch.ops.qwen38.q8_0_gemv(x, weight_q, weight_d, out)
    return out


def q8_0_gemv_int8(x_q, x_d, weight_q, weight_d, out=None) -> torch.Tensor:
    out = _out(x_q, weight_q, out)
    torch.ops.qwen38.q8_0_gemv_int8(x_q, x_d, weight_q, weight_d, out)
    return out


def q8_0_gemv_int8x2(x_q, x_q_lo, x_d, weight_q, weight_d, out=None) -> torch.Tensor:
    out = _out(x_q, weight_q, out)
    torch.ops.qwen38.q8_0_gemv_int8x2(x_q, x_q_lo, x_d, weight_q, weight_d, out)
    return out
