"""Checkpoint loading: GGUF files and HF safetensors folders, both delivered in the ONE internal layout
(layout.py). Tensors are read and moved to the target device one at a time.

Beyond each format's own structure (gguf_file.py, hf_folder.py), a checkpoint must hold exactly the
tensors its config describes (no layer silently dropped or ignored), each of the expected shape, and
finite: a NaN in one lm_head row would make that row's token win forever.

The MTP (nextn) block is layer num_layers of the checkpoint: blk.{num_layers}.* in a GGUF (its count is
qwen35.nextn_predict_layers), mtp.* in an HF folder (mtp_num_hidden_layers). An HF folder whose config counts
the block but that holds no mtp.* tensor at all loads without it (repackaged checkpoints drop the block and
keep the config); a partial block is an error.

Under tensor parallelism (Checkpoint.shard, shard.py) each load is one rank's share: rows are read as byte
ranges of the stored tensor (nothing else of it), a column share (the row-parallel matrices ssm_out,
attn_output, ffn_down) from the whole tensor read onto the device, cut, and the rest freed; every check is
the whole checkpoint's.

Inside Checkpoint.loading() (from_pretrained's whole load) the finiteness of each weight that goes to a
GPU is checked there and read back once at the end, rather than waited for weight by weight: each wait
would drain the reads and copies that TensorReader overlaps."""
from __future__ import annotations

import contextlib
import dataclasses
import pathlib

import torch

from ..config import ATTENTION
from ..errors import CheckpointError
from ..files import regular_file
from .gguf_file import GGUFCheckpoint, GGUFHeader, read_header
from .hf_folder import HFCheckpoint
from .layout import HF_NAMES, MTP_HF_NAMES, SMALL_PARTS, expected_shape, gguf_tensor_name, hf_to_internal, layer_parts
from .shard import Cut, Shard
from .source import TensorSource
from .q8_0 import Q8_BLOCK
from .tensors import Q8Tensor, TensorReader

# Elements per isfinite pass over a weight: bounds the pass's temporary to 16 MB (a 27B embedding has 1.3 G).
CHECK_CHUNK = 1 << 24

__all__ = ["Checkpoint", "CheckpointError", "Q8Tensor", "Shard", "TensorSource", "open_checkpoint", "read_gguf_header",
           "read_gguf_metadata"]

Weight = torch.Tensor | Q8Tensor


