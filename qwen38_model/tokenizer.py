"""Qwen3.5 byte-level BPE tokenizer, from an HF folder or from GGUF metadata, plus its chat template and
its end-of-generation ids (the stop-token policy, stop_tokens.py, which the config reads too).

Both sources build the same `tokenizers.Tokenizer`: NFC normaliser, Qwen3.5's regex split, byte-level
mapping, BPE over byte-level strings, added tokens matched before the split. A GGUF stores only the
vocabulary, the merges and the token types (llama.cpp's `qwen35` pre-tokenizer implies the regex), so the
pipeline around them is rebuilt here. Chat templates render as transformers renders them, bounded
(chat_template.py). Malformed tokenizer files or metadata are CheckpointErrors naming the file and key.
"""
from __future__ import annotations

import codecs
import functools
import operator
import pathlib
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from . import chat_template as templates
from .checkpoint import read_gguf_header
from .checkpoint.gguf_file import GGUFHeader
from .errors import CheckpointError
from .files import folder_file, optional_json_object
from .stop_tokens import (TOKEN_CONTROL, TOKEN_UNUSED, TOKEN_USER_DEFINED, gguf_stop_token_ids, gguf_string_list,
                          gguf_token_id, gguf_vocabulary, hf_stop_token_ids)

# Qwen3.5's split regex (its tokenizer.json, llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35). It differs from
# Qwen2/Qwen3 by keeping combining marks \p{M} inside letter runs.
QWEN35_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TOKENIZER_JSON_LIMIT_BYTES = 256 << 20  # Qwen3.5's is 11 MB


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
        self._added = tokenizer.get_added_tokens_decoder()  # id -> AddedToken

    @classmethod
    def from_hf_folder(cls, path: str | pathlib.Path) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (chat template, special-token strings) +
        generation_config.json / config.json (eos ids)."""
        path = pathlib.Path(path)
        if not (path / "tokenizer.json").exists():
            raise CheckpointError(f"{path}: no tokenizer.json; an HF checkpoint folder needs tokenizer.json (the "
                                  "tokenizer) beside config.json and model.safetensors (or its shards and "
                                  "model.safetensors.index.json); tokenizer_config.json (chat template, special "
                                  "tokens) and generation_config.json (end-of-generation ids) are optional")
        tokenizer_file = folder_file(path, "tokenizer.json", "tokenizer file")
        if tokenizer_file.stat().st_size > TOKENIZER_JSON_LIMIT_BYTES:
            raise CheckpointError(f"{tokenizer_file}: more than {TOKENIZER_JSON_LIMIT_BYTES} bytes")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the tokenizers library raises plain Exception for any malformed file
            raise CheckpointError(f"{tokenizer_file}: not a tokenizers file ({str(e)[:200]})") from None
        if not isinstance(tokenizer.decoder, decoders.ByteLevel):
            raise CheckpointError(f"{tokenizer_file}: decoder {tokenizer.decoder!r:.80}, expected ByteLevel "
                                  "(Qwen3.5 tokenizers are byte-level BPE)")
        config = optional_json_object(path, "tokenizer_config.json")
        chat_template = config.get("chat_template")
        if chat_template is None and (path / "chat_template.jinja").exists():
            template_file = folder_file(path, "chat_template.jinja", "chat template")
            if template_file.stat().st_size > 4 * templates.MAX_SOURCE_CHARS:  # 4 bytes per character at most
                raise CheckpointError(f"{template_file}: more than {templates.MAX_SOURCE_CHARS} characters")
            chat_template = template_file.read_bytes().decode("utf-8", "replace")
        if chat_template is not None and not isinstance(chat_template, str):
            raise CheckpointError(f"{path / 'tokenizer_config.json'}: chat_template must be a string, found "
                                  f"{type(chat_template).__name__} (named templates are not supported)")
        special_tokens = {name: _token_content(config[name], path / "tokenizer_config.json", name)
                          for name in ("bos_token", "eos_token", "pad_token", "unk_token")
                          if config.get(name) is not None}
        return cls(tokenizer, chat_template, list(hf_stop_token_ids(path)), special_tokens)

    @classmethod
    def from_gguf_header(cls, header: GGUFHeader, source: str) -> Tokenizer:
        """From a GGUF header: its metadata, the token count checked against token_embd.weight's rows (a
        vocabulary-only GGUF, without tensors, has nothing to check it against)."""
        embedding = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
        vocab_size = embedding.dims[1] if embedding is not None and len(embedding.dims) >= 2 else None
        return cls.from_gguf_metadata(header.metadata, source, vocab_size)

    @classmethod
    def from_gguf_metadata(cls, fields: dict[str, Any], source: str = "GGUF metadata",
                           vocab_size: int | None = None) -> Tokenizer:
        """From GGUF metadata as a plain dict: key -> python value (str, int, list). vocab_size: the model's
        (token_embd.weight's rows, load_tokenizer reads them): the token list must be exactly that long, as
        llama.cpp requires (a longer list produces ids the model has no row for; a shorter one leaves ids
        the model can produce that decode to nothing)."""
        model = fields.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise CheckpointError(f"{source}: tokenizer.ggml.model is {model!r:.80}; only byte-level BPE ('gpt2') "
                                  "is supported")
        if not fields.get("tokenizer.ggml.tokens"):
            raise CheckpointError(f"{source}: no tokenizer.ggml.tokens")
        tokens, token_types = gguf_vocabulary(fields, source)
        if vocab_size is not None and len(tokens) != vocab_size:
            raise CheckpointError(f"{source}: tokenizer.ggml.tokens has {len(tokens)} tokens, the model's embedding "
                                  f"(token_embd.weight) {vocab_size} rows: they must be equal (llama.cpp's n_vocab)")
        if not fields.get("tokenizer.ggml.merges"):
            raise CheckpointError(f"{source}: no tokenizer.ggml.merges: a byte-level BPE ('gpt2') vocabulary needs its "
                                  "merges (without them every text would be split into single characters)")
        # Spaces inside byte-level tokens are already mapped to 'Ġ', so the one space separates the pair.
        merges = gguf_string_list(fields, "tokenizer.ggml.merges", source)
        pairs = [tuple(merge.split(" ")) for merge in merges]
        bad = next((m for m, pair in zip(merges, pairs) if len(pair) != 2), None)
        if bad is not None:
            raise CheckpointError(f"{source}: tokenizer.ggml.merges entry {bad!r:.80} is not two tokens separated by "
                                  "one space")
        vocab = {token: i for i, (token, kind) in enumerate(zip(tokens, token_types)) if kind != TOKEN_UNUSED}
        added = [(token, kind == TOKEN_CONTROL) for token, kind in zip(tokens, token_types)
                 if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
        try:
            tokenizer = byte_level_bpe(vocab, pairs, added)
        except Exception as e:  # e.g. a merge naming a token that is not in the vocabulary
            raise CheckpointError(f"{source}: tokenizer.ggml.tokens / merges do not form a BPE tokenizer "
                                  f"({str(e)[:200]})") from None
        special_tokens = {name: tokens[gguf_token_id(fields, key, len(tokens), source)] for name, key in (
            ("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id"),
            ("pad_token", "tokenizer.ggml.padding_token_id")) if key in fields}
        chat_template = fields.get("tokenizer.chat_template")
        if chat_template is not None and not isinstance(chat_template, str):
            raise CheckpointError(f"{source}: tokenizer.chat_template must be a string")
        return cls(tokenizer, chat_template, list(gguf_stop_token_ids(fields, source)), special_tokens)

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) become their ids.
        Qwen adds no BOS. A text that is not a str, or holds a lone surrogate (no UTF-8 for it), is a
        ValueError."""
        return self.tokenizer.encode(check_text(text, "text"), add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (an iterable of integer ids >= 0, e.g. a list, a 1-d tensor); an id without a
        token decodes to nothing. Anything else is a ValueError naming `ids`."""
        return self.tokenizer.decode(check_token_ids(ids, "ids"),
                                     skip_special_tokens=check_flag(skip_special_tokens, "skip_special_tokens"))

    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        """The bytes one id stands for, such that decode(ids) is the UTF-8 decoding (invalid bytes as U+FFFD)
        of the ids' bytes concatenated. As the ByteLevel decoder: a token whose every character is in the
        byte-level alphabet maps each back to its byte, any other token is its own UTF-8; an id without a
        token is nothing (decode() skips it), and so is a skipped special token."""
        token_id = check_token_id(token_id, "token_id")
        added = self._added.get(token_id)
        if added is not None and added.special and skip_special_tokens:
            return b""
        token = self.tokenizer.id_to_token(token_id)
        if token is None:
            return b""
        byte_of = _byte_level_values()
        return bytes(byte_of[c] for c in token) if all(c in byte_of for c in token) else token.encode()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """The prompt text for `messages`, rendered like transformers' apply_chat_template(tokenize=False);
        extra keyword arguments (tools=..., enable_thinking=...) reach the template. Errors of the
        template and its bounds (chat_template.py) are ChatTemplateErrors (a ValueError)."""
        check_messages(messages)
        check_flag(add_generation_prompt, "add_generation_prompt")
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        return templates.render(self.chat_template, messages=messages,
                                    add_generation_prompt=add_generation_prompt,
                                    **{**self.special_tokens, **kwargs})

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Turns ids arriving one by one into text, never emitting part of a multi-byte character.

    Each id's bytes go through an incremental UTF-8 decoder, which holds back at most the 3 bytes of an
    unfinished character and turns bytes that can never form one into U+FFFD at once: linear time however
    many ids never complete a character. The pieces concatenate to decode(all ids)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token_id: int) -> str:
        """Text completed by this id ('' while a character is unfinished)."""
        return self.utf8.decode(self.tokenizer.token_bytes(token_id, self.skip_special_tokens))

    def flush(self) -> str:
        """Whatever is still held (end of generation), an unfinished character shown as U+FFFD."""
        text = self.utf8.decode(b"", final=True)
        self.utf8.reset()
        return text


MAX_TOKEN_ID = 2**32 - 1  # the tokenizers library's ids are u32; no vocabulary comes near


def check_text(text, name: str) -> str:
    """A str with a UTF-8 form: not bytes (decode them first), not None, no lone surrogate."""
    if not isinstance(text, str):
        hint = " (decode bytes to str first)" if isinstance(text, (bytes, bytearray)) else ""
        raise ValueError(f"{name} must be a str, found {type(text).__name__}{hint}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} holds a lone surrogate {text[e.start]!r} at index {e.start} (not Unicode text: "
                         "it has no UTF-8 form)") from None
    return text


def check_token_id(value, name: str) -> int:
    """An integer token id in [0, 2^32) (Python, numpy or 0-d tensor integer; not a bool, a float or a str)."""
    if isinstance(value, bool) or (getattr(value, "dtype", None) is not None and str(value.dtype).endswith("bool")):
        raise ValueError(f"{name} must be an integer token id, found {value!r:.40}")
    try:
        i = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer token id, found {type(value).__name__} {value!r:.40}") from None
    if not 0 <= i <= MAX_TOKEN_ID:
        raise ValueError(f"{name} must be a token id in [0, {MAX_TOKEN_ID}], found {i}")
    return i


def check_token_ids(ids, name: str) -> list[int]:
    """An iterable of token ids (check_token_id each) as a list of ints; a 1-d tensor or array too."""
    if isinstance(ids, (str, bytes, bytearray, dict)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{name} must be a sequence of integer token ids, found {type(ids).__name__}")
    if getattr(ids, "ndim", 1) != 1:
        raise ValueError(f"{name} must be a 1-d sequence of token ids, found shape {tuple(ids.shape)}")
    ids = list(ids)
    # The common case, a list of Python ints, in C loops (a whole reply's ids are decoded at once).
    if set(map(type, ids)) <= {int} and (not ids or (min(ids) >= 0 and max(ids) <= MAX_TOKEN_ID)):
        return ids
    return [check_token_id(value, f"{name}[{k}]") for k, value in enumerate(ids)]


def check_flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, found {value!r:.40}")
    return value


def check_messages(messages) -> None:
    """A list (or tuple) of dicts, each with a str 'role': what every chat template iterates over."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts like {{'role': 'user', 'content': '...'}}, found "
                         f"{type(messages).__name__}")
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{k}] must be a dict with 'role' and 'content', found {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{k}]['role'] must be a str, found {message.get('role')!r:.40}")
        content = message.get("content")
        if isinstance(content, str):
            check_text(content, f"messages[{k}]['content']")


def _token_content(entry, path: pathlib.Path, name: str) -> str:
    # tokenizer_config.json writes a special token either as its text or as an AddedToken dict.
    content = entry.get("content") if isinstance(entry, dict) else entry
    if not isinstance(content, str):
        raise CheckpointError(f"{path}: {name} must be a string or an object with a 'content' string")
    return content


@functools.cache
def _byte_level_values() -> dict[str, int]:
    """The byte-level alphabet backwards: character -> byte (GPT-2's bytes_to_unicode: printable bytes map
    to themselves, the other bytes to 256 + n in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


def load_tokenizer(path: str | pathlib.Path) -> Tokenizer:
    """The tokenizer of a checkpoint: an HF folder's tokenizer.json, or a GGUF's tokenizer.ggml.* metadata."""
    path = pathlib.Path(path)
    if path.is_dir():
        return Tokenizer.from_hf_folder(path)
    return Tokenizer.from_gguf_header(read_gguf_header(path), str(path))
