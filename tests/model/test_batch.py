"""Many sequences at once (engine.BatchEngine): every sequence of a batch gets exactly the tokens of its solo
run, greedy and sampled with its seed, whatever else is in the batch, however padded, and whenever it
joined; forward() with an attention_mask gives each row the logits of that row alone."""
import numpy as np
import pytest
import torch

from qwen38_model import Qwen38ForCausalLM
from qwen38_model.conversation import PrefixCache
from qwen38_model.default_model import default_model_path
from qwen38_model.engine import BatchEngine, Sequence, run_batch
from qwen38_model.generation import StopCondition
from qwen38_model.model import PREFILL_CHUNK
from qwen38_model.sampling import SamplingConfig

SAMPLED = dict(do_sample=True, temperature=0.9, top_k=40, top_p=0.95)


@pytest.fixture(scope="module")
def model():
    return Qwen38ForCausalLM.from_pretrained(default_model_path(), device="cpu")


@pytest.fixture(scope="module")
def cuda_model():
    return Qwen38ForCausalLM.from_pretrained(default_model_path(), device="cuda")


def prompts(model, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in lengths]


def solo(model, prompt, **kwargs):
    return model.generate(prompt[None], **kwargs)[0, prompt.shape[0]:].tolist()


def left_padded(rows, pad):
    width = max(r.shape[0] for r in rows)
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - r.shape[0]:] = r
        mask[b, width - r.shape[0]:] = 1
    return ids, mask


def new_tokens(out, width, stop_ids, pad):
    """A row of generate()'s output past the prompt, cut after its first stop token (the rest is padding)."""
    tokens = out[width:].tolist()
    for i, t in enumerate(tokens):
        if t in stop_ids:
            assert all(p == pad for p in tokens[i + 1:]), "generate() pads after a row's stop token"
            return tokens[: i + 1]
    return tokens


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_batched_generate_rows_equal_their_solo_runs(model, sampling):
    rows = prompts(model, [5, 9, 2, 7])
    pad = 0
    ids, mask = left_padded(rows, pad)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, seed=11, pad_token_id=pad, **sampling)
    stats = model.last_generation_stats
    assert len(stats.sequences) == len(rows) and stats.new_tokens == sum(s.new_tokens for s in stats.sequences)
    stop_ids = set(model.config.eos_token_ids)
    for j, prompt in enumerate(rows):
        assert new_tokens(out[j], ids.shape[1], stop_ids, pad) == solo(model, prompt, max_new_tokens=12, seed=11 + j,
                                                                        **sampling), f"row {j}"


def test_num_return_sequences_share_the_prompt_and_sample_with_their_seeds(model):
    prompt = prompts(model, [6])[0]
    out = model.generate(prompt[None], max_new_tokens=8, seed=3, num_return_sequences=3, **SAMPLED)
    assert out.shape[0] == 3
    stop_ids = set(model.config.eos_token_ids)
    for i in range(3):
        assert new_tokens(out[i], 6, stop_ids, model.config.eos_token_ids[0]) == solo(
            model, prompt, max_new_tokens=8, seed=3 + i, **SAMPLED)


def test_sequences_joining_and_leaving_keep_their_tokens(model):
    """More sequences than slots, different lengths and limits: each waits for a slot, joins while others
    decode, and still gets its solo tokens."""
    rows = prompts(model, [3, 8, 5, 2, 6, 4, 7], seed=5)
    limits = [3, 10, 1, 7, 5, 9, 2]
    engine = BatchEngine(model, 3, 32, torch.float32)
    eos = frozenset(model.config.eos_token_ids)
    sequences = [Sequence(p.to(model.device, torch.int32), SamplingConfig(eos_token_ids=tuple(eos)), 0, n,
                          StopCondition(eos)) for p, n in zip(rows, limits)]
    run_batch(engine, sequences, chunk_size=3)
    for j, (p, n, seq) in enumerate(zip(rows, limits, sequences)):
        assert seq.tokens == solo(model, p, max_new_tokens=n), f"sequence {j}"