class Checkpoint:
    """A tensor source (source.TensorSource: a GGUF file, an HF folder, ...) plus the rules that turn its
    tensors into the model's weights: small tensors float32; large matrices in `dtype`, or Q8_0 when stored so
    (GGUF) or asked for (quantize="q8_0", the converter's quantization)."""

    def __init__(self, source: TensorSource, progress=None):
        self.source = source
        self.config = source.config
        if (not source.gguf_layout and self.config.num_mtp_layers
                and not any(n.startswith("mtp.") for n in source.names())):
            self.config = dataclasses.replace(self.config, num_mtp_layers=0)
        self.path = source.path
        self.gguf_layout = source.gguf_layout
        self.progress = progress  # called with (bytes read so far, bytes in the checkpoint)
        self.bytes_read = 0
        self.reader: TensorReader | None = None  # made for the device of the first load
        self.unchecked: list | None = None  # inside loading(): (finite flag, load arguments) per GPU weight
        self.shard: Shard | None = None  # set by use_shard: every load is this rank's share
        self._check_tensor_set()
        if self.gguf_layout:
            self._check_small_types()

    def use_shard(self, shard: Shard) -> None:
        """From now on every load is the shard's rank's share (tensor parallelism); a Shard of this model."""
        self.shard = shard

    def load(self, part: str, layer: int | None, device, dtype: torch.dtype, quantize: str | None) -> Weight:
        if part == "output" and (self.config.tie_word_embeddings or not self._has("output", None)):
            part_to_read = "token_embd"
        else:
            part_to_read = part
        name = self._name(part_to_read, layer)
        expected = expected_shape(self.config, part)
        if not self.gguf_layout and part == "ssm_conv1d":
            expected = (expected[0], 1, expected[1])  # HF keeps nn.Conv1d's [C, 1, K]
        if self.source.shape(name) != expected:  # before reading: the HF conversions reshape by the config
            raise CheckpointError(f"{self.path}: tensor {self.source.full_name(name)!r} has shape "
                                  f"{self.source.shape(name)}, expected {expected} from the model config")
        w = self._read_internal(part_to_read, layer, device)
        if part in SMALL_PARTS:
            w = w.dequantize() if isinstance(w, Q8Tensor) else w.to(torch.float32)
        elif quantize == "q8_0" and not isinstance(w, Q8Tensor):
            w = Q8Tensor.quantize(w)
        elif not isinstance(w, Q8Tensor):
            w = w.to(dtype)
        finite = _finite(w)
        if self.unchecked is not None and finite.device.type != "cpu":
            self.unchecked.append((finite, (part, layer, device, dtype, quantize)))
        elif not bool(finite):
            self._raise_non_finite(w, self.source.full_name(name))
        return w

    @contextlib.contextmanager
    def loading(self):
        """One load of the model's weights: GPU weights' finiteness flags are read back in one sync on
        leaving, and the first non-finite weight is then loaded again, checked at once, to raise the error
        its own load would have raised (an error of another kind in a later weight, a wrong shape say, is
        raised first). The reader's threads and staging are released on leaving."""
        self.unchecked = []
        try:
            yield self
            unchecked, self.unchecked = self.unchecked, None  # from here on a load checks at once
            flags = torch.stack([flag for flag, _ in unchecked]).tolist() if unchecked else []
            failed = next((args for ok, (_, args) in zip(flags, unchecked) if not ok), None)
            if failed is not None:
                self.load(*failed)  # raises, naming the tensor
        finally:
            self.unchecked = None
            if self.reader is not None:
                self.reader.close()
                self.reader = None

    def load_fused(self, parts: tuple[str, ...], layer: int, device, dtype, quantize) -> Weight:
        """Matrices that share an input, concatenated along the output rows, so one GEMV reads them all.
        The group stays Q8_0 only if every part is; otherwise it is dequantized to `dtype`."""
        weights = [self.load(p, layer, device, dtype, quantize) for p in parts]
        if all(isinstance(w, Q8Tensor) for w in weights):
            return Q8Tensor(torch.cat([w.q for w in weights]), torch.cat([w.d for w in weights]))
        return torch.cat([w.dequantize(dtype) if isinstance(w, Q8Tensor) else w for w in weights])

    def _raise_non_finite(self, w: Weight, name: str) -> None:
        """The error of a weight with NaN or infinite values: how many, the first one and where."""
        values = (w.d if isinstance(w, Q8Tensor) else w).reshape(-1)
        bad = (~torch.isfinite(values)).nonzero()[:, 0]
        what = "Q8_0 block scale" if isinstance(w, Q8Tensor) else "value"
        raise CheckpointError(f"{self.path}: tensor {name!r} holds {bad.numel()} non-finite {what}s (NaN or infinity), "
                              f"the first {float(values[bad[0]])} at flat index {int(bad[0])}")

    def _check_tensor_set(self) -> None:
        """The tensors are exactly those of the config's layers (and MTP block): a block_count of 1 over 8
        stored layers, an attention tensor in a GDN layer or an unknown blk.N must not load as a different
        model."""
        config, names = self.config, set(self.source.names())
        if config.num_mtp_layers > 1:
            raise CheckpointError(f"{self.path}: {config.num_mtp_layers} MTP layers; this implementation runs one "
                                  "(the released Qwen3.5/3.6/3.8 checkpoints have one)")
        if self.gguf_layout and config.num_mtp_layers and f"blk.{config.num_layers}.nextn.eh_proj.weight" not in names:
            # Said first: a wrong nextn_predict_layers would otherwise read as a missing trunk tensor.
            raise CheckpointError(f"{self.path}: blk.{config.num_layers} is an MTP block by "
                                  f"qwen35.nextn_predict_layers ({self._describe_layers()}), but it has no "
                                  f"'blk.{config.num_layers}.nextn.eh_proj.weight'")
        layers = range(config.num_layers + config.num_mtp_layers)
        wanted = [self._name(part, layer) for layer in layers for part in layer_parts(config, layer)]
        wanted += [self._name("token_embd", None), self._name("output_norm", None)]
        if not config.tie_word_embeddings:
            wanted.append(self._name("output", None))
        if not self.gguf_layout and config.tie_word_embeddings and "lm_head.weight" in names:
            # Loading it would break the tie, ignoring it would run another head than the one stored.
            raise CheckpointError(f"{self.path}: tensor 'lm_head.weight' is stored, but tie_word_embeddings is true "
                                  f"in {config.source or 'config.json'}: expected no 'lm_head.weight' (the head is "
                                  f"{self.source.full_name('embed_tokens.weight')!r}), found one of shape "
                                  f"{self.source.shape('lm_head.weight')}")
        missing = next((n for n in wanted if not self.source.has(n)), None)
        if missing is not None:
            raise CheckpointError(f"{self.path}: missing tensor {self.source.full_name(missing)!r}")
        extra = sorted(names - {self.source.full_name(n) for n in wanted} - set(self._tolerated(names)))
        if extra:
            raise CheckpointError(f"{self.path}: {len(extra)} tensors are not part of the model its config describes "
                                  f"({self._describe_layers()}): {', '.join(map(repr, extra[:4]))}"
                                  f"{', ...' if len(extra) > 4 else ''}")

    def _check_small_types(self) -> None:
        """llama.cpp's converter and quantizer store norms, conv weights, ssm_a and ssm_dt as F32, always.
        Checked because such a tensor can be smaller than the alignment: relabelled F16 or BF16, it would
        still fit its padded slot and load its bytes as garbage."""
        for layer in [None, *range(self.config.num_layers + self.config.num_mtp_layers)]:
            parts = ["output_norm"] if layer is None else layer_parts(self.config, layer)
            for part in set(parts) & SMALL_PARTS:
                name = self._name(part, layer)
                if self.source.dtype_name(name) != "F32":
                    raise CheckpointError(f"{self.path}: tensor {name!r} has ggml type {self.source.dtype_name(name)}, "
                                          "expected F32 (llama.cpp always stores norms, conv weights, ssm_a and ssm_dt "
                                          "as F32)")

    def _tolerated(self, names: set[str]) -> list[str]:
        """Stored tensors the model does not use: the vision tower, and an HF folder's mtp.* when its config
        counts no MTP block (transformers drops them the same way). A tied model's stored lm_head.weight is
        an error (_check_tensor_set), not tolerated: the config describes no such tensor."""
        if self.gguf_layout:
            return []
        unused = ("model.visual.",) + (() if self.config.num_mtp_layers else ("mtp.",))
        return [n for n in names if n.startswith(unused)]

    def _describe_layers(self) -> str:
        c = self.config
        mtp = f" and {c.num_mtp_layers} MTP block(s)" if c.num_mtp_layers else ""
        return f"{c.num_layers} layers{mtp}, attention at {[i for i, t in enumerate(c.layer_types) if t == ATTENTION]}"

    def _name(self, part: str, layer: int | None) -> str:
        if self.gguf_layout:
            return gguf_tensor_name(part, layer)
        if part == "output":
            return "lm_head.weight"
        if part in MTP_HF_NAMES:
            return MTP_HF_NAMES[part]
        name = HF_NAMES[part]
        if layer is None:
            return name
        mtp_layer = layer - self.config.num_layers
        return f"mtp.layers.{mtp_layer}.{name}" if mtp_layer >= 0 else f"layers.{layer}.{name}"

    def _has(self, part: str, layer: int | None) -> bool:
        return self.source.has(self._name(part, layer))

    def _read_internal(self, part: str, layer: int | None, device) -> Weight:
        name = self._name(part, layer)
        if self.reader is None or self.reader.device != torch.device(device):
            self.reader = TensorReader(device)
        cut = self.shard.cut(part, self.gguf_layout) if self.shard is not None else None
        t = self.source.read(name, self.reader) if cut is None else self._read_cut(name, cut)
        self.bytes_read += self.source.nbytes(name)  # the progress of tensors done, a share or not
        if self.progress is not None:
            self.progress(self.bytes_read, self.source.total_bytes())
        if self.gguf_layout:
            return t
        # A rank's share of HF tensors is its heads in HF's order: converted over the rank's shape (shard.py).
        return hf_to_internal(part, t, self.config if self.shard is None else self.shard.config)

    def _read_cut(self, name: str, cut: Cut) -> Weight:
        if cut.dim == 0:
            pieces = [self.source.read_rows(name, self.reader, start, stop) for start, stop in cut.ranges]
        else:  # a column share is no byte range of a row-major tensor: read whole, cut on the device
            whole = self.source.read(name, self.reader)
            pieces = [_columns(whole, start, stop) for start, stop in cut.ranges]
        if len(pieces) == 1:
            return pieces[0]
        if isinstance(pieces[0], Q8Tensor):
            return Q8Tensor(torch.cat([p.q for p in pieces], cut.dim), torch.cat([p.d for p in pieces], cut.dim))
        return torch.cat(pieces, cut.dim)


