"""GGUF (llama.cpp, arch qwen35): the header is checked under llama.cpp's rules first, then parsed by the
gguf package's reader; each tensor's bytes are read on demand, one at a time (tensors.read_bytes).

The reader trusts the file: an array length of 2^62 loops until memory runs out, a tensor offset near
2^64 wraps around to the header, a relabelled tensor type reads the neighbour's bytes. check_header walks
the header front to back as llama.cpp's gguf_init_from_file does, bounding every count and length by the
bytes left in the file before using it, and requires the tensors to tile the data section: each starts
where the previous one ends, padded to the alignment, in directory order, and the last ends the file.
"""
from __future__ import annotations

import dataclasses
import math
import mmap
import struct

import gguf
import torch

from ..config import Qwen38Config
from ..errors import CheckpointError
from ..files import regular_file
from .tensors import Q8Tensor, read_bytes

T = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
DENSE_TYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
SCALAR_BYTES = {V.UINT8: 1, V.INT8: 1, V.UINT16: 2, V.INT16: 2, V.UINT32: 4, V.INT32: 4, V.FLOAT32: 4,
                V.BOOL: 1, V.UINT64: 8, V.INT64: 8, V.FLOAT64: 8}
MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, dimension count, ggml type, offset
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME - 1 (room for the C string's terminator)


@dataclasses.dataclass
class TensorInfo:
    name: str
    dims: list[int]  # ggml ne, fastest first
    ggml_type: T
    offset: int  # from the start of the data section
    nbytes: int


class _Cursor:
    """Reads the header front to back; every read is checked against the end of the file first."""

    def __init__(self, path: str, data: mmap.mmap):
        self.path, self.data, self.pos = path, data, 0

    def left(self) -> int:
        return len(self.data) - self.pos

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            raise CheckpointError(f"{self.path}: {what} at offset {self.pos} needs {n} bytes, the file has "
                                  f"{self.left()} left")
        self.pos += n

    def take(self, n: int, what: str) -> bytes:
        self.skip(n, what)
        return self.data[self.pos - n : self.pos]

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def string(self, what: str) -> str:
        start = self.pos
        raw = self.take(self.u64(f"length of {what}"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: {what} at offset {start} is not UTF-8 (byte {e.start}: "
                                  f"{e.reason})") from None

    def bound(self, count: int, min_bytes: int, what: str) -> None:
        """A count read from the file, checked against the room left for its items before any loop."""
        if count * min_bytes > self.left():
            raise CheckpointError(f"{self.path}: {what} is {count}, but {count} of them need at least "
                                  f"{count * min_bytes} bytes and the file has {self.left()} left")


def check_header(path: str) -> None:
    """llama.cpp's checks of a GGUF header and its tensor directory; a CheckpointError names the field and
    its offset, or the tensor."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise CheckpointError(f"{path}: {size} bytes, too short for a GGUF header (24)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cur = _Cursor(path, data)
            if cur.take(4, "magic") != b"GGUF":
                raise CheckpointError(f"{path}: not a GGUF file (magic {data[:4]!r}, expected b'GGUF')")
            version = cur.u32("version")
            if version & 0xFFFF == 0:
                raise CheckpointError(f"{path}: GGUF version field {version:#x}: a big-endian file, not supported")
            if version not in gguf.READER_SUPPORTED_VERSIONS:
                raise CheckpointError(f"{path}: GGUF version {version}, supported: "
                                      f"{', '.join(map(str, gguf.READER_SUPPORTED_VERSIONS))}")
            num_tensors, num_kv = cur.u64("tensor count"), cur.u64("metadata key count")
            cur.bound(num_kv, MIN_KV_BYTES, "the metadata key count")
            alignment = _check_metadata(cur, num_kv)
            cur.bound(num_tensors, MIN_TENSOR_INFO_BYTES, "the tensor count")
            infos = _tensor_infos(cur, num_tensors)
            data_start = -(-cur.pos // alignment) * alignment
    _check_data_layout(path, infos, alignment, data_start, size)


def _check_metadata(cur: _Cursor, count: int) -> int:
    """Walks the key-value pairs; returns general.alignment (default 32)."""
    keys, alignment = set(), gguf.GGUF_DEFAULT_ALIGNMENT
    for i in range(count):
        key = cur.string(f"metadata key #{i}")
        if key in keys:
            raise CheckpointError(f"{cur.path}: metadata key {key!r} appears twice")
        keys.add(key)
        value_type = cur.u32(f"value type of metadata key {key!r}")
        if key == "general.alignment":
            alignment = cur.u32("general.alignment") if value_type == V.UINT32 else 0
            if alignment == 0 or alignment & (alignment - 1):
                raise CheckpointError(f"{cur.path}: general.alignment must be a uint32 power of two, found type "
                                      f"{value_type} value {alignment}")
        else:
            _skip_value(cur, value_type, f"metadata key {key!r}")
    return alignment


def _skip_value(cur: _Cursor, value_type: int, what: str) -> None:
    if value_type in SCALAR_BYTES:
        cur.skip(SCALAR_BYTES[value_type], f"value of {what}")
    elif value_type == V.STRING:
        cur.string(f"string value of {what}")
    elif value_type == V.ARRAY:
        item_type = cur.u32(f"item type of {what}")
        length = cur.u64(f"array length of {what}")
        if item_type in SCALAR_BYTES:
            cur.skip(length * SCALAR_BYTES[item_type], f"array of {what}")
        elif item_type == V.STRING:
            cur.bound(length, 8, f"the array length of {what}")
            for i in range(length):
                cur.string(f"item {i} of {what}")
        else:  # llama.cpp has no nested arrays either
            raise CheckpointError(f"{cur.path}: {what} is an array of type {item_type}, expected a scalar or "
                                  "string type")
    else:
        raise CheckpointError(f"{cur.path}: {what} has value type {value_type}, not a GGUF type (0-12)")


def _tensor_info(cur: _Cursor, i: int) -> TensorInfo:
    name = cur.string(f"name of tensor #{i}")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise CheckpointError(f"{cur.path}: tensor #{i} has a name of {len(name.encode())} bytes, at most "
                              f"{MAX_NAME_BYTES}")
    n_dims = cur.u32(f"dimension count of tensor {name!r}")
    if n_dims > MAX_DIMS:
        raise CheckpointError(f"{cur.path}: tensor {name!r} has {n_dims} dimensions, at most {MAX_DIMS}")
    dims = [cur.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims)]
    if math.prod(dims) >= 2**63:  # ggml counts elements in int64
        raise CheckpointError(f"{cur.path}: tensor {name!r} has dimensions {dims}: {math.prod(dims)} elements, "
                              "more than int64 holds")
    raw_type = cur.u32(f"ggml type of tensor {name!r}")
    if raw_type not in T._value2member_map_:
        raise CheckpointError(f"{cur.path}: tensor {name!r} has ggml type {raw_type}, not a ggml type")
    ggml_type = T(raw_type)
    block, type_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    row = dims[0] if dims else 1
    if row % block:
        raise CheckpointError(f"{cur.path}: tensor {name!r} of ggml type {ggml_type.name} has rows of {row} values, "
                              f"not a multiple of its block of {block}")
    offset = cur.u64(f"data offset of tensor {name!r}")
    return TensorInfo(name, dims, ggml_type, offset, math.prod(dims) // block * type_bytes)


def _tensor_infos(cur: _Cursor, count: int) -> list[TensorInfo]:
    infos, names = [], set()
    for i in range(count):
        infos.append(_tensor_info(cur, i))
        if infos[-1].name in names:
            raise CheckpointError(f"{cur.path}: tensor {infos[-1].name!r} appears twice in the directory")
        names.add(infos[-1].name)
    return infos


def _check_data_layout(path: str, infos: list[TensorInfo], alignment: int, data_start: int, size: int) -> None:
    """Tensors lie back to back in directory order, each padded to the alignment (llama.cpp requires each
    offset to be exactly that), and the last one ends the file (within its padding). This one rule rejects
    misaligned, overlapping, out-of-order and wrapped-around offsets, and a tensor whose type or shape was
    changed so that its size no longer fits its slot."""
    expected, previous = 0, None
    for t in infos:
        if t.offset != expected:
            why = (f"the previous tensor {previous.name!r} ({previous.ggml_type.name}, ne {previous.dims}: "
                   f"{previous.nbytes} bytes) ends there, padded to {alignment}" if previous else
                   "the first tensor starts the data section")
            raise CheckpointError(f"{path}: tensor {t.name!r} starts at data offset {t.offset}, expected {expected}: "
                                  f"{why}")
        expected += -(-t.nbytes // alignment) * alignment
        previous = t
    if previous is None:
        return
    end = data_start + previous.offset + previous.nbytes
    if size < end:
        raise CheckpointError(f"{path}: tensor {previous.name!r} is truncated: it ends at byte {end}, the file has "
                              f"{size}")
    if size > data_start + expected:
        raise CheckpointError(f"{path}: {size - end} bytes follow the last tensor {previous.name!r} "
                              f"({previous.ggml_type.name}, ne {previous.dims}), which ends at byte {end}: the "
                              "directory does not describe the file")


def read_metadata(reader: gguf.GGUFReader) -> dict:
    """Every key as a plain Python value (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


class GGUFCheckpoint:
    def __init__(self, path: str):
        self.path = str(path)
        regular_file(path, "GGUF file")
        check_header(self.path)
        reader = gguf.GGUFReader(self.path, "r")  # safe now: the header passed llama.cpp's checks
        self.metadata = read_metadata(reader)
        self._tensors = {t.name: t for t in reader.tensors}
        embed = self._tensors.get("token_embd.weight")
        if embed is None or len(embed.shape) != 2:
            raise CheckpointError(f"{path}: missing tensor 'token_embd.weight' (a 2-D [hidden, vocab] matrix)")
        self.config = Qwen38Config.from_gguf_metadata(self.metadata, vocab_size=int(embed.shape[1]), source=self.path)
        if "output.weight" not in self._tensors:
            # A GGUF without output.weight ties the head to the embedding (llama.cpp's fallback).
            self.config = dataclasses.replace(self.config, tie_word_embeddings=True)

    def full_name(self, name: str) -> str:
        return name  # GGUF names are stored as the model asks for them

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

    def read(self, name: str, device):
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
