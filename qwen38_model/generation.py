"""What decoding shares: a generation's statistics, its stop condition, the text streamer, the seed, and
undoing the steps a read-behind loop ran past a stop. The loop itself is engine.py's (BatchEngine: one
sequence or many, the plain step or speculative.py's MTP step)."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    graph: bool = False
    capture_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        # The first new token comes from the prefill's logits; the rest are decode steps.
        return (self.new_tokens - 1) / self.decode_s if self.decode_s and self.new_tokens > 1 else 0.0

    def __str__(self) -> str:
        # Time to first token = the prefill: it ends with the first new token selected.
        mode = "CUDA graph" if self.graph else "eager"
        return (f"prefill: {self.prompt_tokens} tokens, {self.prefill_tok_s:.1f} tok/s, time to first token "
                f"{self.prefill_s:.3f} s | decode ({mode}): {self.new_tokens} tokens, {self.decode_tok_s:.1f} tok/s")


@dataclass
class StopCondition:
    eos_token_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()
    tokenizer: object = None
    tokens: list[int] = field(default_factory=list)

    def done(self, token: int) -> bool:
        self.tokens.append(token)
        if token in self.eos_token_ids:
            return True
        if self.stop_strings:
            # A stop string of n characters lies within the last 4n + 8 tokens (a token may be a lone byte).
            tail = self.tokenizer.decode(self.tokens[-(4 * max(map(len, self.stop_strings)) + 8):])
            return any(s in tail for s in self.stop_strings)
        return False


class TextStreamer:
    """Prints text as it is generated (the put/end protocol of transformers' TextStreamer), never a
    partial multi-byte character."""

    def __init__(self, tokenizer, skip_prompt: bool = True, skip_special_tokens: bool = False, out=None):
        self.decoder = tokenizer.stream_decoder(skip_special_tokens)
        self.skip_prompt = skip_prompt
        self.out = out or sys.stdout
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            if self.skip_prompt:
                return
        for token in value.reshape(-1).tolist():
            self.out.write(self.decoder.feed(token))
        self.out.flush()

    def end(self) -> None:
        self.out.write(self.decoder.flush() + "\n")
        self.out.flush()


def resolve_seed(seed: int | None, generator: torch.Generator | None) -> int:
    if seed is not None:
        return int(seed)
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))


def keep_only(model, state, prompt_end, reply: list[int]) -> None:
    """Replays past a stop fed discarded tokens into the recurrent states: rewind to the end of the prompt
    and prefill the reply's tokens that belong to the history (all but the last, which the next turn
    feeds), so that the next turn processes only its own tokens; the prefill advances the MTP part by the MTP
    rule (state.py), the mark holding its carry. Done after the reply has been read: the stream has ended,
    and the next turn's first token does not wait for it."""
    state.rewind(prompt_end)
    if reply:
        ids = torch.tensor(reply, dtype=torch.int32, device=state.device)
        model.prefill(ids, state.reserve(len(reply)), state, logits_to_keep=1)
