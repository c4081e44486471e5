"""Synthetic checkpoints: the GGUF converter (convert.py) against llama.cpp's own output, the random HF folders
(synthetic.py) against transformers."""
import json
import pathlib

import gguf
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from qwen38_model import convert, synthetic

# Small enough to be quick, with Hv/Hk = 3 (value-head reorder), GQA and 2 attention layers.
SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "head_dim": 16,
         "linear_key_head_dim": 16, "linear_value_head_dim": 16, "full_attention_interval": 2}
Q8_0_BLOCK_BYTES = 34  # fp16 scale + 32 int8


def read_gguf(path):
    reader = gguf.GGUFReader(path)
    return reader, {name: field.contents() for name, field in reader.fields.items()}


def differing_q8_0_blocks(ours: np.ndarray, theirs: np.ndarray) -> int:
    blocks_a, blocks_b = ours.reshape(-1, Q8_0_BLOCK_BYTES), theirs.reshape(-1, Q8_0_BLOCK_BYTES)
    return int((blocks_a != blocks_b).any(axis=1).sum())


def load_hf(hf_dir: pathlib.Path) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(hf_dir / "model.safetensors")


@pytest.fixture(scope="module")
def small_checkpoints(tmp_path_factory):
    """The same seed in every form: text, text in 3 shards, VLM, VLM in 2 shards."""
    root = tmp_path_factory.mktemp("synthetic")
    forms = {"text": ("text", 1), "text-sharded": ("text", 3), "vlm": ("vlm", 1), "vlm-sharded": ("vlm", 2)}
    return {key: synthetic.write_hf_checkpoint(root / key, SMALL, seed=7, form=form, num_shards=shards)
            for key, (form, shards) in forms.items()}


# --------------------------------------------------------------------------------------------------
# hf_to_gguf against the GGUFs llama.cpp's converter wrote from the oracle's hf/ folder
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["f32", "q8_0", "bf16"])
def test_hf_to_gguf_reproduces_llama_cpp(oracle_dir, tmp_path, qtype):
    # --model-name as the oracle was converted, so even the general.* keys are comparable.
    ours_path = convert.hf_to_gguf(oracle_dir / "hf", tmp_path / "ours.gguf", qtype,
                                     model_name="qwen35-oracle-mini")
    ours, ours_fields = read_gguf(ours_path)
    theirs, their_fields = read_gguf(oracle_dir / f"mini-{qtype}.gguf")

    assert list(ours_fields) == list(their_fields)  # same keys, same order
    for key, value in their_fields.items():
        assert ours_fields[key] == value, key

    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, list(a.shape)) == (b.tensor_type, list(b.shape)), a.name
        data_a, data_b = np.asarray(a.data), np.asarray(b.data)
        if a.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            assert differing_q8_0_blocks(data_a, data_b) == 0, a.name
        else:  # F32 / BF16: the f32 arithmetic (+1, -exp, reorder) is reproduced bit for bit
            assert np.array_equal(data_a.view(np.uint8), data_b.view(np.uint8)), a.name

    assert ours_path.read_bytes() == (oracle_dir / f"mini-{qtype}.gguf").read_bytes()


# --------------------------------------------------------------------------------------------------
# hf_to_gguf conventions, checked against formulas written out here
# --------------------------------------------------------------------------------------------------

