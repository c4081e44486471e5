"""generate(): greedy equals an arg-max loop over the full forward; every sampling setting filters the
distribution exactly as transformers' logits processors do; sampling is reproducible for a seed and
follows the filtered distribution; eos, stop strings and token limits stop exactly."""
import io
import math

import pytest
import torch

from qwen38_model import Qwen38ForCausalLM
from qwen38_model.generation import TextStreamer
from qwen38_model.sampling import SamplerState, SamplingConfig, process_logits, uniform_noise
from qwen38_model.default_model import default_hf_path, default_model_path
from qwen38_model.tokenizer import load_tokenizer

from conftest import require

transformers = require("transformers")


def argmax_loop(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The slow truth: a full forward over the whole sequence for every new token."""
    for _ in range(steps):
        next_id = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids


def screened_prompt(model, length: int, seed: int, steps: int, margin: float = 1e-3) -> torch.Tensor:
    """A random prompt whose greedy continuation has a clear top-1 at every step, so token equality is a
    fair test of the implementation and not of float rounding."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(50):
        ids = torch.randint(0, model.config.vocab_size, (1, length), generator=g)
        if clear_top1_for(model, ids, steps, margin):
            return ids
    raise AssertionError("no prompt with a clear top-1 margin found")


def clear_top1_for(model, ids: torch.Tensor, steps: int, margin: float) -> bool:
    """Whether each of the next `steps` greedy tokens wins by more than margin. Incremental (one token per
    forward through a state), stopping at the first close call: the screening costs O(steps) tokens, the
    full-forward truth in the tests runs once per prompt."""
    state = model.new_state(ids.shape[1] + steps)
    logits = model(ids, state=state, logits_to_keep=1).logits[0, -1]
    for step in range(steps):
        top2 = logits.topk(2)
        if not bool(top2.values[0] - top2.values[1] > margin):
            return False
        if step < steps - 1:
            logits = model(top2.indices[:1].view(1, 1), state=state).logits[0, -1]
    return True


@pytest.fixture(scope="module")
def oracle_model(oracle_dir):
    return Qwen38ForCausalLM.from_pretrained(oracle_dir / "mini-f32.gguf", device="cpu")


def test_greedy_matches_hf_greedy_on_oracle(oracle_model, oracle_ref):
    prompt = oracle_ref["prompt_ids"].long()[None]
    out = oracle_model.generate(prompt, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(out[0, 24:], oracle_ref["hf_greedy"].long())


@pytest.mark.parametrize("path", ["hf", "gguf"])
def test_greedy_equals_argmax_loop_on_synthetic(path):
    model = Qwen38ForCausalLM.from_pretrained(default_hf_path() if path == "hf" else default_model_path(),
                                              device="cpu")
    prompt = screened_prompt(model, 7, seed=0, steps=12)
    assert torch.equal(model.generate(prompt, max_new_tokens=12, eos_token_id=[]), argmax_loop(model, prompt, 12))


# ---- the filtered distribution vs transformers' processors --------------------------------------------

SETTINGS = [
    dict(do_sample=True, temperature=0.7, top_k=0),
    dict(do_sample=True, top_k=5),
    dict(do_sample=True, top_k=0, top_p=0.8),
    dict(do_sample=True, top_k=0, min_p=0.1),
    dict(do_sample=True, temperature=1.3, top_k=40, top_p=0.9, min_p=0.02),
    dict(do_sample=False, repetition_penalty=1.3),
    dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.15),
    dict(do_sample=False, min_new_tokens=3, eos_token_ids=(2, 7)),
]


def hf_processed(logits, history, cfg: SamplingConfig, num_generated: int, prompt_len: int):
    from transformers.generation import logits_process as lp

    processors = []
    if cfg.repetition_penalty != 1.0:
        processors.append(lp.RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty))
    if cfg.min_new_tokens:
        processors.append(lp.MinNewTokensLengthLogitsProcessor(prompt_len, cfg.min_new_tokens,
                                                                list(cfg.eos_token_ids)))
    if cfg.do_sample:
        if cfg.temperature != 1.0:
            processors.append(lp.TemperatureLogitsWarper(cfg.temperature))
        if cfg.top_k:
            processors.append(lp.TopKLogitsWarper(cfg.top_k))
        if cfg.top_p < 1.0:
            processors.append(lp.TopPLogitsWarper(cfg.top_p))
        if cfg.min_p:
            processors.append(lp.MinPLogitsWarper(cfg.min_p))
    scores = logits[None].clone()
    for p in processors:
        scores = p(history[None], scores)
    return scores[0]


