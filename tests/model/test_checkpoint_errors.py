"""Bad input gets our CheckpointError naming the file, the tensor or key and expected vs found: never a
crash, a hang, or a silently wrong model. One section per class of malformed input (issue 10);
test_fuzz_checkpoints.py throws random mutations of the same kinds at the loader."""
import json
import os
import pathlib
import re
import shutil
import struct
import threading

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen38_model import CheckpointError, ConfigError, Qwen38ForCausalLM

REPO = pathlib.Path(__file__).resolve().parents[2]


def load(path):
    return Qwen38ForCausalLM.from_pretrained(path, device="cpu")


def reader_position(reader: gguf.GGUFReader, part: np.ndarray) -> int:
    """File offset of one part (a numpy view of the mapped file) of a reader field."""
    return part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]


def metadata_position(path, key: str, part: int = -1) -> int:
    reader = gguf.GGUFReader(path)
    return reader_position(reader, reader.fields[key].parts[part])


def tensor_position(path, name: str, field: str) -> int:
    """File offset of a tensor directory field: name_len, name, n_dims, dims, type or offset."""
    reader = gguf.GGUFReader(path)
    info = next(t for t in reader.tensors if t.name == name).field
    index = ["name_len", "name", "n_dims", "dims", "type", "offset"].index(field)
    return reader_position(reader, info.parts[index])


def tensor_data_position(path, name: str) -> int:
    return int(next(t for t in gguf.GGUFReader(path).tensors if t.name == name).data_offset)


def patched_copy(src, dst, offset: int, data: bytes):
    shutil.copy(src, dst)
    os.chmod(dst, 0o644)
    with open(dst, "r+b") as f:
        f.seek(offset)
        f.write(data)
    return dst


def relabelled(src, dst, name: str, ggml_type: str):
    """A copy of src whose tensor `name` claims another ggml type (its directory entry only, not its bytes)."""
    return patched_copy(src, dst, tensor_position(src, name, "type"), u32(gguf.GGMLQuantizationType[ggml_type]))


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def u64(value: int) -> bytes:
    return struct.pack("<Q", value)


# --------------------------------------------------------------------------------------------------------
# GGUF header: every count and length bounded by the file, every field named with its offset
# --------------------------------------------------------------------------------------------------------

def test_truncated_gguf(oracle_dir, tmp_path):
    data = (oracle_dir / "mini-q8_0.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: tensor '.*' is truncated: it ends at byte \d+, the file "
                                              r"has \d+"):
        load(path)


