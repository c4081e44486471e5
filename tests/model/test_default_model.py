"""The built-in default model: built once, its GGUF the HF folder beside it quantized, loadable by transformers,
with an MTP block and greedy chat replies that say something. Its cache (issue 10): a killed first build
leaves a .building-* folder, removed once stale; an emptied or damaged model folder is rebuilt, not a
permanent failure; a cache path that cannot be a folder is one clear error."""
import os
import pathlib
import time

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch

from qwen38_model import Qwen38Error, default_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN38_CACHE", str(tmp_path))
    return tmp_path


def test_stale_builds_are_removed_fresh_ones_kept(cache):
    stale, fresh = cache / ".building-killed", cache / ".building-running"
    for folder in (stale, fresh):
        (folder / "hf").mkdir(parents=True)
    old = time.time() - default_model.STALE_BUILD_SECONDS - 60
    os.utime(stale, (old, old))
    path = default_model.default_model_path()
    assert path.is_file()
    assert sorted(p.name for p in cache.iterdir()) == [".building-running", path.parent.name]


def test_an_incomplete_model_folder_is_rebuilt(cache):
    final = cache / f"synthetic-default-v{default_model.DEFAULT_MODEL_VERSION}"
    final.mkdir()  # empty: it used to be taken as the model, failing every later load
    path = default_model.default_model_path()
    assert all((final / name).is_file() for name in default_model.DEFAULT_MODEL_FILES)
    (final / "hf" / "model.safetensors").unlink()  # damaged later
    assert default_model.default_model_path() == path and (final / "hf" / "model.safetensors").is_file()
    assert [p.name for p in cache.iterdir()] == [final.name]


def test_a_cache_path_that_is_a_file(tmp_path, monkeypatch):
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    monkeypatch.setenv("QWEN38_CACHE", str(blocker))
    with pytest.raises(Qwen38Error, match=rf"cannot build the built-in model in {blocker} \(File exists: .*\); set "
                                          r"QWEN38_CACHE to a writable folder"):
        default_model.default_model_path()


def test_the_suite_builds_nothing_in_the_users_cache():
    """conftest points QWEN38_CACHE at a temporary folder for the whole run (and the commands it starts)."""
    root = default_model.default_model_dir().parent
    assert pathlib.Path.home() / ".cache" / "qwen38" not in (root, *root.parents), root


def test_default_model_is_built_once_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN38_CACHE", str(tmp_path))
    path = default_model.default_model_path()
    assert path.is_file() and path.parent.parent == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == [path.parent.name]  # no temporary folder left
    built_at = path.stat().st_mtime_ns
    assert default_model.default_model_path() == path and path.stat().st_mtime_ns == built_at

    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["general.architecture"] == "qwen35" and fields["general.file_type"] == 7
    # 8 trunk layers, then the MTP layer as block 8 (the converter's layout)
    assert fields["qwen35.embedding_length"] == 256 and fields["qwen35.block_count"] == 9
    assert fields["qwen35.nextn_predict_layers"] == 1
    assert fields["qwen35.ssm.group_count"] == 2 and fields["qwen35.ssm.time_step_rank"] == 6
    assert len(fields["tokenizer.ggml.tokens"]) % 32 == 0
    # Q8_0: per GDN layer qkv, gate, beta, alpha, out; per attention layer q, k, v, output; 3 FFN
    # matrices each; embeddings and head; the MTP layer's attention and FFN and its eh_proj. The rest (norms,
    # conv, ssm_a, dt bias) stays F32.
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert sum(t == gguf.GGMLQuantizationType.Q8_0 for t in types.values()) == 6 * 8 + 2 * 7 + 2 + 8
    assert set(types.values()) == {gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32}

    # The GGUF is the HF folder beside it, quantized: Q8_0 costs well under 1% per weight matrix.
    hf = safetensors.torch.load_file(default_model.default_hf_path() / "model.safetensors")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    dequantized = torch.from_numpy(gguf.quants.dequantize(np.asarray(embed.data), embed.tensor_type))
    reference = hf["model.embed_tokens.weight"].float()
    assert (dequantized - reference).norm() / reference.norm() < 1e-2


def test_default_hf_folder_loads_in_transformers(tmp_path, monkeypatch):
    from transformers import Qwen3_5ForCausalLM
    monkeypatch.setenv("QWEN38_CACHE", str(tmp_path))
    _, info = Qwen3_5ForCausalLM.from_pretrained(default_model.default_hf_path(), output_loading_info=True)
    assert not any(info.values())


def test_default_model_has_an_mtp_block_and_greedy_chat_replies_say_something():
    """The built-in model is what `make demo` and a first `qwen38 chat` run: --speculative mtp must work on it,
    and a greedy chat reply must not be empty (its random head used to rank <|im_end|> first after most chat
    prompts)."""
    import qwen38_model

    llm = qwen38_model.load(device="cpu")
    assert llm.model.mtp is not None
    for message in ("Hello", "The quick brown fox", "What is 2+2?", "Bonjour", "a", "Why is the sky blue?"):
        assert llm.chat([{"role": "user", "content": message}], max_new_tokens=16).strip(), message
    ids = torch.tensor([llm.tokenizer.encode("The quick brown fox")])
    plain = llm.model.generate(ids, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(llm.model.generate(ids, max_new_tokens=12, eos_token_id=[], speculative="mtp"), plain)
