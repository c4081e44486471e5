"""Bad input gets our CheckpointError naming the file, the tensor and expected vs found: never a crash,
a hang, or a silently wrong model."""
import json
import shutil

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen38_model import CheckpointError, ConfigError, Qwen38ForCausalLM


def tensor_info_offset(path, name: str) -> int:
    """File offset of a tensor's ggml-type field in the GGUF tensor directory."""
    info = next(t for t in gguf.GGUFReader(path).tensors if t.name == name).field
    n_dims = int(info.parts[2][0])
    return info.offset + 8 + len(name) + 4 + 8 * n_dims


def patched_copy(src, dst, offset: int, data: bytes):
    shutil.copy(src, dst)
    with open(dst, "r+b") as f:
        f.seek(offset)
        f.write(data)
    return dst


def test_truncated_gguf(oracle_dir, tmp_path):
    data = (oracle_dir / "mini-q8_0.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(CheckpointError, match=r"cut\.gguf.*truncated"):
        Qwen38ForCausalLM.from_pretrained(path, device="cpu")


def test_wrong_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(CheckpointError, match=r"model\.gguf: not a GGUF file \(magic b'GGML'"):
        Qwen38ForCausalLM.from_pretrained(path, device="cpu")


def test_garbage_after_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(CheckpointError, match=r"model\.gguf: not a readable GGUF file"):
        Qwen38ForCausalLM.from_pretrained(path, device="cpu")


def test_wrong_arch(oracle_dir, tmp_path):
    src = oracle_dir / "mini-f32.gguf"
    field = gguf.GGUFReader(src).fields["general.architecture"]
    value_offset = field.offset + sum(len(p.tobytes()) for p in field.parts[:-1])
    path = patched_copy(src, tmp_path / "llama.gguf", value_offset, b"qwen99")
    with pytest.raises(ConfigError, match=r"llama\.gguf: general.architecture is 'qwen99', expected 'qwen35'"):
        Qwen38ForCausalLM.from_pretrained(path, device="cpu")


def test_missing_tensor_gguf(oracle_dir, tmp_path):
    src = oracle_dir / "mini-f32.gguf"
    info = next(t for t in gguf.GGUFReader(src).tensors if t.name == "blk.2.ssm_a").field
    path = patched_copy(src, tmp_path / "m.gguf", info.offset + 8, b"blk.2.ssm_X")
    with pytest.raises(CheckpointError, match=r"m\.gguf: missing tensor 'blk\.2\.ssm_a'"):
        Qwen38ForCausalLM.from_pretrained(path, device="cpu")


def test_unsupported_ggml_type(oracle_dir, tmp_path):
    src = oracle_dir / "mini-f32.gguf"
    name = "blk.0.ssm_norm.weight"  # 32 floats; as Q4_0 the same dims need fewer bytes, so the file parses
    offset = tensor_info_offset(src, name)
    path = patched_copy(src, tmp_path / "q4.gguf", offset, int(gguf.GGMLQuantizationType.Q4_0).to_bytes(4, "little"))
    with pytest.raises(CheckpointError, match=r"q4\.gguf: tensor 'blk\.0\.ssm_norm\.weight' has ggml type Q4_0"):
        Qwen38ForCausalLM.from_pretrained(path, device="cpu")


@pytest.fixture
def hf_copy(oracle_dir, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(oracle_dir / "hf", folder)
    return folder


def rewrite_weights(folder, change):
    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, folder / "model.safetensors")


def test_missing_tensor_hf(hf_copy):
    rewrite_weights(hf_copy, lambda w: w.pop("model.layers.1.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"hf: missing tensor 'model\.layers\.1\.linear_attn\.A_log'"):
        Qwen38ForCausalLM.from_pretrained(hf_copy, device="cpu")


def test_wrong_shape_hf(hf_copy):
    def shrink(w):
        w["model.layers.3.self_attn.k_proj.weight"] = w["model.layers.3.self_attn.k_proj.weight"][:-1].clone()

    rewrite_weights(hf_copy, shrink)
    with pytest.raises(CheckpointError, match=r"'attn_k'.*shape \(63, 128\), expected \(64, 128\)|"
                                              r"k_proj.weight'.*shape \(63, 128\), expected \(64, 128\)"):
        Qwen38ForCausalLM.from_pretrained(hf_copy, device="cpu")


def test_truncated_safetensors(hf_copy):
    data = (hf_copy / "model.safetensors").read_bytes()
    (hf_copy / "model.safetensors").write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor '.*' is truncated"):
        Qwen38ForCausalLM.from_pretrained(hf_copy, device="cpu")


def test_inconsistent_heads(hf_copy):
    config = json.loads((hf_copy / "config.json").read_text())
    config["num_key_value_heads"] = 3  # 4 query heads cannot be grouped over 3 KV heads
    (hf_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="num_attention_heads 4 is not a multiple of num_key_value_heads 3"):
        Qwen38ForCausalLM.from_pretrained(hf_copy, device="cpu")


def test_unknown_model_type(hf_copy):
    config = json.loads((hf_copy / "config.json").read_text())
    config["model_type"] = "llama"
    (hf_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        Qwen38ForCausalLM.from_pretrained(hf_copy, device="cpu")


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or folder"):
        Qwen38ForCausalLM.from_pretrained(tmp_path / "nope.gguf", device="cpu")


def test_bad_token_ids(oracle_dir):
    model = Qwen38ForCausalLM.from_pretrained(oracle_dir / "mini-q8_0.gguf", device="cpu")
    with pytest.raises(ValueError, match=r"token id 512 out of range \[0, 512\)"):
        model(torch.tensor([[1, 512]]))
