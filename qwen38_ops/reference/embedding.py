"""Row lookups from an embedding table: Q8_0 (dequantized) or dense (widened to float32).

An id outside [0, V) is a ValueError here, at once: the kernels cannot raise from the device, so they
write a NaN row and flag bad_token instead (its one element, or row t's element t of T), which the caller reads at
its next sync (the reference never needs the flag). Without the check a negative id would silently read a row
from the table's end."""
import torch

from .q8_gemv import dequantize_q8_0


def check_token_ids(op: str, token: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """token as int64 row indices, or a ValueError naming the first id outside [0, vocab_size)."""
    rows = token.long()
    bad = (rows < 0) | (rows >= vocab_size)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{op}: token id {int(rows[i])} (row {i} of {rows.shape[0]}) is outside the vocabulary "
                         f"[0, {vocab_size})")
    return rows


def q8_0_embedding(token, weight_q, weight_d, out, bad_token=None) -> None:
    rows = check_token_ids("q8_0_embedding", token, weight_q.shape[0])
    out.copy_(dequantize_q8_0(weight_q[rows], weight_d[rows], out.dtype))


def embedding(token, weight, out, bad_token=None) -> None:
    rows = check_token_ids("embedding", token, weight.shape[0])
    out.copy_(weight[rows])  # float32 holds every bfloat16 and float16 value: exact
