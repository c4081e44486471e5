"""select_speculative: the token selection of a speculative step, from the verify pass's k+1 logits rows.

Greedy: token for token what select_next_token gives step by step (0, partial and full acceptance, with the
repetition and presence penalties and min_new_tokens, whose state must include the drafts row by row), and
the sampler state after it equals the plain run's. Sampling: the first token and the first two tokens follow
the plain target (chi-square over many seeds, drafts likely, unlikely and of probability 0 under top-k) on a
toy model whose next-token logits depend on the last token; drafts of probability 0 or 1 reproduce plain
sampling token for token (the draw uses the same step's noise); reproducible for a seed. `-m cuda`: the same on the GPU at the 27B vocabulary, and a captured
graph replays what eager computes.
"""
import dataclasses
import functools
import pathlib
import sys

import pytest
import torch

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_model.sampling import SamplerState, SamplingConfig, process_logits, select_next_token, select_speculative

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1] / "ops"))  # the op tests' CUDA helpers
from cuda_helpers import capture_graph, cuda  # noqa: E402

VOCAB_27B = 248320
EOS = 5
GREEDY = {
    "plain": SamplingConfig(),
    "penalties": SamplingConfig(repetition_penalty=1.3, presence_penalty=0.5, min_new_tokens=2, eos_token_ids=(EOS,)),
}
# Every processor on: rows must each be processed with their own state and counters.
ALL_PROCESSORS = SamplingConfig(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, min_p=0.01,
                                repetition_penalty=1.3, presence_penalty=0.5, min_new_tokens=2, eos_token_ids=(EOS,))


def new_state(vocab, prompt, seed, cfg, device="cpu") -> SamplerState:
    s = SamplerState.empty(vocab, device)
    s.reset(torch.as_tensor(prompt).to(device), seed, cfg.eos_token_ids)
    return s


def copy_state(s: SamplerState) -> SamplerState:
    return SamplerState(*(getattr(s, f.name).clone() for f in dataclasses.fields(s)))


def assert_same_state(a: SamplerState, b: SamplerState) -> None:
    for f in dataclasses.fields(a):
        assert torch.equal(getattr(a, f.name), getattr(b, f.name)), f.name


def plain_tokens(rows, s, cfg) -> list[int]:
    """select_next_token on each row in turn (the state advancing), as plain decode would, given row i."""
    token = torch.zeros(1, dtype=torch.int32, device=rows.device)
    position = torch.zeros(1, dtype=torch.int32, device=rows.device)
    out = []
    for row in rows:
        select_next_token(row, s, cfg, token, position)
        out.append(int(token))
    return out


def speculative(rows, drafts, s, cfg) -> tuple[list[int], int]:
    device = rows.device
    tokens = torch.full((rows.shape[0],), -7, dtype=torch.int32, device=device)  # poisoned
    accepted = torch.full((1,), -7, dtype=torch.int32, device=device)
    select_speculative(rows, torch.as_tensor(drafts, dtype=torch.int32).to(device), s, cfg, tokens, accepted)
    return tokens.tolist(), int(accepted)


def greedy_logits(k, vocab, seed, device="cpu"):
    """Random rows where a few tokens (EOS, two prompt tokens, three others) stand out in every row, so the
    penalties and min_new_tokens decide the argmax, and a draft repeated from an earlier row matters."""
    g = torch.Generator().manual_seed(seed)
    rows = 0.5 * torch.randn(k + 1, vocab, generator=g)
    rows[:, [EOS, 11, 12, 13, 14, 15]] = (torch.tensor([5.0, 4.0, 3.9, 3.8, 3.7, 3.6])
                                          + 0.3 * torch.rand(k + 1, 6, generator=g))
    return rows.to(device)


def check_greedy(k, accepted, cfg, vocab, device, seed=0):
    rows = greedy_logits(k, vocab, seed, device)
    s = new_state(vocab, [12, 40, 13], seed, cfg, device)
    plain_state = copy_state(s)
    plain = plain_tokens(rows, plain_state, cfg)
    drafts = plain[:k]
    if accepted < k:
        drafts[accepted] = (plain[accepted] + 1) % vocab  # wrong; later drafts stay the plain tokens
    tokens, num = speculative(rows, drafts, s, cfg)
    assert num == accepted
    assert tokens == plain[: accepted + 1] + [-1] * (k - accepted)
    # The plain run's state after the same a+1 tokens.
    expected = copy_state(new_state(vocab, [12, 40, 13], seed, cfg, device))
    plain_tokens(rows[: accepted + 1], expected, cfg)
    assert_same_state(s, expected)


