"""What the serving benchmarks (serve.py, prefix_cache.py) share: the packages they need and the model they serve."""
from __future__ import annotations

import torch


def require_server_packages(benchmark: str, tiny: bool) -> None:
    """A clear exit when the server's packages (or, without --tiny, a GPU) are missing."""
    try:
        import openai  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"benchmarks.{benchmark} needs openai, starlette and uvicorn ({e})") from None
    if not tiny and not torch.cuda.is_available():
        raise SystemExit(f"benchmarks.{benchmark} needs a CUDA GPU (or --tiny)")


def serving_model(checkpoint: str | None, tiny: bool, synthetic_tokenizer):
    """(model, tokenizer, name): with tiny the built-in default model (or checkpoint) on the CPU; else the
    checkpoint on the GPU, or the 27B shape with synthetic Q8_0 weights and synthetic_tokenizer(vocab_size)."""
    from qwen38_model.tokenizer import load_tokenizer

    if tiny:
        from qwen38_model import Qwen38ForCausalLM
        from qwen38_model.default_model import default_model_path

        path = checkpoint or default_model_path()
        return Qwen38ForCausalLM.from_pretrained(path, device="cpu"), load_tokenizer(path), "tiny"
    from benchmarks.decode import build_model

    model = build_model(checkpoint, "int8")
    if checkpoint:
        return model, load_tokenizer(checkpoint), "checkpoint"
    return model, synthetic_tokenizer(model.config.vocab_size), "synthetic-27b-q8_0"
