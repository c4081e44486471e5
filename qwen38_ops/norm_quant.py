"""Producers of GEMV activations: RMSNorm (+ residual add), SwiGLU, gated RMSNorm, and the quantizer.

Each writes float32 `out` and, when given out_q (+ out_q_lo) and out_d, the quantized activation of the
int8 (two-word) lane; see csrc/bindings.cpp for the exact rounding.
"""
import torch

from ._registry import register
from .reference import norm_quant as ref

for _name in ("quantize_act", "rms_norm", "add_rms_norm", "silu_mul", "gated_rms_norm"):
    register(_name, getattr(ref, _name))


def quantize_act(x: torch.Tensor, two_word: bool = False):
    """Eager convenience: returns (q, q_lo or None, d)."""
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    q_lo = torch.empty_like(q) if two_word else None
    d = torch.empty(*x.shape[:-1], x.shape[-1] // ref.QK, dtype=torch.float32, device=x.device)
    torch.ops.qwen38.quantize_act(x, q, q_lo, d)
    return q, q_lo, d


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    torch.ops.qwen38.rms_norm(x, weight, eps, out, None, None, None)
    return out
