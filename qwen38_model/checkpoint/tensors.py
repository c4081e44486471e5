"""What a checkpoint hands the model (dense tensors, or Q8_0 weights kept packed for the kernels), and how a
tensor's bytes get from the file to the device (TensorReader)."""
from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CheckpointError
from . import q8_0

# Positioned reads in flight. One core copies from the page cache at 1-20 GB/s depending on the host and on
# whether the target pages are fresh (the 2-core CI VM: ~18 GB/s into a reused buffer, ~0.5 GB/s into new
# memory); 8 keep a PCIe 5 link busy on slow cores too and leave the host's other cores alone
# (benchmarks/load.py measures the reads of this many threads beside the load).
READ_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
PIECE_BYTES = 8 << 20  # the largest read, and a pinned staging slot: 2 x READ_THREADS slots = 128 MB
MIN_PIECE_BYTES = 1 << 20  # below this, splitting a read costs more than the threads gain


@dataclass
class Q8Tensor:
    """A Q8_0 matrix in the kernels' layout: quants int8 [N, K] and fp16 scales [N, K/32] as two separate
    arrays (ggml interleaves them per block; split, each row's quants are one contiguous 16-byte-aligned run).
    The codec is q8_0.py's."""

    q: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return q8_0.dequantize(self.q, self.d, dtype)

    @staticmethod
    def from_ggml_bytes(raw: torch.Tensor, shape: tuple[int, int]) -> "Q8Tensor":
        return Q8Tensor(*q8_0.split_ggml_blocks(raw, shape))

    @staticmethod
    def quantize(w: torch.Tensor) -> "Q8Tensor":
        """The converter's Q8_0 of w (gguf.quants'), computed in float32 from the stored weight, like the
        converter."""
        return Q8Tensor(*q8_0.quantize(w))


def pieces(nbytes: int, threads: int, max_piece: int) -> list[tuple[int, int]]:
    """(start, length) pieces covering nbytes: whole waves of `threads` pieces of at most max_piece bytes,
    all about the same size, so the threads of a wave finish together (a tensor's reads end in one wait);
    none under MIN_PIECE_BYTES unless the range itself is smaller (a norm is one read)."""
    waves = -(-nbytes // (threads * max_piece))
    count = max(1, min(threads * waves, nbytes // MIN_PIECE_BYTES))
    size = max(1, -(-nbytes // count))
    return [(start, min(size, nbytes - start)) for start in range(0, nbytes, size)]


class TensorReader:
    """Reads byte ranges of checkpoint files into new uint8 tensors on one device, in positioned reads
    (os.preadv, which releases the GIL) of up to PIECE_BYTES spread over READ_THREADS threads. Not an mmap: mapped pages that were touched stay in the process's resident set, so streaming a
    29 GB file through a mapping would hold all of it; this way only the tensor in flight is resident.

    On the CPU each piece is read straight into the result. On a GPU each piece is read into a pinned
    staging slot and copied to the device asynchronously (on the current stream, so whatever runs on the
    tensor next is ordered after its copies) while the next pieces are read; a slot is read into again
    once its last copy has finished. read() returns when every read has returned, the copies may still
    be running. The pinned block (2 x READ_THREADS slots) is kept by torch's host allocator for reuse."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.threads, self.piece_bytes = READ_THREADS, PIECE_BYTES
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="qwen38-read")
        self.slots, self.copied, self.next_slot = [], [], 0
        if self.device.type != "cpu":
            staging = torch.empty(2 * self.threads * self.piece_bytes, dtype=torch.uint8, pin_memory=True)
            self.slots = list(staging.split(self.piece_bytes))
            self.copied = [torch.cuda.Event() for _ in self.slots]

    def read(self, path: str, offset: int, nbytes: int, tensor_name: str) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        with open(path, "rb") as f:
            args = (f.fileno(), path, tensor_name, offset, nbytes)
            if self.device.type == "cpu":
                self._read_into(out, *args)
            else:
                self._read_staged(out, *args)
        return out

    def close(self) -> None:
        self.pool.shutdown()
        self.slots, self.copied = [], []

    def _read_into(self, out: torch.Tensor, fd: int, path: str, name: str, offset: int, nbytes: int) -> None:
        target = out.numpy()
        reads = [self.pool.submit(_read_piece, fd, target[start : start + length], offset + start, path, name,
                                  offset, nbytes)
                 for start, length in pieces(nbytes, self.threads, self.piece_bytes)]
        wait(reads)  # none may outlive the file or write into `out` after an error
        for r in reads:
            r.result()

    def _read_staged(self, out: torch.Tensor, fd: int, path: str, name: str, offset: int, nbytes: int) -> None:
        in_flight = deque()  # (read, slot, start, length), oldest first; at most one per slot
        try:
            for start, length in pieces(nbytes, self.threads, self.piece_bytes):
                if len(in_flight) == len(self.slots):
                    self._copy(out, *in_flight.popleft())
                slot = self.next_slot
                self.next_slot = (slot + 1) % len(self.slots)
                self.copied[slot].synchronize()
                target = self.slots[slot][:length].numpy()
                read = self.pool.submit(_read_piece, fd, target, offset + start, path, name, offset, nbytes)
                in_flight.append((read, slot, start, length))
            while in_flight:
                self._copy(out, *in_flight.popleft())
        finally:
            wait([item[0] for item in in_flight])  # none may outlive the file or write into a reused slot

    def _copy(self, out: torch.Tensor, read: Future, slot: int, start: int, length: int) -> None:
        read.result()
        out[start : start + length].copy_(self.slots[slot][:length], non_blocking=True)
        self.copied[slot].record(torch.cuda.current_stream(self.device))  # the stream the copy went to


def _read_piece(fd: int, target: np.ndarray, position: int, path: str, name: str, offset: int, nbytes: int) -> None:
    """Fills target from the file at `position`; the file ending first is a truncated tensor."""
    view = memoryview(target)
    while view.nbytes:
        got = os.preadv(fd, [view], position)
        if got == 0:
            size = os.path.getsize(path)
            raise CheckpointError(f"{path}: tensor {name!r} is truncated: expected {nbytes} bytes at offset "
                                  f"{offset}, the file has {max(size - offset, 0)} (file size {size})")
        view, position = view[got:], position + got
