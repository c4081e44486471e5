"""Q8_0 matrix-vector products, one per activation lane. Computed in float64 (exact block sums), so the
reference is the truth the kernels' float32 accumulation is measured against."""
import torch

from .norm_quant import QK


def dequantize_q8_0(weight_q: torch.Tensor, weight_d: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (weight_q.to(dtype).reshape(*weight_d.shape, QK) * weight_d.to(dtype)[..., None]).reshape(weight_q.shape)


def q8_0_gemv(x, weight_q, weight_d, out) -> None:
    w = dequantize_q8_0(weight_q, weight_d, torch.float64)
    out.copy_(x.to(torch.float64) @ w.T)


def _block_dots(x_q, weight_q):
    """Per-block integer dot products [T, N, K/32] (exact in float64: |sum| <= 32*127*127)."""
    xb = x_q.to(torch.float64).reshape(x_q.shape[0], -1, QK)
    wb = weight_q.to(torch.float64).reshape(weight_q.shape[0], -1, QK)
    return torch.einsum("tbi,nbi->tnb", xb, wb)


def _scaled_sum(block_dots, x_d, weight_d, out) -> None:
    scale = x_d.to(torch.float64)[:, None, :] * weight_d.to(torch.float64)[None, :, :]
    out.copy_((block_dots * scale).sum(-1))


def q8_0_gemv_int8(x_q, x_d, weight_q, weight_d, out) -> None:
    _scaled_sum(_block_dots(x_q, weight_q), x_d, weight_d, out)


def q8_0_gemv_int8x2(x_q, x_q_lo, x_d, weight_q, weight_d, out) -> None:
    dots = _block_dots(x_q, weight_q) + _block_dots(x_q_lo, weight_q) / 127
    _scaled_sum(dots, x_d, weight_d, out)
