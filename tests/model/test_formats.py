"""Formats as types, decided at load (qwen38_model/formats.py): make_linear types a linear by its loaded weight;
each producer is built writing its consumer's activation format, and every linear call in every path (chunked
prefill, the MTP block, plain decode, a speculative step with a reduced draft head) gets exactly that format,
also in a model whose matrices are partly dense; a bad lane or a weight of the wrong format is an error at load."""
import pytest
import torch

from qwen38_model import Qwen38ForCausalLM, synthetic
from qwen38_model.checkpoint import Q8Tensor, open_checkpoint
from qwen38_model.formats import QK, ActFormat
from qwen38_model.layers import DenseLinear, Q8Linear, make_linear

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "head_dim": 32,
         "linear_key_head_dim": 32, "linear_value_head_dim": 32, "full_attention_interval": 2}
# Matrices left dense in the mixed model, one behind each kind of producer: layer 0 (GDN) the MLP's down
# (silu_mul) and the GDN output (gated norm), layer 1 (attention) the output projection (the output gate),
# layer 2 (GDN) a part of each fused input group (the two norms), the MTP block's eh_proj (its concat), and
# the LM head (the final norm, the MTP block's output norm, and the draft head).
DENSE_PARTS = {("ffn_down", 0), ("ssm_out", 0), ("attn_output", 1), ("attn_gate", 2), ("ffn_up", 2),
               ("nextn.eh_proj", 4), ("output", None)}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return synthetic.write_hf_checkpoint(tmp_path_factory.mktemp("formats") / "hf", SMALL, seed=7, form="vlm")


def q8_weight(rows: int = 4, cols: int = 2 * QK) -> Q8Tensor:
    return Q8Tensor.quantize(torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)))


def build(hf, lane: str, mixed: bool) -> Qwen38ForCausalLM:
    """The HF checkpoint quantized to Q8_0 at load; mixed: DENSE_PARTS stay dense (float32)."""
    checkpoint = open_checkpoint(hf)
    if mixed:
        load = checkpoint.load  # load_fused reads each part through this instance attribute too

        def load_some_dense(part, layer, device, dtype, quantize):
            return load(part, layer, device, dtype, None if (part, layer) in DENSE_PARTS else quantize)

        checkpoint.load = load_some_dense
    with torch.no_grad():
        return Qwen38ForCausalLM(checkpoint.config, checkpoint, "cpu", torch.float32, "q8_0", lane).eval()


@pytest.mark.parametrize("lane", list(ActFormat))
def test_make_linear_types_a_linear_by_its_weight(lane):
    q8 = make_linear(q8_weight(), lane, "lm_head")
    assert type(q8) is Q8Linear and q8.input_format is lane
    for dtype in (torch.float32, torch.bfloat16):
        dense = make_linear(torch.randn(4, 2 * QK, dtype=dtype), lane, "lm_head")
        assert type(dense) is DenseLinear and dense.input_format is ActFormat.F32  # whatever the lane


def test_formats_are_the_lane_names():
    """from_pretrained(lane=) and the command line's --lane take these names."""
    assert [f.value for f in ActFormat] == ["f32", "int8", "int8x2"]
    assert ActFormat("int8x2") is ActFormat.INT8X2 and ActFormat.INT8 == "int8"


