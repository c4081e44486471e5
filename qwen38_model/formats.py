"""The activation formats the model's linears read, and the Q8_0 block: the one place in Python they are named.

A linear's weight format is its type (layers.Q8Linear, layers.DenseLinear: layers.make_linear picks it from the
loaded weight), and the activation format it reads is its `input_format`, fixed when it is built. Each op that
produces a linear's input (a norm, the GDN's gated norm, attention's output gate, silu_mul, the MTP block's
concat) is given that format once, when its module is built, and writes it into buffers from
Scratch.activation. A new lane is a member here, its buffers in Scratch.activation and its kernels; DESIGN.md
("Activation lanes of the Q8_0 GEMV") has each lane's rounding and the bar it must meet."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

QK = 32  # values per scale of a Q8_0 block, the weights' and the int8 activations' (the kernels' kQuantBlock)


class ActFormat(str, Enum):
    """How a linear's input is stored. The values are from_pretrained's `lane` names (and the command line's
    --lane choices: [f.value for f in ActFormat]); a str, so a format compares equal to its name."""

    F32 = "f32"  # float32 x alone: what a dense linear reads, and the Q8_0 f32 lane (exact dequantize-then-matmul)
    INT8 = "int8"  # also q int8 with per-block scales d: ggml's q8_0 activation rounding
    INT8X2 = "int8x2"  # also q and q_lo, two int8 words per value over one scale: 127x finer than INT8


def lane_format(lane: str) -> ActFormat:
    """from_pretrained's lane (a name or an ActFormat) as an ActFormat; any other is a ValueError naming them."""
    try:
        return ActFormat(lane)
    except ValueError:
        raise ValueError(f"lane must be one of {[f.value for f in ActFormat]}, found {lane!r}") from None


@dataclass
class Activation:
    """A linear's input in `format`: float32 x [rows, width] always (the MTP block and the speculative engine
    read the normed hidden from it in every format); the int lanes add the int8 words q (and q_lo for INT8X2)
    and the per-block scales d [rows, width / QK]."""

    format: ActFormat
    x: torch.Tensor
    q: torch.Tensor | None = None
    q_lo: torch.Tensor | None = None
    d: torch.Tensor | None = None

    def outs(self) -> tuple:
        """The buffers in the order the producing ops take them as outputs (None where the format has none)."""
        return self.x, self.q, self.q_lo, self.d

    def rows_from(self, first: int) -> Activation:
        """Rows first.. (row slices stay contiguous)."""
        return Activation(self.format, *(None if t is None else t[first:] for t in self.outs()))
