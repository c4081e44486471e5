"""Activation producers: RMSNorm variants, SwiGLU, and the activation quantizers of the int8 lanes."""
import torch
import torch.nn.functional as F

QK = 32  # values per quantization block, as in ggml's Q8_0


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    # C's roundf (ggml rounds activations with it); torch.round would round half to even.
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize_int8(x: torch.Tensor):
    """ggml's quantize_row_q8_0: q is rounded with the exact 1/d, but the scale the dot product uses is d
    rounded to fp16. Reproducing both roundings is what makes llama.cpp's logits reproducible."""
    blocks = x.reshape(*x.shape[:-1], -1, QK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv_d = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = round_half_away(blocks * inv_d)
    return q.to(torch.int8).reshape(x.shape), d.squeeze(-1).to(torch.float16).to(x.dtype)


def quantize_int8x2(x: torch.Tensor):
    """Two int8 words per value: x ~= s * (q + q_lo / 127), 127x finer than one word."""
    blocks = x.reshape(*x.shape[:-1], -1, QK)
    s = blocks.abs().amax(-1, keepdim=True) / 127
    t = torch.where(s == 0, torch.zeros_like(blocks), blocks / s)
    q = round_half_away(t).clamp(-127, 127)
    q_lo = round_half_away((t - q) * 127)
    return q.to(torch.int8).reshape(x.shape), q_lo.to(torch.int8).reshape(x.shape), s.squeeze(-1)


def quantize_act(x, out_q, out_q_lo, out_d) -> None:
    if out_q_lo is None:
        q, d = quantize_int8(x)
    else:
        q, q_lo, d = quantize_int8x2(x)
        out_q_lo.copy_(q_lo)
    out_q.copy_(q)
    out_d.copy_(d)


def write_activation(y, out, out_q, out_q_lo, out_d) -> None:
    """Store y and, when the next GEMV reads an int8 lane, its quantized form (of the stored value)."""
    out.copy_(y)
    if out_q is not None:
        quantize_act(out, out_q, out_q_lo, out_d)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x, weight, eps, out, out_q=None, out_q_lo=None, out_d=None) -> None:
    write_activation(_rms(x.to(out.dtype), eps) * weight, out, out_q, out_q_lo, out_d)


def add_rms_norm(residual, x, weight, eps, out, out_q=None, out_q_lo=None, out_d=None) -> None:
    residual.add_(x)
    rms_norm(residual, weight, eps, out, out_q, out_q_lo, out_d)


def silu_mul(gate_up, out, out_q=None, out_q_lo=None, out_d=None) -> None:
    gate, up = gate_up.to(out.dtype).chunk(2, dim=-1)
    write_activation(F.silu(gate) * up, out, out_q, out_q_lo, out_d)


def gated_rms_norm(x, z, weight, eps, out, out_q=None, out_q_lo=None, out_d=None) -> None:
    dv = weight.shape[0]
    heads = x.to(out.dtype).reshape(x.shape[0], -1, dv)
    gate = F.silu(z.to(out.dtype).reshape(heads.shape))
    y = _rms(heads, eps) * weight * gate
    write_activation(y.reshape(out.shape), out, out_q, out_q_lo, out_d)
