"""The prefix cache inside long messages (Server's stride breaks): requests that share a long prefix ending inside
a message (a document with different questions after it, in one chat message or one completion prompt) restore
it up to the last snapshot at a multiple of BREAK_STRIDE tokens, and an exact repeat of a prompt restores all of
it but the tokens past its last such snapshot; every reply is the one a server that caches nothing gives. In
this process, the built-in model (CPU), with the official openai client."""
import sys
import time

import pytest

from test_server import MODEL, local  # noqa: F401 (a fixture)

openai = pytest.importorskip("openai")


def test_stride_breaks_are_the_last_strides_inside_the_last_message():
    from qwen38_model.server import BREAK_STRIDE, STRIDE_BREAKS, stride_breaks

    assert BREAK_STRIDE == 1024 and STRIDE_BREAKS == 2
    assert stride_breaks(5000, ()) == (3072, 4096)  # a completion: the last two below its end
    assert stride_breaks(1024, ()) == () and stride_breaks(1025, ()) == (1024,)
    assert stride_breaks(5000, (40, 100, 4500)) == (40, 100, 3072, 4096, 4500)  # inside the last message (100, 4500)
    assert stride_breaks(5000, (40, 3100, 3200)) == (40, 3100, 3200)  # a last message with no stride in it
    assert stride_breaks(5000, (40,)) == (40,)  # one message (its end the last break): none before 40


def document(tokenizer, tokens: int) -> str:
    words = "river stone cache model token light paper window garden number".split()
    text, i = "", 0
    while len(tokenizer.encode(text)) < tokens:
        text += words[i * 7 % len(words)] + (". " if i % 9 == 8 else " ")
        i += 1
    return text


def test_a_long_shared_prefix_inside_a_message_is_restored(local):  # noqa: F811
    """A ~1300-token document, then different questions after it in the same message (chat) or prompt
    (completion): the second request restores 1024 tokens (the stride before the shared prefix ends; without
    stride breaks 0); the same prompt again restores all of it (its own end, cached with its last logits);
    greedy and sampled replies equal the uncached server's."""
    from qwen38_model.server import Server, serving_in_thread

    model, tokenizer = local
    doc = document(tokenizer, 1300)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    sampled = dict(temperature=1.0, seed=3)

    def run(cache_bytes: int) -> list[tuple[str, int]]:
        server = Server(model, tokenizer, MODEL, max_context=4096, max_queue=1, cache_bytes=cache_bytes,
                        log=sys.stdout, max_batch=1)
        out = []
        with serving_in_thread(server) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)

            def idle():
                while server.scheduler.running or server.scheduler.waiting:  # its snapshots cached
                    time.sleep(0.01)

            for question, kwargs in [("What is the first word?", dict(temperature=0)),
                                     ("Which words repeat?", sampled), ("What is the first word?", dict(temperature=0))]:
                answer = client.chat.completions.create(
                    model=MODEL, max_tokens=6, extra_body=off, **kwargs,
                    messages=[{"role": "user", "content": doc + "\n\n" + question}])
                out.append((answer.choices[0].message.content, answer.usage.prompt_tokens_details.cached_tokens,
                            answer.usage.prompt_tokens))
                idle()
            for ending, kwargs in [(" The end.", dict(temperature=0)), (" Another ending.", sampled),
                                   (" Another ending.", sampled)]:
                answer = client.completions.create(model=MODEL, prompt=doc + ending, max_tokens=6, **kwargs)
                out.append((answer.choices[0].text, answer.usage.prompt_tokens_details.cached_tokens,
                            answer.usage.prompt_tokens))
                idle()
        return out

    cached, uncached = run(1 << 30), run(1)
    assert [text for text, _, _ in cached] == [text for text, _, _ in uncached]
    assert [tokens for _, tokens, _ in uncached] == [0] * 6
    # Each first request restores nothing (a chat prompt starts with its template's header: the completions share
    # none of it); a repeat restores its whole prompt (the state at its end and its last logits, cached together).
    whole = [prompt for _, _, prompt in cached]
    assert [tokens for _, tokens, _ in cached] == [0, 1024, whole[2], 0, 1024, whole[5]]