def test_producers_write_their_consumers_format_fixed_at_build(hf):
    """In the mixed int8 model each producer's format is set at build from the linear it feeds: float32
    before a dense matrix, int8 before a Q8_0 one, even within one layer."""
    model = build(hf, "int8", mixed=True)
    F32, INT8 = ActFormat.F32, ActFormat.INT8
    gdn0, attn1, gdn2, attn3 = model.layers
    assert (gdn0.mixer_in_format, gdn0.mixer.normed_format, gdn0.mlp_in_format, gdn0.mlp.hidden_format) == (
        INT8, F32, INT8, F32)
    assert (attn1.mixer_in_format, attn1.mixer.gated_format, attn1.mlp.hidden_format) == (INT8, F32, INT8)
    assert (gdn2.mixer_in_format, gdn2.mixer.normed_format, gdn2.mlp_in_format) == (F32, INT8, F32)
    assert (attn3.mixer_in_format, attn3.mixer.gated_format, attn3.mlp_in_format) == (INT8, INT8, INT8)
    # One dense part makes its fused group dense.
    assert type(gdn2.mixer.qkvz) is DenseLinear and type(gdn2.mlp.gate_up) is DenseLinear
    assert (model.final_norm_format, model.mtp.eh_in_format, model.mtp.out_format) == (F32, F32, F32)
    assert model.mtp.layer.mixer_in_format is INT8 and type(model.lm_head) is DenseLinear


@pytest.mark.parametrize("mixed", [False, True], ids=["q8_0", "mixed"])
@pytest.mark.parametrize("lane", list(ActFormat))
def test_every_linear_call_gets_its_format(hf, lane, mixed, monkeypatch):
    """Every call of every linear (the draft head too) in the paths that run them: its input is in the
    linear's input_format, with exactly that format's buffers."""
    model = build(hf, lane, mixed)
    calls = []
    for cls in (Q8Linear, DenseLinear):
        def recorded(self, act, scratch, forward=cls.forward):
            calls.append((self.scratch_role, self.input_format, act.format,
                          tuple(t is not None for t in act.outs())))
            return forward(self, act, scratch)

        monkeypatch.setattr(cls, "forward", recorded)
    ids = torch.randint(0, 500, (1, 13), generator=torch.Generator().manual_seed(2))
    model(ids, return_mtp_logits=True)
    state = model.new_state(16, torch.float32)
    model.prefill(ids[0].to(torch.int32), state.reserve(13), state, chunk_size=5)
    model.generate(ids, max_new_tokens=3, eos_token_id=[], seed=0)
    model.generate(ids, max_new_tokens=4, eos_token_id=[], seed=0, speculative="mtp", num_draft_tokens=2,
                   draft_vocab_size=100)
    buffers = {ActFormat.F32: (True, False, False, False), ActFormat.INT8: (True, True, False, True),
               ActFormat.INT8X2: (True, True, True, True)}
    for role, linear_format, act_format, present in calls:
        assert act_format is linear_format and present == buffers[linear_format], role
    roles = {role for role, *_ in calls}
    assert {"lm_head", "mtp.eh_proj", "mtp.draft_head", "mtp.mlp.down", "gdn.out", "attn.out"} <= roles
    expected = ActFormat.F32 if mixed else lane
    assert {f for role, f, *_ in calls if role in ("lm_head", "mtp.draft_head")} == {expected}


def test_a_bad_lane_or_weight_is_an_error_at_load(hf):
    with pytest.raises(ValueError, match=r"lane must be one of \['f32', 'int8', 'int8x2'\], found 'int4'"):
        Qwen38ForCausalLM.from_pretrained(hf, device="cpu", lane="int4")
    with pytest.raises(ValueError, match="lane must be one of"):
        make_linear(q8_weight(), "int4", "mlp.down")
    with pytest.raises(TypeError, match="mlp.down: Q8Linear takes a Q8Tensor, found Tensor"):
        Q8Linear(torch.randn(4, 2 * QK), ActFormat.INT8, "mlp.down")
    with pytest.raises(TypeError, match="lm_head: DenseLinear takes a dense tensor, found Q8Tensor"):
        DenseLinear(q8_weight(), "lm_head")
    w = q8_weight()
    with pytest.raises(ValueError, match=r"gdn.out: a Q8_0 weight is .* found quants \(4, 64\) torch.int8 and "
                                         r"scales \(4, 1\)"):
        Q8Linear(Q8Tensor(w.q, w.d[:, :1]), ActFormat.INT8, "gdn.out")
