"""HF safetensors checkpoints (single file or sharded with model.safetensors.index.json; text-only
`model.*` or the released VLM form `model.language_model.*`). Tensors are read one at a time.

The safetensors header (8-byte length + JSON directory) is parsed here so each tensor can be read with a
positioned read into a buffer of its own (see tensors.read_bytes for why not a mapping)."""
from __future__ import annotations

import json
import pathlib
import struct

import torch

from ..config import Qwen38Config
from ..errors import CheckpointError
from .tensors import read_bytes

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
# Prefixes of the text model's weights: released VLM form first, then the text-only form.
TEXT_PREFIXES = ("model.language_model.", "model.")
TOP_LEVEL = ("lm_head.", "mtp.")


def read_safetensors_header(path: pathlib.Path) -> tuple[dict, int]:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (length,) = struct.unpack("<Q", head)
            if length > 100 << 20:
                raise CheckpointError(f"{path}: not a safetensors file (header length {length} is implausible)")
            header = json.loads(f.read(length))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    header.pop("__metadata__", None)
    return header, 8 + length


class HFCheckpoint:
    def __init__(self, folder: str):
        self.path = str(folder)
        root = pathlib.Path(folder)
        self.config = Qwen38Config.from_hf_folder(root)
        index = root / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            files = sorted({root / f for f in weight_map.values()})
        elif (root / "model.safetensors").exists():
            files = [root / "model.safetensors"]
        else:
            raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")
        self._entries = {}  # name -> (file, absolute offset, nbytes, dtype, shape)
        for file in files:
            header, data_start = read_safetensors_header(file)
            size = file.stat().st_size
            for name, info in header.items():
                begin, end = info["data_offsets"]
                if data_start + end > size:
                    raise CheckpointError(f"{file}: tensor {name!r} is truncated: it ends at byte {data_start + end}, "
                                          f"the file has {size}")
                self._entries[name] = (str(file), data_start + begin, end - begin, info["dtype"], tuple(info["shape"]))
        self.prefix = next((p for p in TEXT_PREFIXES if f"{p}embed_tokens.weight" in self._entries), None)
        if self.prefix is None:
            raise CheckpointError(f"{folder}: missing tensor 'model.embed_tokens.weight' (or "
                                  "'model.language_model.embed_tokens.weight')")

    def full_name(self, name: str) -> str:
        """HF name without the text-model prefix -> the name stored in this checkpoint. The head and the
        MTP block sit at the top level in both forms."""
        return name if name.startswith(TOP_LEVEL) else self.prefix + name

    def has(self, name: str) -> bool:
        return self.full_name(name) in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[4]

    def nbytes(self, name: str) -> int:
        return self._entry(name)[2]

    def total_bytes(self) -> int:
        return sum(entry[2] for entry in self._entries.values())

    def read(self, name: str, device: torch.device) -> torch.Tensor:
        file, offset, nbytes, dtype, shape = self._entry(name)
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{file}: tensor {self.full_name(name)!r} has dtype {dtype}; supported: "
                                  f"{', '.join(SAFETENSORS_DTYPES)}")
        raw = read_bytes(file, offset, nbytes, self.full_name(name)).to(device)
        return raw.view(SAFETENSORS_DTYPES[dtype]).reshape(shape)

    def _entry(self, name: str):
        full = self.full_name(name)
        try:
            return self._entries[full]
        except KeyError:
            raise CheckpointError(f"{self.path}: missing tensor {full!r}") from None