def test_gguf_conventions_on_a_synthetic_checkpoint(small_checkpoints, tmp_path):
    hf_dir = small_checkpoints["text"]
    reader, fields = read_gguf(convert.hf_to_gguf(hf_dir, tmp_path / "m.gguf", "f32"))
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    hf = load_hf(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    Hk, Hv, dv = config["linear_num_key_heads"], config["linear_num_value_heads"], config["linear_value_head_dim"]
    qk_rows = 2 * Hk * config["linear_key_head_dim"]
    # GGUF value head p holds HF value head h(p) = (p mod Hk) * r + p // Hk (grouped -> tiled order).
    h_of_p = [(p % Hk) * (Hv // Hk) + p // Hk for p in range(Hv)]
    rows = np.concatenate([np.arange(h * dv, (h + 1) * dv) for h in h_of_p])

    layer = "model.layers.0."
    np.testing.assert_array_equal(tensors["blk.0.ssm_a"], -np.exp(hf[layer + "linear_attn.A_log"][h_of_p]
                                                                  .astype(np.float64)).astype(np.float32))
    np.testing.assert_array_equal(tensors["blk.0.ssm_dt.bias"], hf[layer + "linear_attn.dt_bias"][h_of_p])
    np.testing.assert_array_equal(tensors["blk.0.ssm_beta.weight"], hf[layer + "linear_attn.in_proj_b.weight"][h_of_p])
    np.testing.assert_array_equal(tensors["blk.0.attn_gate.weight"], hf[layer + "linear_attn.in_proj_z.weight"][rows])
    qkv = hf[layer + "linear_attn.in_proj_qkv.weight"]
    np.testing.assert_array_equal(tensors["blk.0.attn_qkv.weight"],
                                  np.concatenate([qkv[:qk_rows], qkv[qk_rows:][rows]]))
    conv = hf[layer + "linear_attn.conv1d.weight"][:, 0, :]
    np.testing.assert_array_equal(tensors["blk.0.ssm_conv1d.weight"],
                                  np.concatenate([conv[:qk_rows], conv[qk_rows:][rows]]))
    np.testing.assert_array_equal(tensors["blk.0.ssm_out.weight"], hf[layer + "linear_attn.out_proj.weight"][:, rows])
    np.testing.assert_array_equal(tensors["blk.0.ssm_norm.weight"], hf[layer + "linear_attn.norm.weight"])
    np.testing.assert_array_equal(tensors["blk.0.attn_norm.weight"], hf[layer + "input_layernorm.weight"] + 1)
    np.testing.assert_array_equal(tensors["blk.1.attn_q_norm.weight"], hf["model.layers.1.self_attn.q_norm.weight"] + 1)
    np.testing.assert_array_equal(tensors["blk.1.attn_q.weight"], hf["model.layers.1.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(tensors["output_norm.weight"], hf["model.norm.weight"] + 1)

    assert fields["qwen35.attention.recurrent_layers"] == [True, False, True, False]
    assert fields["qwen35.full_attention_interval"] == 2
    assert fields["qwen35.rope.dimension_count"] == 4  # 16 * 0.25
    assert fields["qwen35.ssm.inner_size"] == Hv * dv
    # Tokenizer: 5 added tokens (3 special, <think> and </think> not), padding up to vocab_size.
    types = fields["tokenizer.ggml.token_type"]
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == len(types) == config["vocab_size"] == 512
    assert [(tokens[i], types[i]) for i in range(496, 503)] == [
        ("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4), ("</think>", 4),
        ("[PAD501]", 5), ("[PAD502]", 5)]
    assert fields["tokenizer.ggml.eos_token_id"] == tokens.index("<|im_end|>")
    assert fields["tokenizer.ggml.padding_token_id"] == tokens.index("<|endoftext|>")
    assert fields["tokenizer.chat_template"] == synthetic.SYNTHETIC_CHAT_TEMPLATE


def test_vlm_form_converts_like_text_form(small_checkpoints, tmp_path):
    """model.language_model.* renamed, model.visual.* and mtp.* dropped (--no-mtp), shards joined."""
    files = {key: convert.hf_to_gguf(path, tmp_path / f"{key}.gguf", "q8_0", model_name="same")
             for key, path in small_checkpoints.items()}
    reference = files["text"].read_bytes()
    for key, path in files.items():
        assert path.read_bytes() == reference, key


def test_q8_0_falls_back_to_f16_for_rows_not_a_multiple_of_32(tmp_path):
    odd = {**SMALL, "hidden_size": 48, "num_hidden_layers": 2}
    hf_dir = synthetic.write_hf_checkpoint(tmp_path / "hf", odd, dtype=torch.float16)
    reader, _ = read_gguf(convert.hf_to_gguf(hf_dir, tmp_path / "m.gguf", "q8_0"))
    matrices = {t.name: t for t in reader.tensors if len(t.shape) == 2 and "conv1d" not in t.name}
    for name, t in matrices.items():  # ne0 (t.shape[0]) is the row length that Q8_0 blocks split
        expected = gguf.GGMLQuantizationType.Q8_0 if t.shape[0] % 32 == 0 else gguf.GGMLQuantizationType.F16
        assert t.tensor_type == expected, name
    assert {t.tensor_type for t in matrices.values()} == {gguf.GGMLQuantizationType.Q8_0,
                                                          gguf.GGMLQuantizationType.F16}


# --------------------------------------------------------------------------------------------------
# write_hf_checkpoint
# --------------------------------------------------------------------------------------------------

def test_every_form_loads_in_transformers_as_the_same_model(small_checkpoints):
    from transformers import Qwen3_5ForCausalLM
    ids = torch.tensor([[3, 100, 257, 499, 42, 7, 300, 12, 9, 480]])
    logits = {}
    for key, path in small_checkpoints.items():
        model, info = Qwen3_5ForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
        assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(),
                        "error_msgs": []}, key
        with torch.no_grad():
            logits[key] = model(ids).logits
    assert 0.3 < logits["text"].std() < 3  # O(1) logits
    for key, value in logits.items():
        assert torch.equal(value, logits["text"]), key


def test_every_parameter_is_randomized(small_checkpoints):
    weights = load_hf(small_checkpoints["text"])
    for name, value in weights.items():
        assert value.std() > 0.05, name
    norm = weights["model.layers.0.input_layernorm.weight"]
    assert -0.3 <= norm.min() and norm.max() <= 0.3 and abs(norm.mean()) < 0.1  # zero-centred, used as 1 + w
    gated = weights["model.layers.0.linear_attn.norm.weight"]
    assert 0.7 <= gated.min() and gated.max() <= 1.3


def test_config_json(small_checkpoints):
    text = json.loads((small_checkpoints["text"] / "config.json").read_text())
    assert text["model_type"] == "qwen3_5_text" and text["architectures"] == ["Qwen3_5ForCausalLM"]
    assert text["layer_types"] == ["linear_attention", "full_attention"] * 2
    vlm = json.loads((small_checkpoints["vlm"] / "config.json").read_text())
    assert vlm["model_type"] == "qwen3_5" and vlm["text_config"]["model_type"] == "qwen3_5_text"
    assert {k: v for k, v in vlm["text_config"].items() if not k.startswith("mtp_")} == \
        {k: v for k, v in text.items() if k != "architectures"}


def test_same_seed_same_bytes(tmp_path):
    def files(path):
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}

    a = synthetic.write_hf_checkpoint(tmp_path / "a", SMALL, seed=3, dtype=torch.bfloat16, num_shards=2)
    b = synthetic.write_hf_checkpoint(tmp_path / "b", SMALL, seed=3, dtype=torch.bfloat16, num_shards=2)
    c = synthetic.write_hf_checkpoint(tmp_path / "c", SMALL, seed=4, dtype=torch.bfloat16, num_shards=2)
    assert files(a) == files(b)
    assert files(a)["model-00001-of-00002.safetensors"] != files(c)["model-00001-of-00002.safetensors"]
    ga = convert.hf_to_gguf(a, tmp_path / "a.gguf", "q8_0", model_name="m")
    gb = convert.hf_to_gguf(b, tmp_path / "b.gguf", "q8_0", model_name="m")
    assert ga.read_bytes() == gb.read_bytes()
