"""Decoding: a batched prefill through the model's forward, then one token per step, each step replayed
from a captured CUDA graph on the GPU (eager on the CPU), and HF-style generate() on top.

The step is the model's own `run` over static buffers (one Scratch, the state, device-held token and
position): the graph wraps it, it never forks into a second implementation. The host never waits for
a token before launching the next replay: tokens are copied asynchronously into pinned memory and read
a few steps behind, for streaming and stop checks.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from .sampling import SamplerState, SamplingConfig, select_next_token
from .scratch import Scratch
from .state import StateSnapshot

READ_BEHIND = 4  # replays in flight before the host waits for the oldest token


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


class DecodeEngine:
    """Static decode buffers for one sequence of up to max_seq_len tokens, and the captured step graphs
    (one per sampling configuration: the processors are part of the graph)."""

    def __init__(self, model, max_seq_len: int, kv_dtype: torch.dtype, use_graph: bool | None = None):
        self.model = model
        self.device = model.device
        self.max_seq_len = max_seq_len
        self.kv_dtype = kv_dtype
        self.use_graph = self.device.type == "cuda" if use_graph is None else use_graph
        if self.use_graph and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.state = model.new_state(max_seq_len, kv_dtype)
        self.scratch = Scratch(self.device)
        self.token = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.position = self.state.device_position  # the state's own: a step advances it on the device
        self.sampler = SamplerState.empty(model.config.vocab_size, self.device)
        self.graphs: dict[SamplingConfig, torch.cuda.CUDAGraph] = {}
        # Replays launched before the host reads a token: the steps past a stop feed discarded tokens
        # into the state (run_generation rolls them back when the state is to be continued).
        self.read_ahead = READ_BEHIND if self.use_graph else 0
        self.logits: torch.Tensor | None = None  # the step's logits buffer (fixed once allocated)

    def step(self, cfg: SamplingConfig) -> None:
        """Consume self.token at self.position; leave the next token there and advance the position."""
        self.logits = self.model.run(self.token, self.position, self.state, self.scratch)
        select_next_token(self.logits[0], self.sampler, cfg, self.token, self.position)

    def graph_for(self, cfg: SamplingConfig) -> torch.cuda.CUDAGraph:
        """Capture the step for cfg (once). Must run before reset(): the warm-up step writes the state."""
        if cfg not in self.graphs:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up allocates every scratch buffer, off the capture
                self.warm_up(cfg)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.step(cfg)
            self.graphs[cfg] = graph
            self.scratch.freeze()
        return self.graphs[cfg]

    def warm_up(self, cfg: SamplingConfig) -> None:
        """The step run once before its capture (eagerly: it allocates the scratch buffers), on a token and
        a position set here to valid values (token 0 at position 0), not on whatever the engine holds: a
        warm-up reading an id outside the vocabulary or a position outside the cache would raise the state's
        error flag (or, through an unchecked op, a device-side assert). It writes the state: reset() must
        follow."""
        self.token.zero_()
        self.position.zero_()
        self.step(cfg)

    def reset(self, history: torch.Tensor, seed: int, cfg: SamplingConfig, start: StateSnapshot | None = None) -> None:
        """Empty state, or `start` copied into the state's own tensors (the graphs keep their addresses);
        the sampler sees the whole history either way, so the output is the same as from scratch."""
        if start is None:
            self.state.clear()
        else:
            self.state.restore(start)
        self.sampler.reset(history, seed, cfg.eos_token_ids)

    def prefill(self, prompt: torch.Tensor, cfg: SamplingConfig, progress=None) -> None:
        """The prompt through the model's chunked prefill (every op takes T tokens), then the first new
        token from the last row's logits, selected exactly as a step selects."""
        positions = self.state.reserve(prompt.shape[0])
        logits = self.model.prefill(prompt, positions, self.state, logits_to_keep=1, progress=progress)
        self.position.fill_(self.state.position - 1)
        select_next_token(logits[0], self.sampler, cfg, self.token, self.position)


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


