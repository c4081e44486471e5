"""Qwen3.5 byte-level BPE tokenizer, from an HF folder or from GGUF metadata, plus its chat template.

Both sources build the same `tokenizers.Tokenizer`: NFC normaliser, Qwen3.5's regex split, byte-level
mapping, BPE over byte-level strings, added tokens matched before the split. A GGUF stores only the
vocabulary, the merges and the token types (llama.cpp's `qwen35` pre-tokenizer implies the regex), so the
pipeline around them is rebuilt here. Chat templates render with jinja2 the way transformers renders them.
"""
from __future__ import annotations

import json
import pathlib
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from .errors import CheckpointError

# Qwen3.5's split regex (its tokenizer.json, llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35). It differs from
# Qwen2/Qwen3 by keeping combining marks \p{M} inside letter runs.
QWEN35_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# gguf TokenType values written to tokenizer.ggml.token_type.
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5

# llama.cpp also ends generation on these control tokens, whatever eos_token_id says.
END_OF_GENERATION_TEXTS = ("<|im_end|>", "<|endoftext|>")


def byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]],
                   added: list[tuple[str, bool]]) -> tokenizers.Tokenizer:
    """A Qwen3.5-style tokenizer. `added` = (content, special) pairs; a content already in `vocab` keeps
    its id, a new one gets the next free id in list order."""
    tokenizer = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                                         fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    for content, special in added:
        token = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False,
                           special=special)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    return tokenizer


class Tokenizer:
    """encode / decode / chat template / end-of-generation ids of one checkpoint."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, chat_template: str | None,
                 eos_token_ids: list[int], special_tokens: dict[str, str] | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.eos_token_ids = eos_token_ids
        # bos_token / eos_token / pad_token strings, visible to the chat template as in transformers.
        self.special_tokens = special_tokens or {}

    @classmethod
    def from_hf_folder(cls, path: str | pathlib.Path) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (chat template, special-token strings) +
        generation_config.json / config.json (eos ids)."""
        path = pathlib.Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{path}: no tokenizer.json")
        tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        tokenizer_config = _read_json(path / "tokenizer_config.json")
        chat_template = tokenizer_config.get("chat_template")
        if chat_template is None and (path / "chat_template.jinja").is_file():
            chat_template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        special_tokens = {name: _token_content(tokenizer_config[name])
                          for name in ("bos_token", "eos_token", "pad_token", "unk_token")
                          if tokenizer_config.get(name) is not None}
        return cls(tokenizer, chat_template, _hf_eos_token_ids(path), special_tokens)

    @classmethod
    def from_gguf_metadata(cls, fields: dict[str, Any]) -> Tokenizer:
        """From GGUF metadata as a plain dict: key -> python value (str, int, list)."""
        model = fields.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise CheckpointError(f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        token_types: list[int] = fields["tokenizer.ggml.token_type"]
        # Spaces inside byte-level tokens are already mapped to 'Ġ', so the one space separates the pair.
        merges = [tuple(merge.split(" ")) for merge in fields.get("tokenizer.ggml.merges", [])]
        vocab = {token: i for i, (token, kind) in enumerate(zip(tokens, token_types)) if kind != TOKEN_UNUSED}
        added = [(token, kind == TOKEN_CONTROL) for token, kind in zip(tokens, token_types)
                 if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
        tokenizer = byte_level_bpe(vocab, merges, added)
        special_tokens = {name: tokens[fields[key]] for name, key in (
            ("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id"),
            ("pad_token", "tokenizer.ggml.padding_token_id")) if key in fields}
        return cls(tokenizer, fields.get("tokenizer.chat_template"), _gguf_eos_token_ids(fields, tokens, token_types),
                   special_tokens)

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) become their ids.
        Qwen adds no BOS."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """The prompt text for `messages`, rendered like transformers' apply_chat_template(tokenize=False);
        extra keyword arguments (tools=..., enable_thinking=...) reach the template."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        template = _compile_chat_template(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **{**self.special_tokens, **kwargs})

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Turns ids arriving one by one into text, never emitting part of a multi-byte character.

    Ids are held until their bytes decode without a trailing U+FFFD (an unfinished UTF-8 sequence). Byte-level
    decoding has no context across tokens, so the pieces concatenate to decode(all ids)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.pending: list[int] = []

    def feed(self, token_id: int) -> str:
        """Text completed by this id ('' while a character is unfinished)."""
        self.pending.append(int(token_id))
        text = self.tokenizer.decode(self.pending, self.skip_special_tokens)
        if text.endswith("\ufffd"):
            return ""
        self.pending = []
        return text

    def flush(self) -> str:
        """Whatever is still held (end of generation), invalid bytes shown as U+FFFD."""
        text = self.tokenizer.decode(self.pending, self.skip_special_tokens)
        self.pending = []
        return text


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(entry: str | dict[str, Any]) -> str:
    # tokenizer_config.json writes a special token either as its text or as an AddedToken dict.
    return entry["content"] if isinstance(entry, dict) else entry


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _hf_eos_token_ids(path: pathlib.Path) -> list[int]:
    """generation_config.json's eos_token_id (what transformers' generate stops on), else config.json's."""
    generation_config = _read_json(path / "generation_config.json")
    if "eos_token_id" in generation_config:
        return _as_id_list(generation_config["eos_token_id"])
    config = _read_json(path / "config.json")
    return _as_id_list(config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id")))


def _gguf_eos_token_ids(fields: dict[str, Any], tokens: list[str], token_types: list[int]) -> list[int]:
    """eos, eot and eom ids, then the control tokens llama.cpp treats as end of generation by their text."""
    ids = [fields[key] for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                   "tokenizer.ggml.eom_token_id") if key in fields]
    ids += [i for i, (token, kind) in enumerate(zip(tokens, token_types))
            if kind == TOKEN_CONTROL and token in END_OF_GENERATION_TEXTS]
    return list(dict.fromkeys(ids))


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: plain json.dumps, no HTML escaping (jinja's own tojson escapes <, >, &, ').
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_chat_template(source: str) -> jinja2.Template:
    # The same environment as transformers: sandboxed, trim_blocks + lstrip_blocks, loop controls.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def load_tokenizer(path: str | pathlib.Path) -> Tokenizer:
    """The tokenizer of a checkpoint: an HF folder's tokenizer.json, or a GGUF's tokenizer.ggml.* metadata."""
    path = pathlib.Path(path)
    if path.is_dir():
        return Tokenizer.from_hf_folder(path)
    from .checkpoint import open_checkpoint

    return Tokenizer.from_gguf_metadata(open_checkpoint(path).source.metadata)