@pytest.mark.parametrize("cfg", GREEDY.values(), ids=GREEDY.keys())
@pytest.mark.parametrize("k, accepted", [(0, 0), (1, 0), (1, 1), (3, 0), (3, 2), (3, 3), (7, 4), (7, 7)])
def test_greedy_equals_plain_greedy(k, accepted, cfg):
    check_greedy(k, accepted, cfg, vocab=1000, device="cpu")


def test_greedy_penalties_change_the_tokens():
    """The logits of the tests above make the penalties bite: otherwise they could not tell a row
    processed without the drafts' state."""
    rows = greedy_logits(7, 1000, 0)
    plain = plain_tokens(rows, new_state(1000, [12, 40, 13], 0, GREEDY["plain"]), GREEDY["plain"])
    penalized = plain_tokens(rows, new_state(1000, [12, 40, 13], 0, GREEDY["penalties"]), GREEDY["penalties"])
    assert plain == [EOS] * 8
    assert EOS not in penalized[:2] and EOS in penalized and len(set(penalized)) >= 4


def test_greedy_at_the_27b_vocabulary():
    check_greedy(7, 5, GREEDY["penalties"], vocab=VOCAB_27B, device="cpu")


def test_rows_are_processed_as_single_rows():
    """process_logits on [R, V] with per-row masks and counts: each row bit for bit its [V] result."""
    vocab, g = 300, torch.Generator().manual_seed(3)
    rows = torch.randn(4, vocab, generator=g) * 3
    states = []
    for i in range(4):
        s = new_state(vocab, [1, 2, EOS], 0, ALL_PROCESSORS)
        s.seen[torch.randint(0, vocab, (i * 30,), generator=g)] = True
        s.generated[torch.randint(0, vocab, (i * 20,), generator=g)] = True
        s.num_generated.fill_(i)
        states.append(s)
    stacked = dataclasses.replace(states[0], seen=torch.stack([s.seen for s in states]),
                                  generated=torch.stack([s.generated for s in states]),
                                  num_generated=torch.stack([s.num_generated for s in states]))
    together = process_logits(rows, stacked, ALL_PROCESSORS)
    for i, s in enumerate(states):
        assert torch.equal(together[i], process_logits(rows[i], s, ALL_PROCESSORS))
    assert not torch.equal(together[3], process_logits(rows[3], states[0], ALL_PROCESSORS))


@pytest.mark.parametrize("do_sample", [False, True])
def test_nonfinite_flag_only_for_rows_that_chose(do_sample):
    vocab, k = 100, 3
    cfg = SamplingConfig(do_sample=do_sample, top_k=5)
    rows = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(0))
    rows[2, 17] = float("nan")
    low = rows[0].argmin().item()  # probability 0 under top-k, and never the argmax: rejected either way
    s = new_state(vocab, [1], 0, cfg)
    assert speculative(rows, [low, 1, 2], s, cfg)[1] == 0
    assert not s.nonfinite.item()
    if not do_sample:  # greedy can be forced past row 2
        plain = plain_tokens(rows, new_state(vocab, [1], 0, cfg), cfg)
        assert speculative(rows, plain[:k], s, cfg)[1] >= 2
        assert s.nonfinite.item()


def test_bad_arguments_raise():
    s = new_state(10, [1], 0, SamplingConfig())
    rows, drafts = torch.zeros(3, 10), torch.zeros(2, dtype=torch.int32)
    tokens, num = torch.zeros(3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="logits must be"):
        select_speculative(rows[:2], drafts, s, SamplingConfig(), tokens, num)
    with pytest.raises(ValueError, match="drafts must be"):
        select_speculative(rows, drafts.long(), s, SamplingConfig(), tokens, num)
    with pytest.raises(ValueError, match="tokens must be"):
        select_speculative(rows, drafts, s, SamplingConfig(), tokens[:2], num)


# ---- sampling ---------------------------------------------------------------------------------------------

TOY_VOCAB = 8
TOY_PROMPT = [3]
# top_k 5 of 8: three tokens have probability 0 at every step. The penalties make the second token's
# distribution depend on the first (the table favours repeating the last token).
TOY_CFG = SamplingConfig(do_sample=True, temperature=0.8, top_k=5, top_p=0.95, repetition_penalty=1.3,
                         presence_penalty=0.8)


def toy_table(device="cpu"):
    """logits of the next token given the last one: a toy model for verify rows and plain decode alike."""
    g = torch.Generator().manual_seed(1)
    return (torch.randn(TOY_VOCAB, TOY_VOCAB, generator=g) * 1.5 + 2.0 * torch.eye(TOY_VOCAB)).to(device)


