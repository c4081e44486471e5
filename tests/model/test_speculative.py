"""MTP speculative decoding on the CPU (eager steps, the reference ops): greedy output equals plain greedy
token for token at 0%, partial and 100% acceptance (drafts forced from the plain run's own tokens), with
the MTP block's own drafts, and with logits processors; sampling follows the model's distribution end to end
(chi-square; the selection alone in test_speculative_sampling.py) and is reproducible for a seed; bad
arguments are errors. Every path leaves a state's MTP part as the MTP rule says (state.py; model(ids, state=s)
the reference): plain and speculative turns of a conversation, one or several sequences, a reply read behind
and rolled back, so a speculative turn after plain ones drafts from a filled cache. A capture's warm-up embeds
only valid ids whatever the engine holds (issue 20: it read the -1 placeholder), and an id flagged on the
device is a RuntimeError at the state's next sync. Many slots: sequences joining and leaving a speculative engine
at different times, each with its own drafts (forced right, wrong or partly right, or the block's own), get plain
greedy's tokens; sampled with a fixed k, their solo speculative runs' tokens; their states at the end are the rule's,
read behind too. generate(speculative="mtp") over left-padded rows: greedy, plain batched greedy's output; sampled
with a fixed k, each row's solo speculative run. `-m cuda`: the step graphs, on the GGUF model and on the issue's
dense small-vocabulary HF checkpoint, one slot and many."""
import functools
from collections import deque

import pytest
import torch
from test_speculative_sampling import chi_square_p

from qwen38_model import Qwen38ForCausalLM, convert, synthetic
from qwen38_model import model as model_module
from qwen38_model.conversation import Conversation
from qwen38_model.engine import BatchEngine, Sequence, run_batch
from qwen38_model.generation import StopCondition
from qwen38_model.sampling import SamplerState, SamplingConfig, process_logits
from qwen38_model.scratch import Scratch
from qwen38_model.speculative import (MAX_DRAFT_TOKENS, DraftPolicy, Speculation, SpeculativeStats, best_draft_count,
                                      expected_tokens, prior_step_cost)
from qwen38_model.state import BAD_POSITION
from qwen38_ops.embedding import BAD_TOKEN

from engines import one_sequence

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "head_dim": 32,
         "linear_key_head_dim": 32, "linear_value_head_dim": 32, "full_attention_interval": 2}
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = synthetic.write_hf_checkpoint(tmp_path_factory.mktemp("spec") / "hf", SMALL, seed=5, form="vlm")
    path = convert.hf_to_gguf(folder, folder.parent / "q8.gguf", "q8_0", model_name="spec", mtp=True)
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


def forced_engine(model, drafts: list[int], k: int, use_graph=False, adaptive=False) -> BatchEngine:
    """An engine whose MTP step drafts drafts[position] (a token sequence) with k drafts a step."""
    engine = BatchEngine(model, 1, 64, torch.float32, use_graph,
                         speculation=Speculation(k, adaptive=adaptive, forced_drafts=True))
    engine.mtp.forced[0, : len(drafts)] = torch.tensor(drafts, dtype=torch.int32)
    return engine


def run(engine, prompt: torch.Tensor, cfg=SamplingConfig(), new_tokens=NEW_TOKENS, seed=0):
    """(tokens, stats) of one sequence of prompt [1, T] through the engine."""
    seq = Sequence(prompt[0].to(engine.device, torch.int32), cfg, seed, new_tokens, StopCondition(frozenset()))
    run_batch(engine, [seq], chunk_size=4096)
    return seq.tokens, seq.stats


def forced_run(model, prompt, drafts: list[int], k: int, cfg=SamplingConfig(), adaptive=False):
    return run(forced_engine(model, drafts, k, adaptive=adaptive), prompt, cfg)


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
    engine = forced_engine(model, history + plain_long, 2)
    counts, accepted, rejected = torch.zeros(len(joint), dtype=torch.float64), 0, 0
    for seed in range(500):
        tokens, stats = run(engine, prompt, cfg, 3, seed)
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


def mtp_engine(model, k: int, forced=False) -> BatchEngine:
    return BatchEngine(model, 1, 64, torch.float32, False, speculation=Speculation(k, forced_drafts=forced))


