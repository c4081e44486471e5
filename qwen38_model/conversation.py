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
from dataclasses import dataclass

import safetensors
import torch

from .state import StateSnapshot


class Conversation:
    def __init__(self):
        self.tokens: list[int] = []  # the whole history: prompts and replies
        self.snapshot: StateSnapshot | None = None  # the state after tokens[:snapshot.position]

    def reset(self) -> None:
        self.tokens, self.snapshot = [], None

    def save(self, path: str | pathlib.Path) -> None:
        """The snapshot and the history in one safetensors file (its header names the model config). A path
        that cannot be written is an OSError naming it (safetensors' own error names its temporary file)."""
        if self.snapshot is None:
            raise ValueError("the conversation is empty: nothing to save")
        path = pathlib.Path(path)
        if path.is_dir():
            raise IsADirectoryError(f"cannot save the conversation to {path}: it is a folder")
        if not path.parent.is_dir():
            raise FileNotFoundError(f"cannot save the conversation to {path}: no folder {path.parent}")
        try:
            self.snapshot.save(path, {"tokens": torch.tensor(self.tokens, dtype=torch.int64)})
        except safetensors.SafetensorError as e:  # e.g. no permission, a full disk
            raise OSError(f"cannot save the conversation to {path}: {e}") from None

    @classmethod
    def load(cls, path: str | pathlib.Path, model) -> "Conversation":
        """A conversation saved by save(), onto model's device. The state is checked as StateSnapshot.load
        checks it; the history must be save()'s "tokens" alone: int64, 1-D, at least the state's tokens,
        within the model's context, every id in the vocabulary. Any fault is a ValueError naming the file
        and the field (another model config: the fields that differ)."""
        snapshot, extra = StateSnapshot.load(path, model.config, model.device)
        if "tokens" not in extra:
            raise ValueError(f"{path} holds a state snapshot but not a conversation's token history (no tensor "
                             "'tokens')")
        if extra.keys() != {"tokens"}:
            raise ValueError(f"{path}: unexpected tensor {sorted(extra.keys() - {'tokens'})[0]!r} (a conversation "
                             "file holds the state and 'tokens')")
        check_history(path, extra["tokens"], snapshot.position, model.config)
        conversation = cls()
        conversation.tokens, conversation.snapshot = extra["tokens"].tolist(), snapshot
        return conversation


def check_history(path, tokens: torch.Tensor, position: int, config) -> None:
    """A saved history as save() writes it, and one the model can continue: int64 [n] with
    position <= n <= the model's context, ids in [0, vocab) (an id outside it would embed a NaN row, or
    overflow the kernels' int32 ids)."""
    if tokens.dtype != torch.int64 or tokens.dim() != 1:
        raise ValueError(f"{path}: tensor 'tokens': expected int64 of shape [n], found {tokens.dtype} of shape "
                         f"{list(tokens.shape)}")
    n = tokens.shape[0]
    if not position <= n <= config.max_position_embeddings:
        raise ValueError(f"{path}: tensor 'tokens': expected between the state's {position} tokens and the model's "
                         f"context of {config.max_position_embeddings}, found {n}")
    bad = ((tokens < 0) | (tokens >= config.vocab_size)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"{path}: tensor 'tokens': id {int(tokens[i])} at index {i} is outside the vocabulary "
                         f"[0, {config.vocab_size})")


@dataclass
class CacheEntry:
    """A cached snapshot and, for one taken at the end of a prompt, that prompt's last logits (float32 [V]): the
    same prompt again starts from both, prefilling nothing."""

    snapshot: StateSnapshot
    logits: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.snapshot.nbytes + (0 if self.logits is None else self.logits.numel() * self.logits.element_size())

    def to_host(self) -> "CacheEntry":
        logits = None
        if self.logits is not None:
            logits = torch.empty(self.logits.shape, dtype=self.logits.dtype, pin_memory=torch.cuda.is_available())
            logits.copy_(self.logits)
        return CacheEntry(self.snapshot.to_host(), logits)


class PrefixCache:
    """Snapshots in two tiers, each least-recently-used first within its byte budget: where the model runs
    (max_bytes), and host memory (max_host_bytes, pinned where CUDA is present), which takes what the
    first tier evicts. A host hit restores straight from host memory."""

    def __init__(self, max_bytes: int, max_host_bytes: int = 0):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, found {max_bytes}")
        if max_host_bytes < 0:
            raise ValueError(f"max_host_bytes must be >= 0, found {max_host_bytes}")
        self.max_bytes, self.max_host_bytes = max_bytes, max_host_bytes
        self.entries: OrderedDict[tuple[int, ...], CacheEntry] = OrderedDict()  # oldest use first
        self.host: OrderedDict[tuple[int, ...], CacheEntry] = OrderedDict()
        self.hits = self.misses = 0

    @property
    def nbytes(self) -> int:
        return tier_bytes(self.entries)

    @property
    def host_nbytes(self) -> int:
        return tier_bytes(self.host)

    def longest(self, tokens: list[int]) -> StateSnapshot | None:
        """The snapshot of the longest cached proper prefix of tokens (at least one token is left to
        prefill: the first new token comes from its logits), marked as recently used."""
        best, best_tier = None, None
        for tier in (self.entries, self.host):
            for key in tier:
                if len(key) < len(tokens) and (best is None or len(key) > len(best)) and tuple(tokens[:len(key)]) == key:
                    best, best_tier = key, tier
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        best_tier.move_to_end(best)
        return best_tier[best].snapshot

    def at(self, tokens: list[int]) -> StateSnapshot | None:
        """The snapshot of exactly tokens, marked as recently used; else None."""
        key = tuple(tokens)
        for tier in (self.entries, self.host):
            if key in tier:
                tier.move_to_end(key)
                return tier[key].snapshot
        return None

    def whole(self, tokens: list[int]) -> tuple[StateSnapshot, torch.Tensor] | None:
        """The snapshot of exactly tokens and their last logits, where a prompt's end was cached with them (an
        exact repeat of a prompt starts there: the first new token is selected from those logits, bit for bit
        what the prefill gave), marked as recently used; else None (longest() then)."""
        key = tuple(tokens)
        for tier in (self.entries, self.host):
            entry = tier.get(key)
            if entry is not None and entry.logits is not None:
                self.hits += 1
                tier.move_to_end(key)
                return entry.snapshot, entry.logits
        return None

    def put(self, tokens: list[int], snapshot: StateSnapshot, logits: torch.Tensor | None = None) -> None:
        """Cache snapshot as the state after tokens[:snapshot.position] (with logits: those of its last token,
        for whole()); one larger than the budget is not kept."""
        entry = CacheEntry(snapshot, logits)
        if entry.nbytes > self.max_bytes:
            return
        key = tuple(tokens[:snapshot.position])
        self.host.pop(key, None)
        old = self.entries.pop(key, None)
        if logits is None and old is not None and old.logits is not None:
            entry.logits = old.logits  # the same state: keep what an exact repeat needs
        self.entries[key] = entry
        while self.nbytes > self.max_bytes:
            self.spill(*self.entries.popitem(last=False))

    def spill(self, key: tuple[int, ...], entry: CacheEntry) -> None:
        if entry.nbytes > self.max_host_bytes:
            return
        self.host[key] = entry.to_host()
        while self.host_nbytes > self.max_host_bytes:
            self.host.popitem(last=False)


def tier_bytes(tier: OrderedDict) -> int:
    return sum(entry.nbytes for entry in tier.values())