@pytest.mark.parametrize("setting", SETTINGS, ids=[str(s) for s in SETTINGS])
def test_processors_match_transformers(setting):
    g = torch.Generator().manual_seed(0)
    vocab = 300
    cfg = SamplingConfig(**setting)
    for trial in range(5):
        logits = torch.randn(vocab, generator=g) * 3
        prompt = torch.randint(0, vocab, (6,), generator=g)
        generated = torch.randint(0, vocab, (trial,), generator=g)
        state = SamplerState.empty(vocab, "cpu")
        state.reset(prompt, 0, cfg.eos_token_ids)
        state.seen[generated] = True
        state.generated[generated] = True
        state.num_generated.fill_(trial)
        ours = process_logits(logits, state, cfg)
        theirs = hf_processed(logits, torch.cat([prompt, generated]), cfg, trial, len(prompt))
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
        finite = ~torch.isinf(theirs)
        torch.testing.assert_close(ours[finite], theirs[finite], rtol=1e-6, atol=1e-6)


def test_presence_penalty_subtracts_once_per_generated_token():
    state = SamplerState.empty(10, "cpu")
    state.reset(torch.tensor([1]), seed=0)
    state.generated[torch.tensor([3, 3, 4])] = True
    out = process_logits(torch.zeros(10), state, SamplingConfig(presence_penalty=0.5))
    assert out[3] == -0.5 and out[4] == -0.5 and out[1] == 0 and out[0] == 0


def plain_penalized(logits, bias, seen, counts, cfg: SamplingConfig):
    """The logit bias and the penalties in plain torch, vLLM's order: bias, repetition (on prompt + output),
    frequency (times each output token's count), presence (once per output token)."""
    scores = logits + bias
    penalty = cfg.repetition_penalty
    scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
    scores = scores - cfg.frequency_penalty * counts.float()
    return scores - cfg.presence_penalty * (counts > 0).float()


BIASED = [
    dict(do_sample=False, frequency_penalty=0.7),
    dict(do_sample=False, frequency_penalty=-0.4, presence_penalty=0.3, repetition_penalty=1.2),
    dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, frequency_penalty=1.5, presence_penalty=-0.5),
]


@pytest.mark.parametrize("setting", BIASED, ids=[str(s) for s in BIASED])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_frequency_penalty_and_logit_bias_match_plain_torch(setting, with_bias):
    """The processed scores with a logit bias and a frequency penalty (over generated tokens that repeat) are
    the plain-torch penalized logits, then transformers' warpers for the sampling part."""
    import dataclasses

    g = torch.Generator().manual_seed(1)
    vocab = 300
    cfg = SamplingConfig(**setting, logit_bias=with_bias)
    for trial in range(5):
        logits = torch.randn(vocab, generator=g) * 3
        prompt = torch.randint(0, vocab, (6,), generator=g)
        generated = torch.randint(0, 12, (3 * trial,), generator=g)  # few distinct ids: counts above 1
        bias = {int(t): float(v) for t, v in zip(torch.randint(0, vocab, (8,), generator=g),
                                                 torch.randn(8, generator=g) * 20)} if with_bias else {}
        state = SamplerState.empty(vocab, "cpu")
        state.reset(prompt, 0, cfg.eos_token_ids)
        state.set_logit_bias(bias)
        counts = torch.bincount(generated, minlength=vocab).int()
        state.seen[generated] = True
        state.generated[generated] = True
        state.counts.copy_(counts)
        state.num_generated.fill_(len(generated))
        dense = torch.zeros(vocab)
        dense[list(bias)] = torch.tensor(list(bias.values()), dtype=torch.float32)
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.cat([prompt, generated])] = True
        expected = plain_penalized(logits, dense, seen, counts, cfg)
        if cfg.do_sample:  # the warpers after the penalties, as transformers applies them
            warpers = dataclasses.replace(cfg, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                                          logit_bias=False)
            expected = hf_processed(expected, torch.cat([prompt, generated]), warpers, trial, len(prompt))
        ours = process_logits(logits, state, cfg)
        assert torch.equal(torch.isinf(ours), torch.isinf(expected))
        finite = ~torch.isinf(expected)
        torch.testing.assert_close(ours[finite], expected[finite], rtol=1e-6, atol=1e-5)


