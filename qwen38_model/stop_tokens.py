"""The stop-token policy: which ids end a generation, read from a checkpoint the way its own runtime reads
them (transformers for an HF folder, llama.cpp for a GGUF). config.py stores them in the model's config and
the tokenizer hands them to its user; both import them from here, a leaf, so that the shape of the model
does not depend on the tokenizer module.

The policy of a GGUF reads its vocabulary (control tokens are found by their text), so the GGUF vocabulary
reading and its token types live here too. Malformed values are CheckpointErrors naming the file and key.
"""
from __future__ import annotations

import pathlib
from typing import Any

from .errors import CheckpointError
from .files import optional_json_object

# gguf TokenType values written to tokenizer.ggml.token_type (llama.cpp's llama_token_type: 1 normal,
# 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte; 0, undefined, is never written).
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5
TOKEN_TYPES = range(1, 7)

# llama.cpp also ends generation on these control tokens, whatever eos_token_id says.
END_OF_GENERATION_TEXTS = ("<|im_end|>", "<|endoftext|>")
GGUF_STOP_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def hf_stop_token_ids(folder: pathlib.Path, config: dict | None = None) -> tuple[int, ...]:
    """What transformers' generate() stops on: generation_config.json's eos_token_id where the file has
    one, else config.json's (the top level, then text_config)."""
    generation_config = optional_json_object(folder, "generation_config.json")
    if generation_config.get("eos_token_id") is not None:
        return _id_tuple(generation_config["eos_token_id"], folder / "generation_config.json")
    if config is None:
        config = optional_json_object(folder, "config.json")
    text = config.get("text_config")
    value = config.get("eos_token_id")
    if value is None and isinstance(text, dict):
        value = text.get("eos_token_id")
    return _id_tuple(value, folder / "config.json")


def gguf_stop_token_ids(fields: dict[str, Any], source: str = "GGUF metadata") -> tuple[int, ...]:
    """What llama.cpp stops on: the eos, eot and eom ids, then the control tokens <|im_end|> and
    <|endoftext|> by their text (a GGUF has no generation_config)."""
    tokens, token_types = gguf_vocabulary(fields, source)
    ids = [gguf_token_id(fields, key, len(tokens) or None, source) for key in GGUF_STOP_KEYS if key in fields]
    ids += [i for i, (token, kind) in enumerate(zip(tokens, token_types))
            if kind == TOKEN_CONTROL and token in END_OF_GENERATION_TEXTS]
    return tuple(dict.fromkeys(ids))


def gguf_vocabulary(fields: dict[str, Any], source: str) -> tuple[list[str], list[int]]:
    """tokenizer.ggml.tokens and token_type, checked: strings, integers in TOKEN_TYPES, the same length
    ([], [] when there are no tokens). A vocabulary without its token_type array is an error: every token
    would be plain text (<|im_end|> no control token, no stop id, split into pieces when written)."""
    tokens = gguf_string_list(fields, "tokenizer.ggml.tokens", source)
    if tokens and "tokenizer.ggml.token_type" not in fields:
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens ({len(tokens)} tokens) without "
                              "tokenizer.ggml.token_type: the control tokens (<|im_end|>, ...) cannot be told apart")
    token_types = fields.get("tokenizer.ggml.token_type", [])
    # set(map(type, ...)): one C loop over ~250k entries, where a generator expression takes ~30 ms
    if not isinstance(token_types, list) or len(token_types) != len(tokens) or not set(map(type, token_types)) <= {int}:
        found = f"{len(token_types)} entries" if isinstance(token_types, list) else repr(token_types)[:40]
        raise CheckpointError(f"{source}: tokenizer.ggml.token_type must be {len(tokens)} integers (one per token), "
                              f"found {found}")
    if token_types and not (min(token_types) >= TOKEN_TYPES.start and max(token_types) < TOKEN_TYPES.stop):
        bad = next(i for i, kind in enumerate(token_types) if kind not in TOKEN_TYPES)
        raise CheckpointError(f"{source}: tokenizer.ggml.token_type[{bad}] is {token_types[bad]}, expected a "
                              f"llama_token_type from {TOKEN_TYPES.start} to {TOKEN_TYPES.stop - 1} (1 normal, 2 "
                              "unknown, 3 control, 4 user-defined, 5 unused, 6 byte)")
    return tokens, token_types


def gguf_string_list(fields: dict[str, Any], key: str, source: str) -> list[str]:
    """GGUF metadata `key`, an array of strings ([] when absent)."""
    values = fields.get(key, [])
    if not isinstance(values, list) or not set(map(type, values)) <= {str}:
        raise CheckpointError(f"{source}: {key} must be an array of strings")
    return values


def gguf_token_id(fields: dict[str, Any], key: str, vocab_size: int | None, source: str) -> int:
    """GGUF metadata `key`, a token id in [0, vocab_size) (any id >= 0 when vocab_size is None)."""
    value = fields[key]
    if type(value) is not int or value < 0 or (vocab_size is not None and value >= vocab_size):
        raise CheckpointError(f"{source}: {key} must be a token id in [0, {vocab_size}), found {value!r:.40}")
    return value


def _id_tuple(value, source: pathlib.Path) -> tuple[int, ...]:
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(type(i) is int and i >= 0 for i in ids):
        raise CheckpointError(f"{source}: eos_token_id must be a token id or a list of them, found {value!r:.80}")
    return tuple(ids)
