"""Per-sequence inference state: a KV cache per attention layer, a conv ring and a recurrent state per
GDN layer, and the number of tokens consumed so far; with an MTP block, its KV cache and the trunk's last
normed hidden state (the h of the block's next pair, whose token has not been seen yet)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import safetensors.torch
import torch

from qwen38_ops.embedding import BAD_TOKEN

from .config import ATTENTION, Qwen38Config

# The config fields that decide a state's shapes and meaning: a snapshot restores only into a model with
# the same values (eos ids, the source path and the context limit do not change what a state holds).
SNAPSHOT_CONFIG_EXCLUDED = ("source", "eos_token_ids", "max_position_embeddings", "num_mtp_layers")
MTP_KEYS = ("mtp.k", "mtp.v", "mtp.hidden")  # the MTP part of a saved snapshot (never a digit first: see load)
BAD_POSITION = 1  # what attn_qk_norm_rope_store stores into bad_position (BAD_TOKEN: the embeddings' bit)


@dataclass
class KVCache:
    k: torch.Tensor  # [max_seq_len, Hkv, hd], float32 or bfloat16; keys stored post-norm, post-RoPE
    v: torch.Tensor
    # int32 [1], the state's error flag, shared by its caches: attention stores BAD_POSITION when a position
    # fell outside the cache (nothing is stored then); the embeddings OR in BAD_TOKEN for an id outside the
    # vocabulary (the MTP block's embedding reaches the flag through its cache). sync_position() raises on it.
    bad_position: torch.Tensor | None = None


@dataclass
class GDNState:
    conv: torch.Tensor  # float32 [K-1, C]: the last K-1 conv inputs, oldest first (shifted, not a ring index)
    recurrent: torch.Tensor  # float32 [Hv, dv, dk], key index fastest: row a of head h is one warp's work
    # The states after each token of the last multi-token step ([T, K-1, C] and [T, Hv, dv, dk]), when the
    # sequence keeps them (speculative verify: any accepted prefix is one copy away, no recomputation).
    token_conv: torch.Tensor | None = None
    token_recurrent: torch.Tensor | None = None


@dataclass
class StateSnapshot:
    """A copy of a state after `position` tokens: per layer, the KV rows 0..position-1 (k, v) or the GDN
    (conv, recurrent) pair, on the state's device; with an MTP block, its (k rows, v rows, hidden)."""

    position: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    config: Qwen38Config
    mtp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for part in self.layers + [self.mtp or ()] for t in part)

    def to_host(self) -> "StateSnapshot":
        """A copy in host memory, pinned where CUDA is present (a restore from it is an async copy)."""
        pin = torch.cuda.is_available()

        def copy(t: torch.Tensor) -> torch.Tensor:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            return host.copy_(t)

        return StateSnapshot(self.position, [(copy(a), copy(b)) for a, b in self.layers], self.config,
                             None if self.mtp is None else tuple(copy(t) for t in self.mtp))

    def save(self, path, extra: dict[str, torch.Tensor] | None = None) -> None:
        """A safetensors file (with extra tensors beside the state's); its header names the config the
        state belongs to and the position."""
        tensors = {f"{i}.{name}": t.contiguous().cpu() for i, pair in enumerate(self.layers)
                   for name, t in zip("ab", pair)}
        tensors.update({key: t.contiguous().cpu() for key, t in zip(MTP_KEYS, self.mtp or ())})
        tensors.update(extra or {})
        safetensors.torch.save_file(tensors, str(path), metadata={"qwen38.position": str(self.position),
                                                                  "qwen38.config": config_key(self.config)})

    @staticmethod
    def load(path, config: Qwen38Config, device="cpu") -> tuple["StateSnapshot", dict[str, torch.Tensor]]:
        """A snapshot saved by save(), and the extra tensors saved with it; a file of another model's
        config is a ValueError naming the fields that differ."""
        try:
            f = safetensors.safe_open(str(path), "pt", device=str(device))
        except safetensors.SafetensorError as e:
            raise ValueError(f"{path} is not a safetensors file ({e})") from None
        with f:
            meta = f.metadata() or {}
            if "qwen38.config" not in meta or "qwen38.position" not in meta:
                raise ValueError(f"{path} is not a qwen38 state snapshot (no qwen38.config in its header)")
            saved, ours = json.loads(meta["qwen38.config"]), json.loads(config_key(config))
            differ = [f"{k}: file {saved.get(k)!r}, model {v!r}" for k, v in ours.items() if saved.get(k) != v]
            if differ:
                raise ValueError(f"{path} holds the state of another model config ({'; '.join(differ)})")
            layers = [(f.get_tensor(f"{i}.a"), f.get_tensor(f"{i}.b")) for i in range(len(config.layer_types))]
            mtp = tuple(f.get_tensor(k) for k in MTP_KEYS) if MTP_KEYS[0] in f.keys() else None
            extra = {k: f.get_tensor(k) for k in f.keys() if not k[0].isdigit() and k not in MTP_KEYS}
        return StateSnapshot(int(meta["qwen38.position"]), layers, config, mtp), extra


