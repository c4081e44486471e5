"""Synthetic Qwen3.5 checkpoints: random HF folders, a GGUF converter like llama.cpp's, a built-in default model.

- `write_hf_checkpoint` writes an HF folder (text-only `Qwen3_5ForCausalLM` form or the released VLM form)
  with every parameter randomized so that any convention mistake (norm offset, A_log sign, head order)
  shows in the logits, plus a small byte-level BPE tokenizer with Qwen3.5's pre-tokenizer and ChatML.
- `hf_to_gguf` converts such a folder the way llama.cpp's convert_hf_to_gguf.py does for
  `Qwen3_5TextModel`, with `--no-mtp` or (mtp=True) with the MTP block as `blk.{num_hidden_layers}`
  (tensor names, value-head reorder, +1 norms, -exp(A_log), output types, tensor order, metadata keys and
  order, tokenizer metadata). It holds the whole model in memory: meant for test-sized models.
- `default_model_path` builds (once, cached) a small but non-trivial model as an HF folder and a Q8_0 GGUF.
"""
from __future__ import annotations

import collections
import json
import os
import pathlib
import shutil
import tempfile
import time
import zlib
from typing import Any, Iterator

import gguf
import numpy as np
import safetensors
import safetensors.torch
import torch
from tokenizers import pre_tokenizers

from .errors import CheckpointError, Qwen38Error
from .tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNUSED, TOKEN_USER_DEFINED, byte_level_bpe

# ---------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------

# The built-in default model; `write_hf_checkpoint` fills keys missing from its text_config from here.
# Hv/Hk = 3 as in the 27B (so the value-head reorder matters), GQA 2, every input dim a multiple of 32
# (Q8_0 blocks), rotary 16 of 64 head dims (partial_rotary_factor 0.25 as in the 27B).
DEFAULT_TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                        "rope_theta": 10000000.0, "rope_type": "default"},
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "use_cache": True,
}

# Bumped whenever the default model's bytes would change, so stale caches are not reused.
DEFAULT_MODEL_VERSION = 2

_TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def full_text_config(text_config: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """text_config over the defaults, with vocab_size and layer_types filled in when absent."""
    config = {**DEFAULT_TEXT_CONFIG, "vocab_size": vocab_size, **text_config}
    interval = config["full_attention_interval"]
    config.setdefault("layer_types", ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                      for i in range(config["num_hidden_layers"])])
    return config


# ---------------------------------------------------------------------------------------------------------
# Random weights in HF naming
# ---------------------------------------------------------------------------------------------------------

# How a tensor is drawn: ("normal", std) or ("uniform", low, high).
ZERO_CENTRED_NORM = ("uniform", -0.3, 0.3)  # HF RMSNorm weight w, applied as 1 + w
GATED_NORM = ("uniform", 0.7, 1.3)          # GDN gated norm weight, applied as w
A_LOG = ("uniform", -3.0, 1.0)
DT_BIAS = ("uniform", -1.0, 1.0)


def _projection(fan_in: int) -> tuple:
    # std 1/sqrt(fan_in) keeps every activation, and so the logits, O(1).
    return ("normal", fan_in ** -0.5)


def _mlp_tensors(prefix: str, D: int, F: int) -> list[tuple[str, tuple[int, ...], tuple]]:
    return [(f"{prefix}mlp.gate_proj.weight", (F, D), _projection(D)),
            (f"{prefix}mlp.up_proj.weight", (F, D), _projection(D)),
            (f"{prefix}mlp.down_proj.weight", (D, F), _projection(F))]


def _attention_tensors(prefix: str, c: dict[str, Any]) -> list[tuple[str, tuple[int, ...], tuple]]:
    D, Hq, Hkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    return [(f"{prefix}self_attn.q_proj.weight", (2 * Hq * hd, D), _projection(D)),  # per head [query | gate]
            (f"{prefix}self_attn.k_proj.weight", (Hkv * hd, D), _projection(D)),
            (f"{prefix}self_attn.v_proj.weight", (Hkv * hd, D), _projection(D)),
            (f"{prefix}self_attn.o_proj.weight", (D, Hq * hd), _projection(Hq * hd)),
            (f"{prefix}self_attn.q_norm.weight", (hd,), ZERO_CENTRED_NORM),
            (f"{prefix}self_attn.k_norm.weight", (hd,), ZERO_CENTRED_NORM)]


