"""The one-call entry for the common case: `qwen38_model.load(path)` gives the model and its tokenizer,
with `complete()` and `chat()` returning the generated text. Everything else is the model's own API."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

import torch

from .model import Qwen38ForCausalLM
from .tokenizer import Tokenizer, load_tokenizer


@dataclass
class Qwen38:
    model: Qwen38ForCausalLM
    tokenizer: Tokenizer

    def complete(self, prompt: str, **gen_kwargs) -> str:
        """The text that follows prompt; gen_kwargs go to model.generate() (max_new_tokens, do_sample, ...)."""
        return self._generate(self.tokenizer.encode(prompt), gen_kwargs)

    def chat(self, messages: list[dict[str, Any]], **gen_kwargs) -> str:
        """The assistant's reply to messages ([{"role": "user", "content": "Hi!"}, ...]) under the
        checkpoint's chat template; gen_kwargs go to model.generate()."""
        return self._generate(self.tokenizer.encode(self.tokenizer.apply_chat_template(messages)), gen_kwargs)

    def _generate(self, ids: list[int], gen_kwargs: dict[str, Any]) -> str:
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        prompt = torch.tensor([ids])
        out = self.model.generate(prompt, **{"tokenizer": self.tokenizer, **gen_kwargs})
        # Special tokens (end of turn, end of text) end the reply; they are not part of its text.
        return self.tokenizer.decode(out[0, prompt.shape[1]:].tolist(), skip_special_tokens=True)


def load(path: str | pathlib.Path | None = None, device=None, **kwargs) -> Qwen38:
    """path: a .gguf file or an HF folder (default: the built-in synthetic model, random weights).
    device (default CUDA when available) and kwargs (dtype, quantize, lane) go to from_pretrained."""
    if path is None:
        from .default_model import default_model_path

        path = default_model_path()
    return Qwen38(Qwen38ForCausalLM.from_pretrained(path, device=device, **kwargs), load_tokenizer(path))