def toy_target(table):
    """Plain sampling's target: p(t0) and p(t1 | t0) [t0, t1], processed as select_next_token does."""
    s = new_state(TOY_VOCAB, TOY_PROMPT, 0, TOY_CFG, table.device)
    first = torch.softmax(process_logits(table[TOY_PROMPT[-1]], s, TOY_CFG).double(), -1)
    second = []
    for t0 in range(TOY_VOCAB):
        after = copy_state(s)
        after.seen[t0] = after.generated[t0] = True
        after.num_generated.add_(1)
        second.append(torch.softmax(process_logits(table[t0], after, TOY_CFG).double(), -1))
    return first.cpu(), torch.stack(second).cpu()


def draft_policy(kind, p) -> int:
    """A point-mass draft from a distribution: its most likely token, its least likely possible one, or one
    of probability 0."""
    if kind == "likely":
        return int(p.argmax())
    if kind == "unlikely":
        return int(torch.where(p > 0, p, 2.0).argmin())
    return int(torch.nonzero(p == 0)[0])


@functools.lru_cache(maxsize=None)
def sample_first_two(kind, draws, device="cpu"):
    """The first two tokens of `draws` seeded runs of speculative decoding (k = 2) on the toy model (their
    counts [t0, t1]), the target, and how many first steps accepted a draft. Cached: two tests read one run."""
    table = toy_table(device)
    first, second = toy_target(table)
    # Drafts from the target itself (the draft after d is chosen from p(. | d)); any draft is valid.
    draft_at_start = draft_policy(kind, first)
    draft_after = [draft_policy(kind, second[t]) for t in range(TOY_VOCAB)]
    counts = torch.zeros(TOY_VOCAB, TOY_VOCAB, dtype=torch.float64)
    accepting = 0
    for seed in range(draws):
        s = new_state(TOY_VOCAB, TOY_PROMPT, seed, TOY_CFG, device)
        d1 = draft_at_start
        d2 = draft_after[d1]
        tokens, accepted = speculative(table[[TOY_PROMPT[-1], d1, d2]], [d1, d2], s, TOY_CFG)
        if accepted == 0:
            t0, d1 = tokens[0], draft_after[tokens[0]]
            d2 = draft_after[d1]
            tokens = [t0, speculative(table[[t0, d1, d2]], [d1, d2], s, TOY_CFG)[0][0]]
        accepting += accepted > 0
        counts[tokens[0], tokens[1]] += 1
    return counts, first, second, accepting


def chi_square_p(counts, probs) -> float:
    """The chi-square test's p-value; cells expecting fewer than 5 draws pooled into one."""
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was emitted"
    expected, observed = probs[probs > 0] * n, counts[probs > 0]
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
        observed = torch.cat([observed[~small], observed[small].sum().view(1)])
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(chi2 / 2, dtype=torch.float64)))  # the chi2 tail
    print(f"chi2 = {chi2:.1f}, {dof} dof, p = {p:.3g}")
    return p


def check_sampling_follows_target(kind, draws, device):
    counts, first, second, accepting = sample_first_two(kind, draws, device)
    print(f"{kind}: first draft accepted in {accepting} of {draws}")
    if kind == "impossible":
        assert accepting == 0
    elif kind == "likely":
        assert accepting > draws // 3
    else:
        assert 0 < accepting < draws // 3
    assert chi_square_p(counts.sum(1), first) > 1e-4
    assert chi_square_p(counts.flatten(), (first[:, None] * second).flatten()) > 1e-4


@pytest.mark.parametrize("kind", ["likely", "unlikely", "impossible"])
def test_sampling_follows_the_target(kind):
    check_sampling_follows_target(kind, 2500, "cpu")


def test_chi_square_sees_a_wrong_distribution():
    """The test above has the power to see a classic mistake: resampling a rejected draft (the residual
    without the draft removed) inflates likely drafts."""
    counts, first, second, _ = sample_first_two("likely", 2500, "cpu")
    wrong = first.clone()
    top = int(first.argmax())
    wrong[top] += (1 - first[top]) * first[top]
    wrong[torch.arange(TOY_VOCAB) != top] *= 1 - first[top]
    assert chi_square_p(counts.sum(1), wrong) < 1e-4