def id_buffers(engine: BatchEngine) -> dict[str, torch.Tensor]:
    """Every token-id buffer of the engine an MTP step may embed (directly, or copied into verify_ids)."""
    return {"emitted": engine.emitted, "verify_ids": engine.mtp.verify_ids, "drafts": engine.mtp.drafts,
            "forced": engine.mtp.forced}


def test_a_fresh_engine_holds_only_valid_ids(model):
    """A capture runs before any prefill: every id buffer a step can read holds ids in [0, vocab). The old
    engine kept -1 in its tokens (the "past a" placeholder) and the warm-up embedded it: a device-side
    assert in index_select on the GPU (issue 20)."""
    engine = mtp_engine(model, 3, forced=True)
    for name, ids in id_buffers(engine).items():
        assert ((ids >= 0) & (ids < model.config.vocab_size)).all(), f"{name}: {ids.tolist()[:8]}"


def test_capture_warm_up_embeds_only_valid_ids(model):
    """The warm-up runs before each capture, eagerly on the CPU: the checked reference embedding raises a
    ValueError on any id outside the vocabulary, so this passes only if every id it embeds is valid, on a
    fresh engine and on one whose buffers hold bad ids (-1 past a, as a step leaves them; V); and it leaves
    the state's error flag clear."""
    cfg, V = SamplingConfig(), model.config.vocab_size
    engine = mtp_engine(model, 3)
    for poison in (None, -1, V):
        if poison is not None:
            engine.emitted.fill_(poison)
            engine.accepted.fill_(2)
        for k in range(engine.mtp.k_max + 1):
            engine.mtp.warm_up(1, k)
            engine.mtp.finish(1, k)
        engine.slots.slot(0).sync_position()  # raises if a warm-up flagged anything


def test_the_old_placeholder_in_a_step_is_a_clear_error_on_the_cpu(model):
    """What the warm-up did before the fix, on the CPU: the pending token -1 reaches an embedding (the MTP
    block's, of its pair), whose reference names the bad id (not an IndexError from deep in torch, nor a
    silent read of the last row, as the Q8_0 table's reference did)."""
    engine = mtp_engine(model, 1)
    engine.slots.slot(0).device_position.fill_(1)
    engine.emitted.fill_(-1)
    engine.accepted.zero_()
    with pytest.raises(ValueError, match=r"q8_0_embedding: token id -1 \(row 0 of 1\) is outside the vocabulary"):
        engine.mtp.verify(1, 1)


# --------------------------------------------------------------------------------------------------
# Many slots: B sequences drafting and verifying together (B*(k+1) verify rows), joining and leaving
# --------------------------------------------------------------------------------------------------

def slot_prompts(count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 500, (n,), generator=g, dtype=torch.int32)
            for n in torch.randint(2, 14, (count,), generator=g).tolist()]


def drafts_for(mode: str, sequence: list[int]) -> list[int]:
    """Forced drafts from a sequence's plain greedy history: right, wrong, or every third wrong."""
    if mode == "perfect":
        return sequence
    if mode == "wrong":
        return [(t + 1) % 500 for t in sequence]
    return [t if i % 3 else (t + 1) % 500 for i, t in enumerate(sequence)]


def run_slots(engine: BatchEngine, sequences: list, drafts: list | None = None, chunk_size: int = 4) -> None:
    """run_batch's loop (admissions one at a time, prefill chunks between steps), with sequence j's forced drafts
    drafts[j] (a token sequence indexed by position) written into its slot's row as it moves in."""
    engine.capture()
    waiting, prefilling, current = deque(enumerate(sequences)), None, None
    while waiting or prefilling is not None or any(engine.active):
        if prefilling is None and waiting and engine.free_slots():
            current = waiting.popleft()
            prefilling = engine.admit(current[1], chunk_size)
        if prefilling is not None:
            try:
                next(prefilling)
            except StopIteration:
                prefilling = None
                j, seq = current
                if drafts is not None:
                    engine.mtp.forced[seq.slot, : len(drafts[j])] = torch.tensor(drafts[j], dtype=torch.int32)
        engine.step()
        engine.read(wait=False)
    engine.drain()
    for seq in sequences:
        if seq.error is not None:
            raise seq.error


