"""Producers of GEMV activations: RMSNorm (+ residual add), SwiGLU, gated RMSNorm, and the quantizer.

Each writes float32 `out` and, when given out_q (+ out_q_lo) and out_d, the quantized activation of the
int8 (two-word) lane; see csrc/bindings.cpp for the exact rounding.
"""
from ._registry import register
from .reference import norm_quant as ref

for _name in ("quantize_act", "rms_norm", "add_rms_norm", "silu_mul", "gated_rms_norm"):
    register(_name, getattr(ref, _name))

