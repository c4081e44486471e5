"""Continuing a sequence: snapshot/restore, a Conversation whose turn k prefills only its own tokens, a
prefix cache, snapshots on disk; each exact against the whole history processed from scratch."""
import pathlib

import pytest
import torch

from qwen38_model import Conversation, PrefixCache, Qwen38ForCausalLM, StateSnapshot
from qwen38_model.sampling import SamplingConfig
from qwen38_model.state import KVCache
from qwen38_model.default_model import default_model_path

from engines import one_sequence

TURNS = [[5, 17, 99, 3], [42, 7], [8, 150, 23, 61, 2]]


@pytest.fixture(scope="module")
def oracle_model(oracle_dir):
    return Qwen38ForCausalLM.from_pretrained(oracle_dir / "mini-f32.gguf", device="cpu")


@pytest.fixture(scope="module")
def default_model():
    return Qwen38ForCausalLM.from_pretrained(default_model_path(), device="cpu")


def from_scratch(model, history: list[int], **kwargs) -> list[int]:
    out = model.generate(torch.tensor([history]), **kwargs)
    return out[0, len(history):].tolist()


def test_snapshot_restore_continues_exactly(oracle_model):
    model = oracle_model
    state = model.new_state(32)
    model(torch.tensor([[1, 2, 3, 4]]), state=state)
    snap = state.snapshot()
    first = model(torch.tensor([[9, 8]]), state=state).logits
    model(torch.tensor([[77, 66, 55]]), state=state)  # moves every GDN state away from the snapshot
    state.restore(snap)
    assert state.position == 4
    assert torch.equal(model(torch.tensor([[9, 8]]), state=state).logits, first)


def test_restore_keeps_the_state_tensors(oracle_model):
    """A captured CUDA graph reads the state's addresses: restore copies into them."""
    state = oracle_model.new_state(16)
    oracle_model(torch.tensor([[1, 2, 3]]), state=state)
    snap = state.snapshot()
    def addresses():
        return [t.data_ptr() for layer in state.layers for t in state.tensors(layer)]

    before = addresses()
    state.restore(snap)
    assert addresses() == before


@pytest.mark.parametrize("sampling", [dict(), dict(do_sample=True, temperature=0.8, top_k=20, seed=7,
                                                    repetition_penalty=1.2)], ids=["greedy", "sampled"])
def test_conversation_turns_prefill_only_their_tokens(oracle_model, sampling):
    model, conversation = oracle_model, Conversation()
    history = []
    for k, turn in enumerate(TURNS):
        out = model.generate(torch.tensor([turn]), max_new_tokens=6, eos_token_id=[], conversation=conversation,
                             **sampling)
        reply = out[0, len(turn):].tolist()
        # Turn 1 prefills its prompt; a later turn its own tokens plus the previous reply's last token
        # (selected from the last step's logits, never fed back through the model).
        assert model.last_generation_stats.prompt_tokens == len(turn) + (k > 0)
        history += turn
        assert reply == from_scratch(model, history, max_new_tokens=6, eos_token_id=[], **sampling)
        history += reply
        assert conversation.tokens == history


def test_conversation_after_a_stop_token(default_model):
    """A reply ended by its stop token: the stop token is history like any other."""
    model, conversation = default_model, Conversation()
    first = model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=8, conversation=conversation,
                           eos_token_id=[model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3)[0, -1].item()])
    assert first.shape[1] <= 3 + 3
    history = conversation.tokens + [11, 12]
    reply = model.generate(torch.tensor([[11, 12]]), max_new_tokens=5, eos_token_id=[], conversation=conversation)
    assert reply[0, 2:].tolist() == from_scratch(model, history, max_new_tokens=5, eos_token_id=[])


