"""Qwen38Config: the model's shape, read from GGUF metadata or an HF config.json, never assumed. Every value
is checked for its type and range as it is read: a checkpoint may come from anywhere."""
from __future__ import annotations

import math
import os
import pathlib
from dataclasses import dataclass, field

from .errors import ConfigError
from .files import folder_file, read_json
from .stop_tokens import gguf_stop_token_ids, hf_stop_token_ids

ATTENTION, GDN = "attention", "gdn"
# Bounds checked before anything is built from a count (a file may say block_count = 2^32 - 1):
MAX_LAYERS = 1024  # 16x the 27B's 64
MAX_DIM = 2**31 - 1  # sizes, positions and token ids index int32 tensors in the kernels
MAX_RMS_NORM_EPS = 1e-2  # eps only guards the division; from 1e-2 up it would change the normalisation itself


def layer_types_from_interval(num_layers: int, interval: int) -> tuple[str, ...]:
    """Qwen3.5's layer pattern, what full_attention_interval means in an HF config and in GGUF metadata alike:
    every interval-th layer is full attention (layers interval-1, 2*interval-1, ...), the others Gated DeltaNet."""
    return tuple(ATTENTION if (i + 1) % interval == 0 else GDN for i in range(num_layers))


@dataclass(frozen=True)
class Qwen38Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]  # ATTENTION or GDN per trunk layer (MTP layers excluded)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int  # leading dims of each head that RoPE rotates (NEOX pairs over this width)
    rope_theta: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    num_mtp_layers: int = 0  # MTP (nextn / mtp.*) layers in the checkpoint: 0, or 1 (loaded as model.mtp)
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    source: str = ""  # file or folder the config was read from, for error messages

    def __post_init__(self):
        self.validate()

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    def validate(self) -> None:
        where = f" in {self.source}" if self.source else ""

        def need(ok: bool, what: str):
            if not ok:
                raise ConfigError(f"inconsistent model config{where}: {what}")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "conv_kernel", "max_position_embeddings"):
            value = getattr(self, name)
            need(_is_int(value) and 0 < value <= MAX_DIM, f"{name} must be an integer in [1, {MAX_DIM}], found {value!r}")
        need(0 < self.num_layers <= MAX_LAYERS, f"{self.num_layers} layers, expected 1 to {MAX_LAYERS}")
        need(_is_int(self.num_mtp_layers) and 0 <= self.num_mtp_layers <= MAX_LAYERS,
             f"num_mtp_layers must be an integer in [0, {MAX_LAYERS}], found {self.num_mtp_layers!r}")
        bad = sorted(set(self.layer_types) - {ATTENTION, GDN})
        need(not bad, f"unknown layer types {bad}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
             f"{self.num_key_value_heads}")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0,
             f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of linear_num_key_heads "
             f"{self.linear_num_key_heads}")
        need(_is_int(self.rotary_dim) and 0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0,
             f"rotary_dim {self.rotary_dim} must be even and within head_dim {self.head_dim}")
        need(math.isfinite(self.rms_norm_eps) and 0 < self.rms_norm_eps <= MAX_RMS_NORM_EPS,
             f"rms_norm_eps must be in (0, {MAX_RMS_NORM_EPS}], found {self.rms_norm_eps}")
        need(math.isfinite(self.rope_theta) and self.rope_theta > 1,
             f"rope_theta must be a finite number > 1, found {self.rope_theta}")
        need(isinstance(self.tie_word_embeddings, bool),
             f"tie_word_embeddings must be true or false, found {self.tie_word_embeddings!r}")
        bad = [i for i in self.eos_token_ids if not (_is_int(i) and 0 <= i < self.vocab_size)]
        need(not bad, f"end-of-sequence ids {bad} outside the vocabulary [0, {self.vocab_size})")

    # ---- HF config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf_folder(cls, folder: str | pathlib.Path) -> "Qwen38Config":
        folder = pathlib.Path(folder)
        if not os.path.lexists(folder / "config.json"):
            raise ConfigError(f"{folder}: no config.json (an HF checkpoint folder needs one)")
        path = folder_file(folder, "config.json")
        raw = read_json(path, "config.json")
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object, found {type(raw).__name__}")
        return cls.from_hf_dict(raw, source=str(path), eos_token_ids=hf_stop_token_ids(folder, raw))

    @classmethod
    def from_hf_dict(cls, raw: dict, source: str = "", eos_token_ids: tuple[int, ...] = ()) -> "Qwen38Config":
        """Accepts the text-only form (model_type qwen3_5_text) and the released VLM form (qwen3_5, with
        the language model under text_config)."""
        model_type = raw.get("model_type")
        if model_type == "qwen3_5":
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{source}: model_type qwen3_5 without a text_config object")
        elif model_type == "qwen3_5_text":
            text = raw
        else:
            raise ConfigError(f"{source}: unsupported model_type {model_type!r}, expected 'qwen3_5_text' or 'qwen3_5' "
                              "(Qwen3.5 / Qwen3.8 hybrid GDN + attention)")
        keys = _Keys(text, source)
        num_layers = keys.integer("num_hidden_layers", high=MAX_LAYERS)
        hf_layer_types = text.get("layer_types")
        if hf_layer_types is None:
            layer_types = layer_types_from_interval(num_layers, keys.integer("full_attention_interval", 4))
        else:
            layer_types = _hf_layer_types(hf_layer_types, num_layers, source)
        rope = text.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: rope_parameters must be an object, found {rope!r}")
        rope_keys = _Keys({**text, **rope}, source)  # rope_parameters over the older top-level keys
        hidden = keys.integer("hidden_size")
        heads = keys.integer("num_attention_heads")
        head_dim = keys.integer("head_dim") if "head_dim" in text else hidden // heads
        factor = rope_keys.number("partial_rotary_factor", 0.25)
        if not 0 < factor <= 1:
            raise ConfigError(f"{source}: partial_rotary_factor must be in (0, 1], found {factor}")
        # Keys HF's modeling reads that this implementation takes as fixed: checked, not ignored.
        section = rope.get("mrope_section")
        if section is not None and not (isinstance(section, list) and len(section) in (3, 4)
                                        and all(_is_int(n) and n >= 0 for n in section)):
            raise ConfigError(f"{source}: mrope_section must be a list of 3 non-negative integers (t, h, w), found "
                              f"{section!r:.80}")
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act must be 'silu' (Qwen3.5's MLP and conv activation), found "
                              f"{act!r:.80}")
        return cls(
            vocab_size=keys.integer("vocab_size"), hidden_size=hidden,
            intermediate_size=keys.integer("intermediate_size"), layer_types=layer_types,
            num_attention_heads=heads, num_key_value_heads=keys.integer("num_key_value_heads"),
            head_dim=head_dim, rotary_dim=int(head_dim * factor), rope_theta=rope_keys.number("rope_theta"),
            linear_num_key_heads=keys.integer("linear_num_key_heads"),
            linear_num_value_heads=keys.integer("linear_num_value_heads"),
            linear_key_head_dim=keys.integer("linear_key_head_dim"),
            linear_value_head_dim=keys.integer("linear_value_head_dim"),
            conv_kernel=keys.integer("linear_conv_kernel_dim"), rms_norm_eps=keys.number("rms_norm_eps", 1e-6),
            max_position_embeddings=keys.integer("max_position_embeddings", 262144),
            # The VLM form states it at the top level, the text-only form in its one level.
            tie_word_embeddings=_Keys(raw if "tie_word_embeddings" in raw else text, source).boolean(
                "tie_word_embeddings", False),
            num_mtp_layers=keys.integer("mtp_num_hidden_layers", 0, low=0, high=MAX_LAYERS),
            eos_token_ids=eos_token_ids, source=source,
        )

    # ---- GGUF metadata ---------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict, vocab_size: int, source: str = "") -> "Qwen38Config":
        """meta: GGUF key -> python value; vocab_size: rows of token_embd (the metadata has no key for it).
        block_count includes MTP blocks; nextn_predict_layers says how many."""
        arch = meta.get("general.architecture")
        if arch != "qwen35":
            raise ConfigError(f"{source}: general.architecture is {arch!r}, expected 'qwen35'")
        keys = _Keys(meta, source, "qwen35.")
        num_mtp = keys.integer("nextn_predict_layers", 0, low=0, high=MAX_LAYERS)
        num_layers = keys.integer("block_count", low=num_mtp + 1, high=MAX_LAYERS + num_mtp) - num_mtp
        interval = keys.integer("full_attention_interval", 4)
        layer_types = layer_types_from_interval(num_layers, interval)
        recurrent = meta.get("qwen35.attention.recurrent_layers")
        if recurrent is not None and (not isinstance(recurrent, list) or len(recurrent) < num_layers
                                      or [r is True for r in recurrent[:num_layers]] != [t == GDN for t in layer_types]):
            raise ConfigError(f"{source}: qwen35.attention.recurrent_layers disagrees with full_attention_interval "
                              f"{interval} over the {num_layers} layers: expected "
                              f"{[t == GDN for t in layer_types]!r:.200}, found {recurrent!r:.200}")
        num_v_heads = keys.integer("ssm.time_step_rank")
        inner = keys.integer("ssm.inner_size")
        if inner % num_v_heads:
            raise ConfigError(f"{source}: ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {num_v_heads}")
        return cls(
            vocab_size=vocab_size, hidden_size=keys.integer("embedding_length"),
            intermediate_size=keys.integer("feed_forward_length"), layer_types=layer_types,
            num_attention_heads=keys.integer("attention.head_count"),
            num_key_value_heads=keys.integer("attention.head_count_kv"),
            head_dim=keys.integer("attention.key_length"), rotary_dim=keys.integer("rope.dimension_count"),
            rope_theta=keys.number("rope.freq_base"), linear_num_key_heads=keys.integer("ssm.group_count"),
            linear_num_value_heads=num_v_heads, linear_key_head_dim=keys.integer("ssm.state_size"),
            linear_value_head_dim=inner // num_v_heads, conv_kernel=keys.integer("ssm.conv_kernel"),
            rms_norm_eps=keys.number("attention.layer_norm_rms_epsilon"),
            max_position_embeddings=keys.integer("context_length", 262144), num_mtp_layers=num_mtp,
            eos_token_ids=gguf_stop_token_ids(meta, source), source=source,
        )


