"""The kernels' limits and constants that Python needs, read once from the extension: written once, in
csrc/kernels/op_limits.h, and exported by csrc/bindings.cpp as torch.ops.qwen38.limits() (every build has it, the
CPU-only one too). The family modules take their constants from here; the references keep their own spec
constants (they never load the extension) and tests/ops/test_limits.py checks that the two agree."""
import torch

from . import _C  # noqa: F401  (defines torch.ops.qwen38.limits)

_LIMITS = {name: list(values) for name, values in torch.ops.qwen38.limits().items()}


def _scalar(name: str) -> int:
    (value,) = _LIMITS[name]
    return value


QUANT_BLOCK = _scalar("quant_block")  # values per scale of a Q8_0 block (weights and int8 activations)
ATTENTION_SPLITS = _scalar("attention_splits")  # attention's splits per (token, head) up to ...
ATTENTION_SAME_SPLIT_TOKENS = _scalar("attention_same_split_tokens")  # ... this many tokens
ATTENTION_PREFILL_ROWS = _scalar("attention_prefill_rows")  # query rows per attention_prefill block
ATTENTION_PREFILL_TARGET_BLOCKS = _scalar("attention_prefill_target_blocks")  # its split-K fills this many blocks
ATTENTION_PREFILL_MAX_SPLITS = _scalar("attention_prefill_max_splits")
GDN_STEP_MAX_TOKENS = _scalar("gdn_step_max_tokens")  # the most tokens one gdn_step takes
BAD_POSITION = _scalar("bad_position_flag")  # what attn_qk_norm_rope_store stores for a position outside the cache
BAD_TOKEN = _scalar("bad_token_flag")  # what the embeddings OR in for a token id outside the vocabulary
_configs = _LIMITS["q8_0_gemv_configs"]
Q8_0_GEMV_CONFIGS = tuple(zip(_configs[0::2], _configs[1::2]))  # the compiled GEMV configs, (trip, parts)
