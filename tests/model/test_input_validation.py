"""Arguments of from_pretrained(), forward() and generate(): nonsense is a ValueError naming the argument,
never a silent rounding, a wrap-around or a generation that stops at once (issue 10). Also the one
stop-token policy and the non-finite logits check."""
import pytest
import torch

from qwen38_model import Qwen38ForCausalLM
from qwen38_model.errors import NonFiniteLogitsError
from qwen38_model.tokenizer import load_tokenizer

PROMPT = torch.tensor([[1, 7, 42]])


@pytest.fixture(scope="module")
def model(oracle_dir):
    return Qwen38ForCausalLM.from_pretrained(oracle_dir / "mini-q8_0.gguf", device="cpu")


@pytest.mark.parametrize("ids,message", [
    (PROMPT.to(torch.bfloat16), r"input_ids must be an integer tensor, found torch\.bfloat16"),
    (PROMPT.float() + 0.4, r"input_ids must be an integer tensor, found torch\.float32"),
    (PROMPT.bool(), r"input_ids must be an integer tensor, found torch\.bool"),
    ([[1, 2, 3]], r"input_ids must be a torch\.Tensor of token ids, found list"),
    (torch.tensor([1, 2]), r"input_ids must be \[batch, seq\], found shape \(2,\)"),
    (torch.zeros(1, 0, dtype=torch.long), r"input_ids has no tokens"),
    (torch.tensor([[1, -1]]), r"token id -1 out of range \[0, 512\)"),
])
def test_bad_input_ids(model, ids, message):
    for call in (lambda: model(ids), lambda: model.generate(ids, max_new_tokens=1)):
        with pytest.raises(ValueError, match=message):
            call()


def test_small_integer_ids(model):
    """uint8 ids are fine in forward(); generate() returns the prompt's dtype, which must hold the ids."""
    assert torch.equal(model(PROMPT.to(torch.uint8)).logits, model(PROMPT).logits)
    with pytest.raises(ValueError, match=r"input_ids of dtype torch\.uint8 cannot hold the generated ids \(up to 511\)"):
        model.generate(PROMPT.to(torch.uint8), max_new_tokens=1)
    assert model.generate(PROMPT.to(torch.int16), max_new_tokens=2, eos_token_id=[]).dtype == torch.int16


