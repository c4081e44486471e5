"""Sequences that never re-read their past. A hybrid model's history is its state (16 KV caches and 48
fixed-size GDN states), so a snapshot of the state after a token prefix is all a continuation needs:

- Conversation: the token history and a snapshot of the state that has consumed it (all but the last
  token of the latest reply, which the next turn prefills with its own tokens).
- PrefixCache: snapshots keyed by the tokens they hold, least recently used evicted past a byte budget;
  a request restores the longest cached prefix of its prompt and prefills only the rest.

Both are passed to generate(); the output is the one the whole history would give from scratch."""
from __future__ import annotations

import pathlib
from collections import OrderedDict

import torch

from .state import StateSnapshot


class Conversation:
    def __init__(self):
        self.tokens: list[int] = []  # the whole history: prompts and replies
        self.snapshot: StateSnapshot | None = None  # the state after tokens[:snapshot.position]

    def reset(self) -> None:
        self.tokens, self.snapshot = [], None

    def save(self, path: str | pathlib.Path) -> None:
        """The snapshot and the history in one safetensors file (its header names the model config)."""
        if self.snapshot is None:
            raise ValueError("the conversation is empty: nothing to save")
        self.snapshot.save(path, {"tokens": torch.tensor(self.tokens, dtype=torch.int64)})

    @classmethod
    def load(cls, path: str | pathlib.Path, model) -> "Conversation":
        """A conversation saved by save(), onto model's device; another model config is a ValueError."""
        snapshot, extra = StateSnapshot.load(path, model.config, model.device)
        if "tokens" not in extra or extra["tokens"].shape[0] < snapshot.position:
            raise ValueError(f"{path} holds a state snapshot but not a conversation's token history")
        conversation = cls()
        conversation.tokens, conversation.snapshot = extra["tokens"].tolist(), snapshot
        return conversation


class PrefixCache:
    def __init__(self, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, found {max_bytes}")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], StateSnapshot] = OrderedDict()  # oldest use first
        self.hits = self.misses = 0

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.entries.values())

    def longest(self, tokens: list[int]) -> StateSnapshot | None:
        """The snapshot of the longest cached proper prefix of tokens (at least one token is left to
        prefill: the first new token comes from its logits), marked as recently used."""
        best = None
        for key in self.entries:
            if len(key) < len(tokens) and (best is None or len(key) > len(best)) and tuple(tokens[:len(key)]) == key:
                best = key
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(best)
        return self.entries[best]

    def put(self, tokens: list[int], snapshot: StateSnapshot) -> None:
        """Cache snapshot as the state after tokens[:snapshot.position]; one larger than the whole budget
        is not kept."""
        if snapshot.nbytes > self.max_bytes:
            return
        key = tuple(tokens[:snapshot.position])
        self.entries.pop(key, None)
        self.entries[key] = snapshot
        while self.nbytes > self.max_bytes:
            self.entries.popitem(last=False)
