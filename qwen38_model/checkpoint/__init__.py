"""Checkpoint loading: GGUF files and HF safetensors folders, both delivered in the ONE internal layout
(layout.py). Tensors are read and moved to the target device one at a time."""
from __future__ import annotations

import pathlib

import torch

from ..errors import CheckpointError
from .gguf_file import GGUFCheckpoint
from .hf_folder import HFCheckpoint
from .layout import HF_NAMES, SMALL_PARTS, expected_shape, gguf_tensor_name, hf_to_internal
from .tensors import Q8Tensor

__all__ = ["Checkpoint", "CheckpointError", "Q8Tensor", "open_checkpoint"]

Weight = torch.Tensor | Q8Tensor


class Checkpoint:
    """A GGUF or HF source plus the rules that turn its tensors into the model's weights:
    small tensors float32; large matrices in `dtype`, or Q8_0 when stored so (GGUF) or asked for
    (quantize="q8_0", the converter's quantization)."""

    def __init__(self, source: GGUFCheckpoint | HFCheckpoint, progress=None):
        self.source = source
        self.config = source.config
        self.path = source.path
        self.is_gguf = isinstance(source, GGUFCheckpoint)
        self.progress = progress  # called with (bytes read so far, bytes in the checkpoint)
        self.bytes_read = 0

    def load(self, part: str, layer: int | None, device, dtype: torch.dtype, quantize: str | None) -> Weight:
        if part == "output" and (self.config.tie_word_embeddings or not self._has("output", None)):
            part_to_read = "token_embd"
        else:
            part_to_read = part
        w = self._read_internal(part_to_read, layer, device)
        expected = expected_shape(self.config, part)
        if tuple(w.shape) != expected:
            raise CheckpointError(f"{self.path}: tensor {self._name(part_to_read, layer)!r} has shape {tuple(w.shape)}, "
                                  f"expected {expected} from the model config")
        if part in SMALL_PARTS:
            return w.dequantize() if isinstance(w, Q8Tensor) else w.to(torch.float32)
        if isinstance(w, Q8Tensor):
            return w
        if quantize == "q8_0":
            return Q8Tensor.quantize(w)
        return w.to(dtype)

    def load_fused(self, parts: tuple[str, ...], layer: int, device, dtype, quantize) -> Weight:
        """Matrices that share an input, concatenated along the output rows, so one GEMV reads them all.
        The group stays Q8_0 only if every part is; otherwise it is dequantized to `dtype`."""
        weights = [self.load(p, layer, device, dtype, quantize) for p in parts]
        if all(isinstance(w, Q8Tensor) for w in weights):
            return Q8Tensor(torch.cat([w.q for w in weights]), torch.cat([w.d for w in weights]))
        return torch.cat([w.dequantize(dtype) if isinstance(w, Q8Tensor) else w for w in weights])

    def _name(self, part: str, layer: int | None) -> str:
        if self.is_gguf:
            return gguf_tensor_name(part, layer)
        if part == "output":
            return "lm_head.weight"
        name = HF_NAMES[part]
        return name if layer is None else f"layers.{layer}.{name}"

    def _has(self, part: str, layer: int | None) -> bool:
        return self.source.has(self._name(part, layer))

    def _read_internal(self, part: str, layer: int | None, device) -> Weight:
        name = self._name(part, layer)
        t = self.source.read(name, device)
        self.bytes_read += self.source.nbytes(name)
        if self.progress is not None:
            self.progress(self.bytes_read, self.source.total_bytes())
        if self.is_gguf:
            return t
        return hf_to_internal(part, t, self.config)


def open_checkpoint(path: str | pathlib.Path, progress=None) -> Checkpoint:
    p = pathlib.Path(path)
    if p.is_dir():
        return Checkpoint(HFCheckpoint(str(p)), progress)
    if not p.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF') and not an HF folder")
    return Checkpoint(GGUFCheckpoint(str(p)), progress)
