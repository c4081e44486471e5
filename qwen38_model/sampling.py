"""Choosing the next token on the device: HF's logits processors, then a counter-based sample.

Everything here is torch ops on device tensors with no host synchronisation, so it runs inside the
captured decode graph. The order is transformers' (generation/utils.py, _get_logits_processor):
repetition penalty, [presence penalty], min_new_tokens, then, when sampling, temperature, top-k, top-p,
min-p. presence_penalty is not a transformers processor: it follows vLLM / OpenAI (subtract the penalty
once from every token generated so far) and sits beside the repetition penalty.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ops = torch.ops.qwen38
MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingConfig:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50  # transformers' default; 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    min_new_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be True or False, found {self.do_sample!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, found {value!r}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, found {self.temperature}")
        for name in ("top_k", "min_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, found {value!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], found {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], found {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, found {self.repetition_penalty}")


@dataclass
class SamplerState:
    """Device tensors the processors read and the selection updates, fixed for a graph's lifetime."""

    seen: torch.Tensor  # bool [V]: prompt + generated tokens (repetition penalty)
    generated: torch.Tensor  # bool [V]: generated tokens (presence penalty)
    eos: torch.Tensor  # bool [V]: the stop tokens min_new_tokens holds back
    num_generated: torch.Tensor  # int32 [1]
    seed: torch.Tensor  # int64 [1]
    nonfinite: torch.Tensor  # bool [1]: some selection since reset() saw NaN or infinite logits

    @staticmethod
    def empty(vocab_size: int, device) -> "SamplerState":
        def mask():
            return torch.zeros(vocab_size, dtype=torch.bool, device=device)

        return SamplerState(mask(), mask(), mask(), torch.zeros(1, dtype=torch.int32, device=device),
                            torch.zeros(1, dtype=torch.int64, device=device),
                            torch.zeros(1, dtype=torch.bool, device=device))

    def reset(self, prompt: torch.Tensor, seed: int, eos_token_ids=()) -> None:
        """Host-to-device writes happen here, outside the captured step (a capture may not copy from host)."""
        self.seen.zero_()
        self.seen[prompt.long()] = True
        self.generated.zero_()
        self.eos.zero_()
        self.eos[list(eos_token_ids)] = True
        self.num_generated.zero_()
        self.seed.fill_(seed & MASK32)
        self.nonfinite.zero_()


def process_logits(logits: torch.Tensor, s: SamplerState, cfg: SamplingConfig) -> torch.Tensor:
    """logits float32 [V] -> the processed scores transformers would sample from (or take the argmax of)."""
    scores = logits
    if cfg.repetition_penalty != 1.0:
        penalized = torch.where(scores < 0, scores * cfg.repetition_penalty, scores / cfg.repetition_penalty)
        scores = torch.where(s.seen, penalized, scores)
    if cfg.presence_penalty != 0.0:
        scores = scores - cfg.presence_penalty * s.generated.to(scores.dtype)
    if cfg.min_new_tokens > 0 and cfg.eos_token_ids:
        scores = scores.masked_fill(s.eos & (s.num_generated < cfg.min_new_tokens), float("-inf"))
    if not cfg.do_sample:
        return scores
    if cfg.temperature != 1.0:
        scores = scores / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(scores, min(cfg.top_k, scores.shape[-1])).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_scores, order = torch.sort(scores)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= 1 - cfg.top_p
        drop_sorted[-1:].fill_(False)  # the most likely token always stays
        scores = scores.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    if cfg.min_p > 0.0:
        # transformers sorts to keep at least one token; the most likely one can never fall under
        # min_p * its own probability, so the plain comparison is the same filter.
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < cfg.min_p * probs.max(), float("-inf"))
    return scores


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finaliser (two multiply-xorshift rounds); int64 arithmetic with values kept under
    # 2^32 so every product fits and no platform's overflow behaviour matters.
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    return (x >> 16) ^ x


def uniform_noise(seed: torch.Tensor, counter: torch.Tensor, n: int) -> torch.Tensor:
    """Counter-based uniforms in (0, 1): a hash of (seed, step, index). Reproducible for a seed,
    different per step, the same on CPU and GPU, and free of host round trips."""
    key = _mix32((_mix32(counter.long() & MASK32) ^ seed) & MASK32)
    index = torch.arange(n, device=seed.device, dtype=torch.int64)
    bits = _mix32(_mix32((index ^ key) & MASK32) ^ key)
    return ((bits >> 8).to(torch.float32) + 0.5) / 2**24  # 24 bits: exact in float32, never 0 or 1


def select_next_token(logits: torch.Tensor, s: SamplerState, cfg: SamplingConfig, token: torch.Tensor,
                      position: torch.Tensor) -> None:
    """token <- argmax (greedy) or a sample (Gumbel-max) of the processed logits; position += 1.
    A NaN or infinite logit sets s.nonfinite (one sum: finite float32 logits cannot add up to infinity
    unless some exceeds 1e33), for generate() to report after the run without a host sync per step."""
    s.nonfinite.logical_or_(~torch.isfinite(logits.sum()))
    scores = process_logits(logits, s, cfg)
    if cfg.do_sample:
        u = uniform_noise(s.seed, s.num_generated, scores.shape[-1])
        scores = scores - torch.log(-torch.log(u))
    ops.argmax_advance(scores.contiguous(), token, position)
    s.seen.index_fill_(0, token.long(), True)
    s.generated.index_fill_(0, token.long(), True)
    s.num_generated.add_(1)
