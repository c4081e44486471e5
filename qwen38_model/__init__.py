"""qwen38_model: Qwen3.8 (qwen35 / qwen3_5) as an nn.Module, loaded from GGUF or HF safetensors.

The model's names are imported on first use (PEP 562): `qwen38` and `python -m qwen38_model` import this
package before any of the command line's code runs, and the command line must be able to catch a Ctrl-C
while torch loads (a second or more) to exit with a short message instead of a traceback."""
import importlib

from .errors import CheckpointError, ConfigError, Qwen38Error

__version__ = "0.1.0"  # the package's one version string: pyproject.toml reads it from here

_LAZY = {"Qwen38": "api", "load": "api", "Qwen38Config": "config", "CausalLMOutput": "model",
         "Qwen38ForCausalLM": "model", "Qwen38State": "state", "StateSnapshot": "state",
         "Conversation": "conversation", "PrefixCache": "conversation",
         "TensorParallelCausalLM": "tensor_parallel"}

__all__ = ["CausalLMOutput", "CheckpointError", "ConfigError", "Conversation", "PrefixCache", "Qwen38",
           "Qwen38Config", "Qwen38Error", "Qwen38ForCausalLM", "Qwen38State", "StateSnapshot",
           "TensorParallelCausalLM", "load"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # once imported, a plain attribute
    return value
