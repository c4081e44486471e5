"""GGUF (llama.cpp, arch qwen35): the header is read and checked in one walk under llama.cpp's rules; each
tensor's bytes are read on demand, one at a time (tensors.TensorReader).

read_header walks the header front to back as llama.cpp's gguf_init_from_file does, bounding every count
and length by the bytes left in the file before using it, and requires the tensors to tile the data
section: each starts where the previous one ends, padded to the alignment, in directory order, and the
last ends the file. The walk keeps the values it reads, as the gguf package's reader gives them
(field.contents()): that reader trusts the file (an array length of 2^62 loops until memory runs out, a
tensor offset near 2^64 wraps around to the header), and it turns every string of an array into numpy
parts, ~10 s for a real vocabulary (248,320 tokens and 247,587 merges); a loop over the mapped bytes
decodes them in ~0.1 s.
"""
from __future__ import annotations

import dataclasses
import math
import mmap
import struct

import gguf
import numpy as np
import torch

from ..config import Qwen38Config
from ..errors import CheckpointError
from ..files import regular_file
from .tensors import Q8Tensor, TensorReader

T = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
DENSE_TYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
# Little-endian numpy dtype of each scalar value type (its itemsize is the value's size in the file).
SCALAR_DTYPES = {V.UINT8: np.dtype("<u1"), V.INT8: np.dtype("<i1"), V.UINT16: np.dtype("<u2"),
                 V.INT16: np.dtype("<i2"), V.UINT32: np.dtype("<u4"), V.INT32: np.dtype("<i4"),
                 V.FLOAT32: np.dtype("<f4"), V.BOOL: np.dtype("?"), V.UINT64: np.dtype("<u8"),
                 V.INT64: np.dtype("<i8"), V.FLOAT64: np.dtype("<f8")}
U64 = struct.Struct("<Q")
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

    def strings(self, count: int, what: str) -> list[str]:
        """count strings: a tight loop while each fits and is UTF-8 (a vocabulary has ~250k), then string()
        for the rest, which raises at the first that does not and names it."""
        self.bound(count, 8, f"the array length of {what}")
        data, end, pos = self.data, len(self.data), self.pos
        values = []
        for _ in range(count):
            if end - pos < 8:
                break
            n = U64.unpack_from(data, pos)[0]
            if n > end - pos - 8:
                break
            try:
                values.append(data[pos + 8 : pos + 8 + n].decode("utf-8"))
            except UnicodeDecodeError:
                break
            pos += 8 + n
        self.pos = pos
        while len(values) < count:
            values.append(self.string(f"item {len(values)} of {what}"))
        return values

    def scalar(self, dtype: np.dtype, what: str):
        return np.frombuffer(self.take(dtype.itemsize, what), dtype)[0].item()

    def array(self, dtype: np.dtype, count: int, what: str) -> list:
        start = self.pos
        self.skip(count * dtype.itemsize, what)
        return np.frombuffer(self.data, dtype, count, start).tolist()

    def bound(self, count: int, min_bytes: int, what: str) -> None:
        """A count read from the file, checked against the room left for its items before any loop."""
        if count * min_bytes > self.left():
            raise CheckpointError(f"{self.path}: {what} is {count}, but {count} of them need at least "
                                  f"{count * min_bytes} bytes and the file has {self.left()} left")


@dataclasses.dataclass
class GGUFHeader:
    metadata: dict  # key -> str, int, float, bool or a list of them (the gguf reader's field.contents())
    tensors: list[TensorInfo]  # in directory order
    data_start: int  # file offset of the data section, where tensor offsets count from
    # key -> (value type, item type of an array or None): what the values' python types cannot tell apart
    types: dict = dataclasses.field(default_factory=dict)