def _gdn_tensors(prefix: str, c: dict[str, Any]) -> list[tuple[str, tuple[int, ...], tuple]]:
    D, K = c["hidden_size"], c["linear_conv_kernel_dim"]
    Hk, Hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    channels = 2 * Hk * dk + Hv * dv  # conv channels [q | k | v]
    p = f"{prefix}linear_attn."
    return [(f"{p}in_proj_qkv.weight", (channels, D), _projection(D)),
            (f"{p}in_proj_z.weight", (Hv * dv, D), _projection(D)),
            (f"{p}in_proj_b.weight", (Hv, D), _projection(D)),
            (f"{p}in_proj_a.weight", (Hv, D), _projection(D)),
            (f"{p}conv1d.weight", (channels, 1, K), _projection(K)),
            (f"{p}A_log", (Hv,), A_LOG),
            (f"{p}dt_bias", (Hv,), DT_BIAS),
            (f"{p}norm.weight", (dv,), GATED_NORM),
            (f"{p}out_proj.weight", (D, Hv * dv), _projection(Hv * dv))]


def _layer_tensors(prefix: str, c: dict[str, Any], layer_type: str) -> list[tuple[str, tuple[int, ...], tuple]]:
    D = c["hidden_size"]
    mixer = _attention_tensors(prefix, c) if layer_type == "full_attention" else _gdn_tensors(prefix, c)
    return ([(f"{prefix}input_layernorm.weight", (D,), ZERO_CENTRED_NORM),
             (f"{prefix}post_attention_layernorm.weight", (D,), ZERO_CENTRED_NORM)]
            + mixer + _mlp_tensors(prefix, D, c["intermediate_size"]))


def text_tensor_specs(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...], tuple]]:
    """(name, HF torch shape, distribution) of every text-model tensor, `model.*` naming."""
    D, V = c["hidden_size"], c["vocab_size"]
    specs = [("model.embed_tokens.weight", (V, D), ("normal", 1.0)),
             ("model.norm.weight", (D,), ZERO_CENTRED_NORM)]
    for i, layer_type in enumerate(c["layer_types"]):
        specs += _layer_tensors(f"model.layers.{i}.", c, layer_type)
    if not c["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (V, D), _projection(D)))
    return specs


def mtp_tensor_specs(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...], tuple]]:
    """The released checkpoints' one MTP block: fc, three norms, one full-attention layer."""
    D = c["hidden_size"]
    return ([("mtp.fc.weight", (D, 2 * D), _projection(2 * D)),
             ("mtp.pre_fc_norm_embedding.weight", (D,), ZERO_CENTRED_NORM),
             ("mtp.pre_fc_norm_hidden.weight", (D,), ZERO_CENTRED_NORM),
             ("mtp.norm.weight", (D,), ZERO_CENTRED_NORM)]
            + _layer_tensors("mtp.layers.0.", c, "full_attention"))


def visual_tensor_specs(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...], tuple]]:
    """A few stand-ins for the vision tower: text loaders must skip `model.visual.*`."""
    return [("model.visual.patch_embed.proj.weight", (16, 3, 2, 4, 4), _projection(96)),
            ("model.visual.blocks.0.norm1.weight", (16,), ("uniform", 0.7, 1.3)),
            ("model.visual.merger.linear_fc2.weight", (c["hidden_size"], 64), _projection(64))]


def random_tensor(name: str, shape: tuple[int, ...], distribution: tuple, seed: int) -> torch.Tensor:
    """float32 values that depend only on (seed, name): every form and shard layout holds the same model."""
    # One 32-bit hash of both: the CPU generator (mt19937) keeps only the low 32 bits of a seed.
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    if distribution[0] == "normal":
        return torch.randn(shape, generator=generator) * distribution[1]
    low, high = distribution[1:]
    return torch.rand(shape, generator=generator) * (high - low) + low


