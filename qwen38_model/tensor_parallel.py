"""Tensor parallelism over the GPUs of one host, Megatron-style: each rank of torch.distributed's default process
group holds a share of every layer (checkpoint/shard.py says which) and runs the whole stack on it.

    torchrun --nproc-per-node 2 -m qwen38_model generate --model PATH --prompt ...
    model = TensorParallelCausalLM.from_pretrained(path, tensor_parallel=2)   # in each rank, under torchrun

Per layer two all-reduces of the residual-stream width: the mixer's output and the MLP's (each a row-parallel
matrix's partial sum, DecoderLayer.reduce); the embedding an all-reduce of its rows (each id's row is one rank's,
the others add zeros: exact); the LM head an all-gather of the ranks' vocabulary rows into the whole logits, so
every rank holds the same [rows, V] and selects the same token with the engine's own selection graphs (sampling,
penalties, masks unchanged). Every collective runs on the device into preallocated scratch buffers with no host
sync, so the decode step's CUDA graph captures them (NCCL; gloo on the CPU).

Every rank takes the same calls with the same arguments (generate(), model(ids), ...): rank 0 owns the
tokenizer's input, the streamer and any output, the others follow. Numerics: only the partial sums of the
row-parallel matrices are added in another order than on one device (two float32 halves, then their sum), so
logits differ from one device's by float32 rounding (~1e-7 relative per layer); the int8 lanes quantize the same
32-value blocks as on one device (a rank's share is whole blocks), so their tokens equal one device's unless a
rounding flip changes an activation's int8 value or two logits are within the rounding (tests/model/
test_tensor_parallel.py measures both)."""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import Checkpoint, Shard
from .config import Qwen38Config
from .engine import BatchEngine
from .formats import Activation
from .generation import resolve_seed
from .layers import DenseLinear, Q8Linear, lookup_rows
from .model import Qwen38ForCausalLM
from .scratch import Scratch
from .speculative import Speculation

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns there); torch 2.6 has only the old.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def init_tensor_parallel(size: int, device=None) -> torch.device:
    """Joins torch.distributed's default process group from the launcher's environment (torchrun's RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), or checks the one already joined; it must have `size` ranks.
    Returns this rank's device: `device` (a bare 'cuda' is cuda:LOCAL_RANK), by default cuda:LOCAL_RANK when
    CUDA is available, else the CPU. NCCL on CUDA, gloo on the CPU."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel must be a positive integer, found {size!r}")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise ValueError(f"tensor_parallel={size} runs in {size} processes: start them with torchrun "
                             f"--nproc-per-node {size} (WORLD_SIZE is not set)")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend)
    if dist.get_world_size() != size:
        raise ValueError(f"tensor_parallel={size}, but the process group has {dist.get_world_size()} ranks "
                         f"(torchrun --nproc-per-node {size})")
    if dist.get_backend() != backend:
        raise ValueError(f"the process group's backend is {dist.get_backend()}; a model on {device} needs {backend}")
    return device


class VocabShard:
    """A rank's rows [first, first + rows) of the vocabulary in the embedding table (layers.embed_into calls
    embed_into here for an owner with vocab_parallel set: the model, the MTP block)."""

    def __init__(self, first: int, rows: int, vocab_size: int):
        self.first, self.rows, self.vocab_size = first, rows, vocab_size

    def embed_into(self, owner: nn.Module, ids: torch.Tensor, out: torch.Tensor,
                   bad_token: torch.Tensor | None) -> torch.Tensor:
        local = ids - self.first
        ours = (local >= 0) & (local < self.rows)
        # Another rank's id reads row 0 here, zeroed below; an id outside the vocabulary stays out of this
        # table's range too, for the op to report as on one device (a NaN row survives the zeroing).
        theirs = ~ours & (ids >= 0) & (ids < self.vocab_size)
        lookup_rows(owner, local.masked_fill_(theirs, 0), out, bad_token)
        out.mul_(ours[:, None])
        dist.all_reduce(out)
        return out


class VocabParallelHead(nn.Module):
    """The LM head over a rank's vocabulary rows (`local`, the rank's linear), gathered: forward returns the
    whole logits [rows, V] on every rank."""

    def __init__(self, local: Q8Linear | DenseLinear, size: int):
        super().__init__()
        self.local = local
        self.size = size
        self.input_format = local.input_format
        self.in_features, self.out_features = local.in_features, local.out_features * size

    def forward(self, act: Activation, scratch: Scratch) -> torch.Tensor:
        part = self.local(act, scratch)  # [rows, V/n]
        rows, width = part.shape
        gathered = scratch.empty(self, "gathered", (self.size * rows, width))  # rank-major
        all_gather(gathered, part)
        logits = scratch.empty(self, "logits", (rows, self.out_features))
        logits.view(rows, self.size, width).copy_(gathered.view(self.size, rows, width).transpose(0, 1))
        return logits

    def first_rows(self, rows: int, scratch_role: str):
        raise ValueError("a draft head over the first rows of the vocabulary (draft_vocab_size, --draft-vocab) is "
                         "not available under tensor parallelism: the rows are divided among the ranks")


class TensorParallelCausalLM(Qwen38ForCausalLM):
    """One rank's model: the layers over its Shard of the weights, the collectives above. Its config is the
    rank's shape (head counts and intermediate_size divided; vocab_size the whole vocabulary's)."""

    def __init__(self, config: Qwen38Config, checkpoint: Checkpoint, device, dtype, quantize, lane):
        """config: the whole model's; the default process group's ranks share it, this rank loads its share."""
        shard = Shard(config, dist.get_rank(), dist.get_world_size())
        checkpoint.use_shard(shard)
        super().__init__(shard.config, checkpoint, device, dtype, quantize, lane)
        self.rank, self.size = shard.rank, shard.size
        rows = config.vocab_size // shard.size
        self.vocab_parallel = VocabShard(shard.rank * rows, rows, config.vocab_size)
        self.lm_head = VocabParallelHead(self.lm_head, shard.size)
        for layer in self.layers:
            layer.reduce = dist.all_reduce  # a sum in place (NCCL: on the current stream)
        if self.mtp is not None:
            self.mtp.vocab_parallel = self.vocab_parallel
            self.mtp.layer.reduce = dist.all_reduce

    @classmethod
    def from_pretrained(cls, path, tensor_parallel: int, device=None, **kwargs) -> "TensorParallelCausalLM":
        """Qwen38ForCausalLM.from_pretrained's (dtype, quantize, lane, progress the same), in each of the
        `tensor_parallel` ranks (init_tensor_parallel: the process group, the rank's device)."""
        device = init_tensor_parallel(tensor_parallel, device)
        return super().from_pretrained(path, device=device, **kwargs)

    def generate(self, input_ids: torch.Tensor, *args, seed: int | None = None,
                 generator: torch.Generator | None = None, **kwargs) -> torch.Tensor:
        """Qwen38ForCausalLM.generate; without a seed, rank 0's draw is every rank's (ranks that sampled
        differently would hold different tokens)."""
        if seed is None:
            drawn = torch.tensor([resolve_seed(None, generator)], dtype=torch.int64, device=self.device)
            dist.broadcast(drawn, 0)
            seed = int(drawn)
        return super().generate(input_ids, *args, seed=seed, **kwargs)

    def _batch_engine(self, max_batch: int, max_seq_len: int, kv_dtype, use_graph, exact: bool,
                      speculation: Speculation | None = None) -> BatchEngine:
        """Qwen38ForCausalLM's engine, made to launch the same steps on every rank, as the collectives need
        (and the same draft counts: the graphs differ by k). Two host-side choices of the engine depend on
        timing, which differs between ranks: the adaptive draft count (DraftPolicy times the steps), fixed here
        at num_draft_tokens; and with read_ahead > 0, BatchEngine.read also reads launches whose tokens happen
        to have arrived (an event query), so one rank may see a sequence end a step before another and launch
        one step fewer; read_ahead 0 reads each launch before the next. (The CPU's engine has read_ahead 0.)"""
        if speculation is not None:
            speculation = dataclasses.replace(speculation, adaptive=False)
        engine = super()._batch_engine(max_batch, max_seq_len, kv_dtype, use_graph, exact, speculation)
        engine.read_ahead = 0
        return engine
