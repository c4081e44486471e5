"""HF safetensors checkpoints (single file or sharded with model.safetensors.index.json; text-only
`model.*` or the released VLM form `model.language_model.*`). Tensors are read one at a time.

The safetensors header (8-byte length + JSON directory) is parsed here so each tensor can be read with a
positioned read into a buffer of its own (see tensors.TensorReader for why not a mapping). It is checked
as the safetensors library checks it: a JSON object of at most 100 MB, every tensor's byte range the
size its dtype and shape say, the ranges back to back from 0 (no overlap, no gap) and the last one
ending the file. Every file is opened through files.folder_file: the index cannot name a file outside
the folder."""
from __future__ import annotations

import json
import math
import pathlib
import struct

import torch

from ..config import Qwen38Config
from ..errors import CheckpointError
from ..files import folder_file, read_json
from .tensors import TensorReader

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
# Every dtype the format defines (safetensors 0.8), with its size in bits: a checkpoint may hold tensors we
# never read (vision tower, an MXFP4 or F8_E8M0-scaled quantization). F4 and F6 pack several values a byte:
# a tensor of them must fill whole bytes, as the library requires.
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
              "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64,
              "F64": 64, "I64": 64, "U64": 64}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's limit
# Prefixes of the text model's weights: released VLM form first, then the text-only form.
TEXT_PREFIXES = ("model.language_model.", "model.")
TOP_LEVEL = ("lm_head.", "mtp.")