def test_truncated_gguf_header(oracle_dir, tmp_path):
    data = (oracle_dir / "mini-q8_0.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:5000])  # inside the token list
    with pytest.raises(CheckpointError, match=r"cut\.gguf: the array length of metadata key 'tokenizer\.ggml\.tokens' "
                                              r"is 512, but 512 of them need at least 4096 bytes and the file has \d+ "
                                              r"left"):
        load(path)


def test_wrong_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(CheckpointError, match=r"model\.gguf: not a GGUF file \(magic b'GGML'"):
        load(path)


def test_garbage_after_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(CheckpointError, match=r"model\.gguf: GGUF version 50462976, supported: 2, 3"):
        load(path)


def test_big_endian_gguf(oracle_dir, tmp_path):
    path = patched_copy(oracle_dir / "mini-f32.gguf", tmp_path / "be.gguf", 4, struct.pack(">I", 3))
    with pytest.raises(CheckpointError, match=r"be\.gguf: GGUF version field 0x3000000: a big-endian file"):
        load(path)


@pytest.mark.parametrize("field,offset", [("tensor count", 8), ("metadata key count", 16)])
def test_extreme_counts_fail_before_any_loop(oracle_dir, tmp_path, field, offset):
    path = patched_copy(oracle_dir / "mini-f32.gguf", tmp_path / "count.gguf", offset, u64(2**62))
    with pytest.raises(CheckpointError, match=rf"count\.gguf: the {field} is {2**62}, but .* need at least \d+ bytes "
                                              r"and the file has \d+ left"):
        load(path)


def test_huge_array_length_fails_at_once(oracle_dir, tmp_path):
    """An array length of 2^62 ran for minutes into a MemoryError in the gguf reader."""
    src = oracle_dir / "mini-f32.gguf"
    path = patched_copy(src, tmp_path / "array.gguf", metadata_position(src, "tokenizer.ggml.tokens", 4), u64(2**62))
    with pytest.raises(CheckpointError, match=rf"array\.gguf: the array length of metadata key "
                                              rf"'tokenizer\.ggml\.tokens' is {2**62}"):
        load(path)
    src_type = metadata_position(src, "tokenizer.ggml.token_type", 4)  # an array of int32: 4 * 2^62 bytes
    path = patched_copy(src, tmp_path / "ints.gguf", src_type, u64(2**62))
    with pytest.raises(CheckpointError, match=r"ints\.gguf: array of metadata key 'tokenizer\.ggml\.token_type' at "
                                              rf"offset \d+ needs {4 * 2**62} bytes"):
        load(path)


def test_huge_string_length(oracle_dir, tmp_path):
    src = oracle_dir / "mini-f32.gguf"
    path = patched_copy(src, tmp_path / "s.gguf", metadata_position(src, "general.name", 3), u64(2**64 - 1))
    with pytest.raises(CheckpointError, match=r"s\.gguf: string value of metadata key 'general\.name' at offset \d+ "
                                              rf"needs {2**64 - 1} bytes"):
        load(path)


def test_invalid_utf8_in_metadata(oracle_dir, tmp_path):
    src = oracle_dir / "mini-f32.gguf"
    path = patched_copy(src, tmp_path / "utf8.gguf", metadata_position(src, "general.name", 4), b"\xff\xfe")
    with pytest.raises(CheckpointError, match=r"utf8\.gguf: string value of metadata key 'general\.name' at offset "
                                              r"\d+ is not UTF-8 \(byte 0: invalid start byte\)"):
        load(path)
    key = metadata_position(src, "general.type", 1)
    path = patched_copy(src, tmp_path / "key.gguf", key, b"\xc0")
    with pytest.raises(CheckpointError, match=r"key\.gguf: metadata key #\d+ at offset \d+ is not UTF-8"):
        load(path)


def test_unknown_and_nested_value_types(oracle_dir, tmp_path):
    src = oracle_dir / "mini-f32.gguf"
    path = patched_copy(src, tmp_path / "t.gguf", metadata_position(src, "general.name", 2), u32(13))
    with pytest.raises(CheckpointError, match=r"t\.gguf: metadata key 'general\.name' has value type 13, not a GGUF "
                                              r"type"):
        load(path)
    path = patched_copy(src, tmp_path / "n.gguf", metadata_position(src, "tokenizer.ggml.tokens", 3),
                        u32(gguf.GGUFValueType.ARRAY))
    with pytest.raises(CheckpointError, match=r"n\.gguf: metadata key 'tokenizer\.ggml\.tokens' is an array of type "
                                              r"9, expected a scalar or string type"):
        load(path)


def test_duplicate_metadata_key(oracle_dir, tmp_path):
    src = oracle_dir / "mini-f32.gguf"
    path = patched_copy(src, tmp_path / "dup.gguf", metadata_position(src, "general.type", 1), b"general.name")
    with pytest.raises(CheckpointError, match=r"dup\.gguf: metadata key 'general\.name' appears twice"):
        load(path)


def test_bad_alignment(oracle_dir, tmp_path):
    src = oracle_dir / "mini-f32.gguf"
    reader = gguf.GGUFReader(src)
    name = reader.fields["general.file_type"]  # a uint32 key of 17 bytes: rename it to general.alignment
    assert bytes(name.parts[1]) == b"general.file_type"
    shutil.copy(src, tmp_path / "a.gguf")
    with open(tmp_path / "a.gguf", "r+b") as f:
        f.seek(reader_position(reader, name.parts[0]))
        f.write(u64(17) + b"general.alignment" + u32(gguf.GGUFValueType.UINT32) + u32(48))
    with pytest.raises(CheckpointError, match=r"a\.gguf: general\.alignment must be a uint32 power of two, found type 4 "
                                              r"value 48"):
        load(tmp_path / "a.gguf")


def test_tensor_info_limits(oracle_dir, tmp_path):
    src = oracle_dir / "mini-f32.gguf"
    name = "blk.0.ssm_norm.weight"
    path = patched_copy(src, tmp_path / "dims.gguf", tensor_position(src, name, "n_dims"), u32(9))
    with pytest.raises(CheckpointError, match=r"dims\.gguf: tensor 'blk\.0\.ssm_norm\.weight' has 9 dimensions, at most 4"):
        load(path)
    path = patched_copy(src, tmp_path / "ne.gguf", tensor_position(src, "output.weight", "dims"), u64(2**62))
    with pytest.raises(CheckpointError, match=r"ne\.gguf: tensor 'output\.weight' has dimensions .* more than int64"):
        load(path)
    path = patched_copy(src, tmp_path / "type.gguf", tensor_position(src, name, "type"), u32(1000))
    with pytest.raises(CheckpointError, match=r"type\.gguf: tensor 'blk\.0\.ssm_norm\.weight' has ggml type 1000, not "
                                              r"a ggml type"):
        load(path)
    path = relabelled(src, tmp_path / "block.gguf", "blk.1.ssm_a", "Q8_0")
    with pytest.raises(CheckpointError, match=r"block\.gguf: tensor 'blk\.1\.ssm_a' of ggml type Q8_0 has rows of 6 "
                                              r"values, not a multiple of its block of 32"):
        load(path)


# --------------------------------------------------------------------------------------------------------
# GGUF tensor directory: tensors tile the data section (llama.cpp's rule)
# --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change", ["near 2^64", "+1", "0", "next"])
def test_tensor_offsets(oracle_dir, tmp_path, change):
    src = oracle_dir / "mini-q8_0.gguf"
    reader = gguf.GGUFReader(src)
    i = 20
    tensor, following = reader.tensors[i], reader.tensors[i + 1]
    offset = tensor.data_offset - reader.data_offset
    value = {"near 2^64": 2**64 - reader.data_offset + 64, "+1": offset + 1, "0": 0,
             "next": following.data_offset - reader.data_offset}[change]
    path = patched_copy(src, tmp_path / "off.gguf", tensor_position(src, tensor.name, "offset"), u64(value))
    with pytest.raises(CheckpointError, match=rf"off\.gguf: tensor '{tensor.name}' starts at data offset {value}, "
                                              rf"expected {offset}: the previous tensor '.*' \(.*\) ends there"):
        load(path)


@pytest.mark.parametrize("new_type", ["F32", "F16", "BF16"])
def test_q8_0_relabelled(oracle_dir, tmp_path, new_type):
    """Relabelled, the tensor's bytes no longer fill its slot: the next tensor's offset gives it away."""
    src = oracle_dir / "mini-q8_0.gguf"
    name = "blk.0.ffn_up.weight"
    path = relabelled(src, tmp_path / "r.gguf", name, new_type)
    with pytest.raises(CheckpointError, match=rf"r\.gguf: tensor '.*' starts at data offset \d+, expected \d+: the "
                                              rf"previous tensor '{name}' \({new_type}, ne \[128, 320\]"):
        load(path)


def test_f32_relabelled_f16(oracle_dir, tmp_path):
    src = oracle_dir / "mini-f32.gguf"
    path = relabelled(src, tmp_path / "r.gguf", "output.weight", "F16")
    with pytest.raises(CheckpointError, match=r"r\.gguf: .*the previous tensor 'output\.weight' \(F16"):
        load(path)


def test_small_tensor_relabelled_within_its_padding(oracle_dir, tmp_path):
    """ssm_a [6] is 24 bytes as F32, 12 as BF16: both fit the 32-byte padded slot (found by the fuzz test)."""
    src = oracle_dir / "mini-f32.gguf"
    path = relabelled(src, tmp_path / "r.gguf", "blk.1.ssm_a", "BF16")
    with pytest.raises(CheckpointError, match=r"r\.gguf: tensor 'blk\.1\.ssm_a' has ggml type BF16, expected F32"):
        load(path)


def test_unsupported_ggml_type(oracle_dir, tmp_path):
    src = oracle_dir / "mini-f32.gguf"
    name = "blk.0.ffn_up.weight"  # as I32 the same dims fill the same bytes, so the file parses
    path = relabelled(src, tmp_path / "i32.gguf", name, "I32")
    with pytest.raises(CheckpointError, match=r"i32\.gguf: tensor 'blk\.0\.ffn_up\.weight' has ggml type I32"):
        load(path)


def test_bytes_after_the_last_tensor(oracle_dir, tmp_path):
    path = tmp_path / "long.gguf"
    path.write_bytes((oracle_dir / "mini-f32.gguf").read_bytes() + bytes(4096))
    with pytest.raises(CheckpointError, match=r"long\.gguf: \d+ bytes follow the last tensor 'output_norm\.weight'"):
        load(path)


# --------------------------------------------------------------------------------------------------------
# The tensor set matches the config exactly
# --------------------------------------------------------------------------------------------------------

def test_missing_tensor_gguf(oracle_dir, tmp_path):
    src = oracle_dir / "mini-f32.gguf"
    path = patched_copy(src, tmp_path / "m.gguf", tensor_position(src, "blk.2.ssm_a", "name"), b"blk.2.ssm_X")
    with pytest.raises(CheckpointError, match=r"m\.gguf: missing tensor 'blk\.2\.ssm_a'"):
        load(path)


def test_block_count_smaller_than_the_layers_stored(oracle_dir, tmp_path):
    """block_count = 1 silently ignored blocks 1-7."""
    src = oracle_dir / "mini-q8_0.gguf"
    path = patched_copy(src, tmp_path / "b.gguf", metadata_position(src, "qwen35.block_count"), u32(1))
    with pytest.raises(CheckpointError, match=r"b\.gguf: \d+ tensors are not part of the model its config describes "
                                              r"\(1 layers, attention at \[\]\): 'blk\.1\."):
        load(path)


def test_nextn_predict_layers_without_mtp_tensors(oracle_dir, tmp_path):
    """nextn_predict_layers = 1 over 8 blocks makes blk.7 the MTP block: it must have MTP tensors."""
    writer = gguf.GGUFWriter(tmp_path / "n.gguf", "qwen35")
    copy_gguf(gguf.GGUFReader(oracle_dir / "mini-q8_0.gguf"), writer, extra={"qwen35.nextn_predict_layers": (1, gguf.GGUFValueType.UINT32)})
    with pytest.raises(CheckpointError, match=r"n\.gguf: blk\.7 is an MTP block by qwen35\.nextn_predict_layers "
                                              r"\(7 layers and 1 MTP block\(s\).*no 'blk\.7\.nextn\.eh_proj\.weight'"):
        load(tmp_path / "n.gguf")


def copy_gguf(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, extra: dict) -> None:
    """Rewrite a GGUF with extra or replaced metadata: key -> (value, GGUFValueType); tensors as they are."""
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in extra:
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type)
    for key, (value, value_type) in extra.items():
        sub_type = gguf.GGUFValueType.UINT32 if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, value_type, sub_type)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_copy_gguf_round_trips(oracle_dir, tmp_path):
    """The helper above writes a loadable file: the errors it is used for come from the extra key."""
    writer = gguf.GGUFWriter(tmp_path / "same.gguf", "qwen35")
    copy_gguf(gguf.GGUFReader(oracle_dir / "mini-q8_0.gguf"), writer, extra={})
    assert torch.equal(load(tmp_path / "same.gguf")(torch.tensor([[1, 2]])).logits,
                       load(oracle_dir / "mini-q8_0.gguf")(torch.tensor([[1, 2]])).logits)


