"""MTP speculative decoding on the CPU (eager steps, the reference ops): greedy output equals plain greedy
token for token at 0%, partial and 100% acceptance (drafts forced from the plain run's own tokens), with
the MTP block's own drafts, and with logits processors; sampling follows the model's distribution end to end
(chi-square; the selection alone in test_speculative_sampling.py) and is reproducible for a seed; bad
arguments are errors."""
import pytest
import torch
from test_speculative_sampling import chi_square_p

from qwen38_model import Qwen38ForCausalLM, synthetic
from qwen38_model.conversation import Conversation
from qwen38_model.generation import StopCondition
from qwen38_model.sampling import SamplerState, SamplingConfig, process_logits
from qwen38_model.scratch import Scratch
from qwen38_model.speculative import (MAX_DRAFT_TOKENS, DraftPolicy, SpeculativeEngine, best_draft_count,
                                      expected_tokens, prior_step_cost, run_speculative)

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "head_dim": 32,
         "linear_key_head_dim": 32, "linear_value_head_dim": 32, "full_attention_interval": 2}
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = synthetic.write_hf_checkpoint(tmp_path_factory.mktemp("spec") / "hf", SMALL, seed=5, form="vlm")
    path = synthetic.hf_to_gguf(folder, folder.parent / "q8.gguf", "q8_0", model_name="spec", mtp=True)
    return Qwen38ForCausalLM.from_pretrained(path, device="cpu", lane="int8")


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 500, (1, 11), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def plain_long(model, prompt):
    """Plain greedy past NEW_TOKENS, so forced drafts of the last step are known too."""
    out = model.generate(prompt, max_new_tokens=NEW_TOKENS + MAX_DRAFT_TOKENS + 1, eos_token_id=[])
    return out[0, prompt.shape[1]:].tolist()


@pytest.fixture(scope="module")
def plain(plain_long):
    return plain_long[:NEW_TOKENS]


def forced_run(model, prompt, drafts: list[int], k: int, cfg=SamplingConfig(), adaptive=False):
    engine = SpeculativeEngine(model, 64, torch.float32, False, k, forced_drafts=True)
    engine.forced.zero_()
    engine.forced[: len(drafts)] = torch.tensor(drafts, dtype=torch.int32)
    tokens, stats, _ = run_speculative(engine, prompt[0].to(torch.int32), cfg, NEW_TOKENS, 0,
                                       StopCondition(frozenset()), chunk_size=4096, adaptive=adaptive)
    return tokens, stats


@pytest.mark.parametrize("k", [1, 3, MAX_DRAFT_TOKENS])
def test_forced_perfect_drafts_accept_everything_and_equal_plain(model, prompt, plain, plain_long, k):
    tokens, stats = forced_run(model, prompt, prompt[0].tolist() + plain_long, k)
    assert tokens == plain
    assert stats.accepted == stats.drafted > 0
    assert stats.tokens_per_step > k  # every step but possibly the last emits k + 1


@pytest.mark.parametrize("k", [1, 3])
def test_forced_wrong_drafts_accept_nothing_and_equal_plain(model, prompt, plain, k):
    wrong = [(t + 1) % 500 for t in prompt[0].tolist() + plain]
    tokens, stats = forced_run(model, prompt, wrong, k)
    assert tokens == plain
    assert stats.accepted == 0 and stats.steps == NEW_TOKENS - 1


def test_forced_partial_drafts_equal_plain(model, prompt, plain):
    """Every third draft wrong: steps accept 0, 1 or 2 of 3."""
    sequence = prompt[0].tolist() + plain
    partial = [t if i % 3 else (t + 1) % 500 for i, t in enumerate(sequence)]
    tokens, stats = forced_run(model, prompt, partial, 3)
    assert tokens == plain
    assert 0 < stats.accepted < stats.drafted


def test_mtp_drafts_greedy_equal_plain(model, prompt, plain):
    """The block's own drafts (whatever their acceptance on random weights), adaptive and fixed k."""
    for k in (1, 2, 4):
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[], speculative="mtp",
                             num_draft_tokens=k)
        assert out[0, prompt.shape[1]:].tolist() == plain, k
        assert model.last_generation_stats.steps > 0


