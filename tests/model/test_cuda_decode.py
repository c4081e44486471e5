"""The model on the GPU (device machine, `-m cuda`): lane bars on the oracle, greedy tokens, prefill vs
decode, and the captured decode graph replaying bit for bit what eager launches compute."""
import pytest
import torch

from qwen38_model import Qwen38ForCausalLM
from qwen38_model.layers import INT_GEMM_MIN_ROWS
from qwen38_model.sampling import SamplingConfig

from engines import one_sequence
from numerics import rel_l2, row_rel_l2

pytestmark = pytest.mark.cuda


def test_kernels_are_registered():
    import qwen38_ops

    assert qwen38_ops.cuda_kernels_available()


@pytest.fixture(scope="module")
def prompt(oracle_ref):
    return oracle_ref["prompt_ids"].long()[None]


@pytest.mark.parametrize("file", ["hf", "mini-f32.gguf"])
def test_f32_weights_on_gpu(oracle_dir, oracle_ref, prompt, file):
    model = Qwen38ForCausalLM.from_pretrained(oracle_dir / file, device="cuda", dtype=torch.float32)
    logits = model(prompt).logits[0]
    err = rel_l2(logits, oracle_ref["hf_logits_f64"])
    print(f"GPU {file}: rel L2 vs hf_logits_f64 = {err:.2e}")
    assert err <= 1e-5
    out = model.generate(prompt, max_new_tokens=24, eos_token_id=[], kv_dtype=torch.float32)
    assert torch.equal(out[0, 24:].cpu(), oracle_ref["hf_greedy"].long())


@pytest.mark.parametrize("lane, key, bar", [("f32", "hf_logits_f32_from_q8gguf", 1e-5),
                                            ("int8", "llama_logits_q8gguf", 1e-5),
                                            ("int8x2", "hf_logits_f32_from_q8gguf", 1e-3)])
def test_q8_lanes_on_gpu(oracle_dir, oracle_ref, prompt, lane, key, bar):
    model = Qwen38ForCausalLM.from_pretrained(oracle_dir / "mini-q8_0.gguf", device="cuda", lane=lane)
    logits = model(prompt).logits[0]
    rows = row_rel_l2(logits, oracle_ref[key])
    measure = float(rows.median()) if lane == "int8" else rel_l2(logits, oracle_ref[key])
    print(f"GPU {lane} lane vs {key}: {'median per-position ' if lane == 'int8' else ''}rel L2 = {measure:.2e}")
    assert measure <= bar


def check_lane_bar(lane, logits, full, oracle_ref, what):
    """f32: rel L2 <= 1e-5 against the one-pass forward. int8: the lane's own bar, median per-position rel
    L2 <= 1e-5 against llama.cpp's logits. (Comparing int8 runs with each other would not be a bar: any
    float reordering -- GEMM vs GEMV, chunked vs per-token delta rule -- can round a later activation to
    the other q8_0 level, and llama.cpp's own prefill and decode kernels differ the same way.)"""
    if lane == "f32":
        err = rel_l2(logits, full)
        print(f"GPU f32: {what} vs one forward: rel L2 {err:.2e}")
        assert err <= 1e-5
    else:
        rows = row_rel_l2(logits, oracle_ref["llama_logits_q8gguf"])
        print(f"GPU int8: {what} vs llama.cpp: per-position rel L2 median {float(rows.median()):.2e}, "
              f"max {float(rows.max()):.2e}")
        assert float(rows.median()) <= 1e-5


@pytest.mark.parametrize("lane", ["f32", "int8"])
@pytest.mark.parametrize("split", [INT_GEMM_MIN_ROWS - 1, INT_GEMM_MIN_ROWS, INT_GEMM_MIN_ROWS + 1, 17])
def test_prefill_then_decode_holds_the_lane_bar_on_gpu(oracle_dir, oracle_ref, prompt, lane, split):
    """A prefill of `split` tokens (around the GEMV/GEMM and per-token/chunked delta-rule thresholds), then
    one token per call."""
    model = Qwen38ForCausalLM.from_pretrained(oracle_dir / "mini-q8_0.gguf", device="cuda", lane=lane)
    full = model(prompt).logits[0]
    state = model.new_state(prompt.shape[1], torch.float32)  # the lane bars assume float32 KV
    parts = [model(prompt[:, :split], state=state).logits[0]]
    parts += [model(prompt[:, t : t + 1], state=state).logits[0] for t in range(split, prompt.shape[1])]
    check_lane_bar(lane, torch.cat(parts), full, oracle_ref, f"prefill({split}) + decode")


