"""Tokenizer: HF folder vs tokenizer.json, GGUF metadata vs tokenizer.json, streaming, chat template."""
import random
import re
import shutil
import time
import unicodedata

import gguf
import pytest
import tokenizers

from qwen38_model import CheckpointError, convert, synthetic
from qwen38_model.errors import ChatTemplateError
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
    return convert.hf_to_gguf(synthetic_dir, tmp_path_factory.mktemp("tok-gguf") / "m.gguf", "f32")


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
    assert pieces[-2:] == ["", "\ufffd"]  # the first lead byte is known invalid once another one follows
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
    with pytest.raises(ChatTemplateError, match="chat template: A system message must come first"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


def test_stream_decoder_is_linear_on_bytes_that_never_complete(oracle_dir):
    """20000 ids that never complete a character took 56 s (each id re-decoded everything held)."""
    tokenizer = Tokenizer.from_hf_folder(oracle_dir / "hf")
    lead_byte = tokenizer.encode("你")[0]
    stream = tokenizer.stream_decoder()
    start = time.perf_counter()
    text = "".join(stream.feed(lead_byte) for _ in range(20000)) + stream.flush()
    assert time.perf_counter() - start < 2.0
    assert text == "\ufffd" * 20000 == tokenizer.decode([lead_byte] * 20000)


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_stream_decoder_equals_decode_on_random_ids(synthetic_dir, skip_special_tokens):
    """Random ids, special and non-special added tokens and ids past the vocabulary included."""
    tokenizer = Tokenizer.from_hf_folder(synthetic_dir)
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer) + 8) for _ in range(rng.randrange(1, 12))]
        stream = tokenizer.stream_decoder(skip_special_tokens)
        assert "".join(map(stream.feed, ids)) + stream.flush() == tokenizer.decode(ids, skip_special_tokens), ids


def test_stop_tokens_are_one_policy(oracle_dir):
    """generate() and the tokenizer stop on the same ids: generation_config.json's for an HF folder, the
    GGUF's eos + <|im_end|>/<|endoftext|> control tokens (as llama.cpp) for a GGUF."""
    from qwen38_model.checkpoint import open_checkpoint
    from qwen38_model.tokenizer import load_tokenizer

    for path, expected in [(oracle_dir / "hf", (500,)), (oracle_dir / "mini-q8_0.gguf", (500, 502)),
                           (oracle_dir / "mini-f32.gguf", (500, 502))]:
        assert open_checkpoint(path).config.eos_token_ids == expected
        assert tuple(load_tokenizer(path).eos_token_ids) == expected


def test_hf_stop_tokens_without_generation_config(oracle_dir, tmp_path):
    from qwen38_model.stop_tokens import hf_stop_token_ids

    folder = tmp_path / "hf"
    shutil.copytree(oracle_dir / "hf", folder)
    (folder / "generation_config.json").unlink()
    config = {"eos_token_id": 502, "text_config": {"eos_token_id": 500}}
    assert hf_stop_token_ids(folder, config) == (502,)  # the top level first, as the released VLM config
    assert hf_stop_token_ids(folder, {"text_config": {"eos_token_id": [500, 501]}}) == (500, 501)


def gguf_fields_with(oracle_dir, **changes) -> dict:
    fields = gguf_metadata(oracle_dir / "mini-q8_0.gguf")
    fields.update(changes)
    return {k: v for k, v in fields.items() if v is not None}