def test_sure_and_impossible_drafts_reproduce_plain_sampling():
    """Drafts of probability 1 are always accepted; at a draft of probability 0 (nothing to take out of the
    draw) or after all k, the token is drawn as select_next_token draws it at that step (the same noise):
    plain sampling's tokens, token for token, and the same state, step after step. k = 0 as well."""
    vocab, g = 60, torch.Generator().manual_seed(5)
    cfg = dataclasses.replace(ALL_PROCESSORS, top_k=10)
    for seed, k, sure in [(0, 0, 0), (1, 3, 0), (2, 3, 2), (3, 7, 4), (4, 7, 7)]:
        spec, plain = new_state(vocab, [1, 2], seed, cfg), new_state(vocab, [1, 2], seed, cfg)
        for _ in range(3):
            rows = torch.randn(k + 1, vocab, generator=g) * 2
            drafts = torch.randint(0, vocab, (k,), generator=g).tolist()
            for i in range(sure):
                rows[i, drafts[i]] = 1e4  # every other token underflows to probability 0
            if sure < k:
                drafts[sure] = int(rows[sure].argmin())  # outside the top 10
            tokens, accepted = speculative(rows, drafts, spec, cfg)
            assert accepted == sure and tokens[sure + 1:] == [-1] * (k - sure)
            assert tokens[: sure + 1] == plain_tokens(rows[: sure + 1], plain, cfg)
            assert_same_state(spec, plain)


def test_sampling_reproducible_for_a_seed():
    table, cfg = toy_table(), TOY_CFG
    drafts = [2, 2]  # often accepted, often not: both paths through the noise
    rows = table[[TOY_PROMPT[-1], 2, 2]]

    def run(seed):
        s = new_state(TOY_VOCAB, TOY_PROMPT, seed, cfg)
        return [speculative(rows, drafts, s, cfg) for _ in range(3)], s

    outcomes = []
    for seed in range(12):
        (a, sa), (b, sb) = run(seed), run(seed)
        assert a == b
        assert_same_state(sa, sb)
        outcomes.append(str(a))
    assert len(set(outcomes)) > 4


# ---- the GPU (-m cuda) ------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("cfg", GREEDY.values(), ids=GREEDY.keys())
@pytest.mark.parametrize("vocab", [1000, 4097, VOCAB_27B])
def test_cuda_greedy_equals_plain_greedy(vocab, cfg):
    """On the GPU the plain path takes argmax_advance's kernel: the same first-maximal-index rule."""
    for k, accepted in [(0, 0), (3, 0), (3, 2), (7, 5), (7, 7)]:
        check_greedy(k, accepted, cfg, vocab, "cuda", seed=k + accepted)


@cuda
@pytest.mark.parametrize("kind", ["likely", "unlikely", "impossible"])
def test_cuda_sampling_follows_the_target(kind):
    check_sampling_follows_target(kind, 2500, "cuda")


@cuda
@pytest.mark.parametrize("cfg", [GREEDY["penalties"], ALL_PROCESSORS], ids=["greedy", "sampling"])
def test_cuda_graph_replay_equals_eager(cfg):
    """Captured (so no host synchronisation inside), replayed on new logits and drafts: bit for bit what
    eager computes, tokens, count and the whole sampler state, step after step."""
    k, vocab = 7, VOCAB_27B
    logits = torch.zeros(k + 1, vocab, device="cuda")
    drafts = torch.zeros(k, dtype=torch.int32, device="cuda")
    tokens = torch.zeros(k + 1, dtype=torch.int32, device="cuda")
    accepted = torch.zeros(1, dtype=torch.int32, device="cuda")
    graph_state = new_state(vocab, [12, 40, 13], 9, cfg, "cuda")
    start = copy_state(graph_state)
    graph = capture_graph(lambda: select_speculative(logits, drafts, graph_state, cfg, tokens, accepted))
    for f in dataclasses.fields(start):
        getattr(graph_state, f.name).copy_(getattr(start, f.name))  # undo the warm-up's step
    eager_state = copy_state(start)
    counts = set()
    for step in range(6):
        rows = greedy_logits(k, vocab, step, "cuda")
        # Drafts: the plain run's tokens from here, one made wrong (greedy then accepts exactly up to it).
        wrong = (step * 3) % k
        guess = torch.tensor(plain_tokens(rows[:k], copy_state(eager_state), cfg), dtype=torch.int32)
        guess[wrong] = (guess[wrong] + 1) % vocab
        guess = guess.cuda()
        logits.copy_(rows)
        drafts.copy_(guess)
        tokens.fill_(-7)
        accepted.fill_(-7)
        graph.replay()
        eager_tokens = torch.full_like(tokens, -9)
        eager_accepted = torch.full_like(accepted, -9)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            select_speculative(rows, guess, eager_state, cfg, eager_tokens, eager_accepted)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(tokens, eager_tokens) and torch.equal(accepted, eager_accepted)
        assert_same_state(graph_state, eager_state)
        if not cfg.do_sample:
            assert int(accepted) == wrong
        counts.add(int(accepted))
    assert len(counts) > 1