def test_selection_counts_the_generated_tokens():
    """select_next_token keeps the frequency counts on the device: after each step they are the bincount of
    the tokens chosen so far (and only the prompt is in `seen` beside them)."""
    from qwen38_model.sampling import select_next_token

    vocab = 16
    cfg = SamplingConfig(do_sample=True, top_k=0, temperature=1.5, frequency_penalty=0.1)
    state = SamplerState.empty(vocab, "cpu")
    state.reset(torch.tensor([3]), seed=4)
    token, position = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    chosen = []
    g = torch.Generator().manual_seed(2)
    for _ in range(40):
        select_next_token(torch.randn(vocab, generator=g) * 0.1, state, cfg, token, position)
        chosen.append(int(token))
        assert torch.equal(state.counts, torch.bincount(torch.tensor(chosen), minlength=vocab).int())
    assert max(torch.bincount(torch.tensor(chosen)).tolist()) > 1  # the counts did go past 1
    state.reset(torch.tensor([3]), seed=4)
    assert not state.counts.any()


def greedy_biased_loop(model, ids, steps, bias: dict, frequency_penalty: float) -> list[int]:
    """Greedy with a logit bias and a frequency penalty over a full forward per token: the slow truth."""
    dense = torch.zeros(model.config.vocab_size)
    for t, v in bias.items():
        dense[t] = v
    counts = torch.zeros(model.config.vocab_size)
    out = []
    for _ in range(steps):
        scores = model(ids).logits[0, -1] + dense - frequency_penalty * counts
        best = int(scores.argmax())
        out.append(best)
        counts[best] += 1
        ids = torch.cat([ids, torch.tensor([[best]])], dim=1)
    return out


@pytest.fixture(scope="module")
def default_model():
    return Qwen38ForCausalLM.from_pretrained(default_model_path(), device="cpu")


def test_generate_with_logit_bias_and_frequency_penalty(default_model):
    """generate(logit_bias=, frequency_penalty=) on one sequence, on rows decoded together, and speculatively
    (greedy: the same tokens) is the plain greedy loop with the bias added and the penalty subtracted. A bias of
    -100 on the greedy token moves the greedy output off it; +100 forces a token at every step."""
    model = default_model
    prompt = torch.tensor([[5, 6, 7, 8]])
    greedy = model.generate(prompt, max_new_tokens=10, eos_token_id=[])[0, 4:].tolist()
    banned = model.generate(prompt, max_new_tokens=10, eos_token_id=[], logit_bias={greedy[0]: -100})[0, 4:].tolist()
    assert banned[0] != greedy[0] and greedy[0] not in banned
    assert banned == greedy_biased_loop(model, prompt, 10, {greedy[0]: -100.0}, 0.0)
    forced = model.generate(prompt, max_new_tokens=6, eos_token_id=[], logit_bias={42: 100})[0, 4:].tolist()
    assert forced == [42] * 6
    favoured = {42: 3.0, greedy[1]: 1.5}  # 42 would repeat; the penalty holds it back
    for penalty in (0.0, 0.8, -0.5):
        truth = greedy_biased_loop(model, prompt, 12, favoured, penalty)
        kwargs = dict(max_new_tokens=12, eos_token_id=[], logit_bias=favoured, frequency_penalty=penalty)
        assert model.generate(prompt, **kwargs)[0, 4:].tolist() == truth, penalty
        assert model.generate(prompt, speculative="mtp", num_draft_tokens=2, **kwargs)[0, 4:].tolist() == truth
        rows = model.generate(torch.cat([prompt, torch.tensor([[1, 2, 3, 4]])]), **kwargs)
        assert rows[0, 4:].tolist() == truth and \
            rows[1, 4:].tolist() == greedy_biased_loop(model, torch.tensor([[1, 2, 3, 4]]), 12, favoured, penalty)
    assert greedy_biased_loop(model, prompt, 12, favoured, 0.0) != greedy_biased_loop(model, prompt, 12, favoured, 0.8)
    for bad, message in [({512: 1.0}, "outside the vocabulary"), ({-1: 1.0}, "outside the vocabulary"),
                         ({3: float("nan")}, "finite"), ([3], "must be a dict")]:
        with pytest.raises(ValueError, match=message):
            model.generate(prompt, max_new_tokens=2, logit_bias=bad)
    with pytest.raises(ValueError, match="frequency_penalty must be a finite number"):
        model.generate(prompt, max_new_tokens=2, frequency_penalty=float("inf"))


