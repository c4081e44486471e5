"""What a Checkpoint reads tensors through: a tensor source. A GGUF file (gguf_file.GGUFCheckpoint) and an
HF safetensors folder (hf_folder.HFCheckpoint) are the two file sources; anything else that names, sizes and
reads tensors the same way is a source too (benchmarks/decode.py's synthetic 27B weights, made on the GPU).
Checkpoint holds every source to the same rules: the tensor set its config describes, the shapes, finite
values."""
from __future__ import annotations

from typing import Protocol

import torch

from ..config import Qwen38Config
from .tensors import Q8Tensor, TensorReader


class TensorSource(Protocol):
    path: str  # what every error names: the file or folder, or what the tensors are
    config: Qwen38Config  # the model the tensors are of
    # True: tensors named as in a GGUF (blk.N.*, layout.gguf_tensor_name) and stored in the internal layout
    # (layout.py), each with a ggml type (dtype_name); False: HF names and conventions, converted at load.
    gguf_layout: bool

    def names(self) -> list[str]:
        """Every stored tensor's name (full_name's form)."""

    def has(self, name: str) -> bool:
        """Whether the source stores `name` (full_name applied)."""

    def full_name(self, name: str) -> str:
        """The name Checkpoint asks for -> the name stored (an HF folder adds its text-model prefix)."""

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored tensor's shape, in torch order."""

    def nbytes(self, name: str) -> int:
        """The tensor's bytes as stored (what read() reads)."""

    def total_bytes(self) -> int:
        """All tensors' bytes: the whole of the progress Checkpoint reports."""

    def dtype_name(self, name: str) -> str:
        """The ggml type name (F32, Q8_0, ...), for a gguf_layout source."""

    def read(self, name: str, reader: TensorReader) -> torch.Tensor | Q8Tensor:
        """The tensor as stored, on reader.device (a file source reads its bytes through reader)."""

    def read_rows(self, name: str, reader: TensorReader, start: int, stop: int) -> torch.Tensor | Q8Tensor:
        """Rows [start, stop) of the tensor (along its first dim) as read() would give them, reading only those
        (a tensor-parallel rank's share, shard.py)."""