def test_reduced_draft_vocabulary_equals_plain(model, prompt, plain):
    out = model.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[], speculative="mtp", draft_vocab_size=100)
    assert out[0, prompt.shape[1]:].tolist() == plain
    with pytest.raises(ValueError, match="draft_vocab_size"):
        model.generate(prompt, speculative="mtp", draft_vocab_size=0)


def test_processors_greedy_equal_plain(model, prompt):
    kwargs = dict(max_new_tokens=NEW_TOKENS, eos_token_id=[], repetition_penalty=1.3, presence_penalty=0.5)
    plain = model.generate(prompt, **kwargs)
    sequence = plain[0].tolist()
    cfg = SamplingConfig(repetition_penalty=1.3, presence_penalty=0.5)
    tokens, _ = forced_run(model, prompt, sequence, 3, cfg)
    assert tokens == sequence[prompt.shape[1]:]
    assert model.generate(prompt, speculative="mtp", **kwargs).tolist() == plain.tolist()


def test_sampling_is_reproducible_for_a_seed(model, prompt):
    kwargs = dict(max_new_tokens=NEW_TOKENS, eos_token_id=[], do_sample=True, temperature=1.5, top_k=0,
                  speculative="mtp", num_draft_tokens=2)
    a = model.generate(prompt, seed=7, **kwargs)
    assert torch.equal(a, model.generate(prompt, seed=7, **kwargs))
    assert not torch.equal(a, model.generate(prompt, seed=8, **kwargs))


def test_sampling_follows_the_model_distribution(model, prompt, plain_long):
    """End to end on the tiny model: the first three sampled tokens of speculative steps (drafts forced from
    the greedy run, so some are accepted and some rejected, and the state rolled back after a rejection)
    follow the model's own processed distribution: a chi-square test over the token triples top_k allows,
    against the exact joint from the model's forward passes."""
    cfg = SamplingConfig(do_sample=True, temperature=1.5, top_k=3)
    V = model.config.vocab_size

    def target(ids: list[int]) -> torch.Tensor:
        s = SamplerState.empty(V, "cpu")
        s.reset(torch.tensor(ids), 0)
        return process_logits(model(torch.tensor([ids])).logits[0, -1], s, cfg).softmax(-1).double()

    history = prompt[0].tolist()
    joint = {(): 1.0}
    for _ in range(3):
        joint = {seq + (t,): p * float(q[t]) for seq, p in joint.items()
                 for q in [target(history + list(seq))] for t in q.nonzero()[:, 0].tolist()}
    index = {seq: i for i, seq in enumerate(joint)}
    probs = torch.tensor(list(joint.values()), dtype=torch.float64)
    engine = SpeculativeEngine(model, 64, torch.float32, False, 2, forced_drafts=True)
    engine.forced.zero_()
    engine.forced[: len(history) + len(plain_long)] = torch.tensor(history + plain_long, dtype=torch.int32)
    counts, accepted, rejected = torch.zeros(len(joint), dtype=torch.float64), 0, 0
    for seed in range(500):
        tokens, stats, _ = run_speculative(engine, prompt[0].to(torch.int32), cfg, 3, seed, StopCondition(frozenset()),
                                           chunk_size=4096, adaptive=False)
        assert tuple(tokens) in index, f"seed {seed}: {tokens} has probability 0 under the model"
        counts[index[tuple(tokens)]] += 1
        accepted += stats.accepted > 0
        rejected += stats.accepted < stats.drafted
    assert accepted > 20 and rejected > 20  # both paths ran
    assert chi_square_p(counts, probs / probs.sum()) > 1e-3


def test_stop_token_ends_the_output_mid_step(model, prompt, plain):
    """A stop token inside an accepted run: nothing after it is returned."""
    stop = plain[5]
    out = model.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[stop], speculative="mtp")
    assert out[0, prompt.shape[1]:].tolist() == plain[: plain.index(stop) + 1]


def test_conversation_turns_equal_the_whole_history(model, prompt):
    """Speculative turns of a Conversation (the state continued, the replies' steps rolled back where they
    ran past the stop) give what the whole history from scratch gives with plain greedy."""
    conversation, history = Conversation(), []
    for turn in (prompt[0].tolist(), [7, 8, 9], [300, 301]):
        out = model.generate(torch.tensor([turn]), max_new_tokens=9, eos_token_id=[], conversation=conversation,
                             speculative="mtp", num_draft_tokens=3)
        reply = out[0, len(turn):].tolist()
        history += turn
        plain = model.generate(torch.tensor([history]), max_new_tokens=9, eos_token_id=[])
        assert reply == plain[0, len(history):].tolist()
        history += reply
        assert conversation.tokens == history