def run_generation(engine: DecodeEngine, history: torch.Tensor, cfg: SamplingConfig, max_new_tokens: int,
                   seed: int, stop: StopCondition, streamer=None, prefill_progress=None,
                   start: StateSnapshot | None = None, keep_state: bool = False,
                   snapshot_prompt: bool = False) -> tuple[list[int], GenerationStats, StateSnapshot | None]:
    """history int32 [T] on the engine's device: the whole sequence so far. start: a snapshot of its
    first start.position tokens (then only the rest is prefilled), else the whole history is. Returns the
    new tokens (stop token included). keep_state: leave the state holding exactly history + the new tokens
    but the last (undoing the read-ahead steps past a stop), so that it can be snapshotted and continued.
    snapshot_prompt: also return a snapshot of the state at the end of the history (else None is).
    prefill_progress: optional callable(tokens_done, tokens_total) called after each prompt chunk."""
    check_run(engine, history, max_new_tokens, start)
    stats = GenerationStats(prompt_tokens=history.shape[0] - (start.position if start else 0), graph=engine.use_graph)
    if engine.use_graph:
        clock = time.perf_counter()
        graph = engine.graph_for(cfg)
        stats.capture_s = time.perf_counter() - clock
        replay = graph.replay
    else:
        def replay():
            engine.step(cfg)
    engine.reset(history, seed, cfg, start)  # after the capture: its warm-up step writes the state
    prompt = history[engine.state.position:]
    on_gpu = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    host = torch.empty(max_new_tokens, dtype=torch.int32, pin_memory=on_gpu)
    events = []

    def launch_copy(i: int) -> None:
        host[i : i + 1].copy_(engine.token, non_blocking=True)
        if on_gpu:
            events.append(torch.cuda.Event())
            events[-1].record()

    sync()
    clock = time.perf_counter()
    engine.prefill(prompt, cfg, prefill_progress)
    launch_copy(0)
    ahead = engine.read_ahead
    # Only a read-ahead can overrun a stop; the end of the prompt is the point to rewind to.
    rewind_mark = engine.state.mark() if keep_state and ahead else None
    after_prefill = engine.state.snapshot() if snapshot_prompt else None
    sync()
    stats.prefill_s = time.perf_counter() - clock
    clock = time.perf_counter()
    launched = 1  # token 0 came from the prefill
    for read in range(max_new_tokens):
        while launched < max_new_tokens and launched <= read + ahead:
            replay()
            launch_copy(launched)
            launched += 1
        if on_gpu:
            events[read].synchronize()
        token = int(host[read])
        if streamer is not None:
            streamer.put(torch.tensor([token]))
        if stop.done(token):
            break
    sync()
    stats.decode_s = time.perf_counter() - clock
    stats.new_tokens = len(stop.tokens)
    engine.state.sync_position()  # steps run, including replays past a stop (then discarded)
    if rewind_mark is not None and engine.state.position != history.shape[0] + len(stop.tokens) - 1:
        keep_only(engine.model, engine.state, rewind_mark, stop.tokens[:-1])
    return stop.tokens, stats, after_prefill


def check_run(engine, history: torch.Tensor, max_new_tokens: int, start: StateSnapshot | None) -> None:
    if history.shape[0] + max_new_tokens > engine.max_seq_len:
        raise ValueError(f"context overflow: {history.shape[0]} prompt tokens + max_new_tokens {max_new_tokens} > "
                         f"max_seq_len {engine.max_seq_len}")
    if start is not None and start.position >= history.shape[0]:
        raise ValueError(f"the start snapshot holds {start.position} tokens: the history ({history.shape[0]}) must "
                         "extend it by at least one token to prefill")


def keep_only(model, state, prompt_end, reply: list[int]) -> None:
    """Replays past a stop fed discarded tokens into the recurrent states: rewind to the end of the prompt
    and prefill the reply's tokens that belong to the history (all but the last, which the next turn
    feeds), so that the next turn processes only its own tokens. Done after the reply has been read: the
    stream has ended, and the next turn's first token does not wait for it."""
    state.rewind(prompt_end)
    if reply:
        ids = torch.tensor(reply, dtype=torch.int32, device=state.device)
        model.prefill(ids, state.reserve(len(reply)), state, logits_to_keep=1)