def plain_tokens(model, prompt: torch.Tensor, new_tokens: int, **kwargs) -> list[int]:
    out = model.generate(prompt[None].to(model.device), max_new_tokens=new_tokens, eos_token_id=[], **kwargs)
    return out[0, prompt.shape[0]:].tolist()


def solo_plain_tokens(model, prompt: torch.Tensor, new_tokens: int, kv_dtype) -> list[int]:
    """Plain greedy of one sequence alone in a one-slot engine, prefilled in run_slots' chunks: the solo run a slot
    must equal bit for bit. (generate() prefills in one chunk; on CUDA a prompt of 8 rows or more then runs the
    int8 GEMM, whose float order differs from the GEMV's of 4-row chunks, and a near tie can flip.)"""
    seq = Sequence(prompt.to(model.device), SamplingConfig(), 0, new_tokens, StopCondition(frozenset()))
    run_slots(BatchEngine(model, 1, 64, kv_dtype, False), [seq])
    return seq.tokens


def check_slots_equal_plain(model, slots: int, count: int, k: int, forced: bool, adaptive: bool, seed: int,
                            use_graph: bool = False, kv_dtype=torch.float32):
    """count sequences (more than slots: later ones wait and join as others leave) with limits of 1 to 14 new
    tokens, through one speculative engine of `slots` slots: each gets its solo plain greedy tokens. forced: each
    sequence's drafts right, wrong or partly right (cycling through the three), asserted by its acceptance."""
    prompts = slot_prompts(count, seed)
    limits = [1 + (5 * j + seed) % 14 for j in range(count)]
    device = model.device
    plain = [solo_plain_tokens(model, p, n + MAX_DRAFT_TOKENS + 1, kv_dtype) for p, n in zip(prompts, limits)]
    modes = [("perfect", "wrong", "partial")[j % 3] for j in range(count)]
    drafts = [drafts_for(m, p.tolist() + t) for m, p, t in zip(modes, prompts, plain)] if forced else None
    engine = BatchEngine(model, slots, 64, kv_dtype, use_graph,
                         speculation=Speculation(k, adaptive=adaptive, forced_drafts=forced))
    sequences = [Sequence(p.to(device), SamplingConfig(), 0, n, StopCondition(frozenset()))
                 for p, n in zip(prompts, limits)]
    run_slots(engine, sequences, drafts)
    for j, seq in enumerate(sequences):
        assert seq.tokens == plain[j][: limits[j]], f"sequence {j} ({modes[j] if forced else 'MTP drafts'})"
        if forced and not adaptive and seq.stats.drafted:
            stats = seq.stats
            assert (stats.accepted == stats.drafted) == (modes[j] == "perfect"), (j, modes[j], stats)
            assert (stats.accepted == 0) == (modes[j] == "wrong"), (j, modes[j], stats)
    return engine


@pytest.mark.parametrize("k", [1, 3, MAX_DRAFT_TOKENS])
def test_slots_with_forced_drafts_equal_plain_greedy(model, k):
    """Four slots, seven sequences joining at different steps (buckets 1, 2 and 4 as they come and go), each with
    its own drafts: every sequence's tokens are its solo plain greedy run's, each slot accepting what its drafts
    earn (all, none, some) whatever the others accept."""
    check_slots_equal_plain(model, 4, 7, k, forced=True, adaptive=False, seed=k)


@pytest.mark.parametrize("k", [2, 4])
def test_slots_with_the_blocks_drafts_equal_plain_greedy(model, k):
    """The MTP block's own drafts, adaptive k (one for all slots, from the pooled acceptance), three slots."""
    engine = check_slots_equal_plain(model, 3, 6, k, forced=False, adaptive=True, seed=10 + k)
    assert engine.mtp.policy.steps > 0