def test_bad_arguments(model, prompt, tmp_path):
    with pytest.raises(ValueError, match="num_draft_tokens"):
        model.generate(prompt, speculative="mtp", num_draft_tokens=MAX_DRAFT_TOKENS + 1)
    with pytest.raises(ValueError, match="speculative"):
        model.generate(prompt, speculative="medusa")
    folder = synthetic.write_hf_checkpoint(tmp_path / "hf", SMALL, seed=5, form="text")
    plain_model = Qwen38ForCausalLM.from_pretrained(folder, device="cpu")
    with pytest.raises(ValueError, match="MTP block"):
        plain_model.generate(prompt, speculative="mtp")


def test_draft_count_policy():
    assert expected_tokens(0.0, 3) == 1 and expected_tokens(1.0, 3) == 4
    cost = [1 + 0.1 * k for k in range(5)]
    assert best_draft_count(0.0, cost) == 0  # nothing accepted: plain steps (+ the cheap MTP pass)
    assert best_draft_count(1.0, cost) == 4
    assert 0 < best_draft_count(0.5, cost) < 4
    policy = DraftPolicy(4, adaptive=True)
    # Optimistic start: the best k for full acceptance at the prior's costs.
    assert policy.next_k() == best_draft_count(1.0, [prior_step_cost(k) for k in range(5)])
    for _ in range(30):
        policy.record(4, 0, 0.02)
    ks = [policy.next_k() for _ in range(16)]
    assert ks.count(0) == 14 and ks.count(1) == 2  # no drafts, a one-draft probe every 8 steps
    policy.record(0, 0, 0.01)
    assert policy.step_cost()[0] == 0.01 and policy.step_cost()[4] > 0.019  # measured ones replace the prior
    for _ in range(30):
        policy.record(1, 1, 0.011)
    assert policy.next_k() > 0  # drafts accepted again: drafting resumes


def test_scratch_refuses_new_buffers_once_frozen():
    scratch = Scratch("cpu")
    buf = scratch.empty("role", "x", (2, 3))
    scratch.freeze()
    assert scratch.empty("role", "x", (2, 3)) is buf
    with pytest.raises(RuntimeError, match="after a CUDA graph was captured"):
        scratch.empty("role", "x", (4, 3))


# --------------------------------------------------------------------------------------------------
# GPU (device machine, -m cuda): the captured step graphs
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_model(model):
    path = model.config.source
    return Qwen38ForCausalLM.from_pretrained(path, device="cuda", lane="int8")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k", [1, 3, MAX_DRAFT_TOKENS])
def test_cuda_graph_steps_equal_plain_greedy(gpu_model, prompt, k):
    """Plain greedy through its graph vs speculative steps through theirs: forced 100%, 0% and partial
    acceptance and the block's own drafts (adaptive), token for token, on the int8 lane."""
    long = gpu_model.generate(prompt, max_new_tokens=NEW_TOKENS + MAX_DRAFT_TOKENS + 1, eos_token_id=[])[0].tolist()
    plain = long[prompt.shape[1]:][:NEW_TOKENS]
    gpu_prompt = prompt.to("cuda")
    for name, drafts in (("perfect", long), ("wrong", [(t + 1) % 500 for t in long]),
                         ("partial", [t if i % 3 else (t + 1) % 500 for i, t in enumerate(long)])):
        engine = SpeculativeEngine(gpu_model, 64, torch.float32, True, k, forced_drafts=True)
        engine.forced.zero_()
        engine.forced[: len(drafts)] = torch.tensor(drafts, dtype=torch.int32)
        tokens, stats, _ = run_speculative(engine, gpu_prompt[0].to(torch.int32), SamplingConfig(), NEW_TOKENS, 0,
                                           StopCondition(frozenset()), chunk_size=4096, adaptive=False)
        assert tokens == plain, name
        assert (stats.accepted == stats.drafted) == (name == "perfect"), name
    out = gpu_model.generate(gpu_prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[], speculative="mtp",
                             num_draft_tokens=k)
    assert out[0, prompt.shape[1]:].tolist() == plain
    assert gpu_model.last_generation_stats.graph
