"""A rank's share of the weights under tensor parallelism (Megatron-style; qwen38_model/tensor_parallel.py runs
it): which rows or columns of each stored tensor one rank of `size` loads, and the model shape those shares
make (Shard.config, the shape the rank's modules and states are built from).

- GDN layers by key head: rank a holds key heads [a Hk/n, (a+1) Hk/n) and the value heads that read them, their
  q, k, v, z, b, a rows, conv channels, ssm_a and ssm_dt entries, and ssm_out's columns; its conv and recurrent
  states are those heads' (the state is built from Shard.config).
- Attention by query head, the KV heads divided with them (GQA groups stay whole): attn_q/k/v rows, attn_output
  columns; the rank's KV cache holds its KV heads.
- FFN column- then row-parallel: ffn_gate and ffn_up rows, ffn_down columns.
- Embedding and LM head by vocabulary rows (tensor_parallel.py gathers the logits, sums the embedding rows).
- Norms and the MTP block's eh_proj (one [D, 2D] matrix) whole on every rank.
A row-parallel matrix's input (ssm_out's, attn_output's, ffn_down's) is cut on 32-value Q8_0 block
boundaries, so a rank's int8 activation blocks are exactly the whole model's.

Value-head order: the GGUF's tiled order (value head m reads key head m % Hk) puts a rank's value heads in
Hv/Hk runs of Hk/n heads; HF's grouped order puts them in one run, which the HF -> internal conversion over the
rank's shape (Shard.config) turns into the rank's own tiled order. Both give the same shares."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import Qwen38Config
from ..errors import ConfigError
from .q8_0 import Q8_BLOCK


@dataclass(frozen=True)
class Cut:
    """The share of a stored tensor one rank loads: the index ranges [start, stop) it keeps along dim (0: rows,
    the outputs of a matrix; 1: columns, its inputs), concatenated in this order."""

    dim: int
    ranges: tuple[tuple[int, int], ...]


class Shard:
    """Rank `rank` of `size`: its Cut of each part (cut()) and its model shape (config)."""

    def __init__(self, config: Qwen38Config, rank: int, size: int):
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} outside [0, {size})")
        self.full, self.rank, self.size = config, rank, size
        c = config
        for name in ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "intermediate_size",
                     "vocab_size"):
            if getattr(c, name) % size:
                raise ConfigError(f"tensor parallel over {size} ranks: {name} {getattr(c, name)} of "
                                  f"{c.source or 'the model config'} is not a multiple of {size}")
        # The inputs of the row-parallel matrices, cut per rank: each rank's part must be whole Q8_0 blocks.
        for name, width in (("intermediate_size / ranks", c.intermediate_size // size),
                            ("num_attention_heads / ranks x head_dim", c.num_attention_heads // size * c.head_dim),
                            ("linear_num_key_heads / ranks x linear_value_head_dim",
                             c.linear_num_key_heads // size * c.linear_value_head_dim)):
            if width % Q8_BLOCK:
                raise ConfigError(f"tensor parallel over {size} ranks: {name} = {width} in {c.source or 'the model config'} "
                                  f"is not a multiple of {Q8_BLOCK} (a rank's share must be whole Q8_0 blocks)")
        self.config = dataclasses.replace(
            c, num_attention_heads=c.num_attention_heads // size, num_key_value_heads=c.num_key_value_heads // size,
            linear_num_key_heads=c.linear_num_key_heads // size,
            linear_num_value_heads=c.linear_num_value_heads // size, intermediate_size=c.intermediate_size // size)

    def cut(self, part: str, gguf_layout: bool) -> Cut | None:
        """The rank's Cut of a part as stored (gguf_layout: the GGUF's internal layout, else HF's), None for a
        part every rank loads whole. The same for every layer (the MTP block's attention layer included)."""
        c, local = self.full, self.config
        if part in ("token_embd", "output"):
            return self._share(0, local.vocab_size // self.size)
        if part in ("ffn_gate", "ffn_up"):
            return self._share(0, local.intermediate_size)
        if part == "ffn_down":
            return self._share(1, local.intermediate_size)
        if part == "attn_q":  # per head [query | gate]
            return self._share(0, local.num_attention_heads * 2 * c.head_dim)
        if part in ("attn_k", "attn_v"):
            return self._share(0, local.num_key_value_heads * c.head_dim)
        if part == "attn_output":
            return self._share(1, local.num_attention_heads * c.head_dim)
        dv = c.linear_value_head_dim
        if part in ("attn_qkv", "ssm_conv1d"):  # rows (channels) [q | k | v]
            key = self._share(0, local.linear_key_dim).ranges[0]
            k_start = c.linear_key_dim
            value_start = 2 * c.linear_key_dim
            return Cut(0, (key, (k_start + key[0], k_start + key[1]))
                       + self._value_ranges(gguf_layout, dv, value_start))
        if part == "attn_gate":
            return Cut(0, self._value_ranges(gguf_layout, dv))
        if part in ("ssm_beta", "ssm_alpha", "ssm_dt", "ssm_a"):
            return Cut(0, self._value_ranges(gguf_layout, 1))
        if part == "ssm_out":
            return Cut(1, self._value_ranges(gguf_layout, dv))
        return None

    def _share(self, dim: int, width: int) -> Cut:
        """The rank's one run of `width` indices: the a-th of `size` equal runs."""
        return Cut(dim, ((self.rank * width, (self.rank + 1) * width),))

    def _value_ranges(self, gguf_layout: bool, head_width: int, start: int = 0) -> tuple[tuple[int, int], ...]:
        """The index ranges of the rank's value heads, head_width indices each, from `start`: Hv/Hk runs of
        Hk/n heads in the tiled order (run j: heads j Hk + a Hk/n ...), one run of Hv/n heads in HF's."""
        c, local, a = self.full, self.config, self.rank
        if gguf_layout:
            firsts = [j * c.linear_num_key_heads + a * local.linear_num_key_heads
                      for j in range(c.linear_num_value_heads // c.linear_num_key_heads)]
            count = local.linear_num_key_heads
        else:
            firsts, count = [a * local.linear_num_value_heads], local.linear_num_value_heads
        return tuple((start + f * head_width, start + (f + count) * head_width) for f in firsts)
