"""Checks of what a caller passes to from_pretrained(), forward() and generate(): a wrong type or value is
a ValueError naming the argument, expected vs found; never a silent rounding of float token ids, an eos
id of -1 that indexes the last vocabulary row, or a stop string that matches everywhere."""
from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SEED_LIMIT = 2**32  # the sampler keeps a seed's low 32 bits: a larger one would repeat a smaller one's run


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
    if stop_strings is None:
        stops = ()
    elif isinstance(stop_strings, str):
        stops = (stop_strings,)
    elif isinstance(stop_strings, (list, tuple)):
        stops = tuple(stop_strings)
    else:
        raise ValueError(f"stop_strings must be a string or a list of strings, found {type(stop_strings).__name__} "
                         f"{stop_strings!r:.80}")
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError(f"stop_strings must be non-empty strings (an empty one would stop at once), found "
                         f"{stop_strings!r:.80}")
    if stops and tokenizer is None:
        raise ValueError("stop_strings need tokenizer= to decode the generated text")
    if stops and not callable(getattr(tokenizer, "decode", None)):
        raise ValueError(f"tokenizer must have a decode(ids) method (for stop_strings), found "
                         f"{type(tokenizer).__name__}")
    return stops


def check_seed(seed) -> None:
    """None (a random seed) or an integer in [0, 2^32): the sampler's seed is 32 bits, so seed + 2^32 would
    silently repeat seed's samples."""
    if seed is not None and not is_int(seed):
        raise ValueError(f"seed must be an integer, found {seed!r:.40}")
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an integer in [0, {SEED_LIMIT - 1}] (the sampler's seed is 32 bits), "
                         f"found {seed!r:.40}")


def check_new_token_bounds(min_new_tokens, max_new_tokens: int) -> None:
    if is_int(min_new_tokens) and min_new_tokens > max_new_tokens:
        raise ValueError(f"min_new_tokens {min_new_tokens} must be <= max_new_tokens {max_new_tokens}")


def check_streamer(streamer) -> None:
    """None, or an object with callable put(tensor) and end() (transformers' streamer protocol)."""
    if streamer is None:
        return
    missing = [name for name in ("put", "end") if not callable(getattr(streamer, name, None))]
    if missing:
        raise ValueError(f"streamer must have callable put(ids) and end() methods (transformers' streamer "
                         f"protocol, e.g. TextStreamer), found {type(streamer).__name__} without "
                         f"{' and '.join(missing)}")


def check_logits_to_keep(logits_to_keep) -> None:
    if not is_int(logits_to_keep) or logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be an integer >= 0 (0: every row; k: the last k), found "
                         f"{logits_to_keep!r:.40}")


def kept_positions(attention_mask, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per row of input_ids, the positions attention_mask keeps (int64): one contiguous run of ones, as left
    padding (generation) or right padding gives; a ValueError for any other mask. None keeps every position."""
    batch, length = input_ids.shape
    if attention_mask is None:
        return [torch.arange(length)] * batch
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, length):
        found = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a tensor of input_ids' shape {(batch, length)}, found {found}")
    mask = attention_mask.cpu()
    if mask.dtype == torch.bool:
        mask = mask.long()
    if mask.is_floating_point() or mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 and 1")
    kept = []
    for b, row in enumerate(mask):
        ones = row.nonzero()[:, 0]
        if ones.numel() == 0:
            raise ValueError(f"attention_mask row {b} keeps no token")
        if int(ones[-1] - ones[0]) + 1 != ones.numel():
            raise ValueError(f"attention_mask row {b} is not one run of ones (padding must be on the left or the "
                             "right of the tokens)")
        kept.append(ones)
    return kept
