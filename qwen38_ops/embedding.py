"""Embedding lookup from a Q8_0 table; the token ids are read on the device (int32 [T])."""
from ._registry import register
from .reference import embedding as ref

register("q8_0_embedding", ref.q8_0_embedding)