def config_key(config: Qwen38Config) -> str:
    """The config fields a state depends on, as JSON (layer_types as a list)."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in SNAPSHOT_CONFIG_EXCLUDED}
    return json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}, sort_keys=True)


def state_bytes(config: Qwen38Config, max_seq_len: int, kv_dtype: torch.dtype, mtp: bool) -> int:
    """The bytes of a Qwen38State: a K and a V cache per attention layer (and for the MTP block, with its
    hidden carry), a conv and a recurrent state per GDN layer (float32)."""
    c = config
    num_attention = sum(kind == ATTENTION for kind in c.layer_types)
    num_gdn = len(c.layer_types) - num_attention
    kv = (num_attention + mtp) * 2 * max_seq_len * c.num_key_value_heads * c.head_dim * kv_dtype.itemsize
    gdn = num_gdn * ((c.conv_kernel - 1) * c.conv_dim
                     + c.linear_num_value_heads * c.linear_value_head_dim * c.linear_key_head_dim) * 4
    return kv + gdn + (c.hidden_size * 4 if mtp else 0)


def available_memory(device: torch.device) -> int | None:
    """Bytes a new allocation on device can take: on CUDA the free memory plus what torch's allocator holds
    unused (a replaced engine's buffers are freed into it); on the CPU /proc/meminfo's MemAvailable (free
    memory plus the page cache the kernel can drop). None where this cannot be known (no /proc, another
    device type, CUDA absent: the allocation itself then fails)."""
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
    except OSError:
        return None
    return int(fields["MemAvailable"].split()[0]) * 1024  # in kB


def check_state_size(config: Qwen38Config, max_seq_len: int, device, kv_dtype: torch.dtype, mtp: bool,
                     name: str = "max_seq_len", spare_rows: int = 0) -> None:
    """A ValueError, before anything is allocated, for a state longer than the model's context or larger
    than the device's available memory (a too-large allocation would fail deep inside torch, or get the
    process killed on the CPU). name: what the caller calls the length (the CLI: --max-context).
    spare_rows: rows of max_seq_len that only steps in flight past the last kept token write (a speculative
    engine's); they count for the memory, not against the context."""
    limit = config.max_position_embeddings
    if max_seq_len - spare_rows > limit:
        raise ValueError(f"{name} {max_seq_len - spare_rows} exceeds the model's context of {limit} tokens")
    device = torch.device(device)
    needed, available = state_bytes(config, max_seq_len, kv_dtype, mtp), available_memory(device)
    if available is not None and needed > available:
        raise ValueError(f"{name} {max_seq_len}: the state (KV caches and GDN states, KV in {kv_dtype}) needs "
                         f"{needed / 1e9:.2f} GB, {device} has {available / 1e9:.2f} GB available")


class Qwen38State:
    def __init__(self, config: Qwen38Config, max_seq_len: int, device, kv_dtype=torch.float32, mtp: bool = False,
                 spare_rows: int = 0):
        """mtp: also hold an MTP block's KV cache and hidden carry (the model's new_state says). spare_rows:
        see check_state_size."""
        if kv_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"kv_dtype must be torch.float32 or torch.bfloat16, found {kv_dtype}")
        check_state_size(config, max_seq_len, device, kv_dtype, mtp, spare_rows=spare_rows)
        self.config = config
        self.max_seq_len = max_seq_len
        self.device = torch.device(device)
        # Tokens already in the state. The device copy is the truth while graphs replay (a decode step
        # advances it on the GPU); the host int mirrors it for capacity checks and snapshots, written by
        # reserve() and restore() and read back by sync_position() once a generation ends.
        self.position = 0
        self.device_position = torch.zeros(1, dtype=torch.int32, device=device)
        self.bad_position = torch.zeros(1, dtype=torch.int32, device=device)
        self.layers: list[KVCache | GDNState] = []
        c = config
        # Every GDN layer's conv and recurrent state are slices of one tensor each, so that a speculative
        # accept() is two copies, not two per layer.
        num_gdn = sum(kind != ATTENTION for kind in c.layer_types)
        self.gdn_conv = torch.zeros(num_gdn, c.conv_kernel - 1, c.conv_dim, device=device)
        self.gdn_recurrent = torch.zeros(num_gdn, c.linear_num_value_heads, c.linear_value_head_dim,
                                         c.linear_key_head_dim, device=device)
        self.token_conv = self.token_recurrent = None
        for kind in c.layer_types:
            if kind == ATTENTION:
                shape = (max_seq_len, c.num_key_value_heads, c.head_dim)
                self.layers.append(KVCache(torch.zeros(shape, dtype=kv_dtype, device=device),
                                           torch.zeros(shape, dtype=kv_dtype, device=device), self.bad_position))
            else:
                i = sum(isinstance(layer, GDNState) for layer in self.layers)
                self.layers.append(GDNState(self.gdn_conv[i], self.gdn_recurrent[i]))
        shape = (max_seq_len, c.num_key_value_heads, c.head_dim)
        self.mtp_cache = KVCache(torch.zeros(shape, dtype=kv_dtype, device=device),
                                 torch.zeros(shape, dtype=kv_dtype, device=device), self.bad_position) if mtp else None
        # The trunk's normed hidden at position - 1, float32 [1, D]: model.forward pairs it with the next
        # call's first token (the pair that straddles two calls).
        self.mtp_hidden = torch.zeros(1, c.hidden_size, device=device) if mtp else None

    def reserve(self, num_tokens: int) -> torch.Tensor:
        """Positions for the next num_tokens tokens (int32, on the state's device); checks capacity first,
        so an overflow is an error before anything is written."""
        if self.position + num_tokens > self.max_seq_len:
            raise ValueError(f"context overflow: {self.position} tokens in the state + {num_tokens} new > "
                             f"max_seq_len {self.max_seq_len}")
        positions = torch.arange(self.position, self.position + num_tokens, dtype=torch.int32, device=self.device)
        self.position += num_tokens
        self.device_position.fill_(self.position)
        return positions

    def sync_position(self) -> int:
        """The host mirror read back from the device position (one host sync); a RuntimeError if some step
        since the last call had a position outside the KV caches (its keys and values were not stored)."""
        self.position = int(self.device_position)
        flag = int(self.bad_position)
        if flag:
            self.bad_position.zero_()
            # Attention stores its value where the embeddings OR theirs in: when both happened, the token
            # condition may have been overwritten, never the position one.
            problems = []
            if flag & BAD_TOKEN:
                problems.append(f"embedded a token id outside the vocabulary [0, {self.config.vocab_size}) (its "
                                "row is NaN)")
            if flag & BAD_POSITION:
                problems.append(f"ran at a position outside the KV cache (0..{self.max_seq_len - 1}): its "
                                "attention output is wrong")
            problems = problems or [f"set the error flag to {flag}"]
            raise RuntimeError(f"a step {' and '.join(problems)}; the state must be cleared or restored")
        return self.position

    def clear(self) -> None:
        """Empty: GDN states zeroed, position 0 (KV rows need no clearing: none is read before written)."""
        self.gdn_conv.zero_()
        self.gdn_recurrent.zero_()
        self.position = 0
        self.device_position.zero_()

    def tensors(self, layer) -> list[torch.Tensor]:
        """The tensors a layer's state holds (per-token buffers included when kept)."""
        return [t for t in vars(layer).values() if t is not None]

    def keep_token_states(self, max_tokens: int) -> None:
        """Buffers for the per-token GDN states of steps of up to max_tokens tokens (a speculative verify
        writes them; accept() keeps one). At the 27B shape: max_tokens x 48 x 3.1 MB."""
        # [layer, token, ...]: each layer's [T, ...] rows contiguous, as the GDN ops write them.
        self.token_conv = torch.empty((self.gdn_conv.shape[0], max_tokens, *self.gdn_conv.shape[1:]), device=self.device)
        self.token_recurrent = torch.empty((self.gdn_recurrent.shape[0], max_tokens, *self.gdn_recurrent.shape[1:]),
                                           device=self.device)
        gdn_layers = [layer for layer in self.layers if isinstance(layer, GDNState)]
        for i, layer in enumerate(gdn_layers):
            layer.token_conv, layer.token_recurrent = self.token_conv[i], self.token_recurrent[i]

    def accept(self, index: torch.Tensor) -> None:
        """Make every GDN state the one after token `index` (int64 [1], on the device) of the last step that
        kept token states; the KV caches need nothing (rows past the position are never read). No host
        sync, fixed addresses: legal inside a captured graph."""
        torch.index_select(self.token_conv, 1, index, out=self.gdn_conv.unsqueeze(1))
        torch.index_select(self.token_recurrent, 1, index, out=self.gdn_recurrent.unsqueeze(1))

    def mark(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The position and the GDN states, cloned: enough to rewind() here while no KV row below the
        position is rewritten (decoding only appends) -- an eighth of a snapshot at 16k tokens."""
        return self.position, self.gdn_conv.clone(), self.gdn_recurrent.clone()

    def rewind(self, mark: tuple[int, torch.Tensor, torch.Tensor]) -> None:
        position, conv, recurrent = mark
        self.gdn_conv.copy_(conv)
        self.gdn_recurrent.copy_(recurrent)
        self.position = position
        self.device_position.fill_(position)

    def snapshot(self) -> StateSnapshot:
        """Device-side clones (no host sync): the KV rows written so far and every GDN state."""
        n = self.position
        mtp = None
        if self.mtp_cache is not None:
            mtp = (self.mtp_cache.k[:n].clone(), self.mtp_cache.v[:n].clone(), self.mtp_hidden.clone())
        return StateSnapshot(n, [(layer.k[:n].clone(), layer.v[:n].clone()) if isinstance(layer, KVCache)
                                 else (layer.conv.clone(), layer.recurrent.clone()) for layer in self.layers],
                             self.config, mtp)

    def restore(self, snap: StateSnapshot) -> None:
        """Copy snap INTO this state's tensors (never replacing them: a captured CUDA graph keeps reading the
        same addresses). KV rows past snap.position are stale; attention never reads past the position."""
        if config_key(snap.config) != config_key(self.config):
            raise ValueError("the snapshot belongs to another model config")
        if snap.position > self.max_seq_len:
            raise ValueError(f"the snapshot holds {snap.position} tokens > this state's max_seq_len {self.max_seq_len}")
        if (snap.mtp is None) != (self.mtp_cache is None):
            has = "holds no MTP cache" if snap.mtp is None else "holds an MTP cache"
            raise ValueError(f"the snapshot {has}, this state {'has' if self.mtp_cache is not None else 'has none'} "
                             "(a state of the model with its MTP block vs one without)")
        if snap.mtp is not None:
            k, v, hidden = snap.mtp
            self.mtp_cache.k[:snap.position].copy_(k, non_blocking=True)
            self.mtp_cache.v[:snap.position].copy_(v, non_blocking=True)
            self.mtp_hidden.copy_(hidden, non_blocking=True)
        for layer, (a, b) in zip(self.layers, snap.layers):
            if isinstance(layer, KVCache):
                layer.k[:snap.position].copy_(a, non_blocking=True)
                layer.v[:snap.position].copy_(b, non_blocking=True)
            else:
                layer.conv.copy_(a, non_blocking=True)
                layer.recurrent.copy_(b, non_blocking=True)
        self.position = snap.position
        self.device_position.fill_(snap.position)
