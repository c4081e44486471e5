"""The contract: shared/oracle/mini (converted by llama.cpp's own converter) vs HF's and llama.cpp's
logits. Bars from shared/oracle/README.md; every measured figure is printed (pytest -s)."""
import pytest
import torch

from qwen38_model import Qwen38ForCausalLM

from numerics import rel_l2, row_rel_l2


def greedy(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    state = model.new_state(prompt.shape[1] + steps)
    logits = model(prompt, state=state, logits_to_keep=1).logits
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits[0, -1].argmax()))
        logits = model(torch.tensor([[tokens[-1]]]), state=state).logits
    return torch.tensor(tokens)


@pytest.fixture(scope="module", params=["hf", "mini-f32.gguf"])
def f32_model(request, oracle_dir):
    return request.param, Qwen38ForCausalLM.from_pretrained(oracle_dir / request.param, device="cpu")


def test_f32_weights_match_hf_float64(f32_model, oracle_ref):
    name, model = f32_model
    prompt = oracle_ref["prompt_ids"].long()[None]
    logits = model(prompt).logits[0]
    truth = oracle_ref["hf_logits_f64"]
    err, max_abs = rel_l2(logits, truth), float((logits.double() - truth).abs().max())
    top1 = int((logits.argmax(-1) == truth.argmax(-1)).sum())
    print(f"{name}: rel L2 vs hf_logits_f64 = {err:.2e}, max abs = {max_abs:.2e}, top-1 {top1}/24")
    assert err <= 1e-5 and max_abs <= 1e-4 and top1 == 24


def test_f32_weights_greedy_and_teacher_forced(f32_model, oracle_ref):
    name, model = f32_model
    prompt = oracle_ref["prompt_ids"].long()[None]
    expected = oracle_ref["hf_greedy"].long()
    tokens = greedy(model, prompt, len(expected))
    seq = model(oracle_ref["hf_seq_ids"].long()[None]).logits[0]
    seq_top1 = int((seq.argmax(-1) == oracle_ref["hf_seq_logits_f32"].argmax(-1)).sum())
    long_from = int(oracle_ref["hf_long_logits_from"])
    long = model(oracle_ref["hf_long_ids"].long()[None]).logits[0, long_from:]
    long_truth = oracle_ref["hf_long_logits_f32"]
    long_top1 = int((long.argmax(-1) == long_truth.argmax(-1)).sum())
    print(f"{name}: greedy {int((tokens == expected).sum())}/{len(expected)}, teacher-forced {seq_top1}/48, "
          f"long {long_top1}/80 (rel L2 {rel_l2(long, long_truth):.2e})")
    assert torch.equal(tokens, expected) and seq_top1 == 48 and long_top1 == 80


@pytest.mark.parametrize("kind", ["q8", "bf16"])
def test_dequantizing_lane_matches_hf_on_gguf_weights(oracle_dir, oracle_ref, kind):
    file = {"q8": "mini-q8_0.gguf", "bf16": "mini-bf16.gguf"}[kind]
    model = Qwen38ForCausalLM.from_pretrained(oracle_dir / file, device="cpu", lane="f32")
    logits = model(oracle_ref["prompt_ids"].long()[None]).logits[0]
    err = rel_l2(logits, oracle_ref[f"hf_logits_f32_from_{kind}gguf"])
    print(f"{file} (f32 lane): rel L2 vs hf_logits_f32_from_{kind}gguf = {err:.2e}")
    assert err <= 1e-5


def test_int8_lane_reproduces_llama_cpp(oracle_dir, oracle_ref):
    model = Qwen38ForCausalLM.from_pretrained(oracle_dir / "mini-q8_0.gguf", device="cpu", lane="int8")
    logits = model(oracle_ref["prompt_ids"].long()[None]).logits[0]
    rows = row_rel_l2(logits, oracle_ref["llama_logits_q8gguf"])
    print(f"int8 lane vs llama_logits_q8gguf: median per-position rel L2 = {rows.median():.2e}, "
          f"max = {rows.max():.2e}")
    assert rows.median() <= 1e-5


def test_two_word_lane_close_to_dequantized(oracle_dir, oracle_ref):
    model = Qwen38ForCausalLM.from_pretrained(oracle_dir / "mini-q8_0.gguf", device="cpu", lane="int8x2")
    logits = model(oracle_ref["prompt_ids"].long()[None]).logits[0]
    err = rel_l2(logits, oracle_ref["hf_logits_f32_from_q8gguf"])
    print(f"int8x2 lane vs hf_logits_f32_from_q8gguf: rel L2 = {err:.2e}")
    assert err <= 1e-3


def test_quantize_at_load_equals_q8_gguf(oracle_dir):
    """quantize="q8_0" on the bf16 HF folder gives the Q8_0 GGUF's weights: quants and scales bit for bit;
    float32 small tensors within float32 rounding (-exp(A_log) is computed by torch here, numpy there)."""
    ours = Qwen38ForCausalLM.from_pretrained(oracle_dir / "hf", device="cpu", quantize="q8_0")
    gguf = Qwen38ForCausalLM.from_pretrained(oracle_dir / "mini-q8_0.gguf", device="cpu")
    a, b = dict(ours.named_buffers()), dict(gguf.named_buffers())
    assert a.keys() == b.keys()
    packed = [name for name in a if name.endswith(("_q", "_d"))]
    assert len(packed) == 2 * (2 + 6 * 4 + 2 * 4)  # embed, head; 4 matrices a layer (GDN: b|a rows in qkvz)
    worst = 0.0
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        if name in packed:
            assert torch.equal(a[name], b[name]), name
        else:
            worst = max(worst, float(((a[name] - b[name]).abs() / b[name].abs().clamp_min(1e-30)).max()))
    print(f"quantize='q8_0' vs mini-q8_0.gguf: {len(packed)} packed tensors identical; "
          f"float tensors max rel diff {worst:.1e}")
    assert worst <= 2 ** -23
