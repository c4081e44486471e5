"""Qwen38Config: the model's shape, read from GGUF metadata or an HF config.json, never assumed."""
from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field

from .errors import ConfigError

ATTENTION, GDN = "attention", "gdn"


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
    num_mtp_layers: int = 0  # nextn / mtp.* blocks present in the checkpoint (loaded later, not run)
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
                     "linear_key_head_dim", "linear_value_head_dim", "conv_kernel"):
            need(getattr(self, name) > 0, f"{name} must be positive, found {getattr(self, name)}")
        need(self.num_layers > 0, "no layers")
        bad = sorted(set(self.layer_types) - {ATTENTION, GDN})
        need(not bad, f"unknown layer types {bad}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
             f"{self.num_key_value_heads}")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0,
             f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of linear_num_key_heads "
             f"{self.linear_num_key_heads}")
        need(0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0,
             f"rotary_dim {self.rotary_dim} must be even and within head_dim {self.head_dim}")
        need(self.rms_norm_eps > 0 and math.isfinite(self.rope_theta) and self.rope_theta > 0,
             f"rms_norm_eps {self.rms_norm_eps} / rope_theta {self.rope_theta} out of range")

    # ---- HF config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf_folder(cls, folder: str | pathlib.Path) -> "Qwen38Config":
        path = pathlib.Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{folder}: no config.json (an HF checkpoint folder needs one)") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        eos = _eos_ids(raw, pathlib.Path(folder) / "generation_config.json")
        return cls.from_hf_dict(raw, source=str(path), eos_token_ids=eos)

    @classmethod
    def from_hf_dict(cls, raw: dict, source: str = "", eos_token_ids: tuple[int, ...] = ()) -> "Qwen38Config":
        """Accepts the text-only form (model_type qwen3_5_text) and the released VLM form (qwen3_5, with
        the language model under text_config)."""
        model_type = raw.get("model_type")
        if model_type == "qwen3_5":
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{source}: model_type qwen3_5 without a text_config")
            tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        elif model_type == "qwen3_5_text":
            text, tie = raw, raw.get("tie_word_embeddings", False)
        else:
            raise ConfigError(f"{source}: unsupported model_type {model_type!r}, expected 'qwen3_5_text' or 'qwen3_5' "
                              "(Qwen3.5 / Qwen3.8 hybrid GDN + attention)")

        def get(key, default=None):
            if key in text:
                return text[key]
            if default is None:
                raise ConfigError(f"{source}: config has no {key!r}")
            return default

        num_layers = get("num_hidden_layers")
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = get("full_attention_interval", 4)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(num_layers)]
        kinds = {"full_attention": ATTENTION, "linear_attention": GDN}
        unknown = sorted(set(layer_types) - set(kinds))
        if unknown:
            raise ConfigError(f"{source}: unknown layer_types {unknown}")
        if len(layer_types) != num_layers:
            raise ConfigError(f"{source}: layer_types has {len(layer_types)} entries, num_hidden_layers is {num_layers}")
        rope = text.get("rope_parameters") or {}
        theta = rope.get("rope_theta", text.get("rope_theta"))
        if theta is None:
            raise ConfigError(f"{source}: no rope_theta in rope_parameters")
        head_dim = get("head_dim", get("hidden_size") // get("num_attention_heads"))
        factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        eos = eos_token_ids or _as_tuple(text.get("eos_token_id", raw.get("eos_token_id")))
        return cls(
            vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"), layer_types=tuple(kinds[t] for t in layer_types),
            num_attention_heads=get("num_attention_heads"), num_key_value_heads=get("num_key_value_heads"),
            head_dim=head_dim, rotary_dim=int(head_dim * factor), rope_theta=float(theta),
            linear_num_key_heads=get("linear_num_key_heads"), linear_num_value_heads=get("linear_num_value_heads"),
            linear_key_head_dim=get("linear_key_head_dim"), linear_value_head_dim=get("linear_value_head_dim"),
            conv_kernel=get("linear_conv_kernel_dim"), rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            max_position_embeddings=get("max_position_embeddings", 262144), tie_word_embeddings=bool(tie),
            num_mtp_layers=int(text.get("mtp_num_hidden_layers", 0)), eos_token_ids=eos, source=source,
        )

    # ---- GGUF metadata ---------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict, vocab_size: int, source: str = "") -> "Qwen38Config":
        """meta: GGUF key -> python value; vocab_size: rows of token_embd (the metadata has no key for it).
        block_count includes MTP blocks; nextn_predict_layers says how many."""
        arch = meta.get("general.architecture")
        if arch != "qwen35":
            raise ConfigError(f"{source}: general.architecture is {arch!r}, expected 'qwen35'")

        def get(key, default=None):
            full = f"qwen35.{key}"
            if full in meta:
                return meta[full]
            if default is None:
                raise ConfigError(f"{source}: GGUF metadata has no {full!r}")
            return default

        num_mtp = int(get("nextn_predict_layers", 0))
        num_layers = int(get("block_count")) - num_mtp
        interval = int(get("full_attention_interval", 4))
        layer_types = tuple(ATTENTION if (i + 1) % interval == 0 else GDN for i in range(num_layers))
        recurrent = meta.get("qwen35.attention.recurrent_layers")
        if recurrent is not None and [bool(r) for r in recurrent[:num_layers]] != [t == GDN for t in layer_types]:
            raise ConfigError(f"{source}: qwen35.attention.recurrent_layers disagrees with full_attention_interval "
                              f"{interval}")
        head_k_dim = int(get("ssm.state_size"))
        num_v_heads = int(get("ssm.time_step_rank"))
        inner = int(get("ssm.inner_size"))
        if inner % num_v_heads:
            raise ConfigError(f"{source}: ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {num_v_heads}")
        eos = _as_tuple(meta.get("tokenizer.ggml.eos_token_id"))
        return cls(
            vocab_size=vocab_size, hidden_size=int(get("embedding_length")),
            intermediate_size=int(get("feed_forward_length")), layer_types=layer_types,
            num_attention_heads=int(get("attention.head_count")), num_key_value_heads=int(get("attention.head_count_kv")),
            head_dim=int(get("attention.key_length")), rotary_dim=int(get("rope.dimension_count")),
            rope_theta=float(get("rope.freq_base")), linear_num_key_heads=int(get("ssm.group_count")),
            linear_num_value_heads=num_v_heads, linear_key_head_dim=head_k_dim,
            linear_value_head_dim=inner // num_v_heads, conv_kernel=int(get("ssm.conv_kernel")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(get("context_length", 262144)), num_mtp_layers=num_mtp,
            eos_token_ids=eos, source=source,
        )


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _eos_ids(config: dict, generation_config: pathlib.Path) -> tuple[int, ...]:
    # generation_config.json carries the stop set the model was released with; config.json may name one id.
    if generation_config.exists():
        try:
            ids = _as_tuple(json.loads(generation_config.read_text()).get("eos_token_id"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{generation_config}: not valid JSON ({e})") from None
        if ids:
            return ids
    return ()
