"""Seeded fuzzing of the metadata no tensor check reads (issue 24, items 5 and 6). Mutated copies of the
oracle's GGUF files and HF folder must each end in a CheckpointError (ConfigError) that names the file and
the key or tensor and says what was expected, or load and give the original logits bit for bit:

- GGUF: qwen35.attention.value_length, rope.dimension_sections and general.file_type given other values
  (16, 0, a string, short or long lists, sections that leave a rotated pair uncovered), and every qwen35 key
  the loader reads stored with another value type than llama.cpp's loader reads (a uint32 count as int32).
- HF: tie_word_embeddings true over a stored lm_head.weight.
- safetensors: a list or object as a dtype, a __metadata__ that is not a string-to-string map, and the
  dtypes safetensors 0.8 defines (F4, F6_*, F8_E8M0, C64) on an unused tensor (tolerated: same logits).

Every case is a pure function of (SEED, class, case number): a failure names them and the mutation."""
import json
import random
import shutil

import gguf
import pytest
import torch

from qwen38_model import CheckpointError, Qwen38ForCausalLM

from gguf_copies import join_safetensors, rewrite_gguf, split_safetensors

SEED = 20261224
CASES = 40
PROMPT = torch.tensor([[1, 7, 42, 300]])
V = gguf.GGUFValueType


def logits(path) -> torch.Tensor:
    return Qwen38ForCausalLM.from_pretrained(path, device="cpu")(PROMPT).logits


def outcome(path, names: tuple[str, ...], ref: torch.Tensor, description: str) -> str:
    """'error' (a CheckpointError naming the file, one of names, and 'expected') or 'same'; else it fails."""
    try:
        model = Qwen38ForCausalLM.from_pretrained(path, device="cpu")
    except CheckpointError as e:
        message = str(e)
        assert str(path) in message, f"{description}: the error does not name {path}: {message}"
        assert any(n in message for n in names), f"{description}: the error names none of {names}: {message}"
        assert "expected" in message, f"{description}: the error says nothing expected: {message}"
        return "error"
    except Exception as e:  # noqa: BLE001 (the point: nothing but CheckpointError may escape)
        pytest.fail(f"{description}: {type(e).__name__} instead of a CheckpointError: {e}")
    out = model(PROMPT).logits
    assert torch.equal(out, ref), f"{description}: loaded, but with other logits"
    return "same"


# ---- GGUF ---------------------------------------------------------------------------------------------

SECTIONS = "qwen35.rope.dimension_sections"


def mutate_metadata(meta: dict, types: dict, rng: random.Random) -> dict:
    kind = rng.choice(["value_length", "sections", "file_type", "type"])
    if kind == "value_length":
        value = rng.choice([0, 16, 31, 33, 64, 2**32 - 1, "32"])
        return {"qwen35.attention.value_length": (value, V.STRING if isinstance(value, str) else V.UINT32, None)}
    if kind == "sections":
        value = rng.choice([[11, 11, 10], [11, 11, 10, 0, 0], [0, 0, 0, 0], [0, 11, 10, 0], [11, 0, 10, 0],
                            [1, 1, 1, 0], [11, 11, 10, 0], [-1, 11, 10, 0], [2**31 - 1, 11, 10, 0], [1, 1, 0, 0],
                            [11.0, 11.0, 10.0, 0.0], "11,11,10,0", 32])
        if isinstance(value, str):
            return {SECTIONS: (value, V.STRING, None)}
        if isinstance(value, int):
            return {SECTIONS: (value, V.INT32, None)}
        item = V.FLOAT32 if isinstance(value[0], float) else rng.choice([V.INT32, V.UINT32, V.INT64])
        if item == V.UINT32 and min(value) < 0:
            item = V.INT32
        return {SECTIONS: (value, V.ARRAY, item)}
    if kind == "file_type":
        value = rng.choice([0, 1, 7, 32, 2, 15, 38, 1024, 99, 2**32 - 1, "7"])
        value_type = V.STRING if isinstance(value, str) else rng.choice([V.UINT32, V.UINT32, V.INT32, V.UINT64])
        if value_type == V.INT32 and value >= 2**31:
            value_type = V.UINT32
        return {"general.file_type": (value, value_type, None)}
    key = rng.choice(sorted(k for k in meta if k.startswith("qwen35.") or k in ("general.file_type",
                                                                             "general.quantization_version")))
    value_type, item_type = types[key]
    if value_type == V.ARRAY:
        others = [t for t in (V.INT32, V.UINT32, V.INT64, V.UINT8, V.BOOL) if t != item_type]
        if item_type == V.INT32:
            others.remove(V.UINT32)  # both are llama.cpp's integer arrays
        return {key: (meta[key], V.ARRAY, rng.choice(others))}
    others = {V.UINT32: [V.INT32, V.UINT64, V.INT64, V.UINT16], V.FLOAT32: [V.FLOAT64]}.get(value_type, [V.UINT32])
    return {key: (meta[key], rng.choice(others), None)}