def test_logprobs_are_the_log_softmax_of_the_logits_each_token_was_chosen_from(model):
    """A sequence asking for logprobs (cfg.logprobs) gets, with each token (on_token(token, logprobs) and
    seq.logprobs), the log_softmax of model(ids)'s raw logits at that position: the chosen token's and the 20
    most likely (sorted, the greedy token first); a sampled one with a logit bias reports the raw logits' too.
    The sequences beside it that ask for none get exactly their solo tokens."""
    from qwen38_model.engine import TokenLogprobs

    rows = prompts(model, [5, 3, 7], seed=9)
    eos = frozenset(model.config.eos_token_ids)
    plain = SamplingConfig(eos_token_ids=tuple(eos))
    asking = SamplingConfig(eos_token_ids=tuple(eos), logprobs=True)
    sampled = SamplingConfig(eos_token_ids=tuple(eos), logprobs=True, logit_bias=True, **SAMPLED)
    seen = []
    sequences = [Sequence(rows[0].to(torch.int32), asking, 0, 8, StopCondition(eos),
                          on_token=lambda token, lp: seen.append((token, lp))),
                 Sequence(rows[1].to(torch.int32), plain, 0, 8, StopCondition(eos)),
                 Sequence(rows[2].to(torch.int32), sampled, 4, 8, StopCondition(eos), logit_bias={17: 2.5, 30: -4.0})]
    engine = BatchEngine(model, 3, 32, torch.float32)
    run_batch(engine, sequences, chunk_size=4)
    assert sequences[1].tokens == solo(model, rows[1], max_new_tokens=8) and not sequences[1].logprobs
    assert [t for t, _ in seen] == sequences[0].tokens and [lp for _, lp in seen] == sequences[0].logprobs
    assert sequences[0].tokens == solo(model, rows[0], max_new_tokens=8)
    assert sequences[2].tokens == solo(model, rows[2], max_new_tokens=8, seed=4, logit_bias={17: 2.5, 30: -4.0},
                                       **SAMPLED)
    for seq, prompt in ((sequences[0], rows[0]), (sequences[2], rows[2])):
        assert len(seq.logprobs) == len(seq.tokens) >= 2
        ids = torch.cat([prompt, torch.tensor(seq.tokens)])[None]
        truth = torch.log_softmax(model(ids).logits[0, prompt.shape[0] - 1 : -1], -1)  # row t chose token t
        for t, (token, lp) in enumerate(zip(seq.tokens, seq.logprobs)):
            assert isinstance(lp, TokenLogprobs) and len(lp.top) == 20
            assert abs(lp.logprob - float(truth[t, token])) <= 1e-5, (t, lp.logprob, float(truth[t, token]))
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True) and lp.top[0][1] >= lp.logprob
            assert [i for i, _ in lp.top] == truth[t].topk(20).indices.tolist()
            torch.testing.assert_close(torch.tensor(values), truth[t].topk(20).values, rtol=0, atol=1e-5)
            if seq is sequences[0]:  # greedy: the chosen token is the most likely one
                assert lp.top[0] == (token, lp.logprob)


def test_forward_with_attention_mask_gives_each_row_its_own_logits(model):
    rows = prompts(model, [4, 7, 1], seed=2)
    ids, mask = left_padded(rows, 0)
    logits = model(ids, attention_mask=mask).logits
    for b, r in enumerate(rows):
        alone = model(r[None]).logits[0]
        torch.testing.assert_close(logits[b, ids.shape[1] - r.shape[0]:], alone, rtol=0, atol=1e-5)
        assert not logits[b, : ids.shape[1] - r.shape[0]].any()
    right = torch.zeros_like(ids)
    right_mask = torch.zeros_like(mask)
    for b, r in enumerate(rows):
        right[b, : r.shape[0]], right_mask[b, : r.shape[0]] = r, 1
    torch.testing.assert_close(model(right, attention_mask=right_mask).logits[1, :7], logits[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("mask, message", [
    (torch.tensor([[1, 0, 1]]), "not one run of ones"),
    (torch.tensor([[0, 0, 0]]), "keeps no token"),
    (torch.tensor([[1, 2, 1]]), "only 0 and 1"),
    (torch.tensor([[1, 1]]), "input_ids' shape"),
])
def test_bad_attention_masks_are_clear_errors(model, mask, message):
    with pytest.raises(ValueError, match=message):
        model(torch.tensor([[1, 2, 3]]), attention_mask=mask)


def test_batched_generate_refuses_single_sequence_options(model):
    with pytest.raises(ValueError, match="streamer is for one sequence"):
        model.generate(torch.tensor([[1, 2], [3, 4]]), streamer=object())
    with pytest.raises(ValueError, match="prefix_cache is for one sequence"):
        model.generate(torch.tensor([[1, 2]]), num_return_sequences=2, prefix_cache=PrefixCache(1 << 20))


@pytest.mark.cuda
@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_cuda_64_sequences_through_the_graphs_equal_their_solo_runs(cuda_model, sampling):
    """The batch-invariance contract on the GPU, graphs replayed: 64 sequences of different prompts and
    lengths, joining at different steps (one admission per step), in buckets that change as they come and
    go; each bitwise equal to its solo generate() run (one row, bucket 1). The prefill runs in
    generate()'s chunks: a prompt prefilled in other chunks is another float order (attention_prefill's
    split and the GDN chunk loop depend on the chunk), so its bits may differ from generate()'s."""
    model = cuda_model
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 40, (64,), generator=g).tolist()
    limits = torch.randint(1, 24, (64,), generator=g).tolist()
    rows = prompts(model, lengths, seed=8)
    engine = BatchEngine(model, 64, 64, torch.bfloat16)
    eos = frozenset(model.config.eos_token_ids)
    cfg = SamplingConfig(eos_token_ids=tuple(eos), **sampling)
    sequences = [Sequence(p.to("cuda", torch.int32), cfg, 100 + j, n, StopCondition(eos))
                 for j, (p, n) in enumerate(zip(rows, limits))]
    run_batch(engine, sequences, chunk_size=PREFILL_CHUNK)
    assert engine.step_graphs, "the steps replayed captured graphs"
    for j, (p, n, seq) in enumerate(zip(rows, limits, sequences)):
        assert seq.tokens == solo(model, p, max_new_tokens=n, seed=100 + j, **sampling), f"sequence {j}"


@pytest.mark.cuda
def test_cuda_batched_generate_equals_eager_batched(cuda_model):
    rows = prompts(cuda_model, [5, 30, 12, 1, 9], seed=3)
    ids, mask = left_padded(rows, 0)
    graph = cuda_model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[])
    eager = cuda_model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[], use_graph=False)
    assert torch.equal(graph, eager)