@pytest.fixture
def hf_copy(oracle_dir, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(oracle_dir / "hf", folder)
    for f in folder.iterdir():
        os.chmod(f, 0o644)
    return folder


def rewrite_weights(folder, change):
    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, folder / "model.safetensors")


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_missing_tensor_hf(hf_copy):
    rewrite_weights(hf_copy, lambda w: w.pop("model.layers.1.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"hf: missing tensor 'model\.layers\.1\.linear_attn\.A_log'"):
        load(hf_copy)


def test_hf_layers_beyond_num_hidden_layers(hf_copy):
    edit_config(hf_copy, num_hidden_layers=4, layer_types=json.loads((hf_copy / "config.json").read_text())
                ["layer_types"][:4])
    with pytest.raises(CheckpointError, match=r"hf: \d+ tensors are not part of the model its config describes "
                                              r"\(4 layers, attention at \[3\]\): 'model\.layers\.4\."):
        load(hf_copy)


def test_hf_layer_kind_disagrees_with_tensors(hf_copy):
    kinds = json.loads((hf_copy / "config.json").read_text())["layer_types"]
    edit_config(hf_copy, layer_types=["full_attention"] + kinds[1:])
    with pytest.raises(CheckpointError, match=r"hf: missing tensor 'model\.layers\.0\.self_attn\.q_proj\.weight'"):
        load(hf_copy)


def test_untied_hf_without_lm_head(hf_copy):
    rewrite_weights(hf_copy, lambda w: w.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"hf: missing tensor 'lm_head\.weight'"):
        load(hf_copy)


def test_wrong_shape_hf(hf_copy):
    def shrink(w):
        w["model.layers.3.self_attn.k_proj.weight"] = w["model.layers.3.self_attn.k_proj.weight"][:-1].clone()

    rewrite_weights(hf_copy, shrink)
    with pytest.raises(CheckpointError, match=r"k_proj.weight'.*shape \(63, 128\), expected \(64, 128\)"):
        load(hf_copy)


# --------------------------------------------------------------------------------------------------------
# safetensors headers (the safetensors library's rules)
# --------------------------------------------------------------------------------------------------------

def rewrite_header(folder, change):
    data = (folder / "model.safetensors").read_bytes()
    (length,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + length])
    change(header)
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])
    return header


