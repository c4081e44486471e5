"""Embedding lookup from a Q8_0 table; the token ids are read on the device (int32 [T])."""
import torch

from ._registry import register
from .reference import embedding as ref

register("q8_0_embedding", ref.q8_0_embedding)


def q8_0_embedding(token, weight_q, weight_d, out=None) -> torch.Tensor:
    if out is None:
        out = torch.empty(token.shape[0], weight_q.shape[1], dtype=torch.float32, device=token.device)
    torch.ops.qwen38.q8_0_embedding(token, weight_q, weight_d, out)
    return out