class ChainConstraint:
    """A constraint whose allowed tokens depend on the token just chosen (as a grammar's do): after token p, the
    five tokens (7p + k) % V; complete after `length` tokens."""

    def __init__(self, vocab: int, first: int, length: int):
        self.vocab, self.previous, self.left = vocab, first, length

    def allowed(self, previous: int) -> list[int]:
        return [(7 * previous + k) % self.vocab for k in range(5)]

    def fill(self, row: torch.Tensor) -> None:
        bits = np.zeros(row.numel() * 32, dtype=bool)
        bits[self.allowed(self.previous)] = True
        row.copy_(torch.from_numpy(np.packbits(bits, bitorder="little").view("<i4")))  # token t: bit t % 32

    def advance(self, token: int) -> bool:
        ok = token in self.allowed(self.previous)
        self.previous, self.left = token, self.left - 1
        return ok

    def complete(self) -> bool:
        return self.left == 0

    def error(self) -> str:
        return "not among the allowed tokens"


def constrained_run(model, rows, device: str, use_graph: bool):
    """Two constrained sequences (greedy and sampled) beside an unconstrained one, through the engine."""
    eos = frozenset(model.config.eos_token_ids)
    vocab = model.config.vocab_size
    masked = [SamplingConfig(eos_token_ids=tuple(eos), token_mask=True),
              SamplingConfig(eos_token_ids=tuple(eos), token_mask=True, **SAMPLED)]
    sequences = [Sequence(rows[0].to(device, torch.int32), masked[0], 0, 12, StopCondition(eos),
                          constraint=ChainConstraint(vocab, int(rows[0][-1]), 6)),
                 Sequence(rows[1].to(device, torch.int32), SamplingConfig(eos_token_ids=tuple(eos)), 0, 12,
                          StopCondition(eos)),
                 Sequence(rows[2].to(device, torch.int32), masked[1], 3, 12, StopCondition(eos),
                          constraint=ChainConstraint(vocab, int(rows[2][-1]), 8))]
    run_batch(BatchEngine(model, 3, 32, torch.float32, use_graph=use_graph), sequences, chunk_size=4)
    return sequences


def check_constrained(model, rows, sequences):
    """Each constrained token is among those its predecessor allows (greedy: the most likely of them under
    model(ids)'s logits), each constrained sequence stops where its constraint completes, the unconstrained one
    gets its solo tokens."""
    first, plain, sampled = sequences
    assert plain.tokens == solo(model, rows[1], max_new_tokens=12)
    assert len(first.tokens) == 6 and len(sampled.tokens) == 8
    for prompt, seq in ((rows[0], first), (rows[2], sampled)):
        previous = [int(prompt[-1])] + seq.tokens[:-1]
        assert all(t in seq.constraint.allowed(p) for p, t in zip(previous, seq.tokens))
    ids = torch.cat([rows[0], torch.tensor(first.tokens)])[None].to(model.device)
    logits = model(ids).logits[0, rows[0].shape[0] - 1 : -1]
    previous = [int(rows[0][-1])] + first.tokens[:-1]
    for t, (p, token) in enumerate(zip(previous, first.tokens)):
        allowed = first.constraint.allowed(p)
        assert token == allowed[int(logits[t, allowed].argmax())], t