def test_chat_prefills_end_a_chunk_before_every_message(local, monkeypatch):  # noqa: F811
    """A restored chat prefix was prefilled in chunks that ended at its own request's message boundaries (the
    first message and the last BREAK_MESSAGES), and an older message's boundary is none of a later request's: so
    every chat prefill ends a chunk before every message start, whatever it restored (on the GPU a chunk's
    extent sets its float order; the H200 run of benchmarks/prefix_cache.py at db5657b gave 2 of 8 chat replies
    other bits than the uncached server's, both at turn 4, where the 7-message history first dropped boundaries).
    Six turns, cached and not: no prefill chunk holds a message start past its first token, and every
    boundary the cache snapshots is a message start."""
    from qwen38_model.scheduler import message_starts
    from qwen38_model.server import Server, serving_in_thread

    model, tokenizer = local
    chunks = []  # every prefill call's token ids
    prefill = model.prefill

    def recording(ids, *args, **kwargs):
        chunks.append(ids.tolist())
        return prefill(ids, *args, **kwargs)

    monkeypatch.setattr(model, "prefill", recording)
    for cache_bytes in (1 << 30, 1):
        server = Server(model, tokenizer, MODEL, max_context=2048, max_queue=1, cache_bytes=cache_bytes,
                        log=sys.stdout, max_batch=1)
        start = server.message_start
        assert tokenizer.decode([start]) == "<|im_start|>"
        messages = [{"role": "system", "content": "You answer in few words."}]
        with serving_in_thread(server) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
            for turn in range(6):
                messages.append({"role": "user", "content": f"Question {turn}: name a colour and a number."})
                answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
                messages.append({"role": "assistant", "content": answer.choices[0].message.content})
                while server.scheduler.running or server.scheduler.waiting:
                    time.sleep(0.01)
        prompt = server.chat_request({"messages": messages[:-1], "chat_template_kwargs": {"enable_thinking": False}})
        ids = tokenizer.encode(prompt.text)
        assert set(server.message_breaks(prompt, ids)) <= set(message_starts(ids, start))
    assert chunks and all(start not in chunk[1:] for chunk in chunks)


def test_boundary_states_are_cached_as_the_prefill_passes_them(local):  # noqa: F811
    """A chat's states at its message boundaries go into the prefix cache during its prefill, not when its reply
    ends: the sequence holds none of them while it decodes (up to 7 states a slot that the slots' memory does not
    count), and the first streamed token comes after every one of them is in the cache."""
    from qwen38_model.server import Server, serving_in_thread

    model, tokenizer = local
    server = Server(model, tokenizer, MODEL, max_context=2048, max_queue=1, cache_bytes=1 << 30, log=sys.stdout,
                    max_batch=1)
    messages = [{"role": "system", "content": "You answer in few words."}]
    for turn in range(3):
        messages += [{"role": "user", "content": f"Question {turn}?"}, {"role": "assistant", "content": f"Answer {turn}."}]
    messages.append({"role": "user", "content": "And now?"})
    body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
    prompt = server.chat_request(body)
    ids = tokenizer.encode(prompt.text)
    breaks = server.message_breaks(prompt, ids)
    assert len(breaks) >= 4
    with serving_in_thread(server) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                stream=True, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        chunks = iter(stream)
        # The first token streamed: the request was admitted, its prefill done, its reply not yet.
        chunk = next(c for c in chunks if c.choices and c.choices[0].delta.content)
        assert chunk.choices[0].finish_reason is None
        cached = {len(key) for key in server.cache.entries}
        active = [seq for seq in server.scheduler.engine.active if seq is not None]
        assert set(breaks) <= cached and all(not seq.break_snapshots for seq in active)
        for _ in chunks:
            pass