def test_read_ahead_past_a_stop_is_rolled_back(oracle_model):
    """On the GPU, graph replays run a few steps ahead of the host's stop check; the steps past a stop
    must not stay in a continued state (simulated here by a read-ahead on the CPU engine): the state is
    rewound and the reply's kept tokens prefilled, so the next turn feeds only its own tokens + 1."""
    model, conversation = oracle_model, Conversation()
    stop = model.generate(torch.tensor([TURNS[0]]), max_new_tokens=3, eos_token_id=[])[0, -1].item()
    model._engine.read_ahead = 3
    try:
        model.generate(torch.tensor([TURNS[0]]), max_new_tokens=8, eos_token_id=[stop], conversation=conversation)
        assert conversation.tokens[-1] == stop and conversation.snapshot.position == len(conversation.tokens) - 1
        reply = model.generate(torch.tensor([TURNS[1]]), max_new_tokens=5, eos_token_id=[], conversation=conversation)
        assert model.last_generation_stats.prompt_tokens == len(TURNS[1]) + 1
    finally:
        model._engine.read_ahead = 0
    history = conversation.tokens[:len(conversation.tokens) - 5]
    assert reply[0, len(TURNS[1]):].tolist() == from_scratch(model, history, max_new_tokens=5, eos_token_id=[])


def test_prefix_cache_restores_the_longest_prefix(oracle_model):
    model, cache = oracle_model, PrefixCache(max_bytes=1 << 30)
    system = [5, 17, 99, 3, 42, 7]
    out = model.generate(torch.tensor([system]), max_new_tokens=4, eos_token_id=[], prefix_cache=cache)
    cached = out[0].tolist()[:-1]  # the state holds all but the last new token
    request = cached + [8, 150, 23]
    reply = from_scratch(model, request, max_new_tokens=5, eos_token_id=[], prefix_cache=cache)
    assert model.last_generation_stats.prompt_tokens == 3 and cache.hits == 1
    cache.entries.clear()
    assert reply == from_scratch(model, request, max_new_tokens=5, eos_token_id=[])
    assert model.last_generation_stats.prompt_tokens == len(request)


def test_prefix_cache_evicts_least_recently_used(oracle_model):
    state = oracle_model.new_state(8)
    oracle_model(torch.tensor([[1, 2]]), state=state)
    snap = state.snapshot()
    cache = PrefixCache(max_bytes=2 * snap.nbytes)
    cache.put([1, 2], snap)
    cache.put([1, 3], snap)
    assert cache.longest([1, 2, 9]) is snap  # [1, 2] is now the most recently used
    cache.put([1, 4], snap)
    assert sorted(cache.entries) == [(1, 2), (1, 4)] and cache.nbytes <= cache.max_bytes


def test_prefix_cache_spills_to_host_memory(oracle_model):
    model = oracle_model
    state = model.new_state(8)
    model(torch.tensor([[1, 2]]), state=state)
    snap = state.snapshot()
    cache = PrefixCache(max_bytes=snap.nbytes, max_host_bytes=snap.nbytes)
    cache.put([1, 2], snap)
    cache.put([1, 3], snap)  # evicts [1, 2] to the host tier
    assert list(cache.entries) == [(1, 3)] and list(cache.host) == [(1, 2)]
    spilled = cache.longest([1, 2, 5])
    assert spilled is not snap and all(torch.equal(a, b) for x, y in zip(spilled.layers, snap.layers)
                                       for a, b in zip(x, y))
    cache.put([1, 4], snap)  # evicts [1, 3]: the host tier keeps only the most recent
    assert list(cache.host) == [(1, 3)]


def test_conversation_saved_and_loaded(oracle_model, tmp_path):
    model, conversation = oracle_model, Conversation()
    model.generate(torch.tensor([TURNS[0]]), max_new_tokens=4, eos_token_id=[], conversation=conversation)
    conversation.save(tmp_path / "c.safetensors")
    loaded = Conversation.load(tmp_path / "c.safetensors", model)
    assert loaded.tokens == conversation.tokens
    expected = model.generate(torch.tensor([TURNS[1]]), max_new_tokens=4, eos_token_id=[], conversation=conversation)
    assert torch.equal(model.generate(torch.tensor([TURNS[1]]), max_new_tokens=4, eos_token_id=[],
                                      conversation=loaded), expected)


