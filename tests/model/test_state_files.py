"""Seeded fuzzing of conversation and state snapshot files. Mutated copies of a saved conversation
(truncations; bit flips and rewritten entries in the safetensors header; edited qwen38.config and
qwen38.position values; state tensors of another shape or dtype, missing or extra; non-finite and huge
values; token histories with ids outside the vocabulary) and files that are not files (a FIFO, a folder)
must each end one of two ways in Conversation.load and StateSnapshot.load: a ValueError naming the file,
or a state equal to the original's. Never another exception, a hang or memory past a bound: the loads run
in a child process under RLIMIT_AS, each case under an alarm, the child under a timeout.

Every case is a pure function of (SEED, case number): a failure names both and the mutation."""
import json
import os
import pathlib
import random
import resource
import signal
import struct
import subprocess
import sys

import pytest
import safetensors.torch
import torch

SEED = 20261224
CASES = 300
CASE_SECONDS = 10  # far above a case's load (~1 ms)
CHILD_SECONDS = 120
REPO = pathlib.Path(__file__).resolve().parents[2]
# The child's address space may grow by this much past what it has once the model is loaded (0.9 GB on
# a CPU-only torch; a CUDA build maps several GB of libraries, hence a limit relative to that): the case
# files are 180 KB, and a load that allocated what a mutated header claims (2^62 elements) would pass it.
MEMORY_HEADROOM = 1 << 30
TURN = [5, 17, 99, 3]
ODD_JSON = ("[]", "null", "5", '"x"', "{", "", "{}", "[" * 100000, '{"hidden_size": "x"}', "NaN")
ODD_POSITIONS = ("-1", "", "abc", " 7", "+7", "7.0", "1e3", "7_0", "\u0667", "9" * 5000, str(2**40), str(2**64),
                 "262145", "0", "6", "8")
EXTREMES = (0, 1, 2**31 - 1, 2**32, 2**63 - 1, 2**64 - 1)


# ---- mutations (in the test process) ---------------------------------------------------------------