def test_sampled_slots_equal_their_solo_speculative_runs(model):
    """Sampling with a fixed k: each sequence's tokens depend on its own logits rows, drafts and seed only, so in a
    batch of speculative slots they are its solo speculative run's (other sequences, their acceptance, when they
    joined: none of it reaches a slot's rows)."""
    cfg = SamplingConfig(do_sample=True, temperature=1.2, top_k=20)
    prompts = slot_prompts(5, 21)
    limits = [9, 4, 12, 7, 10]

    def sequences():
        return [Sequence(p, cfg, 100 + j, n, StopCondition(frozenset())) for j, (p, n) in enumerate(zip(prompts, limits))]

    speculation = Speculation(2, adaptive=False)
    together = sequences()
    run_slots(BatchEngine(model, 3, 64, torch.float32, False, speculation=speculation), together)
    for j, seq in enumerate(sequences()):
        run_slots(BatchEngine(model, 1, 64, torch.float32, False, speculation=speculation), [seq])
        assert together[j].tokens == seq.tokens, f"sequence {j}"
    assert len({tuple(seq.tokens) for seq in together}) == len(together)


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] (int64, pad 0) and attention_mask of prompts of different lengths, left padded."""
    width = max(p.shape[0] for p in prompts)
    ids, mask = torch.zeros(len(prompts), width, dtype=torch.long), torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - p.shape[0]:], mask[b, width - p.shape[0]:] = p, 1
    return ids, mask


def pin_draft_count(monkeypatch) -> None:
    """generate()'s Speculation with adaptive=False: every step drafts num_draft_tokens, whatever the batch."""
    monkeypatch.setattr(model_module, "Speculation", functools.partial(Speculation, adaptive=False))


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "fixed-k"])
def test_batched_generate_greedy_equals_plain_batched_and_solo(model, monkeypatch, adaptive):
    """generate(speculative="mtp") over four left-padded rows of different lengths, one end token for all (two
    rows stop at it, at different steps; the others run to max_new_tokens): the output is plain batched greedy's
    bit for bit, padding after each stop included, and each row is its solo speculative run; last_generation_stats
    counts each row's drafts and their sum."""
    if not adaptive:
        pin_draft_count(monkeypatch)
    prompts = [p.long() for p in slot_prompts(4, 51)]
    ids, mask = left_padded(prompts)
    width, new_tokens = ids.shape[1], 10
    free = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=[])[:, width:]
    stop = int(free[1, 4])  # row 1 stops at its fifth token; any other row holding it stops there too
    stops = [row.tolist().index(stop) + 1 if stop in row.tolist() else new_tokens for row in free]
    assert stops[1] == 5 and new_tokens in stops, stops
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=[stop], pad_token_id=0)
    plain = model.generate(ids, **kwargs)
    out = model.generate(ids, speculative="mtp", num_draft_tokens=3, **kwargs)
    stats = model.last_generation_stats
    assert torch.equal(out, plain)
    assert [s.new_tokens for s in stats.sequences] == stops
    assert all(isinstance(s, SpeculativeStats) for s in stats.sequences)
    assert stats.drafted == sum(s.drafted for s in stats.sequences) > 0
    assert stats.accepted == sum(s.accepted for s in stats.sequences)
    assert "drafts accepted" in str(stats)
    for b, p in enumerate(prompts):
        solo = model.generate(p[None], max_new_tokens=new_tokens, eos_token_id=[stop], speculative="mtp",
                              num_draft_tokens=3)
        assert out[b, width : width + stops[b]].tolist() == solo[0, p.shape[0]:].tolist(), f"row {b}"


