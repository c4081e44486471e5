"""qwen38_model: Qwen3.8 (qwen35 / qwen3_5) as an nn.Module, loaded from GGUF or HF safetensors."""
from .api import Qwen38, load
from .config import Qwen38Config
from .errors import CheckpointError, ConfigError, Qwen38Error
from .model import CausalLMOutput, Qwen38ForCausalLM
from .state import Qwen38State

__version__ = "0.1.0"  # the package's one version string: pyproject.toml reads it from here

__all__ = ["CausalLMOutput", "CheckpointError", "ConfigError", "Qwen38", "Qwen38Config", "Qwen38Error",
           "Qwen38ForCausalLM", "Qwen38State", "load"]
