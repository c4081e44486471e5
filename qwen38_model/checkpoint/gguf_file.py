"""GGUF (llama.cpp, arch qwen35): metadata and tensor directory through the gguf package's reader; each
tensor's bytes read on demand, one at a time (tensors.read_bytes)."""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import torch

from ..config import Qwen38Config
from ..errors import CheckpointError
from .tensors import Q8Tensor, read_bytes

T = gguf.GGMLQuantizationType
DENSE_TYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}


class _BoundsCheckedReader(gguf.GGUFReader):
    """The reader maps every tensor while it opens the file, and on a truncated file fails with a bare
    numpy reshape error; check the directory against the file size first so the error names the tensor."""

    def __init__(self, path: str):
        self.path = path
        super().__init__(path, "r")

    def _build_tensors(self, start_offs, fields):
        size = len(self.data)
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_type[0]))]
            end = int(start_offs + offset[0]) + int(np.prod(dims)) * type_size // block
            if end > size:
                raise CheckpointError(f"{self.path}: tensor {bytes(name).decode()!r} is truncated: it ends at byte "
                                      f"{end}, the file has {size}")
        super()._build_tensors(start_offs, fields)


def read_metadata(reader: gguf.GGUFReader) -> dict:
    """Every key as a plain Python value (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


class GGUFCheckpoint:
    def __init__(self, path: str):
        self.path = str(path)
        try:
            reader = _BoundsCheckedReader(self.path)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no such file") from None
        except CheckpointError:
            raise
        except Exception as e:  # the reader raises ValueError/IndexError/... on a malformed header
            raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        self.metadata = read_metadata(reader)
        self._tensors = {t.name: t for t in reader.tensors}
        if "token_embd.weight" not in self._tensors:
            raise CheckpointError(f"{path}: missing tensor 'token_embd.weight'")
        vocab = int(self._tensors["token_embd.weight"].shape[1])
        self.config = Qwen38Config.from_gguf_metadata(self.metadata, vocab_size=vocab, source=self.path)
        if "output.weight" not in self._tensors:
            # A GGUF without output.weight ties the head to the embedding (llama.cpp's fallback).
            self.config = dataclasses.replace(self.config, tie_word_embeddings=True)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._entry(name).shape))  # ggml ne is fastest-first

    def nbytes(self, name: str) -> int:
        return int(self._entry(name).n_bytes)

    def total_bytes(self) -> int:
        return sum(int(t.n_bytes) for t in self._tensors.values())

    def dtype_name(self, name: str) -> str:
        return self._entry(name).tensor_type.name

    def read(self, name: str, device: torch.device) -> torch.Tensor | Q8Tensor:
        t = self._entry(name)
        shape = self.shape(name)
        raw = read_bytes(self.path, int(t.data_offset), int(t.n_bytes), name).to(device)
        if t.tensor_type == T.Q8_0:
            if len(shape) != 2:
                raise CheckpointError(f"{self.path}: tensor {name!r} is Q8_0 with shape {shape}, expected 2-D")
            return Q8Tensor.from_ggml_bytes(raw, shape)
        if t.tensor_type in DENSE_TYPES:
            return raw.view(DENSE_TYPES[t.tensor_type]).reshape(shape)
        raise CheckpointError(f"{self.path}: tensor {name!r} has ggml type {t.tensor_type.name}; supported: "
                              "F32, F16, BF16, Q8_0")

    def _entry(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}") from None
