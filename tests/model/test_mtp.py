"""The MTP (nextn) block against an independent float64 reference composed from transformers' own Qwen3.5
modules (a full-attention Qwen3_5DecoderLayer, Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding), the checkpoint's
mtp.* tensors and transformers' own trunk hidden after the final norm; quantized files and activation
lanes against our f32 path on the same dequantized weights; the converter's MTP output; loading errors.
Every measured figure is printed (pytest -s)."""
import json
import shutil

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch

from qwen38_model import CheckpointError, Qwen38ForCausalLM, StateSnapshot, convert, synthetic
from qwen38_model.scratch import Scratch

from conftest import require
from gguf_copies import rewrite_gguf
from numerics import rel_l2

transformers = require("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen  # noqa: E402

# Value/key head ratio 3 and GQA 2 as in the 27B; every matrix dimension a multiple of 32 (Q8_0 blocks);
# head_dim 32 (the GPU attention kernels take 32, 64, 128, 256); attention at layers 1 and 3, so the MTP
# block is blk.4.
SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "head_dim": 32,
         "linear_key_head_dim": 32, "linear_value_head_dim": 32, "full_attention_interval": 2}
PROMPT_LENGTH = 13


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The released (VLM) form with its MTP block in float32, and GGUFs converted from it with the block."""
    root = tmp_path_factory.mktemp("mtp")
    hf = synthetic.write_hf_checkpoint(root / "hf", SMALL, seed=11, form="vlm")
    paths = {"hf": hf}
    for qtype in ("f32", "q8_0", "bf16"):
        paths[qtype] = convert.hf_to_gguf(hf, root / f"{qtype}.gguf", qtype, model_name="mtp", mtp=True)
        paths[f"{qtype}-dequantized"] = dequantized_copy(paths[qtype], root / f"{qtype}-dequantized.gguf")
    return paths


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 500, (1, PROMPT_LENGTH), generator=torch.Generator().manual_seed(3))


def transformers_mtp_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    """float64 [T-1, V]: row t = lm_head(norm(layer(fc[enorm(E x_{t+1}) ; hnorm(h_t)]))) at position t, h =
    transformers' own trunk output after its final norm, every module transformers' own."""
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float64,
                                                            attn_implementation="eager").eval()
    config = model.config
    weights = {k: v.double() for k, v in safetensors.torch.load_file(folder / "model.safetensors").items()
               if k.startswith("mtp.")}

    def norm(name):
        module = hf_qwen.Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps).double()
        module.weight.data = weights[name]
        return module

    attention_layer = config.layer_types.index("full_attention")  # any: only the layer's kind is read
    layer = hf_qwen.Qwen3_5DecoderLayer(config, attention_layer).double().eval()
    prefix = "mtp.layers.0."
    layer.load_state_dict({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)})
    rotary = hf_qwen.Qwen3_5TextRotaryEmbedding(config)
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state  # after the final norm
        embedded = model.model.embed_tokens(ids[:, 1:])
        fused = torch.cat([norm("mtp.pre_fc_norm_embedding.weight")(embedded),
                           norm("mtp.pre_fc_norm_hidden.weight")(hidden[:, :-1])], dim=-1)
        x = fused @ weights["mtp.fc.weight"].T
        positions = torch.arange(x.shape[1])[None]
        causal = torch.full((x.shape[1], x.shape[1]), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        y = layer(x, position_embeddings=rotary(x, positions), attention_mask=causal, position_ids=positions)
        return model.lm_head(norm("mtp.norm.weight")(y))[0]


def dequantized_copy(src, dst):
    """The GGUF with every Q8_0/BF16/F16 tensor stored as the float32 values it holds: the same weights for
    the exact f32 path (dense matrices)."""
    def dequantize(t):
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            return np.asarray(t.data), t.tensor_type
        return gguf.quants.dequantize(t.data, t.tensor_type), gguf.GGMLQuantizationType.F32
    # All F32 now: general.file_type says so, as the loader checks it against the tensors.
    return rewrite_gguf(src, dst, {"general.file_type": (int(gguf.LlamaFileType.ALL_F32), gguf.GGUFValueType.UINT32,
                                                         None)},
                        lambda tensors: {name: dequantize(t) for name, t in tensors.items()})


def poisoned_state(model, length: int):
    """A fresh state whose MTP KV cache holds NaN: a row the block reads before writing shows."""
    state = model.new_state(length, torch.float32)  # the exactness lane, on every device
    state.mtp_cache.k.fill_(float("nan"))
    state.mtp_cache.v.fill_(float("nan"))
    return state


def mtp_row_by_row(model, ids, state, scratch):
    """The trunk over ids [1, T] on state, then the MTP block one pair (h_t, x_{t+1}) at a time (decode
    attention, the GEMV: the speculative engine's draft call). Returns the T-1 rows of MTP logits, and the
    last call's act and the positions (for a further draft step)."""
    tokens = ids[0].to(model.device, torch.int32)
    positions = state.reserve(tokens.shape[0])
    normed = model.final_norm(*model.trunk(tokens, positions, state, scratch), scratch).x.clone()
    rows = []
    for t in range(tokens.shape[0] - 1):
        act = model.mtp(normed[t : t + 1], tokens[t + 1 : t + 2], positions[t : t + 1], state.mtp_cache, scratch)
        rows.append(model.lm_head(act, scratch).clone())
    return torch.cat(rows), act, positions


# --------------------------------------------------------------------------------------------------
# f32 path vs transformers
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(files, ids):
    return transformers_mtp_logits(files["hf"], ids)


@pytest.mark.parametrize("source", ["hf", "f32"])
def test_mtp_logits_match_transformers_float64(files, ids, reference, source):
    model = Qwen38ForCausalLM.from_pretrained(files[source], device="cpu", lane="f32")
    assert model.mtp is not None
    out = model(ids, state=poisoned_state(model, PROMPT_LENGTH), return_mtp_logits=True)
    assert out.mtp_logits.shape == (1, PROMPT_LENGTH - 1, model.config.vocab_size)
    assert out.mtp_logits.dtype == torch.float32
    err = rel_l2(out.mtp_logits[0], reference)
    print(f"{source}: MTP logits vs transformers float64 composition: rel L2 {err:.2e}")
    assert err <= 1e-5
    assert torch.equal(model(ids, return_mtp_logits=True).mtp_logits, out.mtp_logits)  # no state: the same


def test_the_hidden_is_the_normed_one(files, ids, reference):
    """The reference would not be met by the residual stream before the final norm (a seed note's claim):
    the bar above tells the two apart."""
    model = Qwen38ForCausalLM.from_pretrained(files["hf"], device="cpu", lane="f32")
    scratch = Scratch("cpu")
    state = model.new_state(PROMPT_LENGTH)
    positions = state.reserve(PROMPT_LENGTH)
    tokens = ids[0].to(torch.int32)
    residual, delta = model.trunk(tokens, positions, state, scratch)
    unnormed = (residual + delta)[:-1].clone()
    act = model.mtp(unnormed, tokens[1:], positions[:-1], state.mtp_cache, scratch)
    err = rel_l2(model.lm_head(act, scratch), reference)
    print(f"MTP fed the un-normed residual stream: rel L2 {err:.2e} vs the reference")
    assert err > 1e-2


# --------------------------------------------------------------------------------------------------
# The state: continuation, the step API, snapshots
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def f32_model(files):
    return Qwen38ForCausalLM.from_pretrained(files["hf"], device="cpu", lane="f32")


def test_continued_state_keeps_the_block_in_step(f32_model, ids):
    """Two calls on one state: each returns its own pairs; the pair that straddles them (the first call's
    last hidden, the second call's first token) is still written into the block's cache, else every later
    row would attend to a hole."""
    full = f32_model(ids, return_mtp_logits=True).mtp_logits[0]
    state = poisoned_state(f32_model, PROMPT_LENGTH)
    first = f32_model(ids[:, :5], state=state, return_mtp_logits=True)
    second = f32_model(ids[:, 5:], state=state, return_mtp_logits=True)
    assert first.mtp_logits.shape[1] == 4 and second.mtp_logits.shape[1] == PROMPT_LENGTH - 6
    err = rel_l2(torch.cat([first.mtp_logits[0], second.mtp_logits[0]]), torch.cat([full[:4], full[5:]]))
    print(f"prefill(5) + prefill(8) vs one call: MTP rel L2 {err:.2e}")
    assert err <= 1e-6
    kept = f32_model(ids, return_mtp_logits=True, logits_to_keep=3)
    assert kept.logits.shape[1] == 3 and torch.equal(kept.mtp_logits[0], full[-3:])


def test_calls_without_mtp_logits_keep_the_cache_too(f32_model, ids):
    full = f32_model(ids, return_mtp_logits=True).mtp_logits[0]
    state = poisoned_state(f32_model, PROMPT_LENGTH)
    f32_model(ids[:, :7], state=state)
    out = f32_model(ids[:, 7:], state=state, return_mtp_logits=True).mtp_logits[0]
    assert rel_l2(out, full[7:]) <= 1e-6


def test_draft_steps_through_the_block_api(f32_model, ids):
    """MTPBlock.forward one row at a time (the decode attention path, the speculative engine's call) equals
    the teacher-forced rows; a draft step feeds act.x back as the hidden."""
    full = f32_model(ids, return_mtp_logits=True).mtp_logits[0]
    scratch = Scratch("cpu")
    state = poisoned_state(f32_model, PROMPT_LENGTH + 1)
    rows, act, positions = mtp_row_by_row(f32_model, ids, state, scratch)
    err = rel_l2(rows, full)
    print(f"MTPBlock.forward row by row vs teacher-forced: rel L2 {err:.2e}")
    assert err <= 1e-6
    # The last row drafted token T from (h_{T-2}, x_{T-1}) at T-2; the next draft step pairs the block's own
    # output with that token at T-1 (the cache's row T-1 is still NaN: it must be written before it is read).
    hidden = act.x.clone()
    draft = f32_model.lm_head(act, scratch).argmax(-1).to(torch.int32)
    act = f32_model.mtp(hidden, draft, positions[-1:], state.mtp_cache, scratch)
    assert act.x.shape == hidden.shape and bool(torch.isfinite(f32_model.lm_head(act, scratch)).all())
    assert not torch.equal(act.x, hidden)


def test_snapshot_restore_and_file_hold_the_block(f32_model, ids, tmp_path):
    state = f32_model.new_state(PROMPT_LENGTH)
    f32_model(ids[:, :6], state=state)
    snap = state.snapshot()
    assert snap.mtp is not None and snap.mtp[0].shape[0] == 6
    after = f32_model(ids[:, 6:], state=state, return_mtp_logits=True).mtp_logits
    state.restore(snap)
    assert torch.equal(f32_model(ids[:, 6:], state=state, return_mtp_logits=True).mtp_logits, after)
    snap.save(tmp_path / "s.safetensors", {"tokens": ids[0]})
    loaded, extra = StateSnapshot.load(tmp_path / "s.safetensors", f32_model.config)
    assert list(extra) == ["tokens"] and all(torch.equal(a, b) for a, b in zip(loaded.mtp, snap.mtp))
    state.restore(loaded)
    assert torch.equal(f32_model(ids[:, 6:], state=state, return_mtp_logits=True).mtp_logits, after)


def test_model_without_the_block(files, ids, tmp_path):
    plain = convert.hf_to_gguf(files["hf"], tmp_path / "no-mtp.gguf", "f32")  # --no-mtp
    model = Qwen38ForCausalLM.from_pretrained(plain, device="cpu")
    assert model.mtp is None and model.new_state(4).mtp_cache is None
    with pytest.raises(ValueError, match="return_mtp_logits=True but .*no-mtp\\.gguf has no MTP block"):
        model(ids, return_mtp_logits=True)
    with_block = Qwen38ForCausalLM.from_pretrained(files["f32"], device="cpu")
    torch.testing.assert_close(model(ids).logits, with_block(ids).logits, rtol=0, atol=0)
    state = with_block.new_state(PROMPT_LENGTH)
    with_block(ids, state=state)
    with pytest.raises(ValueError, match="holds an MTP cache, this state has none"):
        model.new_state(PROMPT_LENGTH).restore(state.snapshot())


# --------------------------------------------------------------------------------------------------
# Quantized files and lanes: against our f32 path on the same dequantized weights
# --------------------------------------------------------------------------------------------------

def mtp_and_trunk_logits(path, ids, **kwargs):
    model = Qwen38ForCausalLM.from_pretrained(path, device="cpu", **kwargs)
    out = model(ids, return_mtp_logits=True)
    return out.mtp_logits[0], out.logits[0]


@pytest.mark.parametrize("qtype", ["q8_0", "bf16"])
def test_quantized_file_f32_lane_equals_its_dequantized_weights(files, ids, qtype):
    mtp, _ = mtp_and_trunk_logits(files[qtype], ids, lane="f32")
    truth, _ = mtp_and_trunk_logits(files[f"{qtype}-dequantized"], ids)
    err = rel_l2(mtp, truth)
    print(f"{qtype} GGUF (f32 lane) vs its weights dequantized to F32 (dense): MTP rel L2 {err:.2e}")
    assert err <= 1e-5


def test_quantize_at_load_equals_the_q8_gguf(files, ids):
    ours, _ = mtp_and_trunk_logits(files["hf"], ids, lane="f32", quantize="q8_0")
    gguf_mtp, _ = mtp_and_trunk_logits(files["q8_0"], ids, lane="f32")
    err = rel_l2(ours, gguf_mtp)
    print(f"HF quantize='q8_0' vs the Q8_0 GGUF: MTP rel L2 {err:.2e}")
    assert err <= 1e-6


@pytest.mark.parametrize("lane", ["int8x2", "int8"])
def test_int_lanes_on_the_q8_gguf(files, ids, lane):
    """int8x2: the trunk's bar (rel L2 <= 1e-3 vs the dequantized weights in f32). int8 has no f32 bar (its
    contract is llama.cpp's rounding, ~3e-2 from f32 on the oracle): the block may not drift further from
    the f32 lane than the trunk's own logits do (a stale or missing activation quantization is O(1))."""
    truth, trunk_truth = mtp_and_trunk_logits(files["q8_0-dequantized"], ids)
    mtp, trunk = mtp_and_trunk_logits(files["q8_0"], ids, lane=lane)
    err, trunk_err = rel_l2(mtp, truth), rel_l2(trunk, trunk_truth)
    print(f"{lane} lane vs dequantized f32: MTP rel L2 {err:.2e} (trunk logits {trunk_err:.2e})")
    assert err <= (1e-3 if lane == "int8x2" else max(2 * trunk_err, 1e-3))
    assert trunk_err <= (1e-3 if lane == "int8x2" else 5e-2)


# --------------------------------------------------------------------------------------------------
# The converter with the MTP block (llama.cpp's _Qwen35MtpMixin)
# --------------------------------------------------------------------------------------------------

def test_converter_writes_the_block_as_llama_cpp(files, tmp_path):
    with_block = gguf.GGUFReader(files["q8_0"])
    plain = gguf.GGUFReader(convert.hf_to_gguf(files["hf"], tmp_path / "plain.gguf", "q8_0", model_name="mtp"))
    fields = {k: f.contents() for k, f in with_block.fields.items()}
    assert fields["qwen35.block_count"] == 5 and fields["qwen35.nextn_predict_layers"] == 1
    model_keys = [k for k in fields if k.startswith("qwen35.")]
    assert model_keys[-1] == "qwen35.nextn_predict_layers"  # written after the model's own keys
    assert fields["qwen35.attention.recurrent_layers"] == [True, False, True, False]  # the trunk's layers
    tensors = {t.name: t for t in with_block.tensors}
    trunk = [t.name for t in plain.tensors]
    assert [n for n in tensors if not n.startswith("blk.4.")] == trunk  # the trunk, in the same order, first
    for t in plain.tensors:
        assert np.array_equal(np.asarray(t.data), np.asarray(tensors[t.name].data)), t.name
    block = [n for n in tensors if n.startswith("blk.4.")]
    # HF order sorted within the file, renamed in place: fc, the layer, norm, pre_fc_norm_embedding, _hidden.
    assert block[0] == "blk.4.nextn.eh_proj.weight"
    assert block[-3:] == ["blk.4.nextn.shared_head_norm.weight", "blk.4.nextn.enorm.weight", "blk.4.nextn.hnorm.weight"]
    assert {n.removeprefix("blk.4.") for n in block} == {
        "nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight",
        "attn_norm.weight", "post_attention_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
        "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_gate.weight", "ffn_up.weight",
        "ffn_down.weight"}
    Q8, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
    assert tensors["blk.4.nextn.eh_proj.weight"].tensor_type == Q8
    assert all(tensors[n].tensor_type == F32 for n in block if n.endswith("norm.weight"))
    hf = safetensors.torch.load_file(files["hf"] / "model.safetensors")
    for gguf_name, hf_name in [("nextn.enorm", "mtp.pre_fc_norm_embedding"), ("nextn.hnorm", "mtp.pre_fc_norm_hidden"),
                               ("nextn.shared_head_norm", "mtp.norm"), ("attn_norm", "mtp.layers.0.input_layernorm"),
                               ("attn_q_norm", "mtp.layers.0.self_attn.q_norm")]:
        np.testing.assert_array_equal(np.asarray(tensors[f"blk.4.{gguf_name}.weight"].data),
                                      hf[f"{hf_name}.weight"].numpy() + 1)


# --------------------------------------------------------------------------------------------------
# Loading errors
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def hf_copy(files, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(files["hf"], folder)
    return folder


def rewrite_weights(folder, change):
    weights = safetensors.torch.load_file(folder / "model.safetensors")
    change(weights)
    safetensors.torch.save_file(weights, folder / "model.safetensors")


def test_partial_hf_block_is_an_error(hf_copy):
    rewrite_weights(hf_copy, lambda w: w.pop("mtp.layers.0.mlp.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"hf: missing tensor 'mtp\.layers\.0\.mlp\.down_proj\.weight'"):
        Qwen38ForCausalLM.from_pretrained(hf_copy, device="cpu")


def test_hf_block_of_a_wrong_shape_is_an_error(hf_copy):
    rewrite_weights(hf_copy, lambda w: w.__setitem__("mtp.fc.weight", w["mtp.fc.weight"][:, :64].clone()))
    with pytest.raises(CheckpointError, match=r"tensor 'mtp\.fc\.weight' has shape \(64, 64\), expected \(64, 128\)"):
        Qwen38ForCausalLM.from_pretrained(hf_copy, device="cpu")


def test_hf_config_counting_a_block_without_its_tensors_loads_without_it(hf_copy, ids):
    """Repackaged checkpoints drop mtp.* and keep mtp_num_hidden_layers: the trunk loads, the block is absent."""
    rewrite_weights(hf_copy, lambda w: [w.pop(k) for k in [k for k in w if k.startswith("mtp.")]])
    model = Qwen38ForCausalLM.from_pretrained(hf_copy, device="cpu")
    assert model.mtp is None and model.config.num_mtp_layers == 0
    with pytest.raises(ValueError, match="no MTP block"):
        model(ids, return_mtp_logits=True)


def test_two_mtp_layers_are_refused(hf_copy):
    config = json.loads((hf_copy / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 2
    (hf_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"2 MTP layers; this implementation runs one"):
        Qwen38ForCausalLM.from_pretrained(hf_copy, device="cpu")


def test_partial_gguf_block_is_an_error(files, tmp_path):
    def drop(tensors):
        return {n: (np.asarray(t.data), t.tensor_type) for n, t in tensors.items() if n != "blk.4.nextn.hnorm.weight"}
    path = rewrite_gguf(files["f32"], tmp_path / "partial.gguf", tensors=drop)
    with pytest.raises(CheckpointError, match=r"partial\.gguf: missing tensor 'blk\.4\.nextn\.hnorm\.weight'"):
        Qwen38ForCausalLM.from_pretrained(path, device="cpu")


def test_gguf_block_with_a_dedicated_head_is_an_error(files, tmp_path):
    """A block with its own embedding or head (other converters' nextn.embed_tokens / shared_head_head) is not
    this architecture's: refused rather than silently run with the shared ones."""
    def add(tensors):
        out = {n: (np.asarray(t.data), t.tensor_type) for n, t in tensors.items()}
        out["blk.4.nextn.shared_head_head.weight"] = (np.asarray(tensors["output.weight"].data),
                                                      gguf.GGMLQuantizationType.F32)
        return out
    path = rewrite_gguf(files["f32"], tmp_path / "head.gguf", tensors=add)
    with pytest.raises(CheckpointError, match=r"1 tensors are not part of the model .*'blk\.4\.nextn\.shared_head_head"):
        Qwen38ForCausalLM.from_pretrained(path, device="cpu")


# --------------------------------------------------------------------------------------------------
# GPU (device machine, -m cuda)
# --------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("lane", ["f32", "int8x2", "int8"])
def test_mtp_on_gpu(files, ids, lane):
    """The Q8_0 GGUF on the GPU against the CPU f32 path on its dequantized weights, with the lane bars
    above; then the block row by row (split-K decode attention, GEMV) against the GPU's teacher-forced rows
    (tensor-core prefill attention, GEMM from 8 rows), the cache poisoned with NaN first."""
    truth, trunk_truth = mtp_and_trunk_logits(files["q8_0-dequantized"], ids)
    model = Qwen38ForCausalLM.from_pretrained(files["q8_0"], device="cuda", lane=lane)
    out = model(ids, state=poisoned_state(model, PROMPT_LENGTH), return_mtp_logits=True)
    err, trunk_err = rel_l2(out.mtp_logits[0], truth), rel_l2(out.logits[0], trunk_truth)
    print(f"GPU {lane}: MTP rel L2 {err:.2e} vs dequantized f32 on CPU (trunk logits {trunk_err:.2e})")
    assert err <= {"f32": 1e-5, "int8x2": 1e-3, "int8": max(2 * trunk_err, 1e-3)}[lane]

    rows, _, _ = mtp_row_by_row(model, ids, poisoned_state(model, PROMPT_LENGTH), Scratch("cuda"))
    step_err = rel_l2(rows, out.mtp_logits[0])
    print(f"GPU {lane}: MTPBlock.forward row by row vs teacher-forced: rel L2 {step_err:.2e}")
    # int8: GEMV and GEMM may round a later activation to the other q8_0 level (test_cuda_decode.py).
    assert step_err <= {"f32": 1e-5, "int8x2": 1e-3, "int8": max(2 * trunk_err, 1e-3)}[lane]


@pytest.mark.cuda
@pytest.mark.parametrize("lane, bar", [("f32", 1e-5), ("int8x2", 1e-3)])
def test_mtp_at_the_27b_shape_on_gpu(lane, bar):
    """The block at the real shape (D 5120, 24/4 heads of 256, FFN 17408, the 248320-row shared head;
    synthetic Q8_0 weights, one trunk layer): teacher-forced over 5 pairs (GEMV rows, prefill attention)
    equals the block row by row (decode attention), the block's cache poisoned with NaN first."""
    import dataclasses

    from benchmarks.decode import QWEN38_27B, SyntheticQ8Source
    from qwen38_model.checkpoint import Checkpoint
    from qwen38_model.config import ATTENTION

    config = dataclasses.replace(QWEN38_27B, layer_types=(ATTENTION,), num_mtp_layers=1)
    with torch.no_grad():
        model = Qwen38ForCausalLM(config, Checkpoint(SyntheticQ8Source(config)), "cuda", torch.bfloat16, None,
                                  lane).eval()
    ids = torch.randint(0, config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(5))
    out = model(ids, state=poisoned_state(model, 6), return_mtp_logits=True)
    assert bool(torch.isfinite(out.mtp_logits).all())
    rows, _, _ = mtp_row_by_row(model, ids, poisoned_state(model, 6), Scratch("cuda"))
    err = rel_l2(rows, out.mtp_logits[0])
    print(f"GPU 27B shape, {lane}: MTP row by row vs teacher-forced: rel L2 {err:.2e}")
    assert err <= bar
