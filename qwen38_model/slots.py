"""The states of many sequences at once: num_slots slots in stacked tensors, the slot index leading.

Two views of the same memory:
- slot(s) is sequence s's own Qwen38State (views into the stacked tensors): prefill, snapshot, restore,
  mark and rewind run on it unchanged, one sequence at a time;
- rows(B) is the batched state of slots 0..B-1 that one decode step over B rows takes: per attention layer
  the caches [B, L, Hkv, hd], per GDN layer the states [B, ...], the ops' batched-rows mode (row b is
  sequence b, with its own cache and state), so B sequences decode in one launch per op; rows(B, tokens=n) the
  same for a speculative verify of n tokens a slot (B * n rows, slot b's at b*n .. b*n + n - 1: the ops'
  batched-rows mode with n consecutive rows a sequence), each GDN layer keeping the state after every token
  (keep_token_states) so that accept() makes any prefix of each slot's n tokens its state.
Row b of a step (rows b*n.. of a verify) is always slot b: a step's graph for B rows serves whichever sequences
hold slots below B, with no indirection and no recapture when sequences join or leave.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import ATTENTION, GDN, Qwen38Config
from .state import (BAD_POSITION, BAD_TOKEN, GDNState, KVCache, Qwen38State, available_memory, check_kv_dtype,
                    check_state_size)


@dataclass
class BatchRows:
    """What the model's trunk reads of a state, for B rows that are B sequences."""

    layers: list[KVCache | GDNState]
    bad_position: torch.Tensor  # int32 [rows]: row r's error flag (the ops' per-row flags)
    # With an MTP block: its caches [B, L, Hkv, hd] and the rows' hidden carries float32 [B, D] (state.py's rule)
    mtp_cache: KVCache | None = None
    mtp_hidden: torch.Tensor | None = None