def test_batched_generate_sampled_rows_equal_their_solo_runs(model, monkeypatch):
    """Sampled, a fixed draft count: three left-padded rows x two samples (sequence j samples with seed + j, the
    samples of a row sharing its prefill) are each the solo speculative run of its row with seed + j. (An adaptive
    count is one for all the slots of a step, from their pooled acceptance: a sampled row may then draw other
    tokens than alone, from the same distribution.)"""
    pin_draft_count(monkeypatch)
    prompts = [p.long() for p in slot_prompts(3, 52)]
    ids, mask = left_padded(prompts)
    sampling = dict(max_new_tokens=9, eos_token_id=[], do_sample=True, temperature=1.5, top_k=0, speculative="mtp",
                    num_draft_tokens=2)
    out = model.generate(ids, attention_mask=mask, num_return_sequences=2, seed=7, **sampling)
    assert model.last_generation_stats.drafted > 0
    width = ids.shape[1]
    for j in range(out.shape[0]):
        p = prompts[j // 2]
        solo = model.generate(p[None], seed=7 + j, **sampling)
        assert out[j, width:].tolist() == solo[0, p.shape[0]:].tolist(), f"sequence {j}"
    assert len({tuple(row) for row in out[:, width:].tolist()}) == out.shape[0]


def test_slots_read_behind_keep_the_rules_states(model):
    """keep_state sequences of several slots, read 3 launches behind (the GPU's read-ahead, simulated): a slot
    whose sequence has launched all its tokens runs on in the others' steps without selecting, its recurrent states
    junk (idle steps); at its end the state is rolled back to its reply but the last token, as the rule says (the
    MTP part bit for bit, the GDN states as model(ids, state=s) leaves them, to float rounding), and continuing it
    gives plain greedy's next tokens."""
    prompts = slot_prompts(5, 31)
    limits = [3, 9, 5, 11, 2]
    engine = BatchEngine(model, 3, 64, torch.float32, False, speculation=Speculation(2))
    engine.read_ahead = 3
    sequences = [Sequence(p, SamplingConfig(), 0, n, StopCondition(frozenset()), keep_state=True)
                 for p, n in zip(prompts, limits)]
    run_slots(engine, sequences)
    assert any(seq._idle_steps for seq in sequences), "no slot ran idle: the test does not test it"
    for p, n, seq in zip(prompts, limits, sequences):
        history = p.tolist() + seq.tokens
        assert seq.tokens == plain_tokens(model, p, n)
        assert_mtp_part_is_the_rules(model, seq.snapshot, history)
        reference = model.new_state(64, torch.float32)
        model(torch.tensor([history[:-1]]), state=reference)
        state = model.new_state(64, torch.float32)
        state.restore(seq.snapshot)
        torch.testing.assert_close(state.gdn_recurrent, reference.gdn_recurrent, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state.gdn_conv, reference.gdn_conv, rtol=0, atol=0)


def test_slot_policy_pools_acceptance_and_times_each_bucket():
    """One k for all slots: each slot's outcome is a trial of the pooled acceptance, a step's time counts once
    and for its bucket only; the prior of a bucket prices the verify's B*(k+1) rows (the rows kernel's cost)."""
    policy = DraftPolicy(3, adaptive=True)
    for _ in range(20):
        for a in (0, 0, 1, 0):  # four slots: 1 acceptance in 5 trials a step
            policy.record(3, a, 0.05 if a else None, slots=4)
    assert policy.accepted / policy.trials == pytest.approx(0.2, abs=0.02)
    assert policy.step_cost(4)[3] == pytest.approx(0.05, rel=0.2) and policy.seconds.keys() == {4}
    assert policy.step_cost(1) == [prior_step_cost(k) for k in range(4)]
    assert policy.next_k(4) < 3
    assert prior_step_cost(3, 16) > prior_step_cost(3, 1)  # 64 verify rows cost more, relative to 16, than 4 to 1


def mtp_part(state, position: int):
    """What the MTP rule defines of a state after `position` tokens: the block's KV rows 0..position-2 and the
    hidden carry."""
    return state.mtp_cache.k[: position - 1], state.mtp_cache.v[: position - 1], state.mtp_hidden


def assert_mtp_part_is_the_rules(model, snapshot, history: list[int]):
    """snapshot's MTP part is what model(history[:position], state=s) leaves (the rule's reference)."""
    n = snapshot.position
    reference = model.new_state(64, torch.float32)
    model(torch.tensor([history[:n]]), state=reference)
    state = model.new_state(64, torch.float32)
    state.restore(snapshot)
    for name, got, want in zip(("k", "v", "hidden"), mtp_part(state, n), mtp_part(reference, n)):
        assert torch.equal(got, want), f"{name}: the MTP part differs from the rule's ({n} tokens)"


@pytest.mark.parametrize("read_ahead", [0, 3], ids=["exact", "read-behind"])
def test_every_turn_leaves_the_mtp_part_the_rule_says(model, prompt, read_ahead):
    """Code review 2026-12-01 2.2: a plain-decode conversation left the MTP cache empty (0 of 15 rows), so a
    later speculative turn drafted blind. Now plain and speculative turns, read exactly or behind (steps past
    the stop rolled back: the GPU's read-ahead simulated), leave the state as the rule says, and a
    speculative turn after plain ones gives plain greedy's reply."""
    conversation, history = Conversation(), []
    for turn, speculative in ((prompt[0].tolist(), None), ([7, 8, 9], None), ([300, 301], "mtp"), ([5], "mtp"),
                              ([11, 12], None)):
        ids = torch.tensor([turn])
        model.generate(ids, max_new_tokens=1, eos_token_id=[], speculative=speculative)  # (builds the engine)
        model._engine.read_ahead = read_ahead
        try:
            out = model.generate(ids, max_new_tokens=7, eos_token_id=[], conversation=conversation,
                                 speculative=speculative, num_draft_tokens=2)
        finally:
            model._engine.read_ahead = 0
        history += turn
        plain = model.generate(torch.tensor([history]), max_new_tokens=7, eos_token_id=[])
        assert out[0, len(turn):].tolist() == plain[0, len(history):].tolist()
        history += out[0, len(turn):].tolist()
        assert_mtp_part_is_the_rules(model, conversation.snapshot, history)


def test_sequences_decoded_together_leave_the_mtp_part_the_rule_says(model):
    """The plain step over several slots pairs each row with its own carry: each sequence's state at its end
    (and at its prompt's end) is the rule's."""
    engine = BatchEngine(model, 3, 64, torch.float32, False)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 500, (n,), generator=g, dtype=torch.int32) for n in (5, 9, 13)]
    sequences = [Sequence(p, SamplingConfig(do_sample=True), i, 4 + 3 * i, StopCondition(frozenset()),
                          keep_state=True, snapshot_prompt=True) for i, p in enumerate(prompts)]
    run_batch(engine, sequences, chunk_size=4)  # several prefill chunks too
    for p, seq in zip(prompts, sequences):
        assert_mtp_part_is_the_rules(model, seq.prompt_snapshot, p.tolist())
        assert_mtp_part_is_the_rules(model, seq.snapshot, p.tolist() + seq.tokens)


