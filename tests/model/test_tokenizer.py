"""Tokenizer: HF folder vs tokenizer.json, GGUF metadata vs tokenizer.json, streaming, chat template."""
import unicodedata

import gguf
import jinja2
import pytest
import tokenizers

from qwen38_model import synthetic
from qwen38_model.tokenizer import Tokenizer

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café crème brûlée, naïve façade; Ångström, São Paulo, Zürich.",
    "a\u0301b\u0302c decomposed marks stay in the letter run (\\p{M})",  # no precomposed form for b̂
    "我们今天学习语言模型。你好，世界！日本語もあります。",
    "Emoji: 🙂🚀 ✅ 👩‍👩‍👧 🦙🦙 and flags 🇫🇷",
    "Numbers 1234567 3.14159 and code:\n\tdef f(x):\n        return x ** 2\n\n\n",
    "I've been told he'S there, 'RE you sure? '''quoted''' ......!!!!!!",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nhey<|endoftext|>",
]


def gguf_metadata(path) -> dict:
    """What the model loader hands over: the reader's fields as plain python values."""
    return {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory):
    return synthetic.write_hf_checkpoint(tmp_path_factory.mktemp("tok") / "hf", {"num_hidden_layers": 2})


@pytest.fixture(scope="module")
def synthetic_gguf(synthetic_dir, tmp_path_factory):
    return synthetic.hf_to_gguf(synthetic_dir, tmp_path_factory.mktemp("tok-gguf") / "m.gguf", "f32")


@pytest.mark.parametrize("text", TEXTS)
def test_hf_folder_matches_tokenizer_json(oracle_dir, text):
    ours = Tokenizer.from_hf_folder(oracle_dir / "hf")
    reference = tokenizers.Tokenizer.from_file(str(oracle_dir / "hf" / "tokenizer.json"))
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False).ids
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == unicodedata.normalize("NFC", text)  # lossless up to the NFC normaliser


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_gguf_tokenizer_matches_tokenizer_json_on_the_oracle(oracle_dir, qtype):
    from_gguf = Tokenizer.from_gguf_metadata(gguf_metadata(oracle_dir / f"mini-{qtype}.gguf"))
    from_hf = Tokenizer.from_hf_folder(oracle_dir / "hf")
    for text in TEXTS:
        ids = from_hf.encode(text)
        assert from_gguf.encode(text) == ids, text
        assert from_gguf.decode(ids) == from_hf.decode(ids)
        assert from_gguf.decode(ids, skip_special_tokens=True) == from_hf.decode(ids, skip_special_tokens=True)
    # llama.cpp also stops on <|im_end|> (by its text); transformers on generation_config's eos only.
    assert from_hf.eos_token_ids == [500]
    assert from_gguf.eos_token_ids == [500, 502]


def test_gguf_tokenizer_matches_hf_on_the_synthetic_tokenizer(synthetic_dir, synthetic_gguf):
    """Here <think> / </think> are non-special added tokens: USER_DEFINED in the GGUF."""
    from_gguf = Tokenizer.from_gguf_metadata(gguf_metadata(synthetic_gguf))
    from_hf = Tokenizer.from_hf_folder(synthetic_dir)
    for text in TEXTS:
        assert from_gguf.encode(text) == from_hf.encode(text), text
    think = from_hf.encode("<think>x</think>")
    assert think[0] == from_hf.tokenizer.token_to_id("<think>")
    assert from_gguf.decode(think, skip_special_tokens=True) == from_hf.decode(think, skip_special_tokens=True) \
        == "<think>x</think>"
    im_end, endoftext = (from_hf.tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert from_hf.eos_token_ids == [im_end, endoftext]  # generation_config.json
    assert from_gguf.eos_token_ids == [im_end, endoftext]
    assert len(from_gguf) == len(from_hf) == 501


def test_stream_decoder_emits_whole_characters(oracle_dir):
    tokenizer = Tokenizer.from_hf_folder(oracle_dir / "hf")
    text = unicodedata.normalize("NFC", "".join(TEXTS))
    ids = tokenizer.encode(text)
    stream = tokenizer.stream_decoder()
    pieces = [stream.feed(i) for i in ids]
    assert pieces.count("") > 10  # multi-byte characters spread over several byte tokens were held back
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) + stream.flush() == tokenizer.decode(ids) == text


def test_stream_decoder_flushes_invalid_bytes(oracle_dir):
    tokenizer = Tokenizer.from_hf_folder(oracle_dir / "hf")
    first_byte_of_a_cjk_char = tokenizer.encode("你")[0]  # byte 0xE4 alone: never completed
    ids = tokenizer.encode("ok ") + [first_byte_of_a_cjk_char, first_byte_of_a_cjk_char]
    stream = tokenizer.stream_decoder()
    pieces = [stream.feed(i) for i in ids]
    assert "".join(pieces) == "ok "
    assert "".join(pieces) + stream.flush() == tokenizer.decode(ids) == "ok \ufffd\ufffd"


CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hello!"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    "multi-turn": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello.", "reasoning_content": "  greet back \n"},
                   {"role": "user", "content": "Ça va ? 你好 🙂"}],
    "tools": [{"role": "system", "content": "Use tools."},
              {"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
              {"role": "tool", "content": "{\"temp\": 21, \"sky\": \"<clear>\"}"}],
}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather & <temp>",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("options", [{}, {"enable_thinking": False}, {"enable_thinking": True},
                                     {"add_generation_prompt": False}])
def test_chat_template_renders_like_transformers(synthetic_dir, synthetic_gguf, name, options):
    from transformers import AutoTokenizer
    messages = CONVERSATIONS[name]
    kwargs = {"add_generation_prompt": True, **options, **({"tools": TOOLS} if name == "tools" else {})}
    expected = AutoTokenizer.from_pretrained(synthetic_dir).apply_chat_template(messages, tokenize=False, **kwargs)
    assert Tokenizer.from_hf_folder(synthetic_dir).apply_chat_template(messages, **kwargs) == expected
    assert Tokenizer.from_gguf_metadata(gguf_metadata(synthetic_gguf)).apply_chat_template(messages, **kwargs) \
        == expected


def test_chat_template_generation_prompt(synthetic_dir):
    tokenizer = Tokenizer.from_hf_folder(synthetic_dir)
    messages = CONVERSATIONS["single"]
    assert tokenizer.apply_chat_template(messages) == \
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert tokenizer.apply_chat_template(messages, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_raise_exception(synthetic_dir):
    tokenizer = Tokenizer.from_hf_folder(synthetic_dir)
    with pytest.raises(jinja2.TemplateError, match="system message must come first"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