def split(data: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def join(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def rewritten(tensors: dict, meta: dict, path) -> bytes:
    safetensors.torch.save_file(tensors, str(path))
    header, body = split(path.read_bytes())
    header["__metadata__"] = meta
    return join(header, body)


def odd_tensor(t: torch.Tensor, rng: random.Random) -> tuple[str, torch.Tensor]:
    """Another shape or dtype, or a bad value, for a state tensor (restore's copy_ would broadcast a 1-row or
    0-d tensor and convert any dtype)."""
    kind = rng.choice(["1 row", "extra row", "row less", "1-D", "0-d", "unsqueeze", "transpose", "int64", "bool",
                       "float64", "float16", "nan", "inf", "-inf", "1e30", "-1e30"])
    if kind in ("nan", "inf", "-inf", "1e30", "-1e30"):
        t = t.clone()
        t.view(-1)[rng.randrange(t.numel())] = float(kind)
        return kind, t
    return kind, {
        "1 row": lambda: t[:1].clone(), "extra row": lambda: torch.cat([t, t[:1]]), "row less": lambda: t[1:].clone(),
        "1-D": lambda: t.flatten().clone(), "0-d": lambda: t.flatten()[0].clone(), "unsqueeze": lambda: t[None].clone(),
        "transpose": lambda: t.transpose(0, -1).contiguous(), "int64": lambda: t.to(torch.int64),
        "bool": lambda: t != 0, "float64": lambda: t.double(), "float16": lambda: t.half(),
    }[kind]()


def odd_tokens(tokens: torch.Tensor, position: int, rng: random.Random) -> tuple[str, torch.Tensor]:
    kind = rng.choice(["-5", "600", "512", "2^40", "2^63-1", "short", "empty", "2-D", "int32", "float", "bool",
                       "long"])
    if kind in ("-5", "600", "512", "2^40", "2^63-1"):
        t = tokens.clone()
        t[rng.randrange(len(t))] = {"-5": -5, "600": 600, "512": 512, "2^40": 2**40, "2^63-1": 2**63 - 1}[kind]
        return f"an id {kind}", t
    return kind, {"short": lambda: tokens[: position - 1].clone(), "empty": lambda: tokens[:0].clone(),
                  "2-D": lambda: tokens[None].clone(), "int32": lambda: tokens.int(), "float": lambda: tokens.float(),
                  "bool": lambda: tokens != 0, "long": lambda: torch.zeros(262145, dtype=torch.int64)}[kind]()


def mutate(original: bytes, scratch, rng: random.Random) -> tuple[str, bytes]:
    data = bytearray(original)
    header, body = split(original)
    (length,) = struct.unpack_from("<Q", data)
    meta = dict(header["__metadata__"])
    tensors = safetensors.torch.load(original)
    position = int(meta["qwen38.position"])
    kind = rng.choice(["truncate", "flip header", "header length", "header entry", "config", "position",
                       "metadata key", "tensor", "tensor", "tensor", "remove tensor", "extra tensor", "tokens",
                       "value"])
    if kind == "truncate":
        end = rng.randrange(8 + length) if rng.random() < 0.5 else rng.randrange(len(data))
        return f"truncated to {end} bytes", bytes(data[:end])
    if kind == "flip header":
        at, bit = rng.randrange(8 + length), rng.randrange(8)
        data[at] ^= 1 << bit
        return f"flip byte {at} bit {bit}", bytes(data)
    if kind == "header length":
        value = rng.choice(EXTREMES + (length - 1, length + 1))
        data[:8] = struct.pack("<Q", value)
        return f"header length {length} -> {value}", bytes(data)
    if kind == "header entry":
        name = rng.choice(sorted(k for k in header if k != "__metadata__"))
        entry, field = header[name], rng.choice(["dtype", "shape", "data_offsets", "entry"])
        if field == "dtype":  # same-size relabels included: F32 -> I32 / U32, I64 -> F64 / U64
            entry["dtype"] = rng.choice(["F32", "I32", "U32", "F64", "I64", "U64", "BF16", "F16", "BOOL", "F8_E4M3", "", 7])
        elif field == "shape":
            shape = entry["shape"]
            entry["shape"] = rng.choice([shape + [1], shape[:-1], [1] + shape, [0] * len(shape), [2**62] + shape[1:],
                                         [-1] + shape[1:], shape[::-1], [shape[0] * shape[1]] + shape[2:], "x"])
        elif field == "data_offsets":
            begin, end = entry["data_offsets"]
            entry["data_offsets"] = rng.choice([[begin + 4, end + 4], [begin, end - 4], [end, begin], [begin, 2**64]])
        else:
            header[name] = rng.choice([None, "x", 5, [], {}])
        return f"header of {name!r}: {field} -> {header[name]!r:.80}", join(header, body)
    if kind == "config":
        config = json.loads(meta["qwen38.config"])
        choice = rng.randrange(3)
        if choice == 0:
            meta["qwen38.config"] = rng.choice(ODD_JSON)
        elif choice == 1:
            key = rng.choice(sorted(config))
            config[key] = rng.choice([None, "128", 128.0, True, [8], {}, -1, 0, 2**40, 1e30, "x"])
            meta["qwen38.config"] = json.dumps(config)
        else:
            del config[rng.choice(sorted(config))]
            meta["qwen38.config"] = json.dumps(config)
        header["__metadata__"] = meta
        return f"qwen38.config -> {meta['qwen38.config']!r:.80}", join(header, body)
    if kind == "position":
        meta["qwen38.position"] = rng.choice(ODD_POSITIONS)
        header["__metadata__"] = meta
        return f"qwen38.position -> {meta['qwen38.position']!r:.40}", join(header, body)
    if kind == "metadata key":
        key = rng.choice(sorted(meta))
        del meta[key]
        header["__metadata__"] = meta
        return f"header without {key}", join(header, body)
    if kind == "tensor":
        name = rng.choice(sorted(k for k in tensors if k != "tokens"))
        description, tensors[name] = odd_tensor(tensors[name], rng)
        return f"tensor {name!r}: {description}", rewritten(tensors, meta, scratch)
    if kind == "remove tensor":
        name = rng.choice(sorted(tensors))
        del tensors[name]
        return f"without tensor {name!r}", rewritten(tensors, meta, scratch)
    if kind == "extra tensor":
        name = rng.choice(["99.a", "8.a", "mtp.k", "mtp.hidden", "x", "0.c"])
        tensors[name] = torch.zeros(3)
        return f"with an extra tensor {name!r}", rewritten(tensors, meta, scratch)
    if kind == "tokens":
        description, tensors["tokens"] = odd_tokens(tensors["tokens"], position, rng)
        return f"tokens: {description}", rewritten(tensors, meta, scratch)
    # A raw write into a float32 state tensor's bytes.
    name = rng.choice(sorted(k for k in header if k not in ("__metadata__", "tokens")))
    begin, end = header[name]["data_offsets"]
    at = 8 + length + begin + 4 * rng.randrange((end - begin) // 4)
    value = rng.choice([float("nan"), float("inf"), -float("inf"), 1e30, -3e38])
    data[at : at + 4] = struct.pack("<f", value)
    return f"bytes of {name!r} at {at} set to {value}", bytes(data)


# ---- the loads (in the child) -------------------------------------------------------------------------

class CaseTimeout(BaseException):
    """Raised by the alarm; a BaseException so that no except-Exception in the loader can swallow it."""


def expire(signum, frame):
    raise CaseTimeout()


def same_snapshot(a, b) -> bool:
    pairs = list(zip(a.layers, b.layers)) + ([(a.mtp, b.mtp)] if a.mtp is not None or b.mtp is not None else [])
    return a.position == b.position and len(a.layers) == len(b.layers) and all(
        x is not None and y is not None and len(x) == len(y)
        and all(s.dtype == t.dtype and torch.equal(s, t) for s, t in zip(x, y)) for x, y in pairs)


def outcome(load, path, same) -> str:
    """'error' or 'same', else a line saying what went wrong."""
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    try:
        result = load(path)
    except CaseTimeout:
        return f"no result within {CASE_SECONDS} s"
    except ValueError as e:
        return "error" if str(path) in str(e) else f"a ValueError not naming the file: {e}"
    except Exception as e:  # noqa: BLE001 (the point: nothing but ValueError may escape)
        return f"{type(e).__name__} instead of a ValueError: {str(e)[:300]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return "same" if same(result) else "loaded a state different from the original"


def child(model_path: str, original: str, cases: list[str]) -> None:
    """Loads each case file both ways; prints one JSON line per case (the case first, so that a hang or a
    kill names it)."""
    from qwen38_model import Conversation, Qwen38ForCausalLM, StateSnapshot

    model = Qwen38ForCausalLM.from_pretrained(model_path, device="cpu")
    reference = Conversation.load(original, model)
    signal.signal(signal.SIGALRM, expire)
    with open("/proc/self/status") as status:
        in_use = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (in_use + MEMORY_HEADROOM, in_use + MEMORY_HEADROOM))
    for path in cases:
        print(json.dumps({"case": path}), flush=True)
        conversation = outcome(lambda p: Conversation.load(p, model), path,
                               lambda c: c.tokens == reference.tokens and same_snapshot(c.snapshot, reference.snapshot))
        snapshot = outcome(lambda p: StateSnapshot.load(p, model.config), path,
                           lambda loaded: same_snapshot(loaded[0], reference.snapshot))
        print(json.dumps({"case": path, "conversation": conversation, "snapshot": snapshot}), flush=True)


def run_child(model_path, original, cases: list) -> tuple[dict[str, dict], str]:
    """{case: its results} from the child, and what went wrong with the child itself ('' if nothing)."""
    # The child imports this checkout's packages, as pytest here does (not an installed copy).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen([sys.executable, __file__, str(model_path), str(original), *map(str, cases)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        out, err = process.communicate(timeout=CHILD_SECONDS)
        problem = "" if process.returncode == 0 else f"the child's rc {process.returncode}: {err[-3000:]}"
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        problem = f"the child ran past {CHILD_SECONDS} s"
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in results if "conversation" in r}, problem


@pytest.fixture(scope="module")
def saved(oracle_dir, tmp_path_factory):
    """(model path, a saved conversation of 8 tokens, its state after 7)."""
    from qwen38_model import Conversation, Qwen38ForCausalLM

    model_path = oracle_dir / "mini-f32.gguf"
    model = Qwen38ForCausalLM.from_pretrained(model_path, device="cpu")
    conversation = Conversation()
    model.generate(torch.tensor([TURN]), max_new_tokens=4, eos_token_id=[], conversation=conversation)
    path = tmp_path_factory.mktemp("state") / "conversation.safetensors"
    conversation.save(path)
    return model_path, path


def test_fuzzed_conversation_files(saved, tmp_path):
    model_path, original = saved
    data = original.read_bytes()
    cases, descriptions = [], {}
    for case in range(CASES):
        rng = random.Random(f"{SEED}:{case}")
        description, mutated = mutate(data, tmp_path / "scratch.safetensors", rng)
        path = tmp_path / f"case{case:03d}.safetensors"
        path.write_bytes(mutated)
        cases.append(path)
        descriptions[str(path)] = f"SEED {SEED} case {case}: {description}"
    # Not files: a FIFO (open() would block forever), a folder, a link to a folder, a character device; and an
    # empty file.
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder-link").symlink_to(tmp_path / "folder")
    (tmp_path / "empty").write_bytes(b"")
    for name in ("fifo", "folder", "folder-link", "empty"):
        cases.append(tmp_path / name)
        descriptions[str(tmp_path / name)] = name
    cases.append("/dev/zero")
    descriptions["/dev/zero"] = "a character device"
    results, problem = run_child(model_path, original, cases)
    tally, failures = {}, [problem] if problem else []
    for path in map(str, cases):
        if path not in results:
            failures.append(f"{descriptions[path]}: no result (the child hung or died here, or did not get here)")
            continue
        for load in ("conversation", "snapshot"):
            result = results[path][load]
            tally[result] = tally.get(result, 0) + 1
            if result not in ("error", "same"):
                failures.append(f"{descriptions[path]}: {load} load: {result}")
    print(tally)
    assert not failures, f"{len(failures)} of {2 * len(cases)} loads:\n" + "\n".join(failures[:40])
    assert tally["error"] > len(cases)  # the mutations mostly break the file


def test_the_original_loads_and_a_missing_file_is_named(saved, tmp_path):
    from qwen38_model import Conversation, Qwen38ForCausalLM

    model_path, original = saved
    model = Qwen38ForCausalLM.from_pretrained(model_path, device="cpu")
    loaded = Conversation.load(original, model)
    assert len(loaded.tokens) == 8 and loaded.snapshot.position == 7
    with pytest.raises(FileNotFoundError, match=f"^No such file or directory: {tmp_path}/none$"):
        Conversation.load(tmp_path / "none", model)


def test_restore_refuses_a_snapshot_of_other_shapes(saved):
    """A snapshot built in memory: restore() checks shapes and dtypes before copying anything."""
    from qwen38_model import Qwen38ForCausalLM

    model = Qwen38ForCausalLM.from_pretrained(saved[0], device="cpu")
    state = model.new_state(16)
    model(torch.tensor([TURN]), state=state)
    good = state.snapshot()
    gdn_layer, attention_layer = 0, model.config.layer_types.index("attention")
    bad_cases = {
        "a 1-row KV tensor": (attention_layer, 0, lambda t: t[:1]),
        "a 1-row conv state": (gdn_layer, 0, lambda t: t[:1]),
        "a 1-D conv state": (gdn_layer, 0, lambda t: t.flatten()),
        "a 0-d recurrent state": (gdn_layer, 1, lambda t: t.flatten()[0]),
        "an int64 recurrent state": (gdn_layer, 1, lambda t: t.long()),
        "a bool conv state": (gdn_layer, 0, lambda t: t != 0),
    }
    before = [t.clone() for layer in state.layers for t in state.tensors(layer)]
    for description, (layer, which, change) in bad_cases.items():
        layers = [list(pair) for pair in good.layers]
        layers[layer][which] = change(layers[layer][which])
        snap = type(good)(good.position, [tuple(pair) for pair in layers], good.config, good.mtp)
        with pytest.raises(ValueError, match=f"^the snapshot: tensor '{layer}.{'ab'[which]}': expected"):
            state.restore(snap)
        assert all(torch.equal(a, b) for a, b in zip(before, [t for l in state.layers for t in state.tensors(l)])), \
            description
    for position in (-1, 3, 5, True):  # KV rows of 4 tokens
        with pytest.raises(ValueError, match="the snapshot"):
            state.restore(type(good)(position, good.layers, good.config, good.mtp))


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2], sys.argv[3:])
