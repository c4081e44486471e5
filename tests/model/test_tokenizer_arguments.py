"""Seeded fuzzing of the tokenizer's arguments (issue 24 item 2): encode, decode, token_bytes, the stream
decoder's feed and apply_chat_template's messages, given None, bytes, lone surrogates, negative, huge,
float, bool and str ids, non-iterables and mistyped messages. Each case ends in a result of the right type
for a valid argument, or a ValueError whose message starts with the argument's name (`text`, `ids[k]`,
`token_id`, `messages[k]...`): never the tokenizers library's TypeError / OverflowError, never a bool
taken as an id.

The cases run in a child process under an address-space limit and a CPU-time limit (resource.setrlimit),
with a wall-clock timeout: a case that grew or hung fails the test instead of the machine. Every case is
a pure function of (SEED, case number): a failure names both."""
import os
import pathlib
import random
import re

import numpy as np
import torch

from bounded import assert_cases_passed

SEED = 20261224
CASES = 600
ROOT = pathlib.Path(__file__).resolve().parents[2]
ORACLE = pathlib.Path(os.environ.get("QWEN38_ORACLE") or ROOT / "tests" / "oracle" / "mini")
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"

BAD_IDS = (-1, -2, -2**31, -2**63, 2**32, 2**32 + 1, 2**63, 2**64, 2**100, True, False, 1.5, 3.0, float("nan"),
           "a", "7", b"7", None, [1], (1,), {}, 1j, torch.tensor(1.0), torch.tensor(True), np.float32(2.0),
           np.bool_(True))
GOOD_IDS = (0, 1, 42, 255, 500, 511, 512, 2**32 - 1, np.int64(7), torch.tensor(9), np.uint32(3))
NOT_SEQUENCES = (None, 5, 2.5, "abc", b"\x01\x02", {"ids": [1]}, True)
BAD_TEXTS = (None, b"hello", bytearray(b"hi"), 5, 1.5, ["a"], ("a",), True)
BAD_MESSAGES = (None, "hi", 5, {"role": "user", "content": "x"}, b"x", [None], ["hi"], [[]], [{"role": 5}],
                [{"content": "x"}], [{"role": None, "content": "x"}])


def random_text(rng: random.Random) -> str:
    alphabet = "abc xyz\n\t<|im_end|>é中🙂\u0301"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))


def with_surrogate(rng: random.Random) -> str:
    text = random_text(rng)
    at = rng.randint(0, len(text))
    return text[:at] + chr(rng.randint(0xD800, 0xDFFF)) + text[at:]


def case(tokenizer, rng: random.Random):
    """(description, call, expected): expected is None (a valid call: a result of the right type) or the
    regex the ValueError's message must start with."""
    kind = rng.randrange(9)
    if kind == 0:
        text = rng.choice(BAD_TEXTS)
        return f"encode({text!r})", lambda: tokenizer.encode(text), r"text must be a str"
    if kind == 1:
        text = with_surrogate(rng)
        return f"encode({text!r})", lambda: tokenizer.encode(text), r"text holds a lone surrogate"
    if kind == 2:
        text = random_text(rng)
        return f"encode({text!r})", lambda: tokenizer.encode(text), None
    if kind == 3:
        ids = [rng.choice(GOOD_IDS) for _ in range(rng.randint(0, 6))]
        at = rng.randint(0, len(ids))
        ids.insert(at, rng.choice(BAD_IDS))
        return f"decode({ids!r})", lambda: tokenizer.decode(ids), rf"ids\[{at}\] must be "
    if kind == 4:
        ids = [rng.choice(GOOD_IDS) for _ in range(rng.randint(0, 6))]
        as_tensor = rng.random() < 0.3 and all(not isinstance(i, torch.Tensor) for i in ids)
        value = torch.tensor([int(i) for i in ids], dtype=torch.long) if as_tensor else ids
        return f"decode({value!r})", lambda: tokenizer.decode(value), None
    if kind == 5:
        value = rng.choice(NOT_SEQUENCES)
        return f"decode({value!r})", lambda: tokenizer.decode(value), r"ids must be a sequence"
    if kind == 6:
        value = rng.choice(BAD_IDS + GOOD_IDS)
        bad = any(value is v for v in BAD_IDS)
        return f"token_bytes({value!r})", lambda: tokenizer.token_bytes(value), r"token_id must be " if bad else None
    if kind == 7:
        value = rng.choice(BAD_IDS + GOOD_IDS)
        bad = any(value is v for v in BAD_IDS)
        decoder = tokenizer.stream_decoder()
        return f"feed({value!r})", lambda: decoder.feed(value), r"token_id must be " if bad else None
    if rng.random() < 0.2:
        messages = [{"role": "user", "content": with_surrogate(rng)}]
        return f"apply_chat_template({messages!r})", lambda: tokenizer.apply_chat_template(messages), \
            r"messages\[0\]\['content'\] holds a lone surrogate"
    messages = rng.choice(BAD_MESSAGES)
    return f"apply_chat_template({messages!r})", lambda: tokenizer.apply_chat_template(messages), r"messages"


RESULT_TYPES = {"encode": list, "decode": str, "token_bytes": bytes, "feed": str}


def fuzz_tokenizer_arguments() -> None:
    """The cases (run in the child)."""
    from qwen38_model.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(ORACLE / "mini-q8_0.gguf")
    tokenizer.chat_template = TEMPLATE
    failures = []
    for number in range(CASES):
        rng = random.Random(f"{SEED}/{number}")
        description, call, expected = case(tokenizer, rng)
        where = f"SEED {SEED} case {number}: {description}"
        try:
            result = call()
        except ValueError as e:
            if expected is None or not re.match(expected, str(e)):
                failures.append(f"{where}: ValueError {str(e)[:200]!r}, expected "
                                f"{'a result' if expected is None else expected!r}")
            continue
        except Exception as e:  # noqa: BLE001 (the point: nothing but ValueError may escape)
            failures.append(f"{where}: {type(e).__name__} {str(e)[:200]!r} instead of a ValueError")
            continue
        name = description.split("(")[0]
        if expected is not None:
            failures.append(f"{where}: returned {result!r:.80} instead of a ValueError")
        elif name in RESULT_TYPES and not isinstance(result, RESULT_TYPES[name]):
            failures.append(f"{where}: returned a {type(result).__name__}")
    assert not failures, f"{len(failures)} of {CASES} cases failed:\n" + "\n".join(failures[:30])
    print(f"{CASES} cases passed", flush=True)


def test_fuzzed_tokenizer_arguments(oracle_dir):
    assert_cases_passed("fuzz_tokenizer_arguments", __file__, CASES)
