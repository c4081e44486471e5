"""Per-sequence inference state: a KV cache per attention layer, a conv ring and a recurrent state per
GDN layer, and the number of tokens consumed so far; with an MTP block, its KV cache and the trunk's last
normed hidden state (the h of the block's next pair, whose token has not been seen yet).

The MTP rule, the one thing advancing a state does to its MTP part, whatever advances it (model.forward and
every prefill through model.prefill, the plain decode step and the MTP step in engine.py / speculative.py):
after the trunk has consumed tokens x_0..x_{p-1}, the block's cache holds the pair (h_t, x_{t+1}) at
position t for every t < p - 1 (h_t: the trunk's normed hidden at t) and mtp_hidden holds h_{p-1}. So each
consumed token x_t is paired with the hidden before it, at t - 1 (model.mtp_pairs), and mtp_hidden becomes
the hidden of the last one. A snapshot of any path therefore drafts as well as any other."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass

import safetensors.torch
import torch

from qwen38_ops.limits import BAD_POSITION, BAD_TOKEN  # the flag bits the kernels set (op_limits.h)

from .config import ATTENTION, Qwen38Config
from .errors import CheckpointError
from .files import regular_file

# The config fields that decide a state's shapes and meaning: a snapshot restores only into a model with
# the same values (eos ids, the source path and the context limit do not change what a state holds).
SNAPSHOT_CONFIG_EXCLUDED = ("source", "eos_token_ids", "max_position_embeddings", "num_mtp_layers")
MTP_KEYS = ("mtp.k", "mtp.v", "mtp.hidden")  # the MTP part of a saved snapshot (never a digit first: see load)
KV_DTYPES = (torch.float32, torch.bfloat16)  # what a state's KV caches hold (Qwen38State's kv_dtype)
# The largest magnitude a saved state value may have: far above what a real state holds (activations stay
# within ~1e5; a GDN recurrent state is a decayed sum of products of L2-normed keys and values), far below
# where a step's products of two such values, summed over a head, would overflow float32 (3.4e38).
STATE_VALUE_LIMIT = 1e15
# safetensors' dtype names, for the header check (a name not here is refused as it is written).
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


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
        """A snapshot saved by save(), and the extra tensors saved with it. Everything is checked against
        config before a tensor is returned: the header (the config fields, the position), every state
        tensor's name, shape and dtype, then its values (finite, within STATE_VALUE_LIMIT). Any fault is a
        ValueError naming the file and the field (a file of another model's config: the fields that
        differ); a missing file a FileNotFoundError."""
        f = open_snapshot_file(path, device)
        with f:
            position = check_snapshot_header(path, f.metadata() or {}, config)
            names = set(f.keys())
            state_names = {name for name in names if is_state_name(name)}
            # A state holds the MTP part exactly when the model has the block (new_state): restore() would
            # refuse the other case.
            layout = snapshot_layout(config, position, mtp=config.num_mtp_layers > 0)
            found = {}
            for name in names:
                view = f.get_slice(name)
                found[name] = (tuple(view.get_shape()), SAFETENSORS_DTYPES.get(view.get_dtype(), view.get_dtype()))
            check_layout(path, layout, {name: found[name] for name in state_names})
            # Shapes and dtypes are right: read the data (bounded by the file's size) and check the values.
            state = {name: read_tensor(path, f, name) for name in layout}
            for name, t in state.items():
                check_values(path, name, t)
            extra = {name: read_tensor(path, f, name) for name in sorted(names - state_names)}
        layers = [(state[f"{i}.a"], state[f"{i}.b"]) for i in range(len(config.layer_types))]
        mtp = tuple(state[k] for k in MTP_KEYS) if MTP_KEYS[0] in state else None
        return StateSnapshot(position, layers, config, mtp), extra


def is_state_name(name: str) -> bool:
    """A tensor of the state itself (a layer's "<i>.a"/"<i>.b" or the MTP part), not an extra of save()."""
    return name[:1].isdigit() or name in MTP_KEYS


def read_tensor(path, f, name: str) -> torch.Tensor:
    """f's tensor name; a dtype torch cannot hold (an extra's header may name any) is a ValueError."""
    try:
        return f.get_tensor(name)
    except (safetensors.SafetensorError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: tensor {name!r} cannot be read ({type(e).__name__}: {str(e)[:200]})") from None


def open_snapshot_file(path, device):
    """safetensors' reader on path, a regular file (a FIFO would block open() forever, a folder fails deep
    inside safetensors); a missing file is a FileNotFoundError naming it, any other fault a ValueError."""
    try:
        regular_file(path, "state snapshot file")
    except CheckpointError as e:
        if not os.path.lexists(path):
            raise FileNotFoundError(f"No such file or directory: {path}") from None
        raise ValueError(str(e)) from None
    try:
        return safetensors.safe_open(str(path), "pt", device=str(device))
    except (safetensors.SafetensorError, OSError) as e:
        raise ValueError(f"{path} is not a safetensors file ({e})") from None


def check_snapshot_header(path, meta: dict, config: Qwen38Config) -> int:
    """The position a snapshot file's header holds, after checking that its qwen38.config is this model's
    (the fields config_key names) and that the position fits the model's context."""
    if "qwen38.config" not in meta or "qwen38.position" not in meta:
        raise ValueError(f"{path} is not a qwen38 state snapshot (no qwen38.config and qwen38.position in its "
                         "header)")
    try:
        saved = json.loads(meta["qwen38.config"])
    except (ValueError, RecursionError) as e:  # JSONDecodeError, absurd nesting
        raise ValueError(f"{path}: qwen38.config in the header is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: qwen38.config in the header: expected a JSON object, found "
                         f"{type(saved).__name__}")
    ours = json.loads(config_key(config))
    differ = [f"{k}: file {saved.get(k)!r:.100}, model {v!r:.100}" for k, v in ours.items() if saved.get(k) != v]
    if differ:
        raise ValueError(f"{path} holds the state of another model config ({'; '.join(differ)})")
    text = meta["qwen38.position"]
    # ASCII digits only (int() would also take " 7", "+7", "7_0" and other scripts' digits), few enough
    # that int() cannot refuse them.
    if not re.fullmatch(r"[0-9]{1,20}", text):
        raise ValueError(f"{path}: qwen38.position in the header: expected a decimal token count, found {text!r:.100}")
    position = int(text)
    if position > config.max_position_embeddings:
        raise ValueError(f"{path}: qwen38.position in the header: {position} tokens, more than the model's context "
                         f"of {config.max_position_embeddings}")
    return position


def snapshot_layout(config: Qwen38Config, position: int, mtp: bool) -> dict[str, tuple[tuple, tuple]]:
    """name -> (shape, allowed dtypes) of every tensor of a snapshot after position tokens, as save() names
    them: per layer "<i>.a", "<i>.b" (KV rows, or the GDN conv and recurrent states), with an MTP block its
    KV rows and hidden carry. The shapes are exactly those of a Qwen38State's tensors: restore()'s copy_
    would broadcast a 1-row or 0-d tensor silently, and convert any dtype."""
    c = config
    kv = ((position, c.num_key_value_heads, c.head_dim), KV_DTYPES)
    layout = {}
    for i, kind in enumerate(c.layer_types):
        if kind == ATTENTION:
            layout[f"{i}.a"] = layout[f"{i}.b"] = kv
        else:
            layout[f"{i}.a"] = ((c.conv_kernel - 1, c.conv_dim), (torch.float32,))
            layout[f"{i}.b"] = ((c.linear_num_value_heads, c.linear_value_head_dim, c.linear_key_head_dim),
                                (torch.float32,))
    if mtp:
        layout["mtp.k"] = layout["mtp.v"] = kv
        layout["mtp.hidden"] = ((1, c.hidden_size), (torch.float32,))
    return layout


def check_layout(where, layout: dict, found: dict) -> None:
    """found (name -> (shape, dtype)) holds exactly the tensors of layout, each of its shape and dtype."""
    unexpected = sorted(found.keys() - layout.keys())
    if unexpected:
        raise ValueError(f"{where}: unexpected state tensor {unexpected[0]!r} (a snapshot of this config holds "
                         f"{len(layout)}: {', '.join(list(layout)[:4])}, ...)")
    for name, (shape, dtypes) in layout.items():
        if name not in found:
            raise ValueError(f"{where}: no tensor {name!r} (expected shape {list(shape)})")
        got_shape, got_dtype = found[name]
        if tuple(got_shape) != shape:
            raise ValueError(f"{where}: tensor {name!r}: expected shape {list(shape)}, found {list(got_shape)}")
        if got_dtype not in dtypes:
            raise ValueError(f"{where}: tensor {name!r}: expected dtype {' or '.join(map(str, dtypes))}, found "
                             f"{got_dtype}")


def check_values(where, name: str, t: torch.Tensor) -> None:
    """Every value of a state tensor finite and within STATE_VALUE_LIMIT (one host sync per tensor)."""
    if t.numel() == 0:
        return
    largest = t.abs().amax()  # NaN when any value is NaN
    if not bool(largest <= STATE_VALUE_LIMIT):
        flat = t.flatten()
        index = int((~(flat.abs() <= STATE_VALUE_LIMIT)).nonzero()[0])
        raise ValueError(f"{where}: tensor {name!r}: value {flat[index].item()} at flat index {index} (expected "
                         f"finite values of magnitude at most {STATE_VALUE_LIMIT:g})")


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


def check_kv_dtype(kv_dtype) -> None:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be torch.float32 or torch.bfloat16, found {kv_dtype}")


def check_state_size(config: Qwen38Config, max_seq_len: int, device, kv_dtype: torch.dtype, mtp: bool,
                     name: str = "max_seq_len", spare_rows: int = 0, sequences: int = 1) -> None:
    """A ValueError, before anything is allocated, for a state longer than the model's context or larger
    than the device's available memory (a too-large allocation would fail deep inside torch, or get the
    process killed on the CPU). name: what the caller calls the length (the CLI: --max-context).
    spare_rows: rows of max_seq_len that only steps in flight past the last kept token write (an MTP step's
    verify rows, engine.py); they count for the memory, not against the context. sequences: states of that many sequences
    (slots.SlotStates)."""
    limit = config.max_position_embeddings
    if max_seq_len - spare_rows > limit:
        raise ValueError(f"{name} {max_seq_len - spare_rows} exceeds the model's context of {limit} tokens")
    device = torch.device(device)
    needed, available = sequences * state_bytes(config, max_seq_len, kv_dtype, mtp), available_memory(device)
    if available is not None and needed > available:
        of = f"{sequences} sequences' states" if sequences > 1 else "the state"
        raise ValueError(f"{name} {max_seq_len}: {of} (KV caches and GDN states, KV in {kv_dtype}) needs "
                         f"{needed / 1e9:.2f} GB, {device} has {available / 1e9:.2f} GB available")


class Qwen38State:
    def __init__(self, config: Qwen38Config, max_seq_len: int, device, kv_dtype=torch.float32, mtp: bool = False,
                 spare_rows: int = 0):
        """mtp: also hold an MTP block's KV cache and hidden carry (the model's new_state says). spare_rows:
        see check_state_size."""
        check_kv_dtype(kv_dtype)
        check_state_size(config, max_seq_len, device, kv_dtype, mtp, spare_rows=spare_rows)
        c = config
        # Every GDN layer's conv and recurrent state are slices of one tensor each, so that a speculative
        # accept() is two copies, not two per layer.
        num_gdn = sum(kind != ATTENTION for kind in c.layer_types)
        kv_shape = (max_seq_len, c.num_key_value_heads, c.head_dim)
        self._bind(config, max_seq_len, device,
                   torch.zeros(1, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32, device=device),
                   torch.zeros(num_gdn, c.conv_kernel - 1, c.conv_dim, device=device),
                   torch.zeros(num_gdn, c.linear_num_value_heads, c.linear_value_head_dim, c.linear_key_head_dim,
                               device=device),
                   [(torch.zeros(kv_shape, dtype=kv_dtype, device=device),
                     torch.zeros(kv_shape, dtype=kv_dtype, device=device))
                    for _ in range(len(c.layer_types) - num_gdn + mtp)],
                   torch.zeros(1, c.hidden_size, device=device) if mtp else None)

    @classmethod
    def over(cls, config: Qwen38Config, max_seq_len: int, device_position: torch.Tensor, bad_position: torch.Tensor,
             gdn_conv: torch.Tensor, gdn_recurrent: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]],
             mtp_hidden: torch.Tensor | None = None) -> "Qwen38State":
        """A state over tensors someone else holds (slots.SlotStates: one slot's views of batched tensors):
        device_position and bad_position int32 [1], gdn_conv [num_gdn, K-1, C], gdn_recurrent
        [num_gdn, Hv, dv, dk], kv: (k, v) [max_seq_len, Hkv, hd] per attention layer, then the MTP block's when
        mtp_hidden (float32 [1, D]) is given."""
        state = cls.__new__(cls)
        state._bind(config, max_seq_len, gdn_conv.device, device_position, bad_position, gdn_conv, gdn_recurrent,
                    kv, mtp_hidden)
        return state

    def _bind(self, config, max_seq_len, device, device_position, bad_position, gdn_conv, gdn_recurrent, kv,
              mtp_hidden: torch.Tensor | None) -> None:
        self.config = config
        self.max_seq_len = max_seq_len
        self.device = torch.device(device)
        # Tokens already in the state. The device copy is the truth while graphs replay (a decode step
        # advances it on the GPU); the host int mirrors it for capacity checks and snapshots, written by
        # reserve() and restore() and read back by sync_position() once a generation ends.
        self.position = 0
        self.device_position = device_position
        self.bad_position = bad_position
        self.gdn_conv, self.gdn_recurrent = gdn_conv, gdn_recurrent
        self.token_conv = self.token_recurrent = None
        self.layers: list[KVCache | GDNState] = []
        caches, gdn = iter(kv), iter(zip(gdn_conv, gdn_recurrent))
        for kind in config.layer_types:
            if kind == ATTENTION:
                self.layers.append(KVCache(*next(caches), bad_position))
            else:
                self.layers.append(GDNState(*next(gdn)))
        self.mtp_cache = KVCache(*next(caches), bad_position) if mtp_hidden is not None else None
        # The trunk's normed hidden at position - 1, float32 [1, D]: model.forward pairs it with the next
        # call's first token (the pair that straddles two calls).
        self.mtp_hidden = mtp_hidden

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

    def mark(self) -> tuple:
        """The position, the GDN states and the MTP hidden carry, cloned: enough to rewind() here while no KV
        row below the position is rewritten (decoding only appends; the MTP rule writes the block's row
        position - 1 again, with the same pair) -- an eighth of a snapshot at 16k tokens."""
        hidden = None if self.mtp_hidden is None else self.mtp_hidden.clone()
        return self.position, self.gdn_conv.clone(), self.gdn_recurrent.clone(), hidden

    def rewind(self, mark: tuple) -> None:
        position, conv, recurrent, hidden = mark
        self.gdn_conv.copy_(conv)
        self.gdn_recurrent.copy_(recurrent)
        if hidden is not None:
            self.mtp_hidden.copy_(hidden)
        self.position = position
        self.device_position.fill_(position)

    def snapshot(self, clone: bool = True) -> StateSnapshot:
        """Device-side clones (no host sync): the KV rows written so far and every GDN state. clone=False:
        views of this state's own tensors instead, valid until it changes (what restore() into another
        state copies from: the engine moves a prefilled sequence into its slot so)."""
        n = self.position
        keep = torch.Tensor.clone if clone else (lambda t: t)
        mtp = None
        if self.mtp_cache is not None:
            mtp = (keep(self.mtp_cache.k[:n]), keep(self.mtp_cache.v[:n]), keep(self.mtp_hidden))
        return StateSnapshot(n, [(keep(layer.k[:n]), keep(layer.v[:n])) if isinstance(layer, KVCache)
                                 else (keep(layer.conv), keep(layer.recurrent)) for layer in self.layers],
                             self.config, mtp)

    def restore(self, snap: StateSnapshot) -> None:
        """Copy snap INTO this state's tensors (never replacing them: a captured CUDA graph keeps reading the
        same addresses). KV rows past snap.position are stale; attention never reads past the position."""
        if config_key(snap.config) != config_key(self.config):
            raise ValueError("the snapshot belongs to another model config")
        if not isinstance(snap.position, int) or isinstance(snap.position, bool) or snap.position < 0:
            raise ValueError(f"the snapshot's position must be an int >= 0, found {snap.position!r}")
        if snap.position > self.max_seq_len:
            raise ValueError(f"the snapshot holds {snap.position} tokens > this state's max_seq_len {self.max_seq_len}")
        # Shapes and dtypes, checked before anything is copied (copy_ broadcasts and converts silently);
        # the values are load()'s to check (a snapshot taken in memory is the state's own).
        found = {f"{i}.{name}": (tuple(t.shape), t.dtype) for i, pair in enumerate(snap.layers)
                 for name, t in zip("ab", pair)}
        found.update({key: (tuple(t.shape), t.dtype) for key, t in zip(MTP_KEYS, snap.mtp or ())})
        if snap.mtp is not None and len(snap.mtp) != len(MTP_KEYS):
            raise ValueError(f"the snapshot's MTP part must hold {len(MTP_KEYS)} tensors, found {len(snap.mtp)}")
        check_layout("the snapshot", snapshot_layout(self.config, snap.position, snap.mtp is not None), found)
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