def test_conversation_saved_where_it_cannot_be_is_an_error_naming_the_file(oracle_model, tmp_path):
    """A missing folder or a folder as the file: an OSError naming the path (safetensors' own error named a
    temporary file, and the chat REPL died on it)."""
    conversation = Conversation()
    oracle_model.generate(torch.tensor([TURNS[0]]), max_new_tokens=2, conversation=conversation)
    missing = tmp_path / "no" / "c.safetensors"
    with pytest.raises(FileNotFoundError, match=f"^cannot save the conversation to {missing}: no folder "
                                                f"{missing.parent}$"):
        conversation.save(missing)
    with pytest.raises(IsADirectoryError, match=f"^cannot save the conversation to {tmp_path}: it is a folder$"):
        conversation.save(tmp_path)


def test_snapshot_of_another_model_is_refused(oracle_model, default_model, tmp_path):
    state = oracle_model.new_state(8)
    oracle_model(torch.tensor([[1, 2]]), state=state)
    state.snapshot().save(tmp_path / "s.safetensors")
    with pytest.raises(ValueError, match="another model config"):
        StateSnapshot.load(tmp_path / "s.safetensors", default_model.config)
    with pytest.raises(ValueError, match="another model config"):
        default_model.new_state(8).restore(state.snapshot())
    (tmp_path / "x.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a safetensors file"):
        StateSnapshot.load(tmp_path / "x.safetensors", oracle_model.config)


def test_conversation_benchmark_runs_tiny(tmp_path):
    """`python -m benchmarks.conversation --tiny`: the script end to end on the built-in model (a smoke test of
    the script; its figures mean nothing on the CPU)."""
    import json
    import subprocess
    import sys

    from benchmarks.conversation import TINY

    out = tmp_path / "conversation.json"
    subprocess.run([sys.executable, "-m", "benchmarks.conversation", "--tiny", "--json", str(out)], check=True,
                   cwd=pathlib.Path(__file__).resolve().parents[2], capture_output=True, timeout=120)
    results = json.loads(out.read_text())
    assert len(results["turns"]) == TINY["turns"] - 1
    for turn in results["turns"]:
        # A continued turn prefills its message and the previous reply's last token; without reuse, everything.
        assert turn["conversation"]["prefilled"] == turn["prefix_cache"]["prefilled"] == TINY["message"] + 1
        assert turn["no_reuse"]["prefilled"] == turn["history"] + TINY["message"]
    snapshot = results["snapshot"]
    turns, message, reply = TINY["turns"], TINY["message"], TINY["reply"]
    assert snapshot["position"] == TINY["history"] + (turns - 1) * message + turns * reply - 1
    assert 0 < snapshot["kv_bytes"] < snapshot["bytes"] <= snapshot["file_bytes"]


# ---- on the GPU (`-m cuda`): the built-in tiny model, the captured decode graph ----------------------------

GPU_STEPS = 7


@pytest.fixture(scope="module")
def gpu_model():
    """The f32 lane with an f32 KV cache: the lane where token equality across code paths is a fair bar."""
    return Qwen38ForCausalLM.from_pretrained(default_model_path(), device="cuda", lane="f32")


def greedy_with_margin(model, ids: list[int], steps: int = GPU_STEPS) -> tuple[list[int], float]:
    """The greedy continuation, one eager forward per token through a state, and its smallest top-1 margin."""
    state = model.new_state(len(ids) + steps)
    logits = model(torch.tensor([ids]), state=state, logits_to_keep=1).logits[0, -1]
    tokens, margin = [], float("inf")
    for step in range(steps):
        top2 = logits.topk(2)
        margin = min(margin, float(top2.values[0] - top2.values[1]))
        tokens.append(int(top2.indices[0]))
        if step < steps - 1:
            logits = model(torch.tensor([[tokens[-1]]]), state=state).logits[0, -1]
    return tokens, margin


