"""The checkpoint's Q8_0 codec (qwen38_model/checkpoint/q8_0.py) writes the bytes llama.cpp's converter writes
(gguf.quants), and the same bytes as the op reference's quantizer (qwen38_ops.reference.norm_quant), which
keeps its own as the spec of the activation quantization: random blocks, all-zero blocks, exact ties."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from qwen38_model.checkpoint import q8_0
from qwen38_ops.reference import norm_quant as ref

STEP = 2.0**-7  # a block whose amax is 127 * STEP has d = STEP and 1/d = 2^7 exactly


def gguf_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf.quants' Q8_0 bytes of w (float32, as the converter quantizes), split as the checkpoint splits them."""
    raw = quants.quantize(w.to(torch.float32).numpy(), GGMLQuantizationType.Q8_0)
    return q8_0.split_ggml_blocks(torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1), tuple(w.shape))


def blocks(*values: list[float]) -> torch.Tensor:
    """One row per list, each padded with zeros to one block of 32."""
    return torch.tensor([v + [0.0] * (q8_0.Q8_BLOCK - len(v)) for v in values], dtype=torch.float32)


def cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ties = [127 * STEP] + [(n + 0.5) * STEP for n in range(-15, 15)]  # w / d = n + 0.5 exactly: away from zero
    return {
        "random": torch.cat([torch.randn(16, 256, generator=g) * scale for scale in (1e-3, 0.05, 1.0, 1e3)]),
        "zero blocks": torch.cat([torch.zeros(2, 64), torch.randn(2, 64, generator=g)], dim=1),
        "ties": blocks(ties, [-v for v in ties]),
        "bfloat16": (torch.randn(8, 128, generator=g) * 0.02).to(torch.bfloat16),  # an HF weight as stored
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (fp16 scales compared as their bits)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.dtype == torch.float16 else a,
                                              b.view(torch.int16) if b.dtype == torch.float16 else b)


@pytest.mark.parametrize("case", list(cases()))
def test_codec_writes_the_converters_bytes(case):
    w = cases()[case]
    q, d = q8_0.quantize(w)
    q_gguf, d_gguf = gguf_q8_0(w)
    assert same(q, q_gguf) and same(d, d_gguf)


@pytest.mark.parametrize("case", list(cases()))
def test_codec_and_op_reference_give_the_same_bytes(case):
    w = cases()[case]
    q, d = q8_0.quantize(w)
    q_ref, d_ref = ref.quantize_int8(w.to(torch.float32))
    assert same(q, q_ref) and same(d, d_ref.to(torch.float16))


def test_codec_rounds_as_roundf_just_below_one_half():
    """w / d = 0.5 - 2^-25: roundf (gguf's np_roundf, the converter) gives 0, where floor(|t| + 0.5) gives 1
    (the float32 sum rounds up to 1.0). The op reference writes the latter (csrc/kernels/norm_quant.cu says
    so); the checkpoint's codec must write the converter's bytes."""
    w = blocks([127 * STEP, (0.5 - 2.0**-25) * STEP, -(0.5 - 2.0**-25) * STEP])
    q, d = q8_0.quantize(w)
    q_gguf, d_gguf = gguf_q8_0(w)
    assert same(q, q_gguf) and same(d, d_gguf)
    assert q[0, 1:3].tolist() == [0, 0]


def test_dequantize_equals_gguf():
    w = cases()["random"]
    q, d = q8_0.quantize(w)
    raw = quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    expected = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q8_0))
    assert torch.equal(q8_0.dequantize(q, d), expected)