@pytest.mark.parametrize("changes,message", [
    ({"tokenizer.ggml.tokens": None}, r"no tokenizer\.ggml\.tokens"),
    ({"tokenizer.ggml.tokens": [1, 2]}, r"tokenizer\.ggml\.tokens must be an array of strings"),
    ({"tokenizer.ggml.token_type": [1, 1]}, r"tokenizer\.ggml\.token_type must be 512 integers \(one per token\), "
                                            r"found 2 entries"),
    ({"tokenizer.ggml.eos_token_id": 512}, r"tokenizer\.ggml\.eos_token_id must be a token id in \[0, 512\), found 512"),
    ({"tokenizer.ggml.padding_token_id": -1}, r"tokenizer\.ggml\.padding_token_id must be a token id in \[0, 512\)"),
    ({"tokenizer.ggml.merges": ["a b c"]}, r"tokenizer\.ggml\.merges entry 'a b c' is not two tokens"),
    ({"tokenizer.ggml.merges": ["Ġ zzz"]}, r"tokenizer\.ggml\.tokens / merges do not form a BPE tokenizer \(.*zzz"),
    ({"tokenizer.ggml.model": "llama"}, r"tokenizer\.ggml\.model is 'llama'; only byte-level BPE"),
    ({"tokenizer.chat_template": 7}, r"tokenizer\.chat_template must be a string"),
    # issue 24 item 4: llama.cpp's vocabulary checks
    ({"tokenizer.ggml.merges": []}, r"no tokenizer\.ggml\.merges: a byte-level BPE \('gpt2'\) vocabulary needs"),
    ({"tokenizer.ggml.merges": None}, r"no tokenizer\.ggml\.merges"),
    ({"tokenizer.ggml.token_type": None}, r"tokenizer\.ggml\.tokens \(512 tokens\) without tokenizer\.ggml\.token_type"),
    ({"tokenizer.ggml.token_type": [1] * 511 + [7]}, r"tokenizer\.ggml\.token_type\[511\] is 7, expected a "
                                                    r"llama_token_type from 1 to 6"),
    ({"tokenizer.ggml.token_type": [0] + [1] * 511}, r"tokenizer\.ggml\.token_type\[0\] is 0"),
])
def test_malformed_gguf_tokenizer_metadata(oracle_dir, changes, message):
    with pytest.raises(CheckpointError, match=rf"x\.gguf: {message}"):
        Tokenizer.from_gguf_metadata(gguf_fields_with(oracle_dir, **changes), "x.gguf")


