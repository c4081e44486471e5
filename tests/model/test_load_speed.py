"""The fast load path (issue 20, item 6): positioned reads split over threads (tensors.TensorReader), the GGUF
header read in one checked walk (gguf_file.read_header), GPU finiteness checks read back once
(Checkpoint.loading). The weights must come out bit for bit as before, whatever the split of the reads, and
equal to what the gguf package's own reader finds in the file. The load benchmark's CPU dry run is here too;
its speed is measured by `python -m benchmarks.load` on the GPU, never asserted."""
import json
import os
import random
import shutil
import struct

import gguf
import numpy as np
import pytest
import torch

import benchmarks.load as load_bench
from qwen38_model import CheckpointError, Qwen38ForCausalLM, default_model
from qwen38_model.checkpoint import open_checkpoint, tensors
from qwen38_model.checkpoint.gguf_file import read_header
from qwen38_model.checkpoint.q8_0 import Q8_BLOCK_BYTES
from qwen38_model.checkpoint.tensors import TensorReader, pieces

GGUF_FILES = ["mini-q8_0.gguf", "mini-f32.gguf", "mini-bf16.gguf"]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes on the CPU (compares -0.0 and 0.0, NaN payloads, as different)."""
    return t.detach().cpu().contiguous().flatten().view(torch.uint8)


def buffers(model) -> dict[str, tuple[torch.dtype, tuple, torch.Tensor]]:
    return {name: (b.dtype, tuple(b.shape), bits(b)) for name, b in model.named_buffers()}


def assert_same_buffers(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name][:2] == b[name][:2], name
        assert torch.equal(a[name][2], b[name][2]), name


@pytest.fixture
def tiny_reads(monkeypatch):
    """Reads split into many small pieces over 3 threads, so that one tensor spans many pieces and (on a
    GPU) every staging slot is reused within a tensor."""
    monkeypatch.setattr(tensors, "PIECE_BYTES", 4096)
    monkeypatch.setattr(tensors, "MIN_PIECE_BYTES", 1024)
    monkeypatch.setattr(tensors, "READ_THREADS", 3)


# ---- the reads ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 2, 8])
def test_pieces_cover_the_range_in_balanced_waves(threads):
    for nbytes in [1, 1000, tensors.MIN_PIECE_BYTES, 3 * tensors.MIN_PIECE_BYTES + 5, 94_699_520, 1_351_096_320]:
        parts = pieces(nbytes, threads, tensors.PIECE_BYTES)
        assert [start for start, _ in parts] == [sum(n for _, n in parts[:i]) for i in range(len(parts))]
        assert sum(n for _, n in parts) == nbytes
        assert max(n for _, n in parts) <= tensors.PIECE_BYTES
        assert len({n for _, n in parts[:-1]}) <= 1  # all the same size but the last (which is at most that)
        if nbytes >= threads * tensors.MIN_PIECE_BYTES:
            assert len(parts) % threads == 0  # whole waves: every thread reads as much
        if nbytes < tensors.MIN_PIECE_BYTES:
            assert len(parts) == 1


def test_tensor_reader_reads_exactly_the_range(tmp_path, tiny_reads):
    data = np.random.default_rng(0).integers(0, 256, 300_001, dtype=np.uint8).tobytes()
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    reader = TensorReader("cpu")
    rng = random.Random(0)
    for _ in range(50):
        offset = rng.randrange(len(data))
        nbytes = rng.randrange(1, len(data) - offset + 1)
        got = reader.read(str(path), offset, nbytes, "t")
        assert got.dtype == torch.uint8 and got.device.type == "cpu"
        assert got.numpy().tobytes() == data[offset : offset + nbytes]
    reader.close()


class StandInEvent:
    """A CUDA event's part in the staged reads, on the CPU: recorded after a slot's copy, waited on before
    the slot is read into again."""

    def __init__(self):
        self.pending = False

    def record(self, stream=None):
        self.pending = True

    def synchronize(self):
        self.pending = False


def test_staged_reads_wait_for_each_slot_and_deliver_the_bytes(tmp_path, tiny_reads, monkeypatch):
    """The GPU path's bookkeeping (slots in turn, reads in flight, a slot read into only after its copy's event)
    run on the CPU with plain slots and stand-in events: the copies are synchronous here, so the bytes check
    the order of the pieces and the events check that no slot is overwritten before its copy is done."""
    data = np.random.default_rng(1).integers(0, 256, 200_003, dtype=np.uint8).tobytes()
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    reader = TensorReader("cpu")
    staging = torch.empty(2 * reader.threads * reader.piece_bytes, dtype=torch.uint8)
    reader.slots = list(staging.split(reader.piece_bytes))
    reader.copied = [StandInEvent() for _ in reader.slots]
    slot_of = {slot.data_ptr(): i for i, slot in enumerate(reader.slots)}
    read_piece = tensors._read_piece

    def checked_read(fd, target, *args):
        assert not reader.copied[slot_of[target.ctypes.data]].pending
        read_piece(fd, target, *args)

    monkeypatch.setattr(tensors, "_read_piece", checked_read)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    rng = random.Random(0)
    for _ in range(100):
        offset = rng.randrange(len(data))
        nbytes = rng.randrange(1, len(data) - offset + 1)
        out = torch.empty(nbytes, dtype=torch.uint8)
        with open(path, "rb") as f:
            reader._read_staged(out, f.fileno(), str(path), "t", offset, nbytes)
        assert out.numpy().tobytes() == data[offset : offset + nbytes]
    with pytest.raises(CheckpointError, match=r"blob\.bin: tensor 't' is truncated: expected 10000 bytes"):
        with open(path, "rb") as f:
            reader._read_staged(torch.empty(10_000, dtype=torch.uint8), f.fileno(), str(path), "t", len(data) - 100,
                                10_000)
    reader.close()


def test_a_read_past_the_end_of_the_file_names_the_tensor(tmp_path, tiny_reads):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(10_000))
    with pytest.raises(CheckpointError, match=r"short\.bin: tensor 'blk\.0\.x' is truncated: expected 20000 bytes at "
                                              r"offset 100, the file has 9900 \(file size 10000\)"):
        TensorReader("cpu").read(str(path), 100, 20_000, "blk.0.x")


@pytest.mark.parametrize("file", GGUF_FILES)
def test_tensors_equal_the_gguf_package_reader(oracle_dir, file, tiny_reads):
    """Every tensor as read here against the gguf reader's view of the mapped file: our header walk finds the
    same offsets, types and shapes, and the split reads deliver the same bytes."""
    checkpoint = open_checkpoint(oracle_dir / file)
    reader = TensorReader("cpu")
    for t in gguf.GGUFReader(oracle_dir / file).tensors:
        ours = checkpoint.source.read(t.name, reader)
        raw = np.asarray(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            blocks = raw.reshape(raw.shape[0], -1, Q8_BLOCK_BYTES)
            assert np.array_equal(ours.d.numpy(), blocks[..., :2].copy().view(np.float16).reshape(ours.d.shape)), t.name
            assert np.array_equal(ours.q.numpy(), blocks[..., 2:].copy().view(np.int8).reshape(ours.q.shape)), t.name
        else:
            assert bits(ours).numpy().tobytes() == raw.tobytes(), t.name
            assert tuple(ours.shape) == tuple(int(n) for n in reversed(t.shape)), t.name
    reader.close()


@pytest.mark.parametrize("source", ["builtin", "hf", *GGUF_FILES])
def test_loaded_weights_do_not_depend_on_the_split_of_the_reads(oracle_dir, source, request):
    path = default_model.default_model_path() if source == "builtin" else oracle_dir / source
    whole = buffers(Qwen38ForCausalLM.from_pretrained(path, device="cpu"))
    request.getfixturevalue("tiny_reads")
    assert_same_buffers(whole, buffers(Qwen38ForCausalLM.from_pretrained(path, device="cpu")))


def test_loading_releases_the_reader(oracle_dir):
    checkpoint = open_checkpoint(oracle_dir / "mini-q8_0.gguf")
    with checkpoint.loading():
        checkpoint.load("token_embd", None, "cpu", torch.float32, None)
        assert checkpoint.reader is not None
    assert checkpoint.reader is None and checkpoint.unchecked is None


# ---- the header -----------------------------------------------------------------------------------------

def every_value_type_gguf(path) -> None:
    """A GGUF (no tensors) with a key of every value type and an array of every item type, strings with
    multi-byte characters and empty ones among them."""
    V = gguf.GGUFValueType
    writer = gguf.GGUFWriter(path, "qwen35")
    scalars = {V.UINT8: 255, V.INT8: -128, V.UINT16: 65535, V.INT16: -32768, V.UINT32: 2**32 - 1, V.INT32: -2**31,
               V.FLOAT32: 0.1, V.BOOL: True, V.UINT64: 2**64 - 1, V.INT64: -2**63, V.FLOAT64: 1e-300}
    for kind, value in scalars.items():
        writer.add_key_value(f"test.{kind.name}", value, kind)
        writer.add_key_value(f"test.array.{kind.name}", [value, value], V.ARRAY, kind)
    writer.add_key_value("test.string", "Ġhé 🙂", V.STRING)
    writer.add_key_value("test.array.STRING", ["", "a b", "Ġhé", "🙂" * 50, ""], V.ARRAY, V.STRING)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("file", [*GGUF_FILES, "every-type.gguf"])
def test_header_equals_the_gguf_package_reader(oracle_dir, tmp_path, file):
    path = oracle_dir / file
    if file == "every-type.gguf":
        path = tmp_path / file
        every_value_type_gguf(path)
    header = read_header(str(path))
    reader = gguf.GGUFReader(path)
    expected = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert list(header.metadata) == list(expected)
    for key, value in expected.items():
        got = header.metadata[key]
        assert got == value and type(got) is type(value), key
        if isinstance(value, list):
            assert [type(v) for v in got] == [type(v) for v in value], key
    assert [(t.name, t.dims, t.ggml_type, header.data_start + t.offset, t.nbytes) for t in header.tensors] == \
        [(t.name, [int(n) for n in t.shape], t.tensor_type, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]


def test_a_bad_string_in_a_long_array_is_named(tmp_path):
    """The tight loop over a string array hands the first string that does not decode to the checked reader,
    which names it."""
    path = tmp_path / "v.gguf"
    tokens, token_types, merges = load_bench.real_size_vocabulary(3000, 2000)
    writer = gguf.GGUFWriter(path, "qwen35")
    load_bench.add_tokenizer_metadata(writer, tokens, token_types, merges)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray(path.read_bytes())
    raw = tokens[1234].encode()
    position = data.index(struct.pack("<Q", len(raw)) + raw) + 8
    data[position] = 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"v\.gguf: item 1234 of metadata key 'tokenizer\.ggml\.tokens' at offset "
                                              rf"{position - 8} is not UTF-8 \(byte 0: invalid start byte\)"):
        read_header(str(path))


# ---- the benchmark's CPU dry run -------------------------------------------------------------------------

def test_load_benchmark_small_runs_on_the_cpu(tmp_path, capsys):
    first = load_bench.main(["--small", "--path", str(tmp_path), "--json", str(tmp_path / "load.json"),
                             "--repeats", "1"])
    assert first["written"] and first["device"] == "cpu"
    saved = json.loads((tmp_path / "load.json").read_text())
    for key in ("env", "file_bytes", "warm_read", "page_cache_read", "mmap_sum", "loads", "best", "gbps",
                "page_cache_ratio", "mmap_ratio"):
        assert key in saved, key
    assert saved["best"]["vocab"] > load_bench.SMALL_VOCAB_MERGES
    assert saved["file_bytes"] == os.path.getsize(saved["file"])
    second = load_bench.main(["--small", "--path", str(tmp_path), "--repeats", "1"])
    assert not second["written"]  # the file is reused while it matches the plan
    assert "load + tokenizer:" in capsys.readouterr().out


def test_load_benchmark_file_is_a_loadable_checkpoint(tmp_path):
    path, _ = load_bench.checkpoint_file(tmp_path, load_bench.SMALL, load_bench.real_size_vocabulary(
        load_bench.SMALL_VOCAB_TOKENS, load_bench.SMALL_VOCAB_MERGES), "small.gguf")
    model = Qwen38ForCausalLM.from_pretrained(path, device="cpu")
    assert model.config.num_layers == load_bench.SMALL.num_layers
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


# ---- on the GPU (`-m cuda`) --------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("split", ["default", "tiny"])
@pytest.mark.parametrize("source", ["builtin", *GGUF_FILES])
def test_gpu_load_equals_cpu_load_bit_for_bit(oracle_dir, source, split, request):
    """Staged reads, asynchronous copies and the device-side Q8_0 split give the CPU load's bytes."""
    path = default_model.default_model_path() if source == "builtin" else oracle_dir / source
    on_cpu = buffers(Qwen38ForCausalLM.from_pretrained(path, device="cpu", dtype=torch.float32))
    if split == "tiny":
        request.getfixturevalue("tiny_reads")
    on_gpu = Qwen38ForCausalLM.from_pretrained(path, device="cuda", dtype=torch.float32)
    assert_same_buffers(on_cpu, buffers(on_gpu))


@pytest.mark.cuda
def test_gpu_load_raises_the_first_non_finite_weight(oracle_dir, tmp_path):
    """The deferred check reports what the immediate one does (test_checkpoint_errors runs it on the CPU)."""
    src = oracle_dir / "mini-q8_0.gguf"
    info = next(t for t in gguf.GGUFReader(src).tensors if t.name == "blk.3.attn_q.weight")
    path = tmp_path / "inf.gguf"
    shutil.copy(src, path)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(int(info.data_offset) + 34 * 9)  # the 10th block's fp16 scale
        f.write(np.float16(np.inf).tobytes())
    message = r"inf\.gguf: tensor 'blk\.3\.attn_q\.weight' holds 1 non-finite Q8_0 block scales .* at flat index 9"
    for device in ("cpu", "cuda"):
        with pytest.raises(CheckpointError, match=message):
            Qwen38ForCausalLM.from_pretrained(path, device=device)
