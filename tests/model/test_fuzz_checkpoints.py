"""Seeded fuzzing of both checkpoint formats. Mutated copies of the oracle's GGUF files and HF folder
(truncations; bit flips in the header, metadata and tensor directory; extreme counts, lengths, dimensions,
offsets and types; rewritten safetensors headers; mistyped config.json values) must each end one of three
ways: our CheckpointError naming the file; a model whose logits equal the original's bit for bit; or a
model of another config, where the mutation changed a config value the model reads (rms_norm_eps, say),
or of other weights, where it relabelled a tensor to a dtype of the same size (BF16 -> F16: a valid file
of another model, which no check can tell). Never another exception, a hang (each case has an alarm) or
silently different logits.

Every case is a pure function of (SEED, case number): a failure names both and the mutation."""
import dataclasses
import json
import random
import shutil
import signal
import struct
from contextlib import contextmanager

import gguf
import numpy as np
import pytest
import torch

from qwen38_model import CheckpointError, Qwen38ForCausalLM

from gguf_copies import join_safetensors, split_safetensors

SEED = 20261201
CASES_PER_GGUF = 250
CASES_HF = 250
CASE_SECONDS = 20  # far above the slowest case (a successful load and forward: ~0.05 s)
PROMPT = torch.tensor([[1, 7, 42, 300]])
EXTREMES = (0, 1, 2**31 - 1, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
GGML_TYPES = (0, 1, 2, 8, 16, 24, 26, 30, 39, 2**31, 2**32 - 1)  # F32 F16 Q4_0 Q8_0 IQ2_XXS I8 I32 BF16 ...


class CaseTimeout(BaseException):
    """Raised by the alarm; a BaseException so that no except-Exception in the loader can swallow it."""


@contextmanager
def time_limit(seconds: int):
    def expire(signum, frame):
        raise CaseTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclasses.dataclass
class Reference:
    config: object
    logits: torch.Tensor


def reference(path) -> Reference:
    model = Qwen38ForCausalLM.from_pretrained(path, device="cpu")
    return Reference(dataclasses.replace(model.config, source=""), model(PROMPT).logits)


def outcome(path, named, ref: Reference, description: str, other_weights: bool = False) -> str:
    """'error', 'same', 'config' or 'weights' (see the module docstring); anything else fails the test."""
    try:
        with time_limit(CASE_SECONDS):
            try:
                model = Qwen38ForCausalLM.from_pretrained(path, device="cpu")
            except CheckpointError as e:
                assert str(named) in str(e), f"{description}: the error does not name {named}: {e}"
                return "error"
            logits = model(PROMPT).logits
    except CaseTimeout:
        pytest.fail(f"{description}: no result within {CASE_SECONDS} s")
    except Exception as e:  # noqa: BLE001 (the point: nothing but CheckpointError may escape)
        pytest.fail(f"{description}: {type(e).__name__} instead of a CheckpointError: {e}")
    if dataclasses.replace(model.config, source="") != ref.config:
        return "config"
    if torch.equal(logits, ref.logits):
        return "same"
    assert other_weights, f"{description}: loaded with the same config but different logits"
    return "weights"


# ---- GGUF ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class GGUFFields:
    """Byte positions of the header's fields in the original file, from the gguf reader."""

    data_start: int
    counts: list[int]  # tensor count, metadata key count (u64)
    lengths: list[int]  # every string and array length (u64)
    value_types: list[int]  # every metadata value type (u32)
    numbers: list[tuple[int, str]]  # (position, struct format) of every scalar metadata number
    dims: list[int]  # every tensor dimension (u64)
    types: list[int]  # every tensor's ggml type (u32)
    offsets: list[int]  # every tensor's data offset (u64)
    directory: tuple[int, int]  # where the tensor infos lie


def gguf_fields(path) -> GGUFFields:
    reader = gguf.GGUFReader(path)
    base = reader.data.__array_interface__["data"][0]

    def at(part) -> int:
        return part.__array_interface__["data"][0] - base

    f = GGUFFields(reader.data_offset, [8, 16], [], [], [], [], [], [], (0, 0))
    formats = {np.dtype(np.uint32): "<I", np.dtype(np.int32): "<i", np.dtype(np.float32): "<f",
               np.dtype(np.uint64): "<Q", np.dtype(np.float64): "<d"}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        f.lengths.append(at(field.parts[0]))
        f.value_types.append(at(field.parts[2]))
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            f.lengths.append(at(field.parts[4]))
        elif field.types[0] == gguf.GGUFValueType.STRING:
            f.lengths.append(at(field.parts[3]))
        elif field.parts[-1].dtype in formats:
            f.numbers.append((at(field.parts[-1]), formats[field.parts[-1].dtype]))
    for t in reader.tensors:
        name_len, _, _, dims, ggml_type, offset = t.field.parts
        f.lengths.append(at(name_len))
        f.dims += [at(dims) + 8 * i for i in range(len(dims))]
        f.types.append(at(ggml_type))
        f.offsets.append(at(offset))
    f.directory = (reader.tensors[0].field.offset, f.offsets[-1] + 8)
    return f


def put(data: bytearray, position: int, fmt: str, value) -> None:
    data[position : position + struct.calcsize(fmt)] = struct.pack(fmt, value)


def mutate_gguf(original: bytes, f: GGUFFields, rng: random.Random) -> tuple[str, bytes]:
    data = bytearray(original)
    kind = rng.choice(["truncate", "flip header", "flip directory", "count", "length", "value type", "number",
                       "dimension", "ggml type", "offset"])
    if kind == "truncate":
        end = rng.randrange(f.data_start) if rng.random() < 0.5 else rng.randrange(len(data))
        return f"truncated to {end} bytes", bytes(data[:end])
    if kind in ("flip header", "flip directory"):
        low, high = (0, f.data_start) if kind == "flip header" else f.directory
        position, bit = rng.randrange(low, high), rng.randrange(8)
        data[position] ^= 1 << bit
        return f"{kind}: byte {position} bit {bit}", bytes(data)
    if kind == "number":
        position, fmt = rng.choice(f.numbers)
        if fmt in ("<f", "<d"):
            value = rng.choice([float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 1e30, 1e-30])
        else:
            value = rng.choice([0, 1, 2, 3, 7, 64, 2**31 - 1] + ([2**32 - 1] if fmt == "<I" else []))
            value = value if fmt != "<Q" else rng.choice(EXTREMES)
        put(data, position, fmt, value)
        return f"metadata number at {position} ({fmt}) set to {value}", bytes(data)
    if kind == "offset":
        i = rng.randrange(len(f.offsets))
        current = struct.unpack_from("<Q", data, f.offsets[i])[0]
        other = struct.unpack_from("<Q", data, rng.choice(f.offsets))[0]
        value = rng.choice([0, current + 1, current - 1, current + 32, (current - 32) % 2**64, other,
                            2**64 - 1, 2**64 - f.data_start, rng.getrandbits(64)]) % 2**64
        put(data, f.offsets[i], "<Q", value)
        return f"offset of tensor #{i} {current} -> {value}", bytes(data)
    positions, fmt, values = {
        "count": (f.counts, "<Q", EXTREMES),
        "length": (f.lengths, "<Q", EXTREMES),
        "value type": (f.value_types, "<I", (*range(14), 2**32 - 1)),
        "dimension": (f.dims, "<Q", EXTREMES),
        "ggml type": (f.types, "<I", GGML_TYPES),
    }[kind]
    position, value = rng.choice(positions), rng.choice(values)
    put(data, position, fmt, value)
    return f"{kind} at {position} set to {value}", bytes(data)


@pytest.mark.parametrize("qtype", ["q8_0", "f32"])
def test_fuzzed_gguf_files(oracle_dir, tmp_path, qtype):
    src = oracle_dir / f"mini-{qtype}.gguf"
    original, fields, ref = src.read_bytes(), gguf_fields(src), reference(src)
    path = tmp_path / "fuzzed.gguf"
    tally = {}
    for case in range(CASES_PER_GGUF):
        rng = random.Random(f"{SEED}:{qtype}:{case}")
        description, data = mutate_gguf(original, fields, rng)
        path.write_bytes(data)
        result = outcome(path, path, ref, f"SEED {SEED} {qtype} case {case}: {description}")
        tally[result] = tally.get(result, 0) + 1
    print(f"{qtype}: {tally}")
    assert tally.get("error", 0) > CASES_PER_GGUF // 2  # the mutations mostly break the structure


# ---- HF safetensors + config.json ------------------------------------------------------------------------

ODD_VALUES = (None, "128", 128.0, True, [8], {}, -1, 0, 2**40, 1e30, float("nan"), "x")


SAME_SIZE = {"F16": "BF16", "BF16": "F16"}  # relabels that make a valid file of other weights


def mutate_header(header: dict, rng: random.Random) -> tuple[str, bool]:
    """Changes one tensor's entry; returns its description and whether the result is, by construction, a
    valid file of other weights."""
    names = sorted(k for k in header if k != "__metadata__")
    name = rng.choice(names)
    entry = header[name]
    field = rng.choice(["data_offsets", "shape", "dtype", "entry"])
    old_dtype = entry["dtype"]
    if field == "data_offsets":
        begin, end = entry["data_offsets"]
        other = header[rng.choice(names)]["data_offsets"]
        entry["data_offsets"] = rng.choice([[begin + 1, end + 1], [begin, end - 1], [begin - 1, end], list(other),
                                            [end, begin], [begin, 2**64], [-8, end], [begin, end + 0.5], None])
    elif field == "shape":
        shape = entry["shape"]
        entry["shape"] = rng.choice([shape + [1], shape[:-1], [0] * len(shape), [2**62] + shape[1:],
                                     [-1] + shape[1:], [str(n) for n in shape], shape[::-1], "x"])
    elif field == "dtype":
        entry["dtype"] = rng.choice(["F16", "BF16", "F32", "F64", "I32", "U8", "F8_E4M3", "Q8_0", "", 7])
    else:
        header[name] = rng.choice(ODD_VALUES)
    other_weights = field == "dtype" and SAME_SIZE.get(old_dtype) == entry["dtype"]
    return f"header of {name!r}: {field} -> {header[name]!r:.120}", other_weights


def mutate_hf(original: bytes, config: dict, rng: random.Random) -> tuple[str, bytes, dict, bool]:
    """(description, model.safetensors bytes, config.json object, whether it is a valid file of other weights)."""
    data, config = bytearray(original), json.loads(json.dumps(config))
    (length,) = struct.unpack_from("<Q", data)
    kind = rng.choice(["truncate", "flip header", "header length", "header field", "header field", "config"])
    if kind == "truncate":
        end = rng.randrange(8 + length) if rng.random() < 0.5 else rng.randrange(len(data))
        return f"truncated to {end} bytes", bytes(data[:end]), config, False
    if kind == "flip header":
        position, bit = rng.randrange(8 + length), rng.randrange(8)
        data[position] ^= 1 << bit
        return f"flip byte {position} bit {bit}", bytes(data), config, False
    if kind == "header length":
        value = rng.choice(EXTREMES + (length - 1, length + 1))
        put(data, 0, "<Q", value)
        return f"header length {length} -> {value}", bytes(data), config, False
    if kind == "header field":
        header, body = split_safetensors(bytes(data))
        description, other_weights = mutate_header(header, rng)
        return description, join_safetensors(header, body), config, other_weights
    key = rng.choice(sorted(config))
    config[key] = rng.choice(ODD_VALUES)
    return f"config.json {key} -> {config[key]!r}", bytes(data), config, False


def test_fuzzed_hf_folders(oracle_dir, tmp_path):
    src = oracle_dir / "hf"
    folder = tmp_path / "hf"
    shutil.copytree(src, folder)
    original, config, ref = (src / "model.safetensors").read_bytes(), json.loads((src / "config.json").read_text()), \
        reference(src)
    tally = {}
    for case in range(CASES_HF):
        rng = random.Random(f"{SEED}:hf:{case}")
        description, data, mutated_config, other_weights = mutate_hf(original, config, rng)
        (folder / "model.safetensors").write_bytes(data)
        (folder / "config.json").write_text(json.dumps(mutated_config))
        result = outcome(folder, folder, ref, f"SEED {SEED} hf case {case}: {description}", other_weights)
        tally[result] = tally.get(result, 0) + 1
    print(f"hf: {tally}")
    assert tally.get("error", 0) > CASES_HF // 2