class SlotStates:
    def __init__(self, config: Qwen38Config, num_slots: int, max_seq_len: int, device, kv_dtype: torch.dtype,
                 name: str = "max_seq_len", mtp: bool = False, spare_rows: int = 0):
        """mtp: each slot also holds an MTP block's KV cache and hidden carry, as a model's new_state does (every
        step advances them by state.py's MTP rule). spare_rows: see state.check_state_size."""
        check_kv_dtype(kv_dtype)
        check_batch_state_size(config, num_slots, max_seq_len, device, kv_dtype, name, mtp, spare_rows)
        c = config
        self.config, self.num_slots, self.max_seq_len = config, num_slots, max_seq_len
        self.device = torch.device(device)
        num_gdn = sum(kind != ATTENTION for kind in c.layer_types)
        self.positions = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.flags = torch.zeros(num_slots, dtype=torch.int32, device=device)
        # [layer, slot, ...]: rows(B) of a layer is one contiguous [B, ...] prefix, slot(s) of a layer one
        # contiguous [...] block.
        self.gdn_conv = torch.zeros(num_gdn, num_slots, c.conv_kernel - 1, c.conv_dim, device=device)
        self.gdn_recurrent = torch.zeros(num_gdn, num_slots, c.linear_num_value_heads, c.linear_value_head_dim,
                                         c.linear_key_head_dim, device=device)
        kv_shape = (num_slots, max_seq_len, c.num_key_value_heads, c.head_dim)
        self.kv = [(torch.zeros(kv_shape, dtype=kv_dtype, device=device),
                    torch.zeros(kv_shape, dtype=kv_dtype, device=device))
                   for _ in range(len(c.layer_types) - num_gdn + mtp)]  # the MTP block's last
        self.mtp_hidden = torch.zeros(num_slots, 1, c.hidden_size, device=device) if mtp else None
        self.token_conv = self.token_recurrent = None  # keep_token_states
        self.slots = [Qwen38State.over(config, max_seq_len, self.positions[s : s + 1], self.flags[s : s + 1],
                                       self.gdn_conv[:, s], self.gdn_recurrent[:, s],
                                       [(k[s], v[s]) for k, v in self.kv],
                                       self.mtp_hidden[s] if mtp else None)
                      for s in range(num_slots)]

    def slot(self, s: int) -> Qwen38State:
        return self.slots[s]

    def keep_token_states(self, max_tokens: int) -> None:
        """Buffers for the per-token GDN states of verifies of up to max_tokens tokens a slot (rows(B, tokens=n)
        writes them, accept() keeps one a slot): [layer, slot * n + token, ...], each layer's B * n rows contiguous
        as gdn_step writes them. At the 27B shape: num_slots x max_tokens x 48 x 3.1 MB; a ValueError before
        anything is allocated when the device has not that much free."""
        c, rows = self.config, self.num_slots * max_tokens
        conv_shape = (self.gdn_conv.shape[0], rows, *self.gdn_conv.shape[2:])
        recurrent_shape = (self.gdn_recurrent.shape[0], rows, *self.gdn_recurrent.shape[2:])
        needed = 4 * (math.prod(conv_shape) + math.prod(recurrent_shape))
        available = available_memory(self.device)
        if available is not None and needed > available:
            raise ValueError(f"the speculative verify's per-token GDN states ({self.num_slots} sequences x {max_tokens} "
                             f"tokens x {c.layer_types.count(GDN)} layers) need {needed / 1e9:.2f} GB, {self.device} has "
                             f"{available / 1e9:.2f} GB available: fewer sequences or draft tokens")
        self.token_conv = torch.empty(conv_shape, device=self.device)
        self.token_recurrent = torch.empty(recurrent_shape, device=self.device)

    def rows(self, num_rows: int, tokens: int = 1, flags: torch.Tensor | None = None) -> BatchRows:
        """Slots 0..num_rows-1 for a step of `tokens` consecutive rows a slot (more than 1: a verify, the GDN layers
        writing each token's state into keep_token_states' buffers). flags: int32 [num_rows * tokens], a flag a
        row the ops set instead of the slots' own (fold_flags ORs them in); None: the slots' flags (tokens 1)."""
        flags = self.flags[:num_rows] if flags is None else flags
        caches, gdn = iter(self.kv), iter(zip(self.gdn_conv, self.gdn_recurrent))
        token_states = iter(zip(self.token_conv, self.token_recurrent)) if tokens > 1 else None
        layers = []
        for kind in self.config.layer_types:
            if kind == ATTENTION:
                k, v = next(caches)
                layers.append(KVCache(k[:num_rows], v[:num_rows], flags))
            else:
                conv, recurrent = next(gdn)
                layer = GDNState(conv[:num_rows], recurrent[:num_rows])
                if token_states is not None:
                    token_conv, token_recurrent = next(token_states)
                    layer.token_conv, layer.token_recurrent = (token_conv[: num_rows * tokens],
                                                               token_recurrent[: num_rows * tokens])
                layers.append(layer)
        if self.mtp_hidden is None:
            return BatchRows(layers, flags)
        k, v = next(caches)  # the MTP block's, last
        return BatchRows(layers, flags, KVCache(k[:num_rows], v[:num_rows], flags), self.mtp_hidden[:num_rows, 0])

    def accept(self, index: torch.Tensor) -> None:
        """Make slot b's GDN states (b < B = index's length) those after row index[b] of the last verify that kept
        token states (int64 [B], on the device: b * tokens + the slot's accepted count); the KV caches need nothing
        (rows past a position are never read). No host sync, fixed addresses: legal inside a captured graph."""
        rows = index.shape[0]
        torch.index_select(self.token_conv, 1, index, out=self.gdn_conv[:, :rows])
        torch.index_select(self.token_recurrent, 1, index, out=self.gdn_recurrent[:, :rows])

    def fold_flags(self, row_flags: torch.Tensor) -> None:
        """OR row_flags int32 [B, n] (a step's flags of n rows a slot, rows(B, n, flags)) into slots 0..B-1's."""
        flags = self.flags[: row_flags.shape[0]]
        for bit in (BAD_POSITION, BAD_TOKEN):
            flags.bitwise_or_((row_flags & bit).amax(1))

    @property
    def nbytes(self) -> int:
        tensors = [self.gdn_conv, self.gdn_recurrent] + [t for pair in self.kv for t in pair]
        tensors += [self.mtp_hidden] if self.mtp_hidden is not None else []
        return sum(t.numel() * t.element_size() for t in tensors)


def check_batch_state_size(config: Qwen38Config, num_slots: int, max_seq_len: int, device, kv_dtype,
                           name: str = "max_seq_len", mtp: bool = False, spare_rows: int = 0) -> None:
    """check_state_size for num_slots sequences of max_seq_len tokens each, before anything is allocated."""
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"the number of sequences must be an integer >= 1, found {num_slots!r}")
    check_state_size(config, max_seq_len, device, kv_dtype, mtp=mtp, name=name, spare_rows=spare_rows,
                     sequences=num_slots)
