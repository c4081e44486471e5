"""What a checkpoint hands the model: dense tensors, or Q8_0 weights kept packed for the kernels."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import CheckpointError

Q8_BLOCK = 32  # values per block
Q8_BLOCK_BYTES = 34  # fp16 scale + 32 int8 quants, ggml's block_q8_0


@dataclass
class Q8Tensor:
    """A Q8_0 matrix in the kernels' layout: quants int8 [N, K] and fp16 scales [N, K/32] as two separate
    arrays (ggml interleaves them per block; split, each row's quants are one contiguous 16-byte-aligned run)."""

    q: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        from qwen38_ops.reference.q8_gemv import dequantize_q8_0

        return dequantize_q8_0(self.q, self.d, dtype)

    @staticmethod
    def from_ggml_bytes(raw: torch.Tensor, shape: tuple[int, int]) -> "Q8Tensor":
        rows, cols = shape
        blocks = raw.reshape(rows, cols // Q8_BLOCK, Q8_BLOCK_BYTES)
        d = blocks[..., :2].contiguous().view(torch.float16).reshape(rows, cols // Q8_BLOCK)
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, cols)
        return Q8Tensor(q, d)

    @staticmethod
    def quantize(w: torch.Tensor) -> "Q8Tensor":
        """gguf.quants' Q8_0 (the converter's): d = amax/127, q = round-half-away(w / d) using 1/d, d
        stored fp16. Computed in float32 from the stored weight, like the converter."""
        from qwen38_ops.reference.norm_quant import quantize_int8

        q, d = quantize_int8(w.to(torch.float32))
        return Q8Tensor(q, d.to(torch.float16))


def read_bytes(path: str, offset: int, nbytes: int, tensor_name: str) -> torch.Tensor:
    """One tensor's bytes into a fresh host buffer with a positioned read. Not an mmap: mapped pages that
    were touched stay in the process's resident set, so streaming a 29 GB file through a mapping would
    hold all of it; this way only the tensor in flight is resident."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    with open(path, "rb") as f:
        f.seek(offset)
        got = f.readinto(memoryview(buf.numpy()))
    if got != nbytes:
        raise CheckpointError(f"{path}: tensor {tensor_name!r} is truncated: expected {nbytes} bytes at offset "
                              f"{offset}, the file has {max(got, 0)} (file size {os.path.getsize(path)})")
    return buf