def test_truncated_safetensors(hf_copy):
    data = (hf_copy / "model.safetensors").read_bytes()
    (hf_copy / "model.safetensors").write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor '.*' is truncated"):
        load(hf_copy)


def test_overlapping_data_offsets(hf_copy):
    def overlap(header):
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
        b = header[names[4]]  # moved 4 bytes back into names[3]'s data
        b["data_offsets"] = [b["data_offsets"][0] - 4, b["data_offsets"][1] - 4]

    rewrite_header(hf_copy, overlap)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor '.*' has data_offsets \[\d+, \d+\]: the "
                                              r"previous tensor '.*' ends at \d+ \(tensors must not overlap"):
        load(hf_copy)


def test_reversed_and_oversized_offsets(hf_copy):
    name = "model.norm.weight"
    header = rewrite_header(hf_copy, lambda h: h[name].update(data_offsets=h[name]["data_offsets"][::-1]))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight': data_offsets must be \[begin, end\] "
                                              r"with 0 <= begin <= end"):
        load(hf_copy)
    begin = header[name]["data_offsets"][1]
    rewrite_header(hf_copy, lambda h: h[name].update(data_offsets=[begin, begin + 2 * 128 + 2]))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight': data_offsets .* span 258 bytes, but dtype "
                                              r"BF16 and shape \[128\] need 256"):
        load(hf_copy)