def test_sampled_frequencies_follow_the_filtered_distribution():
    """Gumbel-max over counter-based noise: 20000 draws vs the filtered softmax (chi-square, p > 1e-4)."""
    vocab, draws = 12, 20000
    logits = torch.linspace(-2, 2, vocab)
    cfg = SamplingConfig(do_sample=True, temperature=0.8, top_k=8, top_p=0.9)
    state = SamplerState.empty(vocab, "cpu")
    state.reset(torch.tensor([0]), seed=0)
    scores = process_logits(logits, state, cfg)
    probs = torch.softmax(scores.double(), -1)
    counts = torch.zeros(vocab, dtype=torch.float64)
    seeds = torch.arange(draws, dtype=torch.int64)
    for step in range(4):  # the step counter and the seed both vary
        for s in seeds[step::4]:
            u = uniform_noise(s.view(1), torch.tensor([step], dtype=torch.int32), vocab)
            counts[int(torch.argmax(scores - torch.log(-torch.log(u))))] += 1
    kept = probs > 0
    assert counts[~kept].sum() == 0
    expected = probs[kept] * draws
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    dof = int(kept.sum()) - 1
    # Wilson-Hilferty: chi2 of dof degrees at p = 1e-4 is below dof * (1 + 3.72 * sqrt(2 / (9 dof)))^3.
    bound = dof * (1 - 2 / (9 * dof) + 3.72 * math.sqrt(2 / (9 * dof))) ** 3
    print(f"chi2 = {chi2:.1f} with {dof} dof (p=1e-4 bound {bound:.1f})")
    assert chi2 < bound


def test_sampling_reproducible_and_seed_sensitive(oracle_model, oracle_ref):
    prompt = oracle_ref["prompt_ids"].long()[None]
    kwargs = dict(max_new_tokens=16, do_sample=True, temperature=1.0, top_k=0, eos_token_id=[])
    a = oracle_model.generate(prompt, seed=11, **kwargs)
    b = oracle_model.generate(prompt, seed=11, **kwargs)
    c = oracle_model.generate(prompt, seed=12, **kwargs)
    d = oracle_model.generate(prompt, generator=torch.Generator().manual_seed(5), **kwargs)
    e = oracle_model.generate(prompt, generator=torch.Generator().manual_seed(5), **kwargs)
    assert torch.equal(a, b) and not torch.equal(a, c) and torch.equal(d, e)
    assert len(set(a[0, 24:].tolist())) > 3  # different per step


def test_eos_stops_exactly_and_min_new_tokens_holds(oracle_model, oracle_ref):
    prompt = oracle_ref["prompt_ids"].long()[None]
    greedy = oracle_ref["hf_greedy"].long().tolist()
    eos = greedy[5]
    first = greedy.index(eos)
    out = oracle_model.generate(prompt, max_new_tokens=24, eos_token_id=eos)
    assert out[0, 24:].tolist() == greedy[: first + 1]
    held = oracle_model.generate(prompt, max_new_tokens=24, eos_token_id=eos, min_new_tokens=first + 2)
    assert eos not in held[0, 24 : 24 + first + 2].tolist()
    assert oracle_model.generate(prompt, max_new_tokens=3, eos_token_id=[]).shape == (1, 27)


