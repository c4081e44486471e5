"""qwen38_model.load(): the model and its tokenizer in one call; complete() and chat() return exactly the
new text that generate() produces, on the built-in model and on the oracle (GGUF and HF forms)."""
import warnings

import pytest
import torch

import qwen38_model
from qwen38_model.default_model import default_model_path


def new_text(llm, prompt: str, **kwargs) -> str:
    """The long way round: encode, generate, decode the new ids."""
    ids = torch.tensor([llm.tokenizer.encode(prompt)])
    out = llm.model.generate(ids, **kwargs)
    return llm.tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


def check_helpers(llm):
    text = llm.complete("Once upon a time", max_new_tokens=8)
    assert isinstance(text, str) and text == new_text(llm, "Once upon a time", max_new_tokens=8)
    assert str(llm.model.last_generation_stats).startswith("prefill: ")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    if llm.tokenizer.chat_template is None:  # the oracle's tokenizer has none
        with pytest.raises(ValueError, match="no chat template"):
            llm.chat(messages)
        return
    reply = llm.chat(messages, max_new_tokens=6, do_sample=True, temperature=0.8, seed=4)
    templated = llm.tokenizer.apply_chat_template(messages)
    assert reply == new_text(llm, templated, max_new_tokens=6, do_sample=True, temperature=0.8, seed=4)
    assert "<|im_" not in reply and str(llm.model.last_generation_stats).startswith("prefill: ")


def test_load_the_built_in_model():
    llm = qwen38_model.load(device="cpu")
    assert llm.model.device.type == "cpu" and len(llm.tokenizer) > 256
    check_helpers(llm)


@pytest.mark.parametrize("form", ["mini-q8_0.gguf", "hf"])
def test_load_the_oracle(oracle_dir, form):
    llm = qwen38_model.load(oracle_dir / form, device="cpu", lane="f32")
    assert llm.model.lane == "f32"
    check_helpers(llm)


def test_load_explains_bad_requests(tmp_path):
    with pytest.raises(qwen38_model.CheckpointError, match="no such file"):
        qwen38_model.load(tmp_path / "missing.gguf")
    llm = qwen38_model.load(default_model_path(), device="cpu")
    with pytest.raises(ValueError, match="the prompt encodes to no tokens"):
        llm.complete("")
    if not torch.cuda.is_available():  # one clear error, no rebuild warning (there is nothing to rebuild)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError, match=r"^device='cuda' but (torch .* is a CPU build|no CUDA GPU is visible)"):
                qwen38_model.load(device="cuda")
