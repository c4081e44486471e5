"""Q8_0, ggml's 8-bit block format, in torch alone: what loading a checkpoint does with it (split a GGUF's
blocks into the kernels' layout, quantize a dense weight at load, dequantize). Loading imports nothing of
qwen38_ops, neither the extension nor the op references; the references keep their own Q8_0 (a reference is
the spec of its op) and tests/model/test_q8_0_codec.py holds the two, and gguf.quants, to the same bytes.

A block is 32 values: an fp16 scale d and 32 int8 quants q, value = d * q. ggml stores each block as its 2
scale bytes then its 32 quants (34 bytes); the kernels read the quants [N, K] and the scales [N, K/32] as
two arrays, so that each row's quants are one contiguous 16-byte-aligned run."""
from __future__ import annotations

import torch

Q8_BLOCK = 32  # values per block
Q8_BLOCK_BYTES = 34  # fp16 scale + 32 int8 quants, ggml's block_q8_0


def split_ggml_blocks(raw: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 matrix's bytes as ggml stores them (uint8, rows x cols/32 blocks of 34 bytes) -> quants int8
    [rows, cols] and scales fp16 [rows, cols/32]."""
    rows, cols = shape
    blocks = raw.reshape(rows, cols // Q8_BLOCK, Q8_BLOCK_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).reshape(rows, cols // Q8_BLOCK)
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, cols)
    return q, d


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] -> quants int8 [..., K] and scales fp16 [..., K/32], the bytes llama.cpp's converter writes
    (gguf.quants.quantize, bit-exact with ggml's quantize_row_q8_0_ref): in float32, d = amax/127 per block,
    q = roundf(w * (1/d)) (0 for an all-zero block), d stored as fp16."""
    blocks = w.to(torch.float32).reshape(*w.shape[:-1], -1, Q8_BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv_d = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _roundf(blocks * inv_d)
    return q.to(torch.int8).reshape(w.shape), d.squeeze(-1).to(torch.float16)


def dequantize(q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """quants [..., K] and scales [..., K/32] -> d * q in `dtype`."""
    return (q.to(dtype).reshape(*d.shape, Q8_BLOCK) * d.to(dtype)[..., None]).reshape(q.shape)


def _roundf(t: torch.Tensor) -> torch.Tensor:
    """C's roundf (half away from zero) as gguf.quants' np_roundf computes it: floor(|t|) plus 1 where the
    fraction is at least one half. Not floor(|t| + 0.5): that sum rounds up to 1 at |t| = 0.5 - 2^-25.
    In place on temporaries: at load this runs on matrices of up to a billion values."""
    magnitude = t.abs()
    whole = magnitude.floor()
    whole.add_(magnitude.sub_(whole).mul_(2).floor_())  # the fraction is exact, and so is twice it
    return whole.copysign_(t)
