"""Our model vs HF transformers' Qwen3_5ForCausalLM on tiny random configs, every parameter randomized,
saved as text-only, as the released VLM form, and sharded."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen38_model import Qwen38ForCausalLM

from conftest import require
from numerics import rel_l2

transformers = require("transformers")

# Two head layouts: value/key head ratio 3 with GQA group 2, and ratio 2 with group 3; odd vocabularies.
CONFIGS = {
    "ratio3_gqa2": dict(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                        linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=8),
    "ratio2_gqa3": dict(vocab_size=257, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                        num_attention_heads=6, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=12, linear_value_head_dim=16),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random, so any convention mistake (norm offset, head order, A_log sign) shows."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("linear_attn.norm.weight"):
            p.data = torch.empty_like(p).uniform_(0.7, 1.3, generator=g)  # used as w
        elif "norm" in name:
            p.data = torch.empty_like(p).uniform_(-0.3, 0.3, generator=g)  # used as 1 + w
        elif name.endswith("A_log"):
            p.data = torch.empty_like(p).uniform_(-3, 1, generator=g)
        elif name.endswith("dt_bias"):
            p.data = torch.empty_like(p).uniform_(-1, 1, generator=g)
        else:
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.data = torch.randn(p.shape, generator=g) / fan_in**0.5


def make_hf_model(name: str, seed: int = 0):
    config = transformers.Qwen3_5TextConfig(
        **CONFIGS[name], rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False, attn_implementation="eager")
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    randomize_(model, seed)
    return model


def save_vlm_form(model, folder) -> None:
    """The released layout: model.language_model.* weights, a vision tower and an MTP block beside them,
    config model_type qwen3_5 with the language model under text_config."""
    folder.mkdir()
    weights = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v.contiguous()
               for k, v in model.state_dict().items()}
    weights["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
    weights["mtp.fc.weight"] = torch.randn(model.config.hidden_size, 2 * model.config.hidden_size)
    weights["mtp.norm.weight"] = torch.randn(model.config.hidden_size)
    save_file(weights, folder / "model.safetensors")
    text = model.config.to_dict()
    text["model_type"] = "qwen3_5_text"
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module", params=list(CONFIGS))
def hf_case(request, tmp_path_factory):
    model = make_hf_model(request.param)
    root = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(root / "text")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    save_vlm_form(model, root / "vlm")
    ids = torch.randint(0, model.config.vocab_size, (1, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    return root, ids, logits


@pytest.mark.parametrize("form", ["text", "vlm", "sharded"])
def test_logits_match_transformers(hf_case, form):
    root, ids, hf_logits = hf_case
    if form == "sharded":
        assert len(list((root / "sharded").glob("*.safetensors"))) > 1
    model = Qwen38ForCausalLM.from_pretrained(root / form, device="cpu")
    ours = model(ids).logits
    err = rel_l2(ours, hf_logits)
    print(f"{root.name}/{form}: rel L2 vs transformers float32 = {err:.2e}")
    assert ours.shape == hf_logits.shape and ours.dtype == torch.float32
    assert err <= 1e-5


def test_prefill_then_decode_equals_full_forward(hf_case):
    root, ids, _ = hf_case
    model = Qwen38ForCausalLM.from_pretrained(root / "text", device="cpu")
    full = model(ids).logits
    state = model.new_state(max_seq_len=ids.shape[1])
    parts = [model(ids[:, :7], state=state).logits]
    parts += [model(ids[:, t : t + 1], state=state).logits for t in range(7, ids.shape[1])]
    err = rel_l2(torch.cat(parts, dim=1), full)
    print(f"{root.name}: prefill(7) + {ids.shape[1] - 7} decode steps vs full forward: rel L2 = {err:.2e}")
    assert err <= 1e-6
    with pytest.raises(ValueError, match="context overflow"):
        model(ids[:, :1], state=state)


def test_logits_to_keep(hf_case):
    root, ids, hf_logits = hf_case
    model = Qwen38ForCausalLM.from_pretrained(root / "text", device="cpu")
    last = model(ids, logits_to_keep=3).logits
    assert last.shape == (1, 3, hf_logits.shape[-1])
    assert rel_l2(last, hf_logits[:, -3:]) <= 1e-5


def test_vlm_form_keeps_mtp_readable(hf_case):
    from qwen38_model.checkpoint import open_checkpoint

    root, _, _ = hf_case
    source = open_checkpoint(root / "vlm").source
    assert source.shape("mtp.fc.weight")[1] == 2 * source.shape("mtp.norm.weight")[0]
    assert load_file(root / "vlm" / "model.safetensors")["mtp.fc.weight"].shape == source.shape("mtp.fc.weight")