def read_safetensors_header(path: pathlib.Path) -> tuple[dict, int]:
    """The tensor directory {name: (dtype, shape, begin, end)} and where the data starts."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise CheckpointError(f"{path}: not a safetensors file (header length {length}: at most "
                                  f"{MAX_HEADER_BYTES} and within the file's {size} bytes)")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not a safetensors file (header is not UTF-8 at byte {8 + e.start})") from None
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is a JSON {type(header).__name__}, not an "
                              "object)")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        # The library's rule: an optional map of string to string (JSON null counts as absent).
        bad = (f"a JSON {type(metadata).__name__}" if not isinstance(metadata, dict) else
               next(f"key {k!r} with a {type(v).__name__} value" for k, v in metadata.items() if not isinstance(v, str)))
        raise CheckpointError(f"{path}: __metadata__ must be an object of string values: expected a JSON object of "
                              f"string to string, found {bad:.120}")
    entries = {name: _entry(path, name, info) for name, info in header.items()}
    _check_layout(path, entries, size - 8 - length)
    return entries, 8 + length


def _entry(path: pathlib.Path, name: str, info) -> tuple[str, tuple[int, ...], int, int]:
    def bad(what: str):
        return CheckpointError(f"{path}: tensor {name!r}: {what}")

    if not isinstance(info, dict):
        raise bad(f"expected an object with dtype, shape and data_offsets, found {info!r:.80}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:  # a list or object is no dtype (nor hashable)
        raise bad(f"unknown dtype {dtype!r:.40}, expected one of {', '.join(DTYPE_BITS)}")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise bad(f"shape must be a list of non-negative integers, found {shape!r:.80}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets must be [begin, end] with 0 <= begin <= end, found {offsets!r:.80}")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8:
        raise bad(f"dtype {dtype} and shape {shape} make {bits} bits, not a whole number of bytes")
    nbytes = bits // 8
    if offsets[1] - offsets[0] != nbytes:
        raise bad(f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but dtype {dtype} and shape "
                  f"{shape} need {nbytes}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def _check_layout(path: pathlib.Path, entries: dict, data_bytes: int) -> None:
    """In order of their offsets the tensors lie back to back from 0 and the last one ends the file."""
    end, previous = 0, None
    for name, (_, _, begin, stop) in sorted(entries.items(), key=lambda item: item[1][2:]):
        if begin != end:
            after = f"the previous tensor {previous!r} ends at {end}" if previous else "the data starts at 0"
            raise CheckpointError(f"{path}: tensor {name!r} has data_offsets [{begin}, {stop}]: {after} (tensors "
                                  f"must not overlap or leave gaps)")
        end, previous = stop, name
    if end > data_bytes:
        raise CheckpointError(f"{path}: tensor {previous!r} is truncated: it ends at data byte {end}, the file holds "
                              f"{data_bytes} data bytes")
    if end < data_bytes:
        raise CheckpointError(f"{path}: {data_bytes - end} bytes after the last tensor's data that no tensor covers "
                              "(the header does not describe the file)")


class HFCheckpoint:
    """An HF safetensors folder as a tensor source (source.TensorSource)."""

    gguf_layout = False

    def __init__(self, folder: str):
        self.path = str(folder)
        root = pathlib.Path(folder)
        self.config = Qwen38Config.from_hf_folder(root)
        files = self._shards(root)
        self._entries = {}  # name -> (file, absolute offset, nbytes, dtype, shape)
        for file in files:
            header, data_start = read_safetensors_header(file)
            for name, (dtype, shape, begin, end) in header.items():
                if name in self._entries:
                    raise CheckpointError(f"{file}: tensor {name!r} is also in {self._entries[name][0]}")
                self._entries[name] = (str(file), data_start + begin, end - begin, dtype, shape)
        self._total_bytes = sum(entry[2] for entry in self._entries.values())
        self.prefix = next((p for p in TEXT_PREFIXES if f"{p}embed_tokens.weight" in self._entries), None)
        if self.prefix is None:
            raise CheckpointError(f"{folder}: missing tensor 'model.embed_tokens.weight' (or "
                                  "'model.language_model.embed_tokens.weight')")

    @staticmethod
    def _shards(root: pathlib.Path) -> list[pathlib.Path]:
        """The safetensors files: the shards the index names (each inside the folder), or model.safetensors."""
        if (root / "model.safetensors.index.json").exists():
            index = folder_file(root, "model.safetensors.index.json", "safetensors index")
            weight_map = read_json(index, "safetensors index")
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index}: not a safetensors index (expected a 'weight_map' object of "
                                      "tensor name -> file name)")
            return sorted({folder_file(root, name, "shard") for name in weight_map.values()})
        if (root / "model.safetensors").exists():
            return [folder_file(root, "model.safetensors", "safetensors file")]
        raise CheckpointError(f"{root}: no model.safetensors or model.safetensors.index.json")

    def full_name(self, name: str) -> str:
        """HF name without the text-model prefix -> the name stored in this checkpoint. The head and the
        MTP block sit at the top level in both forms."""
        return name if name.startswith(TOP_LEVEL) else self.prefix + name

    def has(self, name: str) -> bool:
        return self.full_name(name) in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[4]

    def nbytes(self, name: str) -> int:
        return self._entry(name)[2]

    def total_bytes(self) -> int:
        return self._total_bytes

    def read(self, name: str, reader: TensorReader) -> torch.Tensor:
        return self.read_rows(name, reader, 0, self.shape(name)[0])

    def read_rows(self, name: str, reader: TensorReader, start: int, stop: int) -> torch.Tensor:
        file, offset, nbytes, dtype, shape = self._entry(name)
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{file}: tensor {self.full_name(name)!r} has dtype {dtype}; supported: "
                                  f"{', '.join(SAFETENSORS_DTYPES)}")
        row_bytes = nbytes // shape[0]  # safetensors are row-major
        raw = reader.read(file, offset + start * row_bytes, (stop - start) * row_bytes, self.full_name(name))
        return raw.view(SAFETENSORS_DTYPES[dtype]).reshape(stop - start, *shape[1:])

    def _entry(self, name: str):
        full = self.full_name(name)
        try:
            return self._entries[full]
        except KeyError:
            raise CheckpointError(f"{self.path}: missing tensor {full!r}") from None