def test_error_flag_raises_at_sync_naming_the_condition(model):
    state = model.new_state(8, torch.float32)
    V = model.config.vocab_size
    for flag, expected in ((BAD_TOKEN, rf"embedded a token id outside the vocabulary \[0, {V}\)"),
                           (BAD_POSITION, r"ran at a position outside the KV cache \(0\.\.7\)"),
                           (BAD_TOKEN | BAD_POSITION, r"vocabulary .* and ran at a position outside the KV cache")):
        state.bad_position.fill_(flag)
        with pytest.raises(RuntimeError, match=expected):
            state.sync_position()
        assert int(state.bad_position) == 0  # cleared: the next sync does not raise again
        state.sync_position()


# --------------------------------------------------------------------------------------------------
# GPU (device machine, -m cuda): the captured step graphs
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_model(model):
    path = model.config.source
    return Qwen38ForCausalLM.from_pretrained(path, device="cuda", lane="int8")


@pytest.mark.cuda
@pytest.mark.parametrize("k", [1, 3, MAX_DRAFT_TOKENS])
def test_cuda_graph_steps_equal_plain_greedy(gpu_model, prompt, k):
    """Plain greedy through its graph vs MTP steps through theirs (one engine, the step graphs captured by
    its one capture function): forced 100%, 0% and partial acceptance and the block's own drafts (adaptive),
    token for token, on the int8 lane."""
    long = gpu_model.generate(prompt, max_new_tokens=NEW_TOKENS + MAX_DRAFT_TOKENS + 1, eos_token_id=[],
                              kv_dtype=torch.float32)[0].tolist()  # the engines below keep float32 KV
    plain = long[prompt.shape[1]:][:NEW_TOKENS]
    gpu_prompt = prompt.to("cuda")
    for name, drafts in (("perfect", long), ("wrong", [(t + 1) % 500 for t in long]),
                         ("partial", [t if i % 3 else (t + 1) % 500 for i, t in enumerate(long)])):
        tokens, stats = run(forced_engine(gpu_model, drafts, k, use_graph=True), gpu_prompt)
        assert tokens == plain, name
        assert (stats.accepted == stats.drafted) == (name == "perfect"), name
    out = gpu_model.generate(gpu_prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[], speculative="mtp",
                             num_draft_tokens=k, kv_dtype=torch.float32)
    assert out[0, prompt.shape[1]:].tolist() == plain
    assert gpu_model.last_generation_stats.graph


