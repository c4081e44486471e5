"""The checkpoint a command runs: what is read before the load (a GGUF's header once), the checks, the load."""
from __future__ import annotations

import argparse
import pathlib
import sys
import time
from dataclasses import dataclass

import torch

from ..config import Qwen38Config
from ..sampling_defaults import checkpoint_sampling
from ..state import check_state_size
from ..tokenizer import Tokenizer
from .options import DTYPES, kv_dtype
from .terminal import progress_bar

CPU_WARN_BYTES = 2e9  # above this the CPU reference path takes seconds or more per token


@dataclass
class Source:
    """The checkpoint's path, the device and the tokenizer. gguf_metadata: a GGUF's metadata, read once for
    the tokenizer, the sampling defaults and the checks before the load (None for an HF folder)."""
    path: pathlib.Path
    device: torch.device
    tokenizer: Tokenizer
    gguf_metadata: dict | None

    def sampling(self) -> dict:
        """The checkpoint's own sampling settings, unchecked (sampling_defaults.checkpoint_sampling)."""
        return checkpoint_sampling(self.path, self.gguf_metadata)

    def config(self) -> Qwen38Config:
        """The model's shape for the checks before the load: an HF folder's config.json, or the GGUF metadata
        already read. Its vocabulary size is then the token list's length (llama.cpp's n_vocab; the load
        takes it from token_embd's rows), on which no check before the load depends."""
        if self.gguf_metadata is None:
            return Qwen38Config.from_hf_folder(self.path)
        vocab_size = len(self.gguf_metadata["tokenizer.ggml.tokens"])
        return Qwen38Config.from_gguf_metadata(self.gguf_metadata, vocab_size, str(self.path))


def open_source(args: argparse.Namespace) -> Source:
    """--model (else the built-in model), --device (else CUDA when available), the tokenizer; a warning for a
    large checkpoint on the CPU."""
    from ..checkpoint import read_gguf_header
    from ..default_model import default_model_path

    path = pathlib.Path(args.model) if args.model else default_model_path()
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and checkpoint_bytes(path) > CPU_WARN_BYTES:
        sys.stderr.write(f"warning: a {checkpoint_bytes(path) / 1e9:.1f} GB checkpoint on the CPU: the CPU path runs "
                         "the plain-PyTorch reference ops (exact, float64 inside), meant for tests and tiny models; "
                         "expect minutes per token\n")
    if path.is_dir():
        return Source(path, device, Tokenizer.from_hf_folder(path), None)
    header = read_gguf_header(path)
    return Source(path, device, Tokenizer.from_gguf_header(header, str(path)), header.metadata)


def checkpoint_bytes(path: pathlib.Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size if path.is_file() else 0


def check_max_context(args: argparse.Namespace, source: Source, device: torch.device, model=None) -> None:
    """--max-context within the model's context and the device's available memory, named as the option.
    Called before the weights load (model None: the shape from what was read before the load; a state that
    cannot fit at all is refused at once) and after (the weights then take their share of the memory)."""
    if args.max_context is None:
        return
    config = model.config if model is not None else source.config()
    check_state_size(config, args.max_context, device, kv_dtype(args, device), config.num_mtp_layers > 0,
                     name="--max-context")


def load_model(args: argparse.Namespace, source: Source, ranks: int = 1):
    """The model, with a progress bar and a summary line on stderr. ranks > 1 (under torchrun, the process group
    joined): this rank's share (tensor_parallel.TensorParallelCausalLM), the bar and the line on rank 0 alone."""
    from ..model import Qwen38ForCausalLM

    leader = ranks == 1 or torch.distributed.get_rank() == 0
    options = dict(device=source.device, dtype=DTYPES.get(args.dtype), quantize=args.quantize, lane=args.lane,
                   progress=progress_bar("loading", "GB", 1e9, 2) if leader else None)
    start = time.perf_counter()
    if ranks == 1:
        model = Qwen38ForCausalLM.from_pretrained(source.path, **options)
    else:
        from ..tensor_parallel import TensorParallelCausalLM

        model = TensorParallelCausalLM.from_pretrained(source.path, tensor_parallel=ranks, **options)
    seconds = time.perf_counter() - start
    if ranks == 1:
        sys.stderr.write(f"\rloaded {source.path} on {model.device}: {model.weight_bytes() / 1e9:.2f} GB in {seconds:.1f} s "
                         f"({model.weight_bytes() / 1e9 / seconds:.2f} GB/s)\n")
    elif leader:
        sys.stderr.write(f"\rloaded {source.path} over {ranks} ranks: {model.weight_bytes() / 1e9:.2f} GB on rank 0 "
                         f"({model.device}) in {seconds:.1f} s\n")
    return model