def test_bad_safetensors_headers(hf_copy):
    data = (hf_copy / "model.safetensors").read_bytes()
    (hf_copy / "model.safetensors").write_bytes(u64(2**63) + data[8:])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a safetensors file \(header length "):
        load(hf_copy)
    raw = b"[1, 2, 3]"
    (hf_copy / "model.safetensors").write_bytes(u64(len(raw)) + raw)
    with pytest.raises(CheckpointError, match=r"header is a JSON list, not an object"):
        load(hf_copy)
    (hf_copy / "model.safetensors").write_bytes(data)
    rewrite_header(hf_copy, lambda h: h["model.norm.weight"].update(dtype="F3"))  # F4 is a dtype (safetensors 0.6+)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight': unknown dtype 'F3'"):
        load(hf_copy)
    (hf_copy / "model.safetensors").write_bytes(data + b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"64 bytes after the last tensor's data that no tensor covers"):
        load(hf_copy)


# --------------------------------------------------------------------------------------------------------
# NaN / infinite weights
# --------------------------------------------------------------------------------------------------------

def test_nan_in_an_lm_head_row(oracle_dir, tmp_path):
    """One NaN in a row of the head made that row's token win forever."""
    src = oracle_dir / "mini-f32.gguf"
    position = tensor_data_position(src, "output.weight") + 4 * (128 * 17 + 5)  # row 17, column 5
    path = patched_copy(src, tmp_path / "nan.gguf", position, struct.pack("<f", float("nan")))
    with pytest.raises(CheckpointError, match=r"nan\.gguf: tensor 'output\.weight' holds 1 non-finite values \(NaN or "
                                              rf"infinity\), the first nan at flat index {128 * 17 + 5}"):
        load(path)


def test_infinite_q8_0_scale(oracle_dir, tmp_path):
    src = oracle_dir / "mini-q8_0.gguf"
    position = tensor_data_position(src, "blk.3.attn_q.weight") + 34 * 9  # the 10th block's fp16 scale
    path = patched_copy(src, tmp_path / "inf.gguf", position, np.float16(np.inf).tobytes())
    with pytest.raises(CheckpointError, match=r"inf\.gguf: tensor 'blk\.3\.attn_q\.weight' holds 1 non-finite Q8_0 "
                                              r"block scales .* the first inf at flat index 9"):
        load(path)


def test_infinite_hf_norm(hf_copy):
    rewrite_weights(hf_copy, lambda w: w["model.layers.2.input_layernorm.weight"].__setitem__(3, float("-inf")))
    with pytest.raises(CheckpointError, match=r"hf: tensor 'model\.layers\.2\.input_layernorm\.weight' holds 1 non-finite "
                                              r"values"):
        load(hf_copy)


# --------------------------------------------------------------------------------------------------------
# Config values: types, ranges, no division by zero, no unbounded counts
# --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value,message", [
    ("rms_norm_eps", 1e30, r"rms_norm_eps must be in \(0, 0\.01\], found 1e\+30"),
    ("rms_norm_eps", float("inf"), r"rms_norm_eps must be a finite number, found inf"),
    ("tie_word_embeddings", "no", r"tie_word_embeddings must be true or false, found 'no'"),
    ("max_position_embeddings", -1, r"max_position_embeddings must be an integer in \[1, 2147483647\], found -1"),
    ("max_position_embeddings", 0, r"max_position_embeddings must be an integer in \[1, 2147483647\], found 0"),
    ("max_position_embeddings", "x", r"max_position_embeddings must be an integer .* found 'x'"),
    ("hidden_size", "128", r"hidden_size must be an integer .* found '128'"),
    ("hidden_size", None, r"hidden_size must be an integer .* found None"),
    ("hidden_size", 128.0, r"hidden_size must be an integer .* found 128\.0"),
    ("num_attention_heads", 0, r"num_attention_heads must be an integer in \[1, "),
    ("num_hidden_layers", 10**9, r"num_hidden_layers must be an integer in \[1, 1024\], found 1000000000"),
    ("layer_types", "linear", r"layer_types must be a list of num_hidden_layers = 8 entries, found 'linear'"),
    ("layer_types", [1] * 8, r"unknown layer_types \['1'\]"),
    ("rope_parameters", [1], r"rope_parameters must be an object"),
    ("eos_token_id", 512, None),  # generation_config.json decides; tested below
])
def test_nonsense_hf_config_values(hf_copy, key, value, message):
    edit_config(hf_copy, **{key: value})
    if message is None:
        load(hf_copy)
        return
    with pytest.raises(ConfigError, match=rf"hf/config\.json: .*{message}|inconsistent model config in .*hf/config\.json: "
                                          rf"{message}"):
        load(hf_copy)