def read_header(path: str) -> GGUFHeader:
    """The metadata and tensor directory of a GGUF file, checked as llama.cpp checks them; a CheckpointError
    names the field and its offset, or the tensor."""
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
            types = {}
            metadata = _read_metadata(cur, num_kv, types)
            alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
            cur.bound(num_tensors, MIN_TENSOR_INFO_BYTES, "the tensor count")
            infos = _tensor_infos(cur, num_tensors)
            data_start = -(-cur.pos // alignment) * alignment
    _check_data_layout(path, infos, alignment, data_start, size)
    return GGUFHeader(metadata, infos, data_start, types)


def _read_metadata(cur: _Cursor, count: int, types: dict) -> dict:
    """The key-value pairs; general.alignment, when there, a uint32 power of two. types gets each key's
    (value type, array item type or None)."""
    metadata = {}
    for i in range(count):
        key = cur.string(f"metadata key #{i}")
        if key in metadata:
            raise CheckpointError(f"{cur.path}: metadata key {key!r} appears twice")
        value_type = cur.u32(f"value type of metadata key {key!r}")
        if key == "general.alignment":
            alignment = cur.u32("general.alignment") if value_type == V.UINT32 else 0
            if alignment == 0 or alignment & (alignment - 1):
                raise CheckpointError(f"{cur.path}: general.alignment must be a uint32 power of two, found type "
                                      f"{value_type} value {alignment}")
            metadata[key] = alignment
        else:
            item_type = None
            if value_type == V.ARRAY and cur.left() >= 4:
                item_type = struct.unpack_from("<I", cur.data, cur.pos)[0]  # _read_value reads and checks it
            metadata[key] = _read_value(cur, value_type, f"metadata key {key!r}")
        types[key] = (value_type, item_type if value_type == V.ARRAY else None)
    return metadata


def _read_value(cur: _Cursor, value_type: int, what: str):
    if value_type in SCALAR_DTYPES:
        return cur.scalar(SCALAR_DTYPES[value_type], f"value of {what}")
    if value_type == V.STRING:
        return cur.string(f"string value of {what}")
    if value_type == V.ARRAY:
        item_type = cur.u32(f"item type of {what}")
        length = cur.u64(f"array length of {what}")
        if item_type in SCALAR_DTYPES:
            return cur.array(SCALAR_DTYPES[item_type], length, f"array of {what}")
        if item_type == V.STRING:
            return cur.strings(length, what)
        # llama.cpp has no nested arrays either
        raise CheckpointError(f"{cur.path}: {what} is an array of type {item_type}, expected a scalar or string "
                              "type")
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


# The qwen35.* keys llama.cpp's qwen35 loader reads (and the converter writes), with the value type its
# loader requires of each: llama_model_loader::get_key throws "key ... has wrong type" for any other (a
# uint32 count stored as an int32 is not read there), get_arr takes int32 or uint32 items.
_K, _ARCH = gguf.Keys, "qwen35"
ARCH_KEY_TYPES = {key.format(arch=_ARCH): value_type for key, value_type in {
    _K.LLM.BLOCK_COUNT: V.UINT32, _K.LLM.CONTEXT_LENGTH: V.UINT32, _K.LLM.EMBEDDING_LENGTH: V.UINT32,
    _K.LLM.FEED_FORWARD_LENGTH: V.UINT32, _K.LLM.VOCAB_SIZE: V.UINT32, _K.LLM.FULL_ATTENTION_INTERVAL: V.UINT32,
    _K.LLM.NEXTN_PREDICT_LAYERS: V.UINT32, _K.Attention.HEAD_COUNT: V.UINT32, _K.Attention.HEAD_COUNT_KV: V.UINT32,
    _K.Attention.KEY_LENGTH: V.UINT32, _K.Attention.VALUE_LENGTH: V.UINT32,
    _K.Attention.LAYERNORM_RMS_EPS: V.FLOAT32, _K.Rope.FREQ_BASE: V.FLOAT32, _K.Rope.DIMENSION_COUNT: V.UINT32,
    _K.Rope.DIMENSION_SECTIONS: (V.ARRAY, (V.INT32, V.UINT32)), _K.SSM.CONV_KERNEL: V.UINT32,
    _K.SSM.STATE_SIZE: V.UINT32, _K.SSM.GROUP_COUNT: V.UINT32, _K.SSM.TIME_STEP_RANK: V.UINT32,
    _K.SSM.INNER_SIZE: V.UINT32, f"{{arch}}.attention.recurrent_layers": (V.ARRAY, (V.BOOL,)),
    _K.General.FILE_TYPE: V.UINT32, _K.General.QUANTIZATION_VERSION: V.UINT32,
}.items()}
# general.file_type -> the ggml type it says the matrices have, for the file types this implementation reads.
MAX_SECTION = 2**31 - 1  # llama.cpp holds the sections and their sum in int32
FILE_TYPE_MATRICES = {gguf.LlamaFileType.ALL_F32: T.F32, gguf.LlamaFileType.MOSTLY_F16: T.F16,
                      gguf.LlamaFileType.MOSTLY_BF16: T.BF16, gguf.LlamaFileType.MOSTLY_Q8_0: T.Q8_0}


def _type_name(value_type) -> str:
    """UINT32; ARRAY of BOOL (as found); ARRAY of INT32/UINT32 (as expected)."""
    if isinstance(value_type, tuple):
        items = value_type[1] if isinstance(value_type[1], tuple) else (value_type[1],)
        return f"ARRAY of {'/'.join(_type_name(i) for i in items)}"
    return V(value_type).name if value_type in V._value2member_map_ else str(value_type)


def check_arch_metadata(path: str, header: GGUFHeader, config: Qwen38Config) -> None:
    """The qwen35 keys the config does not take a value from, and the types of all of them, checked against
    the config they imply, so that no key llama.cpp reads says something this model ignores:
    value_length is key_length (head_dim); rope.dimension_sections are four non-negative integers over which
    every rotated pair turns by a text token's position; vocab_size, when there, is token_embd's rows;
    general.file_type a uint32 of the four file types read here whose matrix type holds most of the bytes."""
    meta, types = header.metadata, header.types
    for key, expected in ARCH_KEY_TYPES.items():
        if key not in meta:
            continue
        value_type, item_type = types[key]
        found = (value_type, item_type) if value_type == V.ARRAY else value_type
        ok = (found == expected if not isinstance(expected, tuple) else
              isinstance(found, tuple) and item_type in expected[1])
        if not ok:
            raise CheckpointError(f"{path}: metadata key {key!r} has type {_type_name(found)}, expected "
                                  f"{_type_name(expected)} (the type llama.cpp's qwen35 loader reads)")

    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{path}: metadata key {key!r} {what}")

    key = f"{_ARCH}.attention.value_length"
    if key in meta:
        need(meta[key] == config.head_dim, key, f"is {meta[key]!r}, expected {config.head_dim} "
             f"(= {_ARCH}.attention.key_length: keys and values have head_dim values in this architecture)")
    key = f"{_ARCH}.vocab_size"
    if key in meta:
        need(meta[key] == config.vocab_size, key, f"is {meta[key]!r}, expected {config.vocab_size} (the rows of "
             "'token_embd.weight')")
    key = f"{_ARCH}.rope.dimension_sections"
    if key in meta:  # llama.cpp requires it (get_key_or_arr(..., 4, required)); the converter always writes it
        sections = meta[key]
        need(isinstance(sections, list) and len(sections) == 4, key,
             f"has {len(sections) if isinstance(sections, list) else sections!r:.40} values, expected 4 "
             "(llama.cpp reads exactly 4)")
        need(all(s >= 0 for s in sections) and 0 < sum(sections) <= MAX_SECTION, key,
             f"is {sections}, expected 4 non-negative integers with a sum in [1, {MAX_SECTION}] (ggml adds them "
             "in an int32 and takes each rotated pair's index modulo the sum)")
        # ggml's interleaved M-RoPE turns pair i by the t/h/w position (all three a text token's position, as
        # HF and this implementation rotate every pair) iff its sector s = i % sum has s < 3*sections[s % 3];
        # any other pair turns by the 4th, extra position, a different model.
        total = sum(sections)
        pairs = range(min(config.rotary_dim // 2, total))  # the sectors of all pairs
        uncovered = [i for i in pairs if not i < 3 * sections[i % 3]]
        need(not uncovered, key, f"is {sections}: over rope.dimension_count {config.rotary_dim} ({config.rotary_dim // 2} "
             f"pairs) the pairs {uncovered[:8]} would not turn by the token's position in llama.cpp's interleaved "
             "M-RoPE; expected sections that cover every pair (e.g. [11, 11, 10, 0] for 64 rotated dims)")
    key = _K.General.FILE_TYPE
    if key in meta:
        value = meta[key]
        need(value in gguf.LlamaFileType._value2member_map_ and value != gguf.LlamaFileType.GUESSED, key,
             f"is {value!r}, not a llama.cpp file type (gguf.LlamaFileType): expected one of the file types read "
             f"here: {', '.join(f'{t.value} ({t.name})' for t in FILE_TYPE_MATRICES)}")
        file_type = gguf.LlamaFileType(value)
        need(file_type in FILE_TYPE_MATRICES, key,
             f"is {value} ({file_type.name}), expected one of the file types read here: "
             f"{', '.join(f'{t.value} ({t.name})' for t in FILE_TYPE_MATRICES)}")
        by_type = {}
        for t in header.tensors:
            by_type[t.ggml_type] = by_type.get(t.ggml_type, 0) + t.nbytes
        main = max(by_type, key=by_type.get) if by_type else None
        need(main is None or main == FILE_TYPE_MATRICES[file_type], key,
             f"is {value} ({file_type.name}), expected "
             f"{next(f.value for f, m in FILE_TYPE_MATRICES.items() if m == main) if main in FILE_TYPE_MATRICES.values() else 'another'} "
             f"({main.name}): {file_type.name} has {FILE_TYPE_MATRICES[file_type].name} matrices, but the tensors are "
             f"mostly {main.name} ({by_type[main]} of {sum(by_type.values())} bytes)")


class GGUFCheckpoint:
    """A GGUF file as a tensor source (source.TensorSource)."""

    gguf_layout = True

    def __init__(self, path: str):
        self.path = str(path)
        regular_file(path, "GGUF file")
        header = read_header(self.path)
        self.metadata = header.metadata
        self.data_start = header.data_start
        self._tensors = {t.name: t for t in header.tensors}
        self._total_bytes = sum(t.nbytes for t in header.tensors)
        embed = self._tensors.get("token_embd.weight")
        if embed is None or len(embed.dims) != 2:
            raise CheckpointError(f"{path}: missing tensor 'token_embd.weight' (a 2-D [hidden, vocab] matrix)")
        self.config = Qwen38Config.from_gguf_metadata(self.metadata, vocab_size=embed.dims[1], source=self.path)
        check_arch_metadata(self.path, header, self.config)
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
        return tuple(reversed(self._entry(name).dims))  # ggml ne is fastest-first

    def nbytes(self, name: str) -> int:
        return self._entry(name).nbytes

    def total_bytes(self) -> int:
        return self._total_bytes

    def dtype_name(self, name: str) -> str:
        return self._entry(name).ggml_type.name

    def read(self, name: str, reader: TensorReader):
        return self.read_rows(name, reader, 0, self.shape(name)[0])

    def read_rows(self, name: str, reader: TensorReader, start: int, stop: int):
        t = self._entry(name)
        shape = self.shape(name)
        if t.ggml_type == T.Q8_0 and len(shape) != 2:
            raise CheckpointError(f"{self.path}: tensor {name!r} is Q8_0 with shape {shape}, expected 2-D")
        if t.ggml_type != T.Q8_0 and t.ggml_type not in DENSE_TYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has ggml type {t.ggml_type.name}; supported: "
                                  "F32, F16, BF16, Q8_0")
        row_bytes = t.nbytes // shape[0]  # ggml rows are contiguous, fastest dim first (a Q8_0 row: whole blocks)
        raw = reader.read(self.path, self.data_start + t.offset + start * row_bytes, (stop - start) * row_bytes, name)
        shape = (stop - start, *shape[1:])
        if t.ggml_type == T.Q8_0:
            return Q8Tensor.from_ggml_bytes(raw, shape)
        return raw.view(DENSE_TYPES[t.ggml_type]).reshape(shape)

    def _entry(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}") from None
