"""`python -m benchmarks.prefix_cache --tiny`: the prefix-cache benchmark end to end on the built-in model (CPU): the
server in-process, streamed openai chat requests, the chat trace (thinking off and on), the shared system prompt,
few-shot and document traces, their replay on a server that caches nothing. A smoke test of the script (its timings
mean nothing on the CPU), and of what it measures: from turn 2 on each request restores its whole earlier
conversation, every request after the first its shared prefix (inside a message: up to its stride snapshot), and the
replies are those without the cache."""
import contextlib
import json
import pathlib
import subprocess
import sys

from conftest import require

# The test extra has them: under CI=true a missing one fails rather than skips.
for module in ("openai", "starlette", "uvicorn"):
    require(module)

from benchmarks.prefix_cache import TINY, cacheable_prefix, chat_tokenizer, common_prefix  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_prefix_cache_benchmark_runs_tiny(tmp_path):
    out = tmp_path / "prefix_cache.json"
    subprocess.run([sys.executable, "-m", "benchmarks.prefix_cache", "--tiny", "--json", str(out)], check=True,
                   cwd=REPO, capture_output=True, timeout=180)
    results = json.loads(out.read_text())
    assert results["tiny"] and results["settings"]["thinking_pass"]  # the built-in template reads enable_thinking
    for key in ("env", "settings", "cached_server", "uncached_server", "chat", "chat_thinking", "system", "fewshot"):
        assert key in results, key
    # The replay's server restored nothing (else the identity below compares the cache with itself).
    assert results["uncached_cached_tokens"] == 0 and results["uncached_server"]["entries"] == 0
    assert results["cached_server"]["entries"] > 0
    for key in ("chat", "chat_thinking"):
        report = results[key]
        rows = report["requests"]
        assert len(rows) == TINY["conversations"] * TINY["turns"]
        assert [t["turn"] for t in report["turns"]] == list(range(1, TINY["turns"] + 1))
        for row in rows:
            assert row["ttft_s"] > 0 and row["uncached_ttft_s"] > 0 and row["completion_tokens"] > 0
            assert row["prompt_tokens"] == row["uncached_prompt_tokens"]
            if row["turn"] == 1:
                assert row["cached_tokens"] == 0  # a new conversation, the cache emptied before the trace
            else:
                # The whole earlier conversation (the replies as the template renders them back) is restored.
                assert 0 < row["cacheable_tokens"] <= row["cached_tokens"] < row["prompt_tokens"], (key, row)
        t2 = report["from_turn_2"]
        assert t2["requests"] == TINY["conversations"] * (TINY["turns"] - 1)
        assert t2["all_cacheable_restored"] and t2["cached_tokens"] > 0 and t2["cacheable_restored"] >= 1
        assert 0 < t2["hit_fraction"] < 1
        assert report["identity"] == dict(identical=True, compared=len(rows), differing=0, first_difference=None)
    for key in ("system", "fewshot"):
        report = results[key]
        assert len(report["requests"]) == TINY["requests"] and report["shared_prefix_tokens"] > 0
        assert report["first"]["cached_tokens"] == 0
        assert report["later"]["all_shared_cached"]
        assert report["later"]["min_cached_tokens"] >= report["shared_prefix_tokens"]
        assert report["identity"]["identical"]
    assert results["fewshot"]["shared_prefix_tokens"] > results["system"]["shared_prefix_tokens"]
    # A shared prefix ending inside a message: restored up to its stride snapshot (1024 tokens), the repeat whole.
    report = results["document"]
    assert len(report["requests"]) == TINY["requests"] + 1 and report["first"]["cached_tokens"] == 0
    assert report["document_tokens"] > 1024 and 1024 in report["strides"]
    assert report["later"]["all_reachable_cached"]
    assert [r["cached_tokens"] for r in report["requests"][1:-1]] == [1024] * (TINY["requests"] - 1)
    assert report["repeat"]["cached_tokens"] == report["repeat"]["reachable_tokens"] == report["repeat"]["prompt_tokens"]
    assert report["identity"]["identical"]
    assert results["identical"]


def test_chat_tokenizer_round_trips_every_id():
    tokenizer = chat_tokenizer(600)
    assert len(tokenizer) == 600
    assert tokenizer.decode([550, 599]) == "<550><599>"
    assert tokenizer.encode("<550><599>") == [550, 599]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there."}], add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\nHello there.<|im_end|>\n<|im_start|>assistant\n")


@contextlib.contextmanager
def tiny_server(tokenizer):
    """A server on the built-in model that serves nothing here: its history_ids is the cut under test."""
    from qwen38_model import Qwen38ForCausalLM
    from qwen38_model.default_model import default_model_path
    from qwen38_model.server import Server

    model = Qwen38ForCausalLM.from_pretrained(default_model_path(), device="cpu")
    server = Server(model, tokenizer, "tiny", max_context=64, max_queue=1, cache_bytes=1, max_batch=1)
    try:
        yield server
    finally:
        server.close()


def test_cacheable_prefix_is_the_history_as_the_prompt_renders_it():
    tokenizer = chat_tokenizer(600)
    with tiny_server(tokenizer) as server:
        messages = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "More words."}]
        cacheable, history = cacheable_prefix(server, messages, {"enable_thinking": False})
        prefix = tokenizer.encode(tokenizer.apply_chat_template(messages[:2], add_generation_prompt=False))
        header = tokenizer.encode("<|im_start|>user\n")
        assert cacheable == len(prefix) and history == len(prefix) + len(header)
        assert cacheable_prefix(server, messages[:1], {}) == (0, len(header))
        # A template that renders the last assistant message otherwise than an earlier one (as Qwen's writes a think
        # block into the last): messages[:2] alone is no prefix of the prompt, but the server's cut (the assistant
        # message's end as the prompt renders it) still is, the same tokens as with the plain template.
        tokenizer.chat_template = tokenizer.chat_template.replace(
            "{{- '<|im_start|>assistant\\n' }}\n{%- if message.reasoning_content %}",
            "{{- '<|im_start|>assistant\\n' }}\n{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}\n"
            "{%- if message.reasoning_content %}")
        assert "loop.last" in tokenizer.chat_template
        alone = tokenizer.encode(tokenizer.apply_chat_template(messages[:2], add_generation_prompt=False))
        assert alone != prefix  # the think block: the render alone is not the history
        assert cacheable_prefix(server, messages, {"enable_thinking": False}) == (len(prefix),
                                                                                 len(prefix) + len(header))


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
