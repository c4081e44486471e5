"""The kernels' limits and constants reach Python from the extension (torch.ops.qwen38.limits(), defined in
csrc/bindings.cpp from csrc/kernels/op_limits.h, in every build), and the Python side agrees with them: the
family modules take them from qwen38_ops.limits, and the references, which keep their own spec constants (they
never load the extension), hold the same values."""
import torch

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_ops import attention, attention_prefill, embedding, gdn_step, limits
from qwen38_ops.reference import norm_quant as ref_norm_quant
from qwen38_ops.reference import q8_gemv as ref_q8_gemv


def test_limits_op_exports_every_constant():
    exported = torch.ops.qwen38.limits()
    assert set(exported) == {"quant_block", "attention_splits", "attention_same_split_tokens",
                             "attention_prefill_rows", "attention_prefill_target_blocks",
                             "attention_prefill_max_splits", "gdn_step_max_tokens", "bad_position_flag",
                             "bad_token_flag", "q8_0_gemv_configs"}
    assert all(isinstance(v, int) for values in exported.values() for v in values)
    assert len(exported["q8_0_gemv_configs"]) % 2 == 0


def test_references_agree_with_the_extension():
    assert ref_norm_quant.QK == limits.QUANT_BLOCK == 32  # ggml's Q8_0 block
    assert ref_q8_gemv.QK == limits.QUANT_BLOCK


def test_family_modules_take_the_extension_values():
    assert attention.ATTENTION_SPLITS == limits.ATTENTION_SPLITS
    assert attention.SAME_SPLIT_TOKENS == limits.ATTENTION_SAME_SPLIT_TOKENS
    assert attention.BAD_POSITION == limits.BAD_POSITION
    assert attention_prefill.PREFILL_ROWS == limits.ATTENTION_PREFILL_ROWS
    assert attention_prefill.TARGET_BLOCKS == limits.ATTENTION_PREFILL_TARGET_BLOCKS
    assert attention_prefill.MAX_SPLITS == limits.ATTENTION_PREFILL_MAX_SPLITS
    assert gdn_step.MAX_TOKENS == limits.GDN_STEP_MAX_TOKENS
    assert embedding.BAD_TOKEN == limits.BAD_TOKEN


def test_what_the_python_side_relies_on():
    # Up to SAME_SPLIT_TOKENS rows (a decode step, a verify) every row gets the decode step's split count, so
    # it keeps a T = 1 step's bits; above, the splits are shared out.
    assert all(attention.num_splits(t) == limits.ATTENTION_SPLITS
               for t in range(1, limits.ATTENTION_SAME_SPLIT_TOKENS + 1))
    assert attention.num_splits(limits.ATTENTION_SAME_SPLIT_TOKENS + 1) < limits.ATTENTION_SPLITS
    # Batched rows (a cache a row): every row a sequence's decode step, with its splits, at any T.
    assert all(attention.num_splits(t, batched=True) == limits.ATTENTION_SPLITS for t in (1, 9, 64, 1000))
    # One error int32 holds both flags: distinct bits.
    assert limits.BAD_POSITION & limits.BAD_TOKEN == 0 and limits.BAD_POSITION and limits.BAD_TOKEN
    # The GEMV's default configs (trip 2, parts 1 or 4: q8_0_gemv_default_config) are compiled.
    assert {(2, 1), (2, 4)} <= set(limits.Q8_0_GEMV_CONFIGS)