def test_full_attention_interval_zero(hf_copy):
    config = json.loads((hf_copy / "config.json").read_text())
    del config["layer_types"]
    config["full_attention_interval"] = 0
    (hf_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"full_attention_interval must be an integer in \[1, "):
        load(hf_copy)


def test_config_json_not_an_object(hf_copy):
    (hf_copy / "config.json").write_text("[]")
    with pytest.raises(ConfigError, match=r"hf/config\.json: expected a JSON object, found list"):
        load(hf_copy)
    (hf_copy / "config.json").write_text("[" * 100000)
    with pytest.raises(CheckpointError, match=r"hf/config\.json: not valid JSON \(RecursionError"):
        load(hf_copy)


def test_eos_outside_the_vocabulary(hf_copy):
    (hf_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [500, 512]}))
    with pytest.raises(ConfigError, match=r"end-of-sequence ids \[512\] outside the vocabulary \[0, 512\)"):
        load(hf_copy)
    (hf_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": -1}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id must be a token id or a list"):
        load(hf_copy)


@pytest.mark.parametrize("key,value,message", [
    ("qwen35.block_count", 2**32 - 1, r"qwen35\.block_count must be an integer in \[1, 1024\], found 4294967295"),
    ("qwen35.full_attention_interval", 0, r"qwen35\.full_attention_interval must be an integer in \[1, "),
    ("qwen35.ssm.time_step_rank", 0, r"qwen35\.ssm\.time_step_rank must be an integer in \[1, "),
    ("qwen35.attention.head_count", 0, r"qwen35\.attention\.head_count must be an integer in \[1, "),
    ("qwen35.attention.layer_norm_rms_epsilon", float("inf"),
     r"qwen35\.attention\.layer_norm_rms_epsilon must be a finite number, found inf"),
    ("qwen35.rope.freq_base", float("nan"), r"qwen35\.rope\.freq_base must be a finite number, found nan"),
])
def test_nonsense_gguf_metadata(oracle_dir, tmp_path, key, value, message):
    src = oracle_dir / "mini-f32.gguf"
    data = struct.pack("<f", value) if isinstance(value, float) else u32(value)
    path = patched_copy(src, tmp_path / "meta.gguf", metadata_position(src, key), data)
    with pytest.raises(ConfigError, match=rf"meta\.gguf: {message}"):
        load(path)


