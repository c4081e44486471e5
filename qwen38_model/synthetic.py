"""Random Qwen3.5 HF checkpoints for tests and benchmarks: configs, random weights, the HF writer, a small BPE.

`write_hf_checkpoint` writes an HF folder (text-only `Qwen3_5ForCausalLM` form or the released VLM form)
with every parameter randomized so that any convention mistake (norm offset, A_log sign, head order) shows
in the logits, plus a small byte-level BPE tokenizer with Qwen3.5's pre-tokenizer and ChatML. Same seed,
same bytes. `convert.hf_to_gguf` turns such a folder into a GGUF; `default_model` builds the built-in model
from both.
"""
from __future__ import annotations

import collections
import json
import os
import pathlib
import zlib
from typing import Any

import safetensors.torch
import torch
from tokenizers import pre_tokenizers

from .config import ATTENTION, layer_types_from_interval
from .tokenizer import byte_level_bpe

# ---------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------

# The built-in default model's shape (default_model.py); `write_hf_checkpoint` fills keys missing from its
# text_config from here.
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

_TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def full_text_config(text_config: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """text_config over the defaults, with vocab_size and layer_types filled in when absent."""
    config = {**DEFAULT_TEXT_CONFIG, "vocab_size": vocab_size, **text_config}
    layer_types = layer_types_from_interval(config["num_hidden_layers"], config["full_attention_interval"])
    config.setdefault("layer_types", ["full_attention" if t == ATTENTION else "linear_attention" for t in layer_types])
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

# ChatML as Qwen3 writes it: optional system/tools block (Qwen3's wording; consecutive tool responses in one user turn), reasoning in <think>, tool calls and responses;
# `enable_thinking=False` closes an empty think block in the generation prompt.
SYNTHETIC_CHAT_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages and messages[0].role == 'system' %}
{{- messages[0].content + '\n\n' }}
{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}
{{- '\n' + (tool | tojson) }}
{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
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
{%- if (loop.first and message.content) or not loop.first %}
{{- '\n' }}
{%- endif %}
{%- set call = call.function if call.function else call %}
{{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
{{- call.arguments if call.arguments is string else call.arguments | tojson }}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\n' }}
{%- endif %}
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
