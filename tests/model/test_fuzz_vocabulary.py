"""Seeded fuzzing of a GGUF's vocabulary against its model (issue 24 item 4), checked at load as llama.cpp's
vocabulary loader checks it: copies of the oracle's mini-q8_0.gguf whose tokenizer.ggml.tokens is longer
or shorter than token_embd.weight's 512 rows, whose token_type holds a value outside llama_token_type's 1..6
or is missing, or whose merges are missing, must each make `qwen38_model.load` (the model and its
tokenizer) raise a CheckpointError naming the file and the key; a valid relabelling (a type in 1..6) either
loads or is such an error. Before, 600 tokens loaded and failed only at generate ('token id 517 out of
range'), 400 loaded and left ids that decode to nothing, and the rest loaded silently.

The cases run in a child process under an address-space and a CPU-time limit (resource.setrlimit), with a
wall-clock timeout. Every case is a pure function of (SEED, case number): a failure names both."""
import os
import pathlib
import random
import re

import gguf

from bounded import assert_cases_passed
from gguf_copies import rewrite_gguf

SEED = 20261225
CASES = 36
ROOT = pathlib.Path(__file__).resolve().parents[2]
ORACLE = pathlib.Path(os.environ.get("QWEN38_ORACLE") or ROOT / "tests" / "oracle" / "mini")
ROWS = 512  # token_embd.weight's rows in the oracle's files
TOKENS, TYPES, MERGES = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"
A, S, I32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, gguf.GGUFValueType.INT32
BAD_TYPES = (0, 7, 8, 100, -1, -6, 2**31 - 1, -2**31)


def mutation(rng: random.Random, tokens: list, types: list, name: str):
    """(description, changes, expected): expected None = loads or a CheckpointError; else the regex the
    error must match after '<file>: '."""
    kind = rng.randrange(6)
    if kind == 0:
        n = rng.choice([1, 2, 255, 400, 503, 511, 513, 600, 1024, rng.randint(1, 2000)])
        new_tokens = tokens[:n] + [f"[EXTRA{i}]" for i in range(n - len(tokens))]
        new_types = types[:n] + [1] * (n - len(types))
        return (f"{n} tokens", {TOKENS: (new_tokens, A, S), TYPES: (new_types, A, I32)},
                rf"tokenizer\.ggml\.tokens has {n} tokens, the model's embedding \(token_embd\.weight\) {ROWS} rows")
    if kind == 1:
        at, value = rng.randrange(len(types)), rng.choice(BAD_TYPES)
        new_types = list(types)
        new_types[at] = value
        return (f"token_type[{at}] = {value}", {TYPES: (new_types, A, I32)},
                rf"tokenizer\.ggml\.token_type\[{at}\] is {value}, expected a llama_token_type from 1 to 6")
    if kind == 2:
        return "no token_type", {TYPES: None}, r"tokenizer\.ggml\.tokens \(512 tokens\) without tokenizer\.ggml\.token_type"
    if kind == 3:  # (gguf's writer refuses an empty array: an empty merges list is test_tokenizer's case)
        return ("merges dropped", {MERGES: None},
                r"no tokenizer\.ggml\.merges: a byte-level BPE \('gpt2'\) vocabulary needs its merges")
    if kind == 4:
        at, value = rng.randrange(len(types)), rng.randint(1, 6)
        new_types = list(types)
        new_types[at] = value
        return f"token_type[{at}] = {value} (valid)", {TYPES: (new_types, A, I32)}, None
    return "unchanged", {}, None


def fuzz_vocabulary() -> None:
    """The cases (run in the child)."""
    import tempfile

    import qwen38_model
    from qwen38_model import CheckpointError
    from qwen38_model.tokenizer import load_tokenizer

    def load_both(path):
        return qwen38_model.load(path, device="cpu")

    source = ORACLE / "mini-q8_0.gguf"
    reader = gguf.GGUFReader(source)
    tokens, types = reader.fields[TOKENS].contents(), reader.fields[TYPES].contents()
    assert len(tokens) == len(types) == ROWS
    failures, outcomes = [], {"error": 0, "loaded": 0}
    with tempfile.TemporaryDirectory() as folder:
        for number in range(CASES):
            rng = random.Random(f"{SEED}/{number}")
            path = pathlib.Path(folder) / f"case{number}.gguf"
            description, changes, expected = mutation(rng, tokens, types, path.name)
            where = f"SEED {SEED} case {number}: {description}"
            rewrite_gguf(reader, path, changes)
            for loader, name in ((load_tokenizer, "load_tokenizer"), (load_both, "qwen38_model.load")):
                try:
                    loaded = loader(path)
                except CheckpointError as e:
                    outcomes["error"] += 1
                    message = str(e)
                    if not message.startswith(f"{path}: "):
                        failures.append(f"{where}: {name}: the error does not start with the file: {e}")
                    # The model's load may meet the short vocabulary first (an eos id beyond it): load_tokenizer
                    # must name the count.
                    elif expected is not None and name == "load_tokenizer" and \
                            not re.match(expected, message[len(f"{path}: "):]):
                        failures.append(f"{where}: {name}: {message[:300]!r}, expected {expected!r}")
                    continue
                except Exception as e:  # noqa: BLE001 (the point: nothing but CheckpointError may escape)
                    failures.append(f"{where}: {name}: {type(e).__name__} {str(e)[:200]!r} instead of a "
                                    "CheckpointError")
                    continue
                outcomes["loaded"] += 1
                if expected is not None:
                    failures.append(f"{where}: {name} loaded, expected a CheckpointError matching {expected!r}")
                elif name != "load_tokenizer" and not set(loaded.tokenizer.eos_token_ids) <= \
                        set(range(loaded.model.config.vocab_size)):
                    failures.append(f"{where}: stop ids {loaded.tokenizer.eos_token_ids} outside the vocabulary")
            path.unlink()
    assert not failures, f"{len(failures)} of {CASES} cases failed:\n" + "\n".join(failures[:30])
    print(f"{CASES} cases passed: {outcomes}", flush=True)


def test_fuzzed_gguf_vocabulary(oracle_dir):
    assert_cases_passed("fuzz_vocabulary", __file__, CASES)


def test_the_command_line_refuses_a_short_vocabulary_before_the_load(oracle_dir, tmp_path, capsys, monkeypatch):
    """`qwen38 generate` reads the header once for its tokenizer (cli.source): the same check as load_tokenizer."""
    from qwen38_model import cli

    reader = gguf.GGUFReader(oracle_dir / "mini-q8_0.gguf")
    tokens = [str(t) for t in reader.fields[TOKENS].contents()]
    types = list(reader.fields[TYPES].contents())
    path = tmp_path / "short.gguf"
    rewrite_gguf(reader, path, {TOKENS: (tokens[:400], A, S), TYPES: (types[:400], A, I32)})
    assert cli.main(["generate", "--model", str(path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"tokenizer\.ggml\.tokens has 400 tokens, the model's embedding "
                                       rf"\(token_embd\.weight\) {ROWS} rows", err[0]), err