def _columns(w: Weight, start: int, stop: int) -> Weight:
    """Columns [start, stop) of a matrix, contiguous (Shard cuts Q8_0 columns on block boundaries)."""
    if isinstance(w, Q8Tensor):
        return Q8Tensor(w.q[:, start:stop].contiguous(), w.d[:, start // Q8_BLOCK : stop // Q8_BLOCK].contiguous())
    return w[:, start:stop].contiguous()


def _finite(w: Weight) -> torch.Tensor:
    """Every value finite, as a bool tensor on w's device (no sync). For Q8_0 the fp16 block scales are the
    only values that can be NaN or infinite. CHECK_CHUNK elements per pass keep the temporaries small."""
    values = (w.d if isinstance(w, Q8Tensor) else w).reshape(-1)
    return torch.stack([torch.isfinite(values[i : i + CHECK_CHUNK]).all()
                        for i in range(0, values.numel(), CHECK_CHUNK)]).all()


def open_checkpoint(path: str | pathlib.Path, progress=None) -> Checkpoint:
    p = pathlib.Path(path)
    if p.is_dir():
        return Checkpoint(HFCheckpoint(str(p)), progress)
    _check_gguf_path(path)
    return Checkpoint(GGUFCheckpoint(str(p)), progress)


def read_gguf_header(path: str | pathlib.Path) -> GGUFHeader:
    """A GGUF file's header (metadata and tensor directory), checked as open_checkpoint checks it, without the
    tensor checks of a Checkpoint: what the tokenizer and the command line read."""
    _check_gguf_path(path)
    return read_header(str(path))


def read_gguf_metadata(path: str | pathlib.Path) -> dict:
    """read_gguf_header's metadata (key -> value)."""
    return read_gguf_header(path).metadata


def _check_gguf_path(path: str | pathlib.Path) -> None:
    p = pathlib.Path(path)
    if not p.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    regular_file(p, "checkpoint file")  # before open(): a FIFO would block it forever
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF') and not an HF folder")