def _hf_layer_types(layer_types, num_layers: int, source: str) -> tuple[str, ...]:
    """An HF config's layer_types list, checked: num_layers known kinds."""
    kinds = {"full_attention": ATTENTION, "linear_attention": GDN}
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        found = f"{len(layer_types)} entries" if isinstance(layer_types, list) else repr(layer_types)[:80]
        raise ConfigError(f"{source}: layer_types must be a list of num_hidden_layers = {num_layers} entries, "
                          f"found {found}")
    unknown = sorted({repr(t) for t in layer_types if not isinstance(t, str) or t not in kinds})
    if unknown:
        raise ConfigError(f"{source}: unknown layer_types {unknown}, expected 'full_attention' or "
                          "'linear_attention'")
    return tuple(kinds[t] for t in layer_types)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_REQUIRED = object()


class _Keys:
    """Typed reads of a config's keys: an integer is an integer (not 128.0, "128", true or [128]) in a
    range, a number is finite; every error names the file and the key, expected vs found."""

    def __init__(self, values: dict, source: str, prefix: str = ""):
        self.values, self.source, self.prefix = values, source, prefix

    def _get(self, key: str, default):
        value = self.values.get(self.prefix + key, default)
        if value is _REQUIRED:
            raise ConfigError(f"{self.source}: config has no {self.prefix + key!r}")
        return value

    def integer(self, key: str, default=_REQUIRED, low: int = 1, high: int = MAX_DIM) -> int:
        value = self._get(key, default)
        if not (_is_int(value) and low <= value <= high):
            raise ConfigError(f"{self.source}: {self.prefix + key} must be an integer in [{low}, {high}], "
                              f"found {value!r:.80}")
        return value

    def number(self, key: str, default=_REQUIRED) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{self.source}: {self.prefix + key} must be a finite number, found {value!r:.80}")
        return float(value)

    def boolean(self, key: str, default=_REQUIRED) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.source}: {self.prefix + key} must be true or false, found {value!r:.80}")
        return value