@pytest.mark.parametrize("lane", ["f32", "int8"])
@pytest.mark.parametrize("chunk", [5, 8, 23])
def test_chunked_prefill_holds_the_lane_bar_on_gpu(oracle_dir, oracle_ref, prompt, lane, chunk):
    """The prompt through model.prefill in chunks of `chunk` tokens (each chunk a separate pass of every
    kernel, continuing the state), all rows kept."""
    model = Qwen38ForCausalLM.from_pretrained(oracle_dir / "mini-q8_0.gguf", device="cuda", lane=lane)
    ids = prompt[0].cuda().to(torch.int32)
    one = model.prefill(ids, *_fresh(model, ids))
    chunked = model.prefill(ids, *_fresh(model, ids), chunk_size=chunk)
    check_lane_bar(lane, chunked, one, oracle_ref, f"chunks of {chunk}")


def _fresh(model, ids):
    state = model.new_state(ids.shape[0], torch.float32)  # the lane bars assume float32 KV
    return state.reserve(ids.shape[0]), state


def step_logits(model, prompt, cfg, kv, steps: int, use_graph: bool) -> torch.Tensor:
    engine, step = one_sequence(model, prompt, cfg, 128, kv, use_graph, seed=7)
    out = []
    for _ in range(steps):
        step()
        out.append(engine.logits[0].clone())
    torch.cuda.synchronize()
    return torch.stack(out)


@pytest.mark.parametrize("lane, kv", [("f32", torch.float32), ("int8", torch.bfloat16)])
def test_graph_replay_equals_eager_bit_for_bit(oracle_dir, prompt, lane, kv):
    model = Qwen38ForCausalLM.from_pretrained(oracle_dir / "mini-q8_0.gguf", device="cuda", lane=lane)
    cfg = SamplingConfig()
    p = prompt[0].cuda().to(torch.int32)
    a = step_logits(model, p, cfg, kv, 64, use_graph=False)
    b = step_logits(model, p, cfg, kv, 64, use_graph=True)
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_sampling_on_gpu_is_reproducible(oracle_dir, prompt):
    model = Qwen38ForCausalLM.from_pretrained(oracle_dir / "mini-q8_0.gguf", device="cuda", lane="int8")
    kwargs = dict(max_new_tokens=32, do_sample=True, temperature=0.9, top_p=0.95, eos_token_id=[])
    a = model.generate(prompt, seed=1, **kwargs)
    b = model.generate(prompt, seed=1, **kwargs)
    c = model.generate(prompt, seed=2, **kwargs)
    assert model.last_generation_stats.graph
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_conversation_through_the_graph_continues_exactly(oracle_dir):
    """Turns continued through the captured graph: restore copies into the engine's buffers (the graph
    keeps its addresses), the read-ahead replays past a stop are undone, and each reply is the one the
    whole history gives from scratch."""
    from qwen38_model import Conversation

    model = Qwen38ForCausalLM.from_pretrained(oracle_dir / "mini-f32.gguf", device="cuda", dtype=torch.float32,
                                              lane="f32")
    turns = [[5, 17, 99, 3], [42, 7], [8, 150, 23, 61, 2]]
    first = model.generate(torch.tensor([turns[0]]), max_new_tokens=3, eos_token_id=[])[0, len(turns[0]):].tolist()
    stop = first[-1]
    slot = model._engine.slots.slot(0)
    addresses = [t.data_ptr() for layer in slot.layers for t in slot.tensors(layer)]
    conversation, history = Conversation(), []
    for k, turn in enumerate(turns):
        out = model.generate(torch.tensor([turn]), max_new_tokens=8, eos_token_id=[stop], conversation=conversation)
        stats = model.last_generation_stats
        assert stats.graph
        if k == 1:  # turn 0 stopped with replays in flight: undone, its reply prefilled then, not now
            assert stats.prompt_tokens == len(turn) + 1
        reply = out[0, len(turn):].tolist()
        history += turn
        scratch = model.generate(torch.tensor([history]), max_new_tokens=8, eos_token_id=[stop])
        assert reply == scratch[0, len(history):].tolist()
        history += reply
        assert conversation.tokens == history
    slot = model._engine.slots.slot(0)
    assert [t.data_ptr() for layer in slot.layers for t in slot.tensors(layer)] == addresses


def test_kv_cache_defaults_to_bfloat16_on_cuda(oracle_dir, prompt):
    """The default a user runs is the one the README's speed figures use."""
    from qwen38_model.state import KVCache

    model = Qwen38ForCausalLM.from_pretrained(oracle_dir / "mini-q8_0.gguf", device="cuda")
    model.generate(prompt, max_new_tokens=2, eos_token_id=[])
    for state in (model._engine.slots.slot(0), model.new_state(8)):
        caches = [layer for layer in state.layers if isinstance(layer, KVCache)]
        assert caches and all(c.k.dtype == c.v.dtype == torch.bfloat16 for c in caches)