@pytest.mark.parametrize("qtype", ["q8_0", "f32"])
def test_fuzzed_gguf_arch_metadata(oracle_dir, tmp_path, qtype):
    src = oracle_dir / f"mini-{qtype}.gguf"
    reader, ref = gguf.GGUFReader(src), logits(src)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    meta = {k: f.contents() for k, f in fields.items()}
    types = {k: (f.types[0], f.types[-1] if f.types[0] == V.ARRAY else None) for k, f in fields.items()}
    path = tmp_path / "meta.gguf"
    tally = {}
    for case in range(CASES):
        rng = random.Random(f"{SEED}:gguf:{qtype}:{case}")
        changes = mutate_metadata(meta, types, rng)
        description = f"SEED {SEED} gguf {qtype} case {case}: {changes}"
        rewrite_gguf(src, path, changes)
        result = outcome(path, tuple(changes), ref, description)
        tally[result] = tally.get(result, 0) + 1
    print(f"{qtype}: {tally}")
    assert tally.get("error", 0) > CASES // 2


# ---- HF -------------------------------------------------------------------------------------------------

NEW_DTYPES = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "F8_E8M0": 8, "C64": 64}


def mutate_hf(header: dict, body: bytes, config: dict, rng: random.Random):
    """(description, header, body, config, names the error may give)."""
    header, config = json.loads(json.dumps(header)), dict(config)
    kind = rng.choice(["dtype", "metadata", "new dtype", "tied head"])
    names = [n for n in header if n != "__metadata__"]
    if kind == "dtype":
        name = rng.choice(names)
        header[name]["dtype"] = rng.choice([[header[name]["dtype"]], {"dtype": header[name]["dtype"]}, None, 16,
                                            True, ["F32", "BF16"], {}])
        return f"dtype of {name} -> {header[name]['dtype']!r}", header, body, config, (name,)
    if kind == "metadata":
        value = rng.choice([{"format": 1}, {"format": None}, {"format": ["pt"]}, ["pt"], "pt", 7, {"a": {"b": "c"}},
                            {"format": "pt"}, None, {}])
        header["__metadata__"] = value
        return f"__metadata__ -> {value!r}", header, body, config, ("__metadata__",)
    if kind == "new dtype":  # an unused tensor (vision tower) of a dtype we never read: tolerated
        dtype = rng.choice(sorted(NEW_DTYPES))
        count = rng.choice([8, 16, 24]) if NEW_DTYPES[dtype] % 8 else rng.choice([1, 3, 8])
        nbytes = count * NEW_DTYPES[dtype] // 8
        header[f"model.visual.blocks.0.w_{dtype}"] = {"dtype": dtype, "shape": [count],
                                                      "data_offsets": [len(body), len(body) + nbytes]}
        return f"unused {dtype} tensor of {count} values", header, body + bytes(nbytes), config, ("model.visual",)
    # tied head: tie_word_embeddings true while lm_head.weight is stored (as it is in the oracle)
    config["tie_word_embeddings"] = True
    return "tie_word_embeddings true over a stored lm_head.weight", header, body, config, ("lm_head.weight",)


def test_fuzzed_hf_metadata(oracle_dir, tmp_path):
    src = oracle_dir / "hf"
    ref = logits(src)
    header, body = split_safetensors((src / "model.safetensors").read_bytes())
    config = json.loads((src / "config.json").read_text())
    folder = tmp_path / "hf"
    tally = {}
    for case in range(CASES):
        rng = random.Random(f"{SEED}:hf:{case}")
        description, h, b, c, names = mutate_hf(header, body, config, rng)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(src, folder)
        (folder / "model.safetensors").chmod(0o644)
        (folder / "config.json").chmod(0o644)
        (folder / "model.safetensors").write_bytes(join_safetensors(h, b))
        (folder / "config.json").write_text(json.dumps(c))
        result = outcome(folder, names, ref, f"SEED {SEED} hf case {case}: {description}")
        tally[result] = tally.get(result, 0) + 1
        if description.startswith("unused"):
            assert result == "same", f"SEED {SEED} hf case {case}: {description} was refused"
    print(f"hf: {tally}")
    assert tally.get("error", 0) > CASES // 3 and tally.get("same", 0) > 0
