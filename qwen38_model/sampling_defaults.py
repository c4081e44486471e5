"""The sampling settings a checkpoint was released with, read as transformers and llama.cpp read them.

An HF folder's generation_config.json or a GGUF's general.sampling.* keys. The command line puts its
options over them (and SAMPLING_DEFAULTS under them); the server puts a request's fields over them, as vLLM
does with a model's generation config.
"""
from __future__ import annotations

import math
import pathlib

from .files import folder_file, read_json

# What sampling uses where neither the command line nor the checkpoint sets a value: greedy, and
# transformers' defaults for the filters.
SAMPLING_DEFAULTS = {"temperature": 0.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
# llama.cpp's converter copies generation_config.json into these GGUF keys (llama.cpp's own defaults).
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                      "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}


def checkpoint_sampling(path: pathlib.Path, gguf_metadata: dict | None) -> dict:
    """The settings of SAMPLING_DEFAULTS that the checkpoint sets, as it stores them (check_settings checks
    them). gguf_metadata: a GGUF's metadata (read_gguf_metadata, read once by the caller for all it takes
    from the header); None for an HF folder, whose generation_config.json is read here."""
    if gguf_metadata is not None:
        return from_gguf_metadata(gguf_metadata)
    if not (path / "generation_config.json").exists():
        return {}
    config = read_json(folder_file(path, "generation_config.json"), "generation_config.json")
    return from_generation_config(config if isinstance(config, dict) else {})


def from_generation_config(config: dict) -> dict:
    """transformers' reading: without do_sample the decoding is greedy, whatever the temperature. A config
    that says nothing about either leaves the temperature to the caller's default."""
    settings = {k: config[k] for k in ("top_k", "top_p", "min_p", "repetition_penalty") if config.get(k) is not None}
    if "do_sample" in config or "temperature" in config:
        settings["temperature"] = float(config.get("temperature") or 1.0) if config.get("do_sample") else 0.0
    return settings


def from_gguf_metadata(metadata: dict) -> dict:
    return {name: metadata[key] for key, name in GGUF_SAMPLING_KEYS.items() if key in metadata}


def check_settings(settings: dict, source) -> dict:
    """settings (names of SAMPLING_DEFAULTS), each a finite number of its default's type (top_k an int),
    the temperature >= 0. source(name): how an error names the value (an option, a checkpoint key)."""
    checked = {}
    for k, v in settings.items():
        kind = type(SAMPLING_DEFAULTS[k])
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or kind(v) != v:
            raise ValueError(f"{source(k)} must be a finite {kind.__name__}, found {v!r:.40}")
        if k == "temperature" and v < 0:
            raise ValueError(f"{source(k)} must be >= 0 (0 = greedy), found {v}")
        checked[k] = kind(v)
    return checked
