"""Checks of what a caller passes to from_pretrained(), forward() and generate(): a wrong type or value is
a ValueError naming the argument, expected vs found; never a silent rounding of float token ids, an eos
id of -1 that indexes the last vocabulary row, or a stop string that matches everywhere."""
from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_device(device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a torch.device or a name like 'cuda' or 'cpu', found {device!r}: "
                         f"{str(e).splitlines()[0]}") from None


def check_dtype(dtype) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(str, DTYPES))}, found {dtype!r}")


def check_input_ids(input_ids, vocab_size: int) -> None:
    """An integer tensor [batch, seq] of ids in [0, vocab_size), at least one token per row."""
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a torch.Tensor of token ids, found {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor, found {input_ids.dtype} (ids are not rounded)")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], found shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids has no tokens")
    ids = input_ids.long()  # compare in int64: a uint8 tensor cannot hold vocab_size
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        raise ValueError(f"token id {int(ids[bad][0])} out of range [0, {vocab_size})")


def check_ids_dtype_holds(dtype: torch.dtype, vocab_size: int) -> None:
    """generate() returns the prompt's dtype: it must hold every id the model can produce."""
    if torch.iinfo(dtype).max < vocab_size - 1:
        raise ValueError(f"input_ids of dtype {dtype} cannot hold the generated ids (up to {vocab_size - 1}); pass "
                         "torch.long ids")


def check_token_count(name: str, value, low: int) -> int:
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, found {value!r}")
    return value


def stop_token_ids(eos_token_id, default: tuple[int, ...], vocab_size: int) -> tuple[int, ...]:
    """eos_token_id as generate() takes it (None: the checkpoint's; an id; a list of ids) -> a tuple."""
    if eos_token_id is None:
        return default
    ids = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    bad = [i for i in ids if not (is_int(i) and 0 <= i < vocab_size)]
    if bad:
        raise ValueError(f"eos_token_id must be token ids in [0, {vocab_size}), found {bad[0]!r}")
    return tuple(ids)


def stop_string_tuple(stop_strings, tokenizer) -> tuple[str, ...]:
    stops = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings or ())
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError(f"stop_strings must be non-empty strings (an empty one would stop at once), found "
                         f"{stop_strings!r:.80}")
    if stops and tokenizer is None:
        raise ValueError("stop_strings need tokenizer= to decode the generated text")
    return stops
