"""Exceptions a user can act on: each message names the file, the tensor or key, expected vs found."""


class Qwen38Error(Exception):
    """Base of qwen38's own errors."""


class CheckpointError(Qwen38Error):
    """A checkpoint (file or folder) cannot be loaded as a qwen35 / qwen3_5 model."""


class ConfigError(CheckpointError):
    """The model configuration is missing, unsupported or inconsistent."""


class ChatTemplateError(Qwen38Error, ValueError):
    """A chat template failed to compile or render, or went past its bounds (steps, size)."""


class NonFiniteLogitsError(Qwen38Error, FloatingPointError):
    """The model produced NaN or infinite logits while generating: its output is meaningless."""