@pytest.mark.cuda
def test_cuda_turns_leave_the_mtp_part_the_rule_says(gpu_model, prompt):
    """Through the graphs (read behind, the steps past each reply's end rolled back): plain and MTP turns of a
    conversation give plain greedy's replies and leave the MTP part as model(ids, state=s) does, to float
    rounding (a prefill's tensor-core GEMM and attention sum in another order than the steps'): every row of
    the block's cache filled, none blind."""
    conversation, history = Conversation(), []
    for turn, speculative in ((prompt[0].tolist(), None), ([7, 8, 9], None), ([300, 301], "mtp"), ([11, 12], None)):
        out = gpu_model.generate(torch.tensor([turn], device="cuda"), max_new_tokens=7, eos_token_id=[],
                                 conversation=conversation, speculative=speculative, kv_dtype=torch.float32)
        assert gpu_model.last_generation_stats.graph
        history += turn
        plain = gpu_model.generate(torch.tensor([history], device="cuda"), max_new_tokens=7, eos_token_id=[],
                                   kv_dtype=torch.float32)
        assert out[0, len(turn):].tolist() == plain[0, len(history):].tolist()
        history += out[0, len(turn):].tolist()
        n = conversation.snapshot.position
        state, reference = gpu_model.new_state(64, torch.float32), gpu_model.new_state(64, torch.float32)
        state.restore(conversation.snapshot)
        gpu_model(torch.tensor([history[:n]], device="cuda"), state=reference)
        for name, got, want in zip(("k", "v", "hidden"), mtp_part(state, n), mtp_part(reference, n)):
            error = (got - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)
            # H200 (f060907): most rows ~1e-7, the rows the decode steps wrote up to 1.02e-2 (their hidden states come
            # from the GEMV, the reference's from the prefill GEMM); a blind or misplaced row is ~1.
            assert error.max() < 3e-2, f"{name}: relative error {error.max():.3g} ({n} tokens)"


# The issue-20 checkpoint: an HF folder (dense bfloat16 on the GPU, so the trunk's embedding is the dense
# table's op, where torch's index_select was) with a small odd vocabulary, one MTP layer, shared embeddings.
SMALL_VOCAB = {"hidden_size": 192, "intermediate_size": 384, "num_hidden_layers": 4, "vocab_size": 503}


@pytest.fixture(scope="module")
def small_vocab_gpu_model(tmp_path_factory):
    folder = synthetic.write_hf_checkpoint(tmp_path_factory.mktemp("small_vocab") / "hf", SMALL_VOCAB, seed=20,
                                           form="vlm", tokenizer=False)
    model = Qwen38ForCausalLM.from_pretrained(folder, device="cuda")
    assert model.config.vocab_size == 503 and model.mtp is not None
    assert hasattr(model, "embed") and hasattr(model.mtp, "embed"), "the table must be dense (the issue's path)"
    return model


