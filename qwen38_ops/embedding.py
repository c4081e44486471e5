"""Embedding lookups, the token ids read on the device (int32 [T]): q8_0_embedding from a Q8_0 table,
embedding from a dense one (float32, bfloat16 or float16). Both write float32 rows.

An id outside [0, V): the reference raises a ValueError; the kernel writes a NaN row and ORs BAD_TOKEN into
bad_token (when given), for the caller to raise at its next sync (Qwen38State.sync_position): int32 [1], one flag
for the T rows, or [T], row t's own flag (batched rows: row t a sequence of its own)."""
from ._registry import register
# BAD_TOKEN: the bit the kernels OR into bad_token (kBadTokenFlag, csrc/kernels/op_limits.h). Not attention's
# BAD_POSITION: a state keeps both conditions in one flag.
from .limits import BAD_TOKEN  # noqa: F401
from .reference import embedding as ref

register("q8_0_embedding", ref.q8_0_embedding)
register("embedding", ref.embedding)