def test_mistyped_gguf_metadata(oracle_dir, tmp_path):
    """block_count = [8] raised a TypeError."""
    writer = gguf.GGUFWriter(tmp_path / "typed.gguf", "qwen35")
    copy_gguf(gguf.GGUFReader(oracle_dir / "mini-f32.gguf"), writer,
              extra={"qwen35.block_count": ([8], gguf.GGUFValueType.ARRAY)})
    with pytest.raises(ConfigError, match=r"typed\.gguf: qwen35\.block_count must be an integer in \[1, 1024\], "
                                          r"found \[8\]"):
        load(tmp_path / "typed.gguf")


def test_wrong_arch(oracle_dir, tmp_path):
    src = oracle_dir / "mini-f32.gguf"
    path = patched_copy(src, tmp_path / "llama.gguf", metadata_position(src, "general.architecture"), b"qwen99")
    with pytest.raises(ConfigError, match=r"llama\.gguf: general.architecture is 'qwen99', expected 'qwen35'"):
        load(path)


def test_inconsistent_heads(hf_copy):
    edit_config(hf_copy, num_key_value_heads=3)  # 4 query heads cannot be grouped over 3 KV heads
    with pytest.raises(ConfigError, match="num_attention_heads 4 is not a multiple of num_key_value_heads 3"):
        load(hf_copy)


def test_unknown_model_type(hf_copy):
    edit_config(hf_copy, model_type="llama")
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        load(hf_copy)


# --------------------------------------------------------------------------------------------------------
# Files: confined to the checkpoint folder, regular files only
# --------------------------------------------------------------------------------------------------------

