"""Continuing a sequence: snapshot/restore, a Conversation whose turn k prefills only its own tokens, a
prefix cache, snapshots on disk; each exact against the whole history processed from scratch."""
import pytest
import torch

from qwen38_model import Conversation, PrefixCache, Qwen38ForCausalLM, StateSnapshot
from qwen38_model.synthetic import default_model_path

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
    before = [t.data_ptr() for layer in state.layers for t in vars(layer).values()]
    state.restore(snap)
    assert [t.data_ptr() for layer in state.layers for t in vars(layer).values()] == before


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
    must not stay in a continued state (simulated here by a read-ahead on the CPU engine)."""
    model, conversation = oracle_model, Conversation()
    stop = model.generate(torch.tensor([TURNS[0]]), max_new_tokens=3, eos_token_id=[])[0, -1].item()
    model._engine.read_ahead = 3
    try:
        model.generate(torch.tensor([TURNS[0]]), max_new_tokens=8, eos_token_id=[stop], conversation=conversation)
        assert conversation.tokens[-1] == stop and conversation.snapshot.position == len(TURNS[0])
        reply = model.generate(torch.tensor([TURNS[1]]), max_new_tokens=5, eos_token_id=[], conversation=conversation)
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