@pytest.mark.cuda
def test_cuda_small_vocab_dense_speculative_graphs_equal_plain(small_vocab_gpu_model):
    """Issue 20: speculative greedy generate() on this checkpoint (24-token prompt, 40 new tokens, k = 1, 3,
    6, graphs on) died in its first capture with a device-side assert in the trunk's index_select (the
    warm-up embedded the -1 placeholder). Now it equals plain greedy token for token, and the CUDA context
    is alive after it."""
    model = small_vocab_gpu_model
    prompt = torch.randint(0, 503, (1, 24), generator=torch.Generator().manual_seed(20)).to("cuda")
    plain = model.generate(prompt, max_new_tokens=40, eos_token_id=[])
    assert model.last_generation_stats.graph
    for k in (1, 3, 6):
        out = model.generate(prompt, max_new_tokens=40, eos_token_id=[], speculative="mtp", num_draft_tokens=k)
        stats = model.last_generation_stats
        assert stats.graph and stats.steps > 0, k
        assert out[0, 24:].tolist() == plain[0, 24:].tolist(), (
            f"k={k}: speculative greedy differs from plain greedy (dense bfloat16 cuBLAS GEMMs of 1 and k+1 rows "
            "may sum in different orders: if the first difference is a near tie, that is the cause)")
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_cuda_bad_token_in_a_replayed_step_raises_at_sync(small_vocab_gpu_model):
    """An id outside the vocabulary reaching a replayed step on the device (the pending token poked to V, or
    -1) is a NaN row and the state's flag, a RuntimeError at the next sync naming it: no device-side assert,
    so the CUDA context (in `serve`, the process) survives and the next generation is right."""
    model, cfg = small_vocab_gpu_model, SamplingConfig()
    prompt = torch.randint(0, 503, (24,), dtype=torch.int32, generator=torch.Generator().manual_seed(21)).to("cuda")

    def generations() -> list[list[int]]:
        return [model.generate(prompt[None], max_new_tokens=8, eos_token_id=[], **kwargs)[0, 24:].tolist()
                for kwargs in ({}, {"speculative": "mtp"})]

    before = generations()
    engine = BatchEngine(model, 1, 64, torch.bfloat16, True, speculation=Speculation(3, adaptive=False))
    engine.capture()
    plain, plain_step = one_sequence(model, prompt, cfg, 64, torch.bfloat16, use_graph=True)
    for bad in (503, -1):
        seq = Sequence(prompt, cfg, 0, 8, StopCondition(frozenset()))
        for _ in engine.admit(seq, 4096):
            pass
        engine.emitted.fill_(bad)  # emitted[0, accepted[0]]: the step's pending token
        engine.mtp.graphs[(1, 3)][0].replay()  # the drafts and the verify
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match=r"embedded a token id outside the vocabulary \[0, 503\)"):
            engine.slots.slot(0).sync_position()
        engine.release(seq)
        plain.tokens.fill_(bad)
        plain_step()
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="outside the vocabulary"):
            plain.slots.slot(0).sync_position()
    del engine, plain, plain_step
    assert generations() == before  # the context is alive and the model's own engines unaffected


@pytest.mark.cuda
@pytest.mark.parametrize("use_graph", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("k", [1, 3, MAX_DRAFT_TOKENS])
def test_cuda_slots_equal_plain_greedy(gpu_model, k, use_graph):
    """Many speculative slots on the GPU, through the graphs (drafts-and-verify and rollback per bucket and k, a
    selection per slot and k) and eager, read behind: four slots, nine sequences joining at different steps, forced
    right, wrong and partly right drafts; then the block's own drafts, adaptive, eight slots and twelve sequences:
    every sequence's tokens are its solo plain greedy run's, token for token, on the int8 lane."""
    check_slots_equal_plain(gpu_model, 4, 9, k, forced=True, adaptive=False, seed=k, use_graph=use_graph)
    check_slots_equal_plain(gpu_model, 8, 12, k, forced=False, adaptive=True, seed=20 + k, use_graph=use_graph)


@pytest.mark.cuda
def test_cuda_sampled_slots_equal_their_solo_speculative_runs(gpu_model):
    """test_sampled_slots_equal_their_solo_speculative_runs through the graphs: a sequence's sampled tokens in a
    batch of speculative slots (fixed k) are its solo speculative run's, bit for bit."""
    cfg = SamplingConfig(do_sample=True, temperature=1.2, top_k=20)
    prompts = [p.to("cuda") for p in slot_prompts(6, 41)]
    limits = [9, 4, 12, 7, 10, 3]

    def sequences():
        return [Sequence(p, cfg, 100 + j, n, StopCondition(frozenset())) for j, (p, n) in enumerate(zip(prompts, limits))]

    speculation = Speculation(3, adaptive=False)
    together = sequences()
    run_slots(BatchEngine(gpu_model, 4, 64, torch.float32, True, speculation=speculation), together)
    solo = BatchEngine(gpu_model, 1, 64, torch.float32, True, speculation=speculation)
    for j, seq in enumerate(sequences()):
        run_slots(solo, [seq])
        assert together[j].tokens == seq.tokens, f"sequence {j}"