def test_a_token_mask_constrains_each_selection_to_its_allowed_tokens(model):
    """cfg.token_mask with a constraint (structured output's contract, here without a grammar library): the
    bitmask the host writes after reading each token is what the next selection chooses from."""
    rows = prompts(model, [5, 4, 6], seed=21)
    check_constrained(model, rows, constrained_run(model, rows, "cpu", use_graph=False))


@pytest.mark.cuda
def test_cuda_constrained_sequences_wait_for_their_tokens_in_the_graphs(cuda_model):
    """On the GPU, where the host reads READ_BEHIND launches late: a constrained sequence's next mask still
    follows its last token (the engine waits for it), and the sequences beside it keep their solo tokens."""
    rows = prompts(cuda_model, [5, 4, 6], seed=21)
    check_constrained(cuda_model, rows, constrained_run(cuda_model, rows, "cuda", use_graph=True))


@pytest.mark.cuda
def test_cuda_logprobs_bias_and_frequency_penalty_through_the_selection_graphs(cuda_model):
    """On the GPU, the selection graphs (captured per slot and config) with logprobs, a logit bias and a
    frequency penalty: each sequence's tokens are those of its solo generate() run (the single-sequence
    engine's graph), and its logprobs those of an eager engine run (no graphs), the other sequences
    unchanged by them."""
    model = cuda_model
    rows = prompts(model, [6, 11, 3, 8], seed=12)
    eos = frozenset(model.config.eos_token_ids)
    bias = {17: 2.5, 30: -4.0, 101: 1.0}
    settings = [(dict(logprobs=True), None, {}), (dict(), None, {}),
                (dict(logprobs=True, logit_bias=True, frequency_penalty=0.7, **SAMPLED), bias,
                 dict(logit_bias=bias, frequency_penalty=0.7, **SAMPLED)),
                (dict(frequency_penalty=-0.5, logit_bias=True), bias, dict(logit_bias=bias, frequency_penalty=-0.5))]

    def run(use_graph):
        engine = BatchEngine(model, 4, 64, torch.bfloat16, use_graph=use_graph)
        sequences = [Sequence(p.to("cuda", torch.int32), SamplingConfig(eos_token_ids=tuple(eos), **cfg), 20 + j, 16,
                              StopCondition(eos), logit_bias=b) for j, (p, (cfg, b, _)) in enumerate(zip(rows, settings))]
        run_batch(engine, sequences, chunk_size=PREFILL_CHUNK)
        return sequences

    graphed, eager = run(True), run(False)
    for j, (p, (_, _, kwargs), seq, ref) in enumerate(zip(rows, settings, graphed, eager)):
        assert seq.tokens == ref.tokens == solo(model, p, max_new_tokens=16, seed=20 + j, **kwargs), f"sequence {j}"
        assert len(seq.logprobs) == (len(seq.tokens) if seq.cfg.logprobs else 0)
        for mine, theirs in zip(seq.logprobs, ref.logprobs):
            assert abs(mine.logprob - theirs.logprob) <= 1e-6 and [i for i, _ in mine.top] == [i for i, _ in theirs.top]


def test_chunk_ends_count_from_the_history_start():
    from qwen38_model.engine import chunk_ends

    assert chunk_ends(0, 10, 4) == [4, 8, 10]
    assert chunk_ends(5, 10, 4) == [8, 10]  # from a restored prefix: the same ends as from 0
    assert chunk_ends(4, 9, 4) == [8, 9]
    assert chunk_ends(0, 10, 4, breaks=(3, 8, 12, 0)) == [3, 4, 8, 10]  # breaks outside (first, total) ignored
    assert chunk_ends(0, 3, 4) == [3]


def test_a_prefix_restored_at_a_break_gives_the_tokens_of_a_full_prefill(model):
    """The prefix cache's promise: a sequence restored from the snapshot taken at a break, then prefilled
    from there, decodes exactly as the same history prefilled whole (the chunks end at the same places)."""
    prompt = prompts(model, [23], seed=9)[0].to(model.device, torch.int32)
    eos = frozenset(model.config.eos_token_ids)
    cfg = SamplingConfig(eos_token_ids=tuple(eos))
    engine = BatchEngine(model, 2, 64, torch.float32)
    whole = Sequence(prompt, cfg, 0, 8, StopCondition(eos), breaks=(7, 15))
    run_batch(engine, [whole], chunk_size=5)
    assert [s.position for s in whole.break_snapshots] == [7, 15]
    restored = Sequence(prompt, cfg, 0, 8, StopCondition(eos), start=whole.break_snapshots[1])
    run_batch(engine, [restored], chunk_size=5)
    assert restored.stats.prompt_tokens == 23 - 15 and restored.tokens == whole.tokens