def test_malformed_tokenizer_files(oracle_dir, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(oracle_dir / "hf", folder)
    (folder / "tokenizer.json").write_text('{"model": {"type": "Nonsense"}}')
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not a tokenizers file"):
        Tokenizer.from_hf_folder(folder)
    shutil.copy(oracle_dir / "hf" / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text('{"chat_template": [{"name": "default", "template": "x"}]}')
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: chat_template must be a string"):
        Tokenizer.from_hf_folder(folder)
    (folder / "tokenizer_config.json").write_text('{"eos_token": 5}')
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: eos_token must be a string"):
        Tokenizer.from_hf_folder(folder)


def test_hf_folder_without_a_tokenizer_says_which_files_it_needs(oracle_dir, tmp_path):
    from qwen38_model.tokenizer import load_tokenizer

    folder = tmp_path / "hf"
    shutil.copytree(oracle_dir / "hf", folder)
    (folder / "tokenizer.json").unlink()
    message = (rf"{re.escape(str(folder))}: no tokenizer\.json; an HF checkpoint folder needs tokenizer\.json \(the "
               r"tokenizer\) beside config\.json and model\.safetensors .* tokenizer_config\.json .* are optional")
    with pytest.raises(CheckpointError, match=message):
        load_tokenizer(folder)


def test_real_size_gguf_vocabulary_reads_back(tmp_path):
    """Qwen3.5's vocabulary size (248,320 tokens, 247,587 merges) written with GGUFWriter as llama.cpp's converter
    writes it reads back unchanged. The gguf package's reader took 9-10 s over these arrays; the times printed
    here are for information (benchmarks/load.py measures the load)."""
    from benchmarks.load import add_tokenizer_metadata, real_size_vocabulary
    from qwen38_model.checkpoint import read_gguf_metadata
    from qwen38_model.tokenizer import load_tokenizer

    tokens, token_types, merges = real_size_vocabulary()
    assert (len(tokens), len(merges)) == (248320, 247587)
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(path, "qwen35")
    add_tokenizer_metadata(writer, tokens, token_types, merges)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    start = time.perf_counter()
    metadata = read_gguf_metadata(path)
    read_s = time.perf_counter() - start
    assert metadata["tokenizer.ggml.tokens"] == tokens
    assert metadata["tokenizer.ggml.merges"] == merges
    assert metadata["tokenizer.ggml.token_type"] == token_types
    start = time.perf_counter()
    tokenizer = load_tokenizer(path)
    tokenizer_s = time.perf_counter() - start
    assert tokenizer.eos_token_ids == [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]
    assert tokenizer.decode(tokenizer.encode("Hello <|im_end|>")) == "Hello <|im_end|>"
    print(f"{path.stat().st_size / 1e6:.1f} MB of metadata: read in {read_s:.2f} s, tokenizer built in "
          f"{tokenizer_s:.2f} s")


# ---- chat templates: bounded, sandboxed ---------------------------------------------------------------

def render(template: str, **context) -> str:
    from qwen38_model import chat_template

    return chat_template.render(template, messages=[{"role": "user", "content": "hi"}], **context)


@pytest.mark.parametrize("template,message", [
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", r"more than 1000000 steps"),
    ("{{ 'x' * 10**10 }}", r"the chat template passes the integer 1e\+10|'\*' result of 10000000000"),
    ("{% set n = 10**5 %}{{ 'x' * n * n }}", r"'\*' result of 10000000000 characters"),
    ("{{ 'x'.ljust(10**9) }}", r"passes the integer 1e\+09 to a call"),
    ("{{ '%999999999s' % 'x' }}", r"formats with width 999999999"),
    ("{{ '{:>999999999}'.format('x') }}", r"formats with width 999999999"),
    ("{{ ('x' * 5000)|replace('', 'y' * 10000) }}", r"replace\(\) result of \d+ characters"),
    ("{{ 'a\nb'|indent(100000) * 1 }}", None),  # within bounds: renders
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
     r"attribute 's' of \d+ characters|'~' result of \d+ characters"),  # '~' is bounded before it builds
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", r"RecursionError"),
    ("{{ 2 ** 100000000 }}", r"a power of about 1e\+08 bits"),
    ("{{ messages[0].content.__class__.__mro__ }}", r"access to attribute '__class__' of 'str' object is unsafe"),
    ("{% for %}", r"does not compile"),
    ("{{ 1 / 0 }}", r"ZeroDivisionError"),
])
def test_chat_template_bounds(template, message):
    start = time.perf_counter()
    if message is None:
        render(template)
    else:
        with pytest.raises(ChatTemplateError, match=message):
            render(template)
    assert time.perf_counter() - start < 10


def test_chat_template_bounds_leave_real_templates_alone(synthetic_dir):
    """The synthetic (Qwen-style) template on a long chat with tools renders as transformers renders it
    (the comparison with transformers is test_chat_template_renders_like_transformers)."""
    tokenizer = Tokenizer.from_hf_folder(synthetic_dir)
    messages = [m for _ in range(200) for m in CONVERSATIONS["multi-turn"]]
    prompt = tokenizer.apply_chat_template([CONVERSATIONS["tools"][0]] + messages, tools=TOOLS)
    assert prompt.count("<|im_start|>user") == 400


def test_gguf_token_count_must_equal_the_embedding_rows(oracle_dir):
    """Issue 24 item 4: from_gguf_metadata(vocab_size=) is llama.cpp's n_vocab == token_embd.weight ne[1];
    load_tokenizer passes the rows (the oracle's files and the built-in model have exactly as many tokens)."""
    fields = gguf_fields_with(oracle_dir)
    assert len(Tokenizer.from_gguf_metadata(fields, "x.gguf", vocab_size=512)) == 503
    for rows in (400, 511, 513, 600):
        with pytest.raises(CheckpointError, match=rf"x\.gguf: tokenizer\.ggml\.tokens has 512 tokens, the model's "
                                                  rf"embedding \(token_embd\.weight\) {rows} rows"):
            Tokenizer.from_gguf_metadata(fields, "x.gguf", vocab_size=rows)