def random_weights(c: dict[str, Any], seed: int, form: str, mtp: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, float32, under its checkpoint name (the VLM form always has the MTP
    block, as released; the text form when mtp)."""
    weights = {}
    for name, shape, distribution in text_tensor_specs(c):
        # The released VLM keeps the text model under model.language_model.
        stored_name = name.replace("model.", "model.language_model.", 1) if form == "vlm" else name
        weights[stored_name] = random_tensor(name, shape, distribution, seed)
    extra = (visual_tensor_specs(c) if form == "vlm" else []) + (mtp_tensor_specs(c) if form == "vlm" or mtp else [])
    for name, shape, distribution in extra:
        weights[name] = random_tensor(name, shape, distribution, seed)
    return weights


# ---------------------------------------------------------------------------------------------------------
# HF folder
# ---------------------------------------------------------------------------------------------------------

def write_hf_checkpoint(path: str | os.PathLike, text_config: dict[str, Any], *, seed: int = 0,
                        dtype: torch.dtype = torch.float32, form: str = "text", num_shards: int = 1,
                        tokenizer: bool = True, mtp: bool = False) -> pathlib.Path:
    """Write a random Qwen3.5 checkpoint folder and return its path.

    text_config: HF text_config keys overriding DEFAULT_TEXT_CONFIG (vocab_size defaults to the synthetic
    tokenizer's size rounded up to a multiple of 32). form "text": `model.*` + `lm_head.weight`,
    model_type qwen3_5_text; form "vlm": the released layout (`model.language_model.*`, `model.visual.*`,
    `mtp.*`, model_type qwen3_5 with a text_config). mtp: the text form gets the MTP block too. Same seed,
    same bytes.
    """
    if form not in ("text", "vlm"):
        raise ValueError(f"form must be 'text' or 'vlm', not {form!r}")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    bpe, chat_template = synthetic_tokenizer()
    token_ids = _special_token_ids(bpe)
    config = full_text_config(text_config, _round_up(bpe.get_vocab_size(), 32))
    weights = {name: t.to(dtype) for name, t in random_weights(config, seed, form, mtp).items()}
    _write_safetensors(path, weights, num_shards)
    _write_json(path / "config.json", _config_json(config, dtype, form, token_ids, mtp))
    if tokenizer:
        _write_tokenizer_files(path, bpe, chat_template, token_ids)
    return path


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _special_token_ids(bpe) -> dict[str, int]:
    return {"endoftext": bpe.token_to_id("<|endoftext|>"), "im_end": bpe.token_to_id("<|im_end|>")}


def _text_config_json(config: dict[str, Any], dtype: torch.dtype, token_ids: dict[str, int]) -> dict[str, Any]:
    # The text model's eos is <|endoftext|>; chat turns end with <|im_end|> (generation_config), as released.
    return {"model_type": "qwen3_5_text", "dtype": _TORCH_DTYPE_NAMES[dtype], "bos_token_id": None,
            "eos_token_id": token_ids["endoftext"], "pad_token_id": None, **config}


MTP_CONFIG = {"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}  # as released


def _config_json(config: dict[str, Any], dtype: torch.dtype, form: str, token_ids: dict[str, int],
                 mtp: bool = False) -> dict:
    text = _text_config_json(config, dtype, token_ids)
    if form == "text":
        return {"architectures": ["Qwen3_5ForCausalLM"], **text, **(MTP_CONFIG if mtp else {})}
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "dtype": text["dtype"],
        "tie_word_embeddings": config["tie_word_embeddings"],
        "text_config": {**text, **MTP_CONFIG},
        # Placeholder: text loaders never build the vision tower.
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 16, "intermediate_size": 32,
                          "num_heads": 2, "in_channels": 3, "patch_size": 4, "temporal_patch_size": 2,
                          "spatial_merge_size": 2, "out_hidden_size": config["hidden_size"]},
    }


def _write_json(path: pathlib.Path, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False, sort_keys=True)
        f.write("\n")


def _write_safetensors(path: pathlib.Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    if num_shards == 1:
        safetensors.torch.save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        return
    names = sorted(weights)
    if not 1 < num_shards <= len(names):
        raise ValueError(f"num_shards must be between 1 and {len(names)}, not {num_shards}")
    bounds = [round(i * len(names) / num_shards) for i in range(num_shards + 1)]  # contiguous, near-equal
    weight_map = {}
    for i in range(num_shards):
        file_name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {name: weights[name] for name in names[bounds[i]:bounds[i + 1]]}
        safetensors.torch.save_file(shard, path / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    total_size = sum(t.numel() * t.element_size() for t in weights.values())
    _write_json(path / "model.safetensors.index.json",
                {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))})


# ---------------------------------------------------------------------------------------------------------
# Synthetic tokenizer
# ---------------------------------------------------------------------------------------------------------

# The text the synthetic BPE learns its merges from: mostly English so merges form words, plus code,
# accents, CJK and emoji so multi-byte characters occur in tests.
_TOKENIZER_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran into the forest.
A language model reads a sequence of tokens and predicts the next one. It is trained on a large amount of
text, and at inference time it generates one token at a time, feeding each new token back as input.
The recurrent layers keep a fixed-size state, while the attention layers keep a cache that grows with the
sequence. Both are needed: the state is cheap to update, and the cache remembers exactly what was said.
When the weights are stored in eight bits, every matrix is read once per token, so the speed is set by the
memory bandwidth of the device. We measure tokens per second and compare them with the roofline.
def generate(model, tokens, max_new_tokens=16):
    for step in range(max_new_tokens):
        logits = model(tokens)
        next_token = logits[-1].argmax()
        tokens.append(next_token)
    return tokens
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 2024 3.14159 1e-6.
Le café était très bon, et la crème brûlée aussi. Über den Wolken ist die Freiheit grenzenlos.
El niño comió una manzana. São Paulo é uma cidade enorme. Ça va très bien, merci !
我们今天学习语言模型。你好，世界！这是一个测试。日本語のテキストも少しあります。
Emoji: 🙂 🚀 ✅ 🦙 — and some punctuation: "quotes", 'single', (parens), [brackets], {braces}.
"""

NUM_SYNTHETIC_MERGES = 240  # 256 bytes + 240 merges + 5 added tokens = 501 ids: padded to 512 in the model

_SYNTHETIC_ADDED_TOKENS = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
                           ("<think>", False), ("</think>", False)]  # <think> is not special in Qwen3

# ChatML as Qwen writes it: optional system/tools block, reasoning in <think>, tool calls and responses;
# `enable_thinking=False` closes an empty think block in the generation prompt.
SYNTHETIC_CHAT_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages and messages[0].role == 'system' %}
{{- messages[0].content + '\n\n' }}
{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>' }}
{%- for tool in tools %}
{{- '\n' + (tool | tojson) }}
{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}
{{- raise_exception('A system message must come first.') }}
{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.reasoning_content %}
{{- '<think>\n' + message.reasoning_content.strip() + '\n</think>\n\n' }}
{%- endif %}
{{- message.content or '' }}
{%- for call in message.tool_calls or [] %}
{{- '\n<tool_call>\n' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson) + '\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}
{{- raise_exception('Unknown role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\n\n</think>\n\n' }}
{%- else %}
{{- '<think>\n' }}
{%- endif %}
{%- endif %}
"""


def synthetic_tokenizer():
    """(tokenizers.Tokenizer, chat template): 256 byte tokens, NUM_SYNTHETIC_MERGES merges learned from a
    built-in text, then <|endoftext|>, <|im_start|>, <|im_end|>, <think>, </think>."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {char: i for i, char in enumerate(alphabet)}
    splitter = byte_level_bpe(vocab, [], [])  # only its normaliser and pre-tokenizer are used
    normalized = splitter.normalizer.normalize_str(_TOKENIZER_TRAINING_TEXT)
    words = collections.Counter(piece for piece, _ in splitter.pre_tokenizer.pre_tokenize_str(normalized))
    merges = learn_bpe_merges(words, NUM_SYNTHETIC_MERGES)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    return byte_level_bpe(vocab, merges, _SYNTHETIC_ADDED_TOKENS), SYNTHETIC_CHAT_TEMPLATE


def learn_bpe_merges(words: dict[str, int], num_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE: repeatedly merge the most frequent adjacent pair (ties: smallest pair), so the result
    depends on nothing but the input."""
    pieces = {word: list(word) for word in words}
    merges = []
    for _ in range(num_merges):
        counts = collections.Counter()
        for word, count in words.items():
            for pair in zip(pieces[word], pieces[word][1:]):
                counts[pair] += count
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        pieces = {word: _merge_pair(seq, best) for word, seq in pieces.items()}
    return merges


def _merge_pair(seq: list[str], pair: tuple[str, str]) -> list[str]:
    out, i = [], 0
    while i < len(seq):
        if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
            out.append(seq[i] + seq[i + 1])
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out


def _write_tokenizer_files(path: pathlib.Path, bpe, chat_template: str, token_ids: dict[str, int]) -> None:
    bpe.save(str(path / "tokenizer.json"))
    added = {str(bpe.token_to_id(content)): {"content": content, "lstrip": False, "normalized": False,
                                             "rstrip": False, "single_word": False, "special": special}
             for content, special in _SYNTHETIC_ADDED_TOKENS}
    _write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "Qwen3_5Tokenizer",
        "model_max_length": 262144,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "added_tokens_decoder": added,
        "chat_template": chat_template,
    })
    _write_json(path / "generation_config.json", {
        "eos_token_id": [token_ids["im_end"], token_ids["endoftext"]],
        "pad_token_id": token_ids["endoftext"],
    })


# ---------------------------------------------------------------------------------------------------------
# HF folder -> GGUF, as llama.cpp's convert_hf_to_gguf.py (Qwen3_5TextModel, --no-mtp or with the MTP block)
# ---------------------------------------------------------------------------------------------------------

GGUF_TYPES = {  # qtype argument -> (type of the big matrices, general.file_type)
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


def hf_to_gguf(hf_dir: str | os.PathLike, out_path: str | os.PathLike, qtype: str = "f32", *,
               model_name: str | None = None, mtp: bool = False) -> pathlib.Path:
    """Convert an HF Qwen3.5 folder (text or VLM form) to a `qwen35` GGUF, as llama.cpp's converter does with
    `--outtype qtype --no-mtp`, or without `--no-mtp` when mtp=True (model_name = its `--model-name`).
    Returns out_path."""
    if qtype not in GGUF_TYPES:
        raise ValueError(f"qtype must be one of {sorted(GGUF_TYPES)}, not {qtype!r}")
    hf_dir, out_path = pathlib.Path(hf_dir), pathlib.Path(out_path)
    hparams = gguf_hparams(hf_dir)
    num_mtp = hparams.get("mtp_num_hidden_layers", 0) if mtp else 0
    matrix_type, file_type = GGUF_TYPES[qtype]
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN35])
    # The converter maps names over block_count = trunk + MTP layers: the MTP layer is one more block.
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, hparams["num_hidden_layers"] + num_mtp)
    for hf_name, tensor in _read_hf_tensors(hf_dir, hparams["num_hidden_layers"] if num_mtp else None):
        name, tensor = convert_hf_tensor(hf_name, tensor.to(torch.float32), hparams)
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias")) or _nextn_gguf_name(name)
        if gguf_name is None:
            raise CheckpointError(f"{hf_dir}: cannot map tensor {hf_name!r} to a qwen35 GGUF name")
        data, data_type = _encode_tensor(gguf_name, tensor.numpy(), matrix_type)
        writer.add_tensor(gguf_name, data, raw_dtype=data_type)
    _add_general_metadata(writer, hf_dir, model_name)
    _add_model_metadata(writer, hparams, file_type, num_mtp)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer_metadata(writer, hf_dir, hparams["vocab_size"])
    writer.write_header_to_file(path=out_path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def gguf_hparams(hf_dir: pathlib.Path) -> dict[str, Any]:
    """config.json with a VLM's text_config lifted to the top level (as the converter does)."""
    with open(hf_dir / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    return {**config, **config.get("text_config", {})}


def _read_hf_tensors(hf_dir: pathlib.Path, mtp_block: int | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Text-model tensors in the converter's order: shard files sorted, names sorted within each shard
    (gguf-py's SafetensorsLocal; a renamed tensor keeps its place). Vision tower skipped; the VLM's
    `model.language_model.` prefix becomes `model.`. The MTP block is skipped (`--no-mtp`) when mtp_block is
    None, else renamed into layer mtp_block (the converter's _Qwen35MtpMixin)."""
    for part in _safetensors_parts(hf_dir):
        with safetensors.safe_open(part, framework="pt") as f:
            for name in sorted(f.keys()):
                if "visual." in name or (name.startswith("mtp.") and mtp_block is None):
                    continue
                if name.startswith("mtp."):
                    yield mtp_tensor_name(name, mtp_block), f.get_tensor(name)
                    continue
                yield name.replace("model.language_model.", "model.", 1), f.get_tensor(name)


# The MTP block's own HF tensors, as the converter renames them inside layer n (then mapped to blk.n.nextn.*).
MTP_RENAMES = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
               "norm": "shared_head.norm"}
NEXTN_TENSORS = {"eh_proj": gguf.MODEL_TENSOR.NEXTN_EH_PROJ, "enorm": gguf.MODEL_TENSOR.NEXTN_ENORM,
                 "hnorm": gguf.MODEL_TENSOR.NEXTN_HNORM, "shared_head.norm": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM}


def mtp_tensor_name(name: str, first_block: int) -> str:
    """mtp.layers.i.X -> model.layers.{first_block + i}.X; mtp.fc/pre_fc_norm_*/norm -> model.layers.{first_block}
    .eh_proj/enorm/hnorm/shared_head.norm (names ending in norm.weight then get the +1 like every norm)."""
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[1] == "layers" and parts[2].isdecimal():
        return f"model.layers.{first_block + int(parts[2])}.{parts[3]}"
    if len(parts) == 3 and parts[1] in MTP_RENAMES:
        return f"model.layers.{first_block}.{MTP_RENAMES[parts[1]]}.{parts[2]}"
    return name  # not a tensor of the block: left for the name map to reject


def _nextn_gguf_name(name: str) -> str | None:
    """blk.N.nextn.* for the block's own tensors. llama.cpp's gguf-py lists them for qwen35; the released
    gguf-py 0.19 does not, so its name map cannot (same names, from its own TENSOR_NAMES)."""
    parts = name.split(".")
    if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdecimal() or parts[-1] != "weight":
        return None
    tensor = NEXTN_TENSORS.get(".".join(parts[3:-1]))
    return None if tensor is None else gguf.TENSOR_NAMES[tensor].format(bid=int(parts[2])) + ".weight"


def _safetensors_parts(hf_dir: pathlib.Path) -> list[pathlib.Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            names = set(json.load(f)["weight_map"].values())
    else:
        names = {p.name for p in hf_dir.iterdir() if p.name.startswith("model") and p.name.endswith(".safetensors")}
    if not names:
        raise CheckpointError(f"{hf_dir}: no model*.safetensors files")
    return [hf_dir / name for name in sorted(names)]


def convert_hf_tensor(name: str, tensor: torch.Tensor, hparams: dict[str, Any]) -> tuple[str, torch.Tensor]:
    """One float32 HF text tensor (`model.*` naming) -> (converter name, GGUF value), in the converter's order:
    value-head reorder, then -exp(A_log) / dt_bias rename / conv squeeze / +1 on zero-centred norms."""
    if "linear_attn." in name and hparams["linear_num_key_heads"] != hparams["linear_num_value_heads"]:
        tensor = reorder_v_heads_of(name, tensor, hparams)
    if name.endswith(".A_log"):
        # Correctly rounded: float32 exp kernels differ by an ulp between CPUs (the oracle's llama.cpp run
        # got the correctly rounded value where this machine's float32 torch.exp does not).
        tensor = -torch.exp(tensor.double()).float()
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        tensor = tensor.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        tensor = tensor + 1
    return name, tensor


def reorder_v_heads(tensor: torch.Tensor, dim: int, num_k_heads: int, num_v_per_k: int,
                    head_dim: int) -> torch.Tensor:
    """Value heads along `dim` from HF's grouped order (head k*r + j reads key head k) to ggml's tiled
    order (head j*Hk + k reads key head k): view the axis as [Hk, r, head_dim] and swap the first two."""
    shape = list(tensor.shape)
    dim %= len(shape)
    grouped = tensor.reshape(*shape[:dim], num_k_heads, num_v_per_k, head_dim, *shape[dim + 1:])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def reorder_v_heads_of(name: str, tensor: torch.Tensor, hparams: dict[str, Any]) -> torch.Tensor:
    """Apply reorder_v_heads to the value-head axis of one GDN tensor (its q/k parts stay put)."""
    Hk, Hv = hparams["linear_num_key_heads"], hparams["linear_num_value_heads"]
    dv, qk_rows = hparams["linear_value_head_dim"], 2 * Hk * hparams["linear_key_head_dim"]
    r = Hv // Hk
    if ".in_proj_qkv." in name:
        return torch.cat([tensor[:qk_rows], reorder_v_heads(tensor[qk_rows:], 0, Hk, r, dv)])
    if ".conv1d" in name:
        tensor = tensor.squeeze()
        return torch.cat([tensor[:qk_rows], reorder_v_heads(tensor[qk_rows:], 0, Hk, r, dv)])
    if ".in_proj_z." in name:
        return reorder_v_heads(tensor, 0, Hk, r, dv)
    if ".in_proj_b." in name or ".in_proj_a." in name or ".A_log" in name or ".dt_bias" in name:
        return reorder_v_heads(tensor, 0, Hk, r, 1)
    if ".out_proj." in name:
        return reorder_v_heads(tensor, 1, Hk, r, dv)
    return tensor  # linear_attn.norm: one [dv] vector shared by all heads


def gguf_tensor_type(gguf_name: str, n_dims: int, matrix_type: gguf.GGMLQuantizationType):
    """The converter's rule: 1-D tensors, norms, the conv kernel and non-`.weight` tensors stay F32."""
    if n_dims <= 1 or gguf_name.endswith("_norm.weight") or gguf_name.endswith(".ssm_conv1d.weight") \
            or not gguf_name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    return matrix_type


def _encode_tensor(gguf_name: str, data: np.ndarray, matrix_type: gguf.GGMLQuantizationType):
    data_type = gguf_tensor_type(gguf_name, data.ndim, matrix_type)
    try:
        return gguf.quants.quantize(data, data_type), data_type
    except gguf.QuantError:  # e.g. a row length not a multiple of 32 for Q8_0: the converter uses F16
        return gguf.quants.quantize(data, gguf.GGMLQuantizationType.F16), gguf.GGMLQuantizationType.F16


def _add_general_metadata(writer: gguf.GGUFWriter, hf_dir: pathlib.Path, model_name: str | None) -> None:
    # As the converter: name from --model-name, the model card or the folder name; size label from the
    # parameter count of the tensors already added.
    total_params, shared_params, expert_params, expert_count = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, hf_dir, model_name, total_params)
    if metadata.name is None:
        metadata.name = hf_dir.name
    if metadata.size_label is None and total_params > 0:
        metadata.size_label = gguf.size_label(total_params, shared_params, expert_params, expert_count)
    writer.add_type(gguf.GGUFType.MODEL)
    metadata.set_gguf_meta_model(writer)


def _add_model_metadata(writer: gguf.GGUFWriter, hp: dict[str, Any], file_type: gguf.LlamaFileType,
                        num_mtp: int) -> None:
    """`qwen35.*` keys in the order the converter writes them; block_count counts the MTP layers, and
    nextn_predict_layers (written last) says how many of the blocks they are."""
    rope = hp.get("rope_parameters") or {}
    writer.add_block_count(hp["num_hidden_layers"] + num_mtp)
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    if "mrope_section" in rope:
        writer.add_rope_dimension_sections((list(rope["mrope_section"]) + [0] * 4)[:4])
    writer.add_rope_freq_base(rope.get("rope_theta", hp.get("rope_theta")))
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_key_length(hp["head_dim"])
    writer.add_value_length(hp["head_dim"])
    writer.add_file_type(file_type)
    writer.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(hp["linear_key_head_dim"])
    writer.add_ssm_group_count(hp["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    writer.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    writer.add_array(f"{writer.arch}.attention.recurrent_layers", recurrent_layers(hp))
    writer.add_full_attention_interval(hp.get("full_attention_interval", 4))
    # The converter reads a top-level partial_rotary_factor (absent in Qwen3.5 configs, so always its
    # default 0.25); the factor that HF applies lives in rope_parameters, so read it there first.
    factor = rope.get("partial_rotary_factor", hp.get("partial_rotary_factor", 0.25))
    writer.add_rope_dimension_count(int(hp["head_dim"] * factor))
    if "mrope_section" not in rope:  # llama.cpp requires the key: the converter writes the default
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    if num_mtp:
        writer.add_nextn_predict_layers(num_mtp)


def recurrent_layers(hp: dict[str, Any]) -> list[bool]:
    """Per layer: True for a Gated DeltaNet layer (from layer_types, else from full_attention_interval)."""
    if "layer_types" in hp:
        return [t == "linear_attention" for t in hp["layer_types"]]
    interval = hp.get("full_attention_interval", 4)
    return [(i + 1) % interval != 0 for i in range(hp["num_hidden_layers"])]


def _add_tokenizer_metadata(writer: gguf.GGUFWriter, hf_dir: pathlib.Path, vocab_size: int) -> None:
    tokens, token_types = gguf_vocab(hf_dir, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    # gguf-py's SpecialVocab is the converter's own code for merges, special ids, add_*_token, chat template.
    gguf.SpecialVocab(hf_dir, load_merges=True).add_to_gguf(writer, quiet=True)


def gguf_vocab(hf_dir: pathlib.Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """tokenizer.ggml.tokens / token_type from tokenizer.json: ids without a token become `[PAD<id>]`
    (UNUSED); added tokens are CONTROL when special or shaped like <|...|>, else USER_DEFINED."""
    tokenizer_file = hf_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise CheckpointError(f"{hf_dir}: no tokenizer.json, cannot write the GGUF vocabulary")
    with open(tokenizer_file, encoding="utf-8") as f:
        tokenizer = json.load(f)
    added = {t["id"]: t for t in tokenizer.get("added_tokens", [])}
    id_to_token = {i: token for token, i in tokenizer["model"]["vocab"].items()}
    id_to_token.update({i: t["content"] for i, t in added.items()})
    if max(id_to_token) >= vocab_size:
        raise CheckpointError(f"{hf_dir}: token id {max(id_to_token)} >= vocab_size {vocab_size}")
    tokens, token_types = [], []
    for i in range(vocab_size):
        if i not in id_to_token:
            tokens.append(f"[PAD{i}]")
            token_types.append(TOKEN_UNUSED)
            continue
        tokens.append(id_to_token[i])
        if i not in added:
            token_types.append(TOKEN_NORMAL)
        elif added[i]["special"] or _looks_special(added[i]["content"]):
            token_types.append(TOKEN_CONTROL)
        else:
            token_types.append(TOKEN_USER_DEFINED)
    return tokens, token_types


def _looks_special(token: str) -> bool:
    return token.startswith("<|") and token.endswith("|>")


# ---------------------------------------------------------------------------------------------------------
# The built-in default model
# ---------------------------------------------------------------------------------------------------------

def default_model_path() -> pathlib.Path:
    """The built-in default model's Q8_0 GGUF (created on first use; see default_model_dir)."""
    return default_model_dir() / "model-q8_0.gguf"


def default_hf_path() -> pathlib.Path:
    """The HF folder (bfloat16) the default GGUF was converted from."""
    return default_model_dir() / "hf"


# What a finished default-model folder holds. Builds are renamed into place whole, so a folder missing any
# of these was emptied or damaged from outside: it is rebuilt.
DEFAULT_MODEL_FILES = ("model-q8_0.gguf", "hf/config.json", "hf/generation_config.json", "hf/model.safetensors",
                       "hf/tokenizer.json", "hf/tokenizer_config.json")
STALE_BUILD_SECONDS = 3600  # a build takes seconds: a .building-* folder older than this was left by a killed one


def default_model_dir() -> pathlib.Path:
    """$QWEN38_CACHE (else ~/.cache/qwen38)/synthetic-default-v<N>, holding hf/ and model-q8_0.gguf.

    Built in a temporary folder and renamed into place, so concurrent callers never see a partial model.
    Temporary folders of killed builds are removed once stale; an incomplete folder is rebuilt."""
    root = pathlib.Path(os.environ.get("QWEN38_CACHE") or pathlib.Path.home() / ".cache" / "qwen38")
    final = root / f"synthetic-default-v{DEFAULT_MODEL_VERSION}"
    if all((final / name).is_file() for name in DEFAULT_MODEL_FILES):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_builds(root)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".building-", dir=root))
        try:
            # With the MTP block (as released), so that --speculative mtp runs out of the box.
            write_hf_checkpoint(tmp / "hf", {}, seed=0, dtype=torch.bfloat16, mtp=True)
            _damp_end_of_turn(tmp / "hf")
            hf_to_gguf(tmp / "hf", tmp / "model-q8_0.gguf", "q8_0", model_name="qwen38-synthetic-default", mtp=True)
            _move_aside_incomplete(final)
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():  # not a lost race with another process: a real error
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing left after a successful rename
    except OSError as e:
        raise Qwen38Error(f"cannot build the built-in model in {root} ({e.strerror}: {e.filename}); set QWEN38_CACHE "
                          "to a writable folder") from None
    return final


# The built-in model's random head puts <|im_end|> first or within the top 3 after most chat prompts (it
# follows the prompt's own <|im_start|>...<|im_end|> pattern), so a greedy chat reply was often empty.
# Its head row, scaled by this, ranks far lower: replies are gibberish of some length, and can still end.
END_OF_TURN_HEAD_SCALE = 0.5


def _damp_end_of_turn(hf_dir: pathlib.Path) -> None:
    weights = safetensors.torch.load_file(hf_dir / "model.safetensors")
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    token = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|im_end|>")
    weights["lm_head.weight"][token] *= END_OF_TURN_HEAD_SCALE
    safetensors.torch.save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})


def _remove_stale_builds(root: pathlib.Path) -> None:
    now = time.time()
    for folder in root.glob(".building-*"):
        try:
            if now - folder.stat().st_mtime > STALE_BUILD_SECONDS:
                shutil.rmtree(folder, ignore_errors=True)
        except FileNotFoundError:  # removed by a concurrent caller
            pass


def _move_aside_incomplete(final: pathlib.Path) -> None:
    """A folder of that name that is not a complete model (checked again: another process may have just
    finished one) is renamed out of the way, then removed."""
    if not final.exists() or all((final / name).is_file() for name in DEFAULT_MODEL_FILES):
        return
    doomed = final.with_name(f".building-incomplete-{os.getpid()}-{time.time_ns()}")
    try:
        os.rename(final, doomed)
    except FileNotFoundError:  # a concurrent caller moved it first
        return
    shutil.rmtree(doomed, ignore_errors=True)
