"""Output buffers for the model's ops, found by (owner's role, name); an owner may also be a role string.

A buffer is shared by every layer: the key is the owner's role (`scratch_role`, else its class name), not
the owner itself, because each buffer is dead by the time the next layer's module of the same role writes
it (the one value that crosses layers, the MLP's output `delta`, is read by the next layer's first norm,
before that layer's MLP runs). So scratch memory is one layer's worth, not 64 layers' -- what lets a
prompt chunk of thousands of tokens fit -- and the decode step touches fewer addresses.

A prompt chunk uses a fresh Scratch or one kept across chunks. The decode step keeps one Scratch for its
lifetime: the warm-up step allocates every buffer once, and a captured CUDA graph then replays on exactly
those addresses, with no allocation inside the step.

A decode step over B sequences (engine.BatchEngine) has a Scratch with rowwise=True: its rows are independent
sequences, and every op runs the form that gives each row the bits of a one-row call (the Q8_0 GEMV at any
row count, never the GEMM), so a sequence's tokens do not depend on what else is in the batch."""
from __future__ import annotations

import torch

from .formats import QK, ActFormat, Activation


class Scratch:
    def __init__(self, device, rowwise: bool = False):
        self.device = torch.device(device)
        self.rowwise = rowwise
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self.frozen = False

    def freeze(self) -> None:
        """No allocation from now on: a captured CUDA graph replays on these buffers' addresses, and a new
        buffer for the same key would free the old one under it (a silent dangling pointer)."""
        self.frozen = True

    def empty(self, owner, name: str, shape, dtype=torch.float32) -> torch.Tensor:
        role = owner if isinstance(owner, str) else getattr(owner, "scratch_role", type(owner).__name__)
        key = (role, name)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != torch.Size(shape) or buf.dtype != dtype:
            if self.frozen:
                found = "none" if buf is None else f"{tuple(buf.shape)} {buf.dtype}"
                raise RuntimeError(f"scratch buffer {key} requested as {tuple(shape)} {dtype} (held: {found}) after "
                                   "a CUDA graph was captured on this Scratch: a graph's buffers cannot change")
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            self._buffers[key] = buf
        return buf

    def activation(self, owner, name: str, rows: int, width: int, fmt: ActFormat) -> Activation:
        """Buffers for a producer that writes `fmt` (its consumer's input_format)."""
        x = self.empty(owner, name, (rows, width))
        if fmt is ActFormat.F32:
            return Activation(fmt, x)
        q = self.empty(owner, name + ".q", (rows, width), torch.int8)
        q_lo = self.empty(owner, name + ".q_lo", (rows, width), torch.int8) if fmt is ActFormat.INT8X2 else None
        return Activation(fmt, x, q, q_lo, self.empty(owner, name + ".d", (rows, width // QK)))