def shard(hf_copy, shard_name):
    (hf_copy / "model.safetensors").rename(hf_copy / "model-00001-of-00001.safetensors")
    names = load_file(hf_copy / "model-00001-of-00001.safetensors")
    weight_map = dict.fromkeys(names, "model-00001-of-00001.safetensors")
    weight_map["lm_head.weight"] = shard_name
    (hf_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("shard_name", ["/etc/passwd", "../outside.safetensors", "sub/../../outside.safetensors"])
def test_shard_index_cannot_leave_the_folder(hf_copy, shard_name):
    (hf_copy.parent / "outside.safetensors").write_text("secret")
    shard(hf_copy, shard_name)
    with pytest.raises(CheckpointError, match=rf"hf: refusing shard '{shard_name}': not a plain name inside the "
                                              r"checkpoint folder") as error:
        load(hf_copy)
    assert "root:" not in str(error.value) and "secret" not in str(error.value)


def test_symlink_out_of_the_folder_is_refused(hf_copy):
    (hf_copy.parent / "outside.safetensors").write_text("secret")
    os.symlink(hf_copy.parent / "outside.safetensors", hf_copy / "evil.safetensors")
    shard(hf_copy, "evil.safetensors")
    with pytest.raises(CheckpointError, match=r"hf: refusing shard 'evil\.safetensors': it resolves to .*outside\."
                                              r"safetensors, outside the checkpoint folder"):
        load(hf_copy)


def test_hugging_face_cache_snapshot_symlinks_load(oracle_dir, tmp_path):
    """The hub cache keeps files in blobs/ and symlinks them from snapshots/<revision>/: that is allowed."""
    repo = tmp_path / "models--org--mini"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for f in (oracle_dir / "hf").iterdir():
        shutil.copy(f, repo / "blobs" / f"hash-{f.name}")
        os.symlink(f"../../blobs/hash-{f.name}", snapshot / f.name)
    assert torch.equal(load(snapshot)(torch.tensor([[1, 2]])).logits, load(oracle_dir / "hf")(torch.tensor([[1, 2]])).logits)


def test_fifo_is_refused_without_blocking(oracle_dir, tmp_path):
    """open() on a FIFO blocks until a writer comes: the loader must stat first."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    folder = tmp_path / "hf"
    shutil.copytree(oracle_dir / "hf", folder)
    os.remove(folder / "config.json")
    os.mkfifo(folder / "config.json")
    errors = []

    def attempt():
        for path in (fifo, folder):
            try:
                load(path)
            except CheckpointError as e:
                errors.append(str(e))

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the loader blocked on a FIFO"
    assert errors[0] == f"{fifo}: not a regular file (the checkpoint file must be one; found a FIFO)"
    assert errors[1] == f"{folder / 'config.json'}: not a regular file (the file must be one; found a FIFO)"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_permission_denied(oracle_dir, tmp_path):
    path = tmp_path / "locked.gguf"
    shutil.copy(oracle_dir / "mini-f32.gguf", path)
    os.chmod(path, 0)
    with pytest.raises(CheckpointError, match=r"locked\.gguf: cannot read the checkpoint file \(Permission denied\)"):
        load(path)


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or folder"):
        load(tmp_path / "nope.gguf")


# --------------------------------------------------------------------------------------------------------
# Nothing executes code from a checkpoint
# --------------------------------------------------------------------------------------------------------

class Payload:
    """Unpickling this runs os.system: a pickle-based loader would create the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_checkpoints_are_never_unpickled(oracle_dir, tmp_path):
    folder = tmp_path / "pt"
    folder.mkdir()
    shutil.copy(oracle_dir / "hf" / "config.json", folder / "config.json")
    marker = tmp_path / "pwned"
    torch.save({"model.embed_tokens.weight": Payload(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pt: no model\.safetensors or model\.safetensors\.index\.json"):
        load(folder)
    assert not marker.exists()


def test_no_code_execution_paths_in_the_package():
    """No pickle (torch.load, pickle), no eval/exec of checkpoint text, templates only in the sandbox."""
    forbidden = re.compile(r"torch\.load\(|\bpickle\b|(?<![.\w])(eval|exec)\(|jinja2\.(Environment|Template)\(")
    for path in (REPO / "qwen38_model").rglob("*.py"):
        found = forbidden.search(path.read_text())
        assert found is None, f"{path} uses {found.group()}"


def test_chat_template_is_sandboxed(oracle_dir):
    from qwen38_model.errors import ChatTemplateError
    from qwen38_model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(oracle_dir / "hf")
    tokenizer.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError, match=r"chat template: access to attribute '__class__' of 'str' object is "
                                                 r"unsafe"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_token_ids(oracle_dir):
    model = load(oracle_dir / "mini-q8_0.gguf")
    with pytest.raises(ValueError, match=r"token id 512 out of range \[0, 512\)"):
        model(torch.tensor([[1, 512]]))