def screened(draw, margin: float = 1e-3):
    """draw(g) -> (value, the smallest top-1 margin of the greedy replies a test compares): the first of up to
    20 draws whose margin exceeds `margin`. On the GPU a prefill and decode steps may round differently (GEMM
    vs GEMV, flash vs split-K attention): screened, token equality tests the reuse of the state, not rounding."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        value, smallest = draw(g)
        if smallest > margin:
            return value
    raise AssertionError("no draw with a clear top-1 margin found")


def random_ids(model, g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()


def conversation_turns(model, lengths: list[int], history: list[int] = ()) -> list[list[int]]:
    """Turns of these lengths after `history`, each answered with GPU_STEPS greedy tokens, every reply clear."""
    def draw(g):
        turns, seen, smallest = [], list(history), float("inf")
        for n in lengths:
            turns.append(random_ids(model, g, n))
            reply, margin = greedy_with_margin(model, seen + turns[-1])
            seen += turns[-1] + reply
            smallest = min(smallest, margin)
        return turns, smallest

    return screened(draw)


def state_tensors(state) -> list[torch.Tensor]:
    return [t for layer in state.layers
            for t in ((layer.k, layer.v) if isinstance(layer, KVCache) else (layer.conv, layer.recurrent))]


SAMPLINGS = [dict(), dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=7, repetition_penalty=1.2)]


@pytest.mark.cuda
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_gpu_conversation_matches_the_whole_history(gpu_model, sampling):
    """Each turn through the captured graph prefills only its own tokens (+ the previous reply's last) and
    replies what the whole history from scratch replies. Turns across the thresholds: flash prefill above 8
    rows, the f32 lane's GEMM from 48."""
    model, conversation, history = gpu_model, Conversation(), []
    for k, turn in enumerate(conversation_turns(model, [13, 5, 9, 50, 1])):
        out = model.generate(torch.tensor([turn]), max_new_tokens=GPU_STEPS, eos_token_id=[],
                             conversation=conversation, **sampling)
        stats = model.last_generation_stats
        assert stats.graph and stats.prompt_tokens == len(turn) + (k > 0)
        reply = out[0, len(turn):].tolist()
        history += turn
        assert reply == from_scratch(model, history, max_new_tokens=GPU_STEPS, eos_token_id=[], **sampling)
        history += reply
        assert conversation.tokens == history and conversation.snapshot.position == len(history) - 1


@pytest.mark.cuda
def test_gpu_conversation_after_a_stop_with_replays_in_flight(gpu_model):
    """A stop token read while later replays already ran: their tokens must not stay in the state. The state
    is rewound to the end of the prompt and the reply's kept tokens prefilled at once, so the next turn feeds
    only its own tokens and the stop token."""
    model = gpu_model
    [first] = conversation_turns(model, [11])
    stop = greedy_with_margin(model, first, 2)[0][1]  # the reply's second token: replays run past it
    conversation = Conversation()
    model.generate(torch.tensor([first]), max_new_tokens=GPU_STEPS, eos_token_id=[stop], conversation=conversation)
    assert conversation.tokens[-1] == stop and len(conversation.tokens) <= len(first) + 2
    position = conversation.snapshot.position
    assert position == len(conversation.tokens) - 1
    [second] = conversation_turns(model, [6], conversation.tokens)
    history = conversation.tokens + second
    out = model.generate(torch.tensor([second]), max_new_tokens=GPU_STEPS, eos_token_id=[], conversation=conversation)
    assert model.last_generation_stats.prompt_tokens == len(history) - position
    assert out[0, len(second):].tolist() == from_scratch(model, history, max_new_tokens=GPU_STEPS, eos_token_id=[])


@pytest.mark.cuda
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_gpu_prefix_cache_matches_the_whole_prompt(gpu_model, sampling):
    """A chat that comes back with its history restores the previous request's end; one whose reply was
    re-rendered restores the previous prompt's end; both reply what the whole prompt from scratch replies."""
    model = gpu_model

    def draw(g):
        request, again = random_ids(model, g, 27), random_ids(model, g, 4)
        reply, m1 = greedy_with_margin(model, request)
        m2 = greedy_with_margin(model, request + reply + again)[1]
        m3 = greedy_with_margin(model, request + again)[1]
        return (request, again), min(m1, m2, m3)

    request, again = screened(draw)
    cache = PrefixCache(max_bytes=1 << 30)
    reply = from_scratch(model, request, max_new_tokens=GPU_STEPS, eos_token_id=[], prefix_cache=cache, **sampling)
    assert cache.misses == 1 and model.last_generation_stats.prompt_tokens == len(request)
    for follow_up, prefilled in ((request + reply + again, len(again) + 1), (request + again, len(again))):
        cached = from_scratch(model, follow_up, max_new_tokens=GPU_STEPS, eos_token_id=[], prefix_cache=cache,
                              **sampling)
        assert model.last_generation_stats.prompt_tokens == prefilled
        assert cached == from_scratch(model, follow_up, max_new_tokens=GPU_STEPS, eos_token_id=[], **sampling)
    assert cache.hits == 2


@pytest.mark.cuda
def test_gpu_restore_into_the_captured_graph_state(gpu_model, tmp_path):
    """A snapshot restored (from the GPU, from pinned host memory, from disk) into the engine whose decode
    graphs are captured: the graph's state tensors keep their addresses, everything restore must overwrite is
    poisoned first, and the replays after it equal the replays after the snapshot was taken, bit for bit."""
    model, cfg = gpu_model, SamplingConfig()
    prompt = torch.tensor(random_ids(model, torch.Generator().manual_seed(1), 21), dtype=torch.int32, device="cuda")
    engine, step = one_sequence(model, prompt, cfg, 96, torch.float32, use_graph=True)
    state = engine.slots.slot(0)
    addresses = [t.data_ptr() for t in state_tensors(state)]
    snapshot = state.snapshot()
    step_inputs = [engine.tokens, engine.slots.positions] + [t for t in vars(engine.samplers[0]).values()
                                                             if isinstance(t, torch.Tensor)]
    saved_inputs = [t.clone() for t in step_inputs]

    def replays() -> torch.Tensor:
        logits = []
        for _ in range(12):
            step()
            logits.append(engine.logits[0].clone())
        return torch.stack(logits)

    expected = replays()
    assert torch.isfinite(expected).all()
    snapshot.save(tmp_path / "s.safetensors")
    loaded, _ = StateSnapshot.load(tmp_path / "s.safetensors", model.config, "cuda")
    for source in (snapshot, snapshot.to_host(), loaded):
        for layer in state.layers:
            if isinstance(layer, KVCache):
                for t in (layer.k, layer.v):
                    t[:snapshot.position].fill_(float("nan"))
                    t[snapshot.position:].fill_(100.0)  # finite stale rows: attention must never read them
            else:
                layer.conv.fill_(float("nan"))
                layer.recurrent.fill_(float("nan"))
        engine.logits.fill_(float("nan"))
        state.restore(source)
        for t, saved in zip(step_inputs, saved_inputs):
            t.copy_(saved)
        assert state.position == snapshot.position
        assert torch.equal(replays(), expected)
    assert [t.data_ptr() for t in state_tensors(state)] == addresses


def test_prefix_cache_keeps_a_prompts_last_logits_for_an_exact_repeat(oracle_model):
    """whole(tokens): only an entry of exactly tokens cached with its logits (a prompt's end); a later put of the
    same state without logits keeps them; they travel to the host tier with the state and count in its bytes."""
    state = oracle_model.new_state(8)
    logits = oracle_model(torch.tensor([[1, 2]]), state=state).logits[0, -1]
    snap = state.snapshot()
    cache = PrefixCache(max_bytes=snap.nbytes + logits.numel() * 4, max_host_bytes=snap.nbytes + logits.numel() * 4)
    cache.put([1, 2], snap)
    assert cache.whole([1, 2]) is None  # no logits: longest() restores a proper prefix only
    cache.put([1, 2], snap, logits)
    cache.put([1, 2], snap)
    got, got_logits = cache.whole([1, 2])
    assert got is snap and got_logits is logits and cache.whole([1, 2, 3]) is None and cache.whole([1]) is None
    assert cache.nbytes == snap.nbytes + logits.numel() * 4
    cache.put([1, 3], snap)  # evicts [1, 2] to the host tier, logits and all
    spilled, spilled_logits = cache.whole([1, 2])
    assert spilled is not snap and torch.equal(spilled_logits, logits)