def test_stop_strings_stop_exactly():
    path = default_model_path()
    model = Qwen38ForCausalLM.from_pretrained(path, device="cpu")
    tokenizer = load_tokenizer(path)
    prompt = torch.tensor([tokenizer.encode("Once upon a time")])
    free = model.generate(prompt, max_new_tokens=30, eos_token_id=[])[0, prompt.shape[1]:].tolist()
    text = tokenizer.decode(free)
    stop = next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1)
                if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2])
    out = model.generate(prompt, max_new_tokens=30, eos_token_id=[], stop_strings=[stop], tokenizer=tokenizer)
    new = out[0, prompt.shape[1]:].tolist()
    assert stop in tokenizer.decode(new) and stop not in tokenizer.decode(new[:-1])
    assert new == free[: len(new)]


def test_a_stop_string_spanning_several_tokens_stops_at_its_last():
    """The stop string is the decoded text of three whole tokens of the free run plus the first character of
    a fourth, so no single token holds it: a stop check that looked at the last token's text alone (the
    review's mutation M6) never stops."""
    path = default_model_path()
    model = Qwen38ForCausalLM.from_pretrained(path, device="cpu")
    tokenizer = load_tokenizer(path)
    prompt = torch.tensor([tokenizer.encode("Once upon a time")])
    free = model.generate(prompt, max_new_tokens=30, eos_token_id=[])[0, prompt.shape[1]:].tolist()
    pieces = [tokenizer.decode([t]) for t in free]
    start = next(i for i in range(5, len(free) - 4) if all(p and "\ufffd" not in p for p in pieces[i : i + 4])
                 and tokenizer.decode(free[: i + 4]) == "".join(pieces[: i + 4]))
    stop = "".join(pieces[start : start + 3]) + pieces[start + 3][0]
    first = tokenizer.decode(free).find(stop)
    assert all(stop not in p for p in pieces) and first >= 0
    out = model.generate(prompt, max_new_tokens=30, eos_token_id=[], stop_strings=[stop], tokenizer=tokenizer)
    new = out[0, prompt.shape[1]:].tolist()
    assert new == free[: len(new)] and stop in tokenizer.decode(new) and stop not in tokenizer.decode(new[:-1])
    assert len(tokenizer.decode(new[:-1])) < first + len(stop) <= len(tokenizer.decode(new))


def test_streamers_see_every_token(oracle_dir, oracle_model, oracle_ref):
    from qwen38_model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_hf_folder(oracle_dir / "hf")
    prompt = oracle_ref["prompt_ids"].long()[None]
    sink = io.StringIO()
    out = oracle_model.generate(prompt, max_new_tokens=10, eos_token_id=[], streamer=TextStreamer(tokenizer, out=sink))
    assert sink.getvalue() == tokenizer.decode(out[0, 24:].tolist()) + "\n"

    class Recorder:
        def __init__(self):
            self.puts = []
            self.ended = False

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended = True

    rec = Recorder()
    out = oracle_model.generate(prompt, max_new_tokens=5, eos_token_id=[], streamer=rec)
    assert rec.puts[0] == prompt.tolist() and [p[0] for p in rec.puts[1:]] == out[0, 24:].tolist() and rec.ended


def test_bad_requests_are_clear_errors(oracle_model):
    with pytest.raises(ValueError, match="exceeds the model's context"):
        oracle_model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=300000)
    with pytest.raises(ValueError, match="context overflow"):
        oracle_model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=10, max_seq_len=8)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        oracle_model.generate(torch.zeros(1, 3, dtype=torch.long), do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="stop_strings need tokenizer"):
        oracle_model.generate(torch.zeros(1, 3, dtype=torch.long), stop_strings=["x"])
