"""Per-sequence inference state: a KV cache per attention layer, a conv ring and a recurrent state per
GDN layer, and the number of tokens consumed so far."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ATTENTION, Qwen38Config


@dataclass
class KVCache:
    k: torch.Tensor  # [max_seq_len, Hkv, hd], float32 or bfloat16; keys stored post-norm, post-RoPE
    v: torch.Tensor


@dataclass
class GDNState:
    conv: torch.Tensor  # float32 [K-1, C]: the last K-1 conv inputs, oldest first (shifted, not a ring index)
    recurrent: torch.Tensor  # float32 [Hv, dv, dk], key index fastest: row a of head h is one warp's work


class Qwen38State:
    def __init__(self, config: Qwen38Config, max_seq_len: int, device, kv_dtype=torch.float32):
        if kv_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"kv_dtype must be torch.float32 or torch.bfloat16, found {kv_dtype}")
        self.max_seq_len = max_seq_len
        self.device = torch.device(device)
        self.position = 0  # tokens already in the state
        self.layers: list[KVCache | GDNState] = []
        c = config
        for kind in c.layer_types:
            if kind == ATTENTION:
                shape = (max_seq_len, c.num_key_value_heads, c.head_dim)
                self.layers.append(KVCache(torch.zeros(shape, dtype=kv_dtype, device=device),
                                           torch.zeros(shape, dtype=kv_dtype, device=device)))
            else:
                self.layers.append(GDNState(
                    torch.zeros(c.conv_kernel - 1, c.conv_dim, device=device),
                    torch.zeros(c.linear_num_value_heads, c.linear_value_head_dim, c.linear_key_head_dim,
                                device=device)))

    def reserve(self, num_tokens: int) -> torch.Tensor:
        """Positions for the next num_tokens tokens (int32, on the state's device); checks capacity first,
        so an overflow is an error before anything is written."""
        if self.position + num_tokens > self.max_seq_len:
            raise ValueError(f"context overflow: {self.position} tokens in the state + {num_tokens} new > "
                             f"max_seq_len {self.max_seq_len}")
        positions = torch.arange(self.position, self.position + num_tokens, dtype=torch.int32, device=self.device)
        self.position += num_tokens
        return positions