@pytest.mark.parametrize("kwargs,message", [
    (dict(presence_penalty=float("nan")), r"presence_penalty must be a finite number, found nan"),
    (dict(presence_penalty=float("inf")), r"presence_penalty must be a finite number, found inf"),
    (dict(repetition_penalty=float("inf")), r"repetition_penalty must be a finite number, found inf"),
    (dict(do_sample=True, temperature=float("nan")), r"temperature must be a finite number, found nan"),
    (dict(do_sample=True, temperature=-1.0), r"temperature must be > 0 when sampling, found -1\.0"),
    (dict(do_sample="yes"), r"do_sample must be True or False, found 'yes'"),
    (dict(top_k=1.5), r"top_k must be an integer >= 0, found 1\.5"),
    (dict(top_p=float("nan")), r"top_p must be a finite number, found nan"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], found 1\.5"),
    (dict(min_new_tokens=-1), r"min_new_tokens must be an integer >= 0, found -1"),
    (dict(max_new_tokens=0), r"max_new_tokens must be an integer >= 1, found 0"),
    (dict(max_new_tokens=2.5), r"max_new_tokens must be an integer >= 1, found 2\.5"),
    (dict(max_seq_len=0), r"max_seq_len must be an integer >= 1, found 0"),
    (dict(stop_strings=""), r"stop_strings must be non-empty strings \(an empty one would stop at once\)"),
    (dict(stop_strings=["ok", ""]), r"stop_strings must be non-empty strings"),
    (dict(stop_strings=[3]), r"stop_strings must be non-empty strings"),
    (dict(eos_token_id=-1), r"eos_token_id must be token ids in \[0, 512\), found -1"),
    (dict(eos_token_id=512), r"eos_token_id must be token ids in \[0, 512\), found 512"),
    (dict(eos_token_id=[500, True]), r"eos_token_id must be token ids in \[0, 512\), found True"),
    (dict(seed=1.5), r"seed must be an integer, found 1\.5"),
])
def test_bad_generate_arguments(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.generate(PROMPT, **{"max_new_tokens": 2, **kwargs})


@pytest.mark.parametrize("kwargs,message", [
    (dict(dtype=torch.int8), r"dtype must be one of torch\.float32, torch\.bfloat16, torch\.float16, found torch\.int8"),
    (dict(device="bogus"), r"device must be a torch\.device or a name like 'cuda' or 'cpu', found 'bogus'"),
    (dict(device="cpu", lane="int4"), r"lane"),
    (dict(device="cpu", quantize="q4_0"), r"quantize must be None or 'q8_0', found 'q4_0'"),
])
def test_bad_from_pretrained_arguments(oracle_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Qwen38ForCausalLM.from_pretrained(oracle_dir / "mini-q8_0.gguf", **{"device": "cpu", **kwargs})


def test_a_gguf_run_stops_on_llama_cpp_stop_set(oracle_dir, model):
    """The GGUF's eos_token_id is 500; llama.cpp also stops on <|im_end|> (502), and so does generate()
    by default: a chat on a GGUF ends at the end of the turn."""
    tokenizer = load_tokenizer(oracle_dir / "mini-q8_0.gguf")
    assert tokenizer.tokenizer.token_to_id("<|im_end|>") == 502
    assert model.config.eos_token_ids == tuple(tokenizer.eos_token_ids) == (500, 502)
    model.generate(PROMPT, max_new_tokens=2)
    assert model._engine.samplers[0].eos.nonzero().flatten().tolist() == [500, 502]  # the run's stop set


def test_non_finite_logits_are_reported(oracle_dir):
    """An overflow inside the model (here: a final norm scaled to 1e38) gives NaN/inf logits; generate()
    says so instead of emitting token 0 forever."""
    model = Qwen38ForCausalLM.from_pretrained(oracle_dir / "mini-f32.gguf", device="cpu")
    model.norm.fill_(1e38)
    assert not torch.isfinite(model(PROMPT).logits).all()
    with pytest.raises(NonFiniteLogitsError, match=r"NaN or infinite logits during this generation"):
        model.generate(PROMPT, max_new_tokens=3, eos_token_id=[])
    model.norm.fill_(1.0)
    model.generate(PROMPT, max_new_tokens=3, eos_token_id=[])  # the flag is reset per run


def test_a_state_beyond_the_context_or_the_memory_is_refused(model, monkeypatch):
    """Issue 20 item 3 / issue 24: a cache size is checked against the model's context and the memory free
    for it before anything is allocated (10**12 tokens used to fail deep inside torch)."""
    import dataclasses

    from qwen38_model import state as state_module
    from qwen38_model.state import KVCache, Qwen38State, state_bytes

    with pytest.raises(ValueError, match=r"^max_seq_len 1000000000000 exceeds the model's context of 262144 tokens$"):
        model.generate(PROMPT, max_new_tokens=2, max_seq_len=10**12)
    # Within a (claimed) context of 2^31 - 1 tokens: 2.2 TB of KV cache, more than any machine here has.
    long_context = dataclasses.replace(model.config, max_position_embeddings=2**31 - 1)
    with pytest.raises(ValueError, match=r"^max_seq_len 2147483647: the state \(KV caches and GDN states, KV in "
                                         r"torch\.float32\) needs 2199\.02 GB, cpu has [\d.]+ GB available$"):
        Qwen38State(long_context, 2**31 - 1, "cpu")
    needed = state_bytes(model.config, 64, torch.float32, mtp=False)
    monkeypatch.setattr(state_module, "available_memory", lambda device: needed - 1)
    with pytest.raises(ValueError, match=r"^max_seq_len 64: the state .* needs "):
        Qwen38State(model.config, 64, "cpu")
    monkeypatch.setattr(state_module, "available_memory", lambda device: needed)
    state = Qwen38State(model.config, 64, "cpu")  # state_bytes is exactly what the tensors take
    kv = sum(layer.k.nbytes + layer.v.nbytes for layer in state.layers if isinstance(layer, KVCache))
    assert needed == kv + state.gdn_conv.nbytes + state.gdn_recurrent.nbytes


def test_a_speculative_engine_may_use_the_whole_context(model):
    """Its spare rows (steps in flight past the last kept token) count for the memory, not against the
    context: --speculative mtp --max-context <the model's context> used to be refused."""
    import dataclasses

    from qwen38_model.state import Qwen38State

    short = dataclasses.replace(model.config, max_position_embeddings=64)
    assert Qwen38State(short, 64 + 28, "cpu", spare_rows=28).max_seq_len == 92
    with pytest.raises(ValueError, match=r"^max_seq_len 65 exceeds the model's context of 64 tokens$"):
        Qwen38State(short, 65 + 28, "cpu", spare_rows=28)
    from qwen38_model.default_model import default_model_path
    from qwen38_model.engine import BatchEngine
    from qwen38_model.speculative import Speculation

    with_mtp = Qwen38ForCausalLM.from_pretrained(default_model_path(), device="cpu")
    with_mtp.config = dataclasses.replace(with_mtp.config, max_position_embeddings=64)
    engine = BatchEngine(with_mtp, 1, 64, torch.float32, False, speculation=Speculation(3))
    assert engine.slots.slot(0).max_seq_len > engine.max_seq_len == 64


# ---- issue 24 item 3: seeded fuzzing of generate() / forward() values, in a bounded child -------------

FUZZ_SEED = 20261226
FUZZ_CASES = 80


class _PutOnly:
    def put(self, value):
        pass


class _EndNotCallable:
    put = staticmethod(lambda value: None)
    end = 5


def _bad_generate_case(rng):
    """(description, kwargs for generate, or ('forward', kwargs), regex of the ValueError or None for a valid
    call)."""
    name = rng.choice(["max_seq_len", "logits_to_keep", "seed", "temperature", "min_new_tokens", "stop_strings",
                       "streamer", "valid"])
    if name == "max_seq_len":
        value = rng.choice([10**12, 2**40, 2**63, 262145])
        return dict(max_seq_len=value), rf"max_seq_len {value} exceeds the model's context of 262144 tokens"
    if name == "logits_to_keep":
        value = rng.choice([-1, -2, -2**40, 1.5, "1", None, True])
        return ("forward", dict(logits_to_keep=value)), r"logits_to_keep must be an integer >= 0"
    if name == "seed":
        value = rng.choice([-1, -2**31, 2**32, 2**32 + 7, 2**64, 1.5, "1", True])
        return dict(do_sample=rng.random() < 0.5, seed=value), r"seed must be an integer"
    if name == "temperature":
        value = rng.choice([-1.0, -1e-9, -5, float("-inf"), float("nan"), "1"])
        return dict(do_sample=rng.random() < 0.5, temperature=value), r"temperature must be"
    if name == "min_new_tokens":
        top = rng.randint(1, 3)
        low = top + rng.choice([1, 2, 10**6, 2**62])
        return dict(max_new_tokens=top, min_new_tokens=low), rf"min_new_tokens {low} must be <= max_new_tokens {top}"
    if name == "stop_strings":
        value = rng.choice([5, 1.5, b"x", {"a"}, {"a": 1}, object(), True])
        return dict(stop_strings=value), r"stop_strings must be a string or a list of strings"
    if name == "streamer":
        value = rng.choice([object(), 5, "x", _PutOnly(), _EndNotCallable()])
        return dict(streamer=value), r"streamer must have callable put\(ids\) and end\(\) methods"
    valid = rng.choice([dict(seed=rng.choice([0, 1, 2**32 - 1]), do_sample=True), dict(temperature=0.0),
                        dict(min_new_tokens=2, max_new_tokens=2, eos_token_id=[]), dict(stop_strings=["zz"]),
                        ("forward", dict(logits_to_keep=rng.choice([0, 1, 2, 100])))])
    return valid, None


def fuzz_generate_arguments() -> None:
    """The cases (run in the child)."""
    import pathlib
    import random
    import re

    from qwen38_model.tokenizer import load_tokenizer
    oracle = pathlib.Path(__file__).resolve().parents[1] / "oracle" / "mini"
    model = Qwen38ForCausalLM.from_pretrained(oracle / "mini-q8_0.gguf", device="cpu")
    tokenizer = load_tokenizer(oracle / "mini-q8_0.gguf")
    failures = []
    for number in range(FUZZ_CASES):
        rng = random.Random(f"{FUZZ_SEED}/{number}")
        call, expected = _bad_generate_case(rng)
        forward = isinstance(call, tuple)
        kwargs = call[1] if forward else {"max_new_tokens": 2, "tokenizer": tokenizer, **call}
        where = f"FUZZ_SEED {FUZZ_SEED} case {number}: {'forward' if forward else 'generate'}({call!r:.120})"
        try:
            out = model(PROMPT, **kwargs) if forward else model.generate(PROMPT, **kwargs)
        except ValueError as e:
            if expected is None or not re.match(expected, str(e)):
                failures.append(f"{where}: ValueError {str(e)[:200]!r}, expected {expected!r}")
            continue
        except Exception as e:  # noqa: BLE001 (the point: nothing but ValueError may escape)
            failures.append(f"{where}: {type(e).__name__} {str(e)[:200]!r} instead of a ValueError")
            continue
        if expected is not None:
            failures.append(f"{where}: accepted, expected a ValueError matching {expected!r}")
        elif forward and out.logits.shape[1] != (min(kwargs["logits_to_keep"], 3) or 3):
            failures.append(f"{where}: {out.logits.shape[1]} logits rows")
    assert not failures, f"{len(failures)} of {FUZZ_CASES} cases failed:\n" + "\n".join(failures[:30])
    print(f"{FUZZ_CASES} cases passed", flush=True)


def test_fuzzed_generate_and_forward_arguments():
    """Under an address-space limit (a 10^12-token cache would need 256 TB: refused before any allocation)
    and a CPU-time limit, each case a ValueError naming the argument or a valid result."""
    from bounded import assert_cases_passed
    assert_cases_passed("fuzz_generate_arguments", __file__, FUZZ_CASES)


def test_seeds_do_not_alias(model):
    """The sampler keeps a seed's 32 bits: seed 2^32 gave seed 0's samples; now it is refused, as the CLI's
    --seed, and the range's ends are taken."""
    kwargs = dict(max_new_tokens=3, do_sample=True, eos_token_id=[])
    for seed in (2**32, 2**32 + 5, -1):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 4294967295\]"):
            model.generate(PROMPT, seed=seed, **kwargs)
    for seed in (0, 2**32 - 1):
        assert model.generate(PROMPT, seed=seed, **kwargs).shape == (1, 6)
