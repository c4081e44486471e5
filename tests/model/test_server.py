"""`serve` with the official openai client on the built-in default model (CPU): chat and completions,
streamed and not, the prefix cache across requests, malformed requests answered as JSON errors; continuous
batching: concurrent clients (greedy and sampled side by side) each get the text of their solo run, n choices,
a client that goes away freeing its slot, the bounded queue (429) beyond the slots; logprobs (both endpoints,
streamed and not), logit_bias and frequency_penalty, and their 400s; --speculative mtp on three slots: five
concurrent clients each get their solo run's text. On the GPU (`-m cuda`):
100 sequential streamed requests leave the GPU memory where it was."""
import contextlib
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
MODEL = "model-q8_0.gguf"  # the served name: the built-in model's file name
SLOTS = 4  # the module server's --max-batch


@pytest.fixture(scope="module")
def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "qwen38_model", "serve", "--port", str(port),
                                "--max-batch", str(SLOTS), "--max-queue", "1"], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            break
        except OSError:
            assert process.poll() is None, process.stderr.read()
            time.sleep(0.3)
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class ScriptedEngine:
    """Stands in for the model and its BatchEngine in an in-process server (one slot): each sequence's
    "generation" is the tokens of `reply`, so that a test can serve a reply that holds </think> or <tool_call>
    blocks (the built-in model's random text never does). It sends no end token."""
    config = types.SimpleNamespace(eos_token_ids=[])  # what the server reads of the model
    max_batch, device, use_graph = 1, torch.device("cpu"), False

    def __init__(self, tokenizer):
        self.tokenizer, self.reply, self.active, self.script = tokenizer, "", [None], iter(())
        self.reply_ids = None  # token ids to send instead of the reply's encoding (ids no text encodes to)

    def free_slots(self) -> int:
        return self.active.count(None)

    def admit(self, seq, chunk_size):
        from qwen38_model.generation import GenerationStats

        seq.stats = GenerationStats(prompt_tokens=seq.history.shape[0])
        ids = self.reply_ids if self.reply_ids is not None else self.tokenizer.encode(self.reply)
        seq.slot, self.active[0], self.script = 0, seq, iter(ids)
        yield from ()

    def step(self) -> None:
        pass

    def read(self, wait: bool) -> list:
        seq = self.active[0]
        token = next(self.script, None) if seq is not None else None
        if token is not None:
            seq.stop.tokens.append(token)
            seq.on_token(token)
        elif seq is not None:  # the script is over: the sequence ends
            self.release(seq)
            return [seq]
        return []

    def release(self, seq) -> None:
        seq.done = True
        if self.active[0] is seq:
            self.active[0] = None

    def drain(self) -> None:
        pass


@contextlib.contextmanager
def scripted_server(max_context: int, eos: tuple[int, ...] = ()):
    """(scripted engine, tokenizer, URL) of an in-process server whose replies a test scripts (ScriptedEngine),
    on the built-in model's tokenizer."""
    from qwen38_model.default_model import default_model_path
    from qwen38_model.server import Server
    from qwen38_model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    model = ScriptedEngine(tokenizer)
    model.config = types.SimpleNamespace(eos_token_ids=list(eos))
    server = Server(model, tokenizer, "scripted", max_context=max_context, max_queue=1, cache_bytes=1 << 20,
                    log=sys.stdout, engine=model)
    with in_process(server) as url:
        yield model, tokenizer, url


def in_process(server):
    """The server in a thread of this process (so that the test can read its state and its model's)."""
    from qwen38_model.server import serving_in_thread

    return serving_in_thread(server)



def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["model-q8_0.gguf"]
    assert json.loads(urllib.request.urlopen(server + "/health").read())["status"] == "ok"


def test_chat_streamed_and_not_agree(client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**args)
    assert whole.usage.completion_tokens <= 8 and whole.choices[0].finish_reason in ("stop", "length")
    chunks = [c.choices[0].delta for c in client.chat.completions.create(**args, stream=True) if c.choices]
    assert "".join(d.content or "" for d in chunks) == whole.choices[0].message.content
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == \
        whole.choices[0].message.reasoning_content  # the template opens <think>: the reply starts reasoning


def test_completion_reuses_the_cached_prompt(client):
    first = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt="The quick brown fox jumps over", max_tokens=4, temperature=0,
                                      seed=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The quick brown fox jumps over", max_tokens=4, temperature=0, stream=True))
    assert text == again.choices[0].text


def test_bad_requests_are_json_errors(client, server):
    cases = [(b"{not json", "not valid JSON"), (b"[1]", "JSON object"),
             (b'{"messages": "hi"}', "messages must be"), (b'{"messages": [{"role": "user", "content": "x"}], '
                                                           b'"max_tokens": 0}', "max_tokens"),
             (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
             (b'{"messages": [{"role": "user", "content": "x"}], "n": 99}', f"n must be an integer in [1, {SLOTS}]"),
             (b'{"messages": [{"role": "user", "content": "x"}], "echo": true}', "echo is not supported")]
    for body, message in cases:
        status, answer = post(server + "/v1/chat/completions", body)
        assert status == 400 and message in answer["error"]["message"], (body, answer)
    with pytest.raises(openai.BadRequestError) as oversized:
        client.completions.create(model=MODEL, prompt="word " * 9000, max_tokens=4)
    assert oversized.value.code == "context_length_exceeded"
    assert post(server + "/v1/nothing", b"{}")[0] == 404
    assert client.completions.create(model=MODEL, prompt="still alive", max_tokens=2).usage.completion_tokens >= 1


def hold_slot(server: str) -> http.client.HTTPConnection:
    """A streamed 6000-token completion that holds a slot once its first event has come (close it to go away)."""
    host, port = server.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    connection.request("POST", "/v1/completions", json.dumps({"prompt": "Once", "max_tokens": 6000, "min_tokens": 6000,
                                                               "stream": True}), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")  # it holds a slot now
    connection.held = response
    return connection


def go_away(connection: http.client.HTTPConnection) -> None:
    connection.held.close()
    connection.close()


def wait_for(server: str, what: str, value: int, timeout: float = 30) -> None:
    """Until /health's `what` (running or waiting) is value."""
    deadline = time.monotonic() + timeout
    while (found := json.loads(urllib.request.urlopen(server + "/health").read())[what]) != value:
        assert time.monotonic() < deadline, (what, found, value)
        time.sleep(0.05)


def test_queue_is_bounded_beyond_the_slots(client, server):
    """Every slot held: one request waits (--max-queue 1), the next is a 429 with Retry-After; a slot freed by a
    client going away serves the waiting one."""
    assert json.loads(urllib.request.urlopen(server + "/health").read())["slots"] == SLOTS
    held = [hold_slot(server) for _ in range(SLOTS)]
    wait_for(server, "running", SLOTS)
    waiting = {}
    thread = threading.Thread(target=lambda: waiting.update(
        r=client.completions.create(model=MODEL, prompt="Queued", max_tokens=3)))
    thread.start()
    wait_for(server, "waiting", 1)
    with pytest.raises(openai.RateLimitError) as busy:
        client.completions.create(model=MODEL, prompt="One too many", max_tokens=3)
    assert busy.value.response.headers["retry-after"] == "1"
    start = time.monotonic()
    go_away(held[0])  # its 6000-token generation stops, the queued request takes the slot
    thread.join(timeout=60)
    assert waiting["r"].usage.completion_tokens >= 1 and time.monotonic() - start < 20
    for connection in held[1:]:
        go_away(connection)
    wait_for(server, "running", 0)


def test_a_client_that_goes_away_frees_its_slot(client, server):
    """A disconnected stream leaves the batch at the scheduler's next iteration (/metrics running drops), the
    others decoding on; the freed slot serves the next request at once."""
    held = [hold_slot(server) for _ in range(SLOTS)]
    wait_for(server, "running", SLOTS)
    go_away(held.pop())
    deadline = time.monotonic() + 20
    while scrape(server)["vllm:num_requests_running", frozenset()] != SLOTS - 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    served = client.completions.create(model=MODEL, prompt="Next in line", max_tokens=3)
    assert served.usage.completion_tokens >= 1
    assert scrape(server)["vllm:num_requests_waiting", frozenset()] == 0
    for connection in held:  # the others still stream: an event comes after the blank line ending the last read
        assert connection.held.readline() == b"\n" and connection.held.readline().startswith(b"data: ")
    for connection in held:
        go_away(connection)
    wait_for(server, "running", 0)


def streamed_text(client, prompt: str, **kwargs) -> tuple[str, float, float]:
    """A streamed completion's text, and when its first and last chunks came."""
    text, times = "", []
    for chunk in client.completions.create(model=MODEL, prompt=prompt, stream=True, **kwargs):
        times.append(time.monotonic())
        text += "".join(c.text for c in chunk.choices)
    return text, times[0], times[-1]


def concurrently(calls: list) -> list:
    """Each call in a thread of its own, all released at once; their results in order."""
    results, start = [None] * len(calls), threading.Barrier(len(calls))

    def run(i):
        start.wait()
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


def overlapped(windows: list[tuple[float, float]]) -> bool:
    """Whether some two of the (first chunk, last chunk) windows overlap: two streams open at once."""
    windows = sorted(windows)
    return any(later[0] < earlier[1] for earlier, later in zip(windows, windows[1:]))


# Each of its own first word, so that no request restores another's prefix (each prefills from scratch, alone or
# beside the others); one is longer than the server's prefill chunk (512 tokens): it joins in chunks while the
# others decode. One more request than slots: the last waits and joins when a slot frees up.
CONCURRENT = [("Alpha beta gamma", 24), ("Bright stars over the quiet harbor tonight", 12),
              ("Dear diary, " + "today was long. " * 60, 16), ("Every morning the baker", 20), ("Fog rolls in", 8)]


def test_concurrent_streams_each_get_their_solo_text(client):
    """Continuous batching is batch-invariant: SLOTS + 1 clients streaming at once, greedy, each get exactly the
    text their request gets alone."""
    assert len(CONCURRENT) == SLOTS + 1
    solo = [streamed_text(client, prompt, max_tokens=n, temperature=0)[0] for prompt, n in CONCURRENT]
    together = concurrently([lambda p=p, n=n: streamed_text(client, p, max_tokens=n, temperature=0)
                             for p, n in CONCURRENT])
    assert [text for text, _, _ in together] == solo
    assert overlapped([(first, last) for _, first, last in together])


def test_each_request_samples_with_its_own_settings_in_one_batch(client):
    """A seeded sampled request beside greedy ones (one with a repetition penalty, one with min_tokens) in one
    batch: each gets its solo text, the sampled one its seed's."""
    requests = [("Golden fields of wheat", dict(temperature=0.9, top_p=0.95, seed=5, max_tokens=20,
                                                      extra_body={"top_k": 40})),
                ("Harbor lights at dusk", dict(temperature=0, max_tokens=20)),
                ("Icicles on the eaves", dict(temperature=0, max_tokens=16,
                                              extra_body={"repetition_penalty": 1.3})),
                ("Jasmine in the garden", dict(temperature=0, max_tokens=12, extra_body={"min_tokens": 12}))]
    solo = [streamed_text(client, prompt, **kwargs)[0] for prompt, kwargs in requests]
    together = concurrently([lambda p=p, k=k: streamed_text(client, p, **k) for p, k in requests])
    assert [text for text, _, _ in together] == solo
    other_seed = streamed_text(client, requests[0][0], **{**requests[0][1], "seed": 6})[0]
    assert other_seed != solo[0]  # the seed is what the sampled text depends on


def test_n_choices_share_the_prompt_and_sample_with_their_seeds(client):
    """n choices (index 0..n-1) decode together from one prefill of the prompt; choice i samples with seed + i,
    so it is the text of a lone request with that seed. Streamed, each choice's deltas (the role first) join to
    its whole answer."""
    args = dict(model=MODEL, prompt="Kites above the dunes", max_tokens=10, temperature=0.9,
                extra_body={"top_k": 40})
    whole = client.completions.create(n=3, seed=3, **args)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    alone = [client.completions.create(seed=3 + i, **args) for i in range(3)]
    assert [(c.text, c.finish_reason) for c in whole.choices] == \
        [(a.choices[0].text, a.choices[0].finish_reason) for a in alone]
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert whole.usage.prompt_tokens == alone[0].usage.prompt_tokens
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Lanterns, please!"}], max_tokens=10,
                temperature=0.9, seed=8, n=2)
    answer = client.chat.completions.create(**chat)
    chunks = [c.choices[0] for c in client.chat.completions.create(**chat, stream=True) if c.choices]
    assert all(len(c.choices) == 1 for c in client.chat.completions.create(**chat, stream=True) if c.choices)
    for i, choice in enumerate(answer.choices):
        mine = [c for c in chunks if c.index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == choice.finish_reason
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert "".join(getattr(c.delta, "reasoning_content", None) or "" for c in mine) == \
            choice.message.reasoning_content


@pytest.fixture(scope="module")
def local():
    """The built-in model and its tokenizer in this process: what the module server serves, for the truth."""
    from qwen38_model import Qwen38ForCausalLM
    from qwen38_model.default_model import default_model_path
    from qwen38_model.tokenizer import load_tokenizer

    path = default_model_path()
    return Qwen38ForCausalLM.from_pretrained(path, device="cpu"), load_tokenizer(path)


def greedy_truth(model, ids: list[int], n: int, **kwargs) -> tuple[list[int], torch.Tensor]:
    """generate()'s greedy tokens after ids (the checkpoint's end tokens), and log_softmax of model(ids)'s raw
    logits at the position each was chosen at ([tokens, V])."""
    tokens = model.generate(torch.tensor([ids]), max_new_tokens=n, **kwargs)[0, len(ids):].tolist()
    logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
    return tokens, torch.log_softmax(logits, -1)


def test_logprobs_in_both_endpoints_streamed_and_not(client, server, local):
    """logprobs as OpenAI returns them, the raw logits' log-softmax of each token (log_softmax of model(ids) at
    its position) and the most likely alternatives, sorted: a completion's logprobs (tokens, token_logprobs,
    top_logprobs, text_offset), a chat's logprobs.content (token, logprob, bytes, top_logprobs); streamed,
    the chunks' parts join to the whole answer's."""
    model, tokenizer = local

    def text_of(token: int) -> str:
        return tokenizer.token_bytes(token).decode("utf-8", "replace")

    prompt = "Quiet rivers run"
    ids = tokenizer.encode(prompt)
    tokens, truth = greedy_truth(model, ids, 8)
    args = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    whole = client.completions.create(**args, logprobs=3)
    lp = whole.choices[0].logprobs
    assert lp.tokens == [text_of(t) for t in tokens] and whole.usage.completion_tokens == len(tokens)
    for t, token in enumerate(tokens):
        assert abs(lp.token_logprobs[t] - float(truth[t, token])) <= 1e-4, t
        best = truth[t].topk(3)
        assert lp.top_logprobs[t].keys() == {text_of(i) for i in best.indices.tolist()} | {text_of(token)}
        texts = [text_of(i) for i in best.indices.tolist()]
        for text, value in zip(texts, best.values.tolist()):
            if texts.count(text) == 1:  # two ids may show as one text (pieces of a character: U+FFFD)
                assert abs(lp.top_logprobs[t][text] - value) <= 1e-4
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[-1] <= len(whole.choices[0].text)
    chunks = [c.choices[0] for c in client.completions.create(**args, logprobs=3, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.choices[0].text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks for v in getattr(c.logprobs, field)] == getattr(lp, field), field
    just_chosen = client.completions.create(**args, logprobs=0).choices[0].logprobs  # the sampled token's only
    assert just_chosen.token_logprobs == lp.token_logprobs
    assert just_chosen.top_logprobs == [{text_of(t): v} for t, v in zip(tokens, lp.token_logprobs)]
    assert client.completions.create(**args).choices[0].logprobs is None

    messages = [{"role": "user", "content": "Name a colour."}]
    status, tokenized = post(server + "/tokenize", json.dumps({"messages": messages}).encode())
    assert status == 200
    tokens, truth = greedy_truth(model, tokenized["tokens"], 8)
    chat = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    answer = client.chat.completions.create(**chat, logprobs=True, top_logprobs=4).choices[0]
    content = answer.logprobs.content
    assert [c.token for c in content] == [text_of(t) for t in tokens]
    for t, (token, entry) in enumerate(zip(tokens, content)):
        assert abs(entry.logprob - float(truth[t, token])) <= 1e-4 and entry.bytes == list(tokenizer.token_bytes(token))
        assert [a.token for a in entry.top_logprobs] == [text_of(i) for i in truth[t].topk(4).indices.tolist()]
        values = [a.logprob for a in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and (entry.top_logprobs[0].token, values[0]) == \
            (entry.token, entry.logprob)  # greedy: the chosen token is the most likely
    streamed = [c.choices[0] for c in client.chat.completions.create(**chat, logprobs=True, top_logprobs=4, stream=True)
                if c.choices]
    joined = [e for c in streamed if c.logprobs is not None for e in c.logprobs.content]
    assert [(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs]) for e in joined] == \
        [(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs]) for e in content]
    bare = client.chat.completions.create(**chat, logprobs=True).choices[0].logprobs.content
    assert [(e.token, e.logprob, e.top_logprobs) for e in bare] == [(e.token, e.logprob, []) for e in content]
    assert client.chat.completions.create(**chat).choices[0].logprobs is None


def test_logprob_and_bias_fields_out_of_range_are_400s(server):
    """top_logprobs beyond 20 (or without logprobs: true), a completion's logprobs beyond 5, a logit_bias naming
    an id outside the vocabulary, holding more than 300 entries or a bias outside [-100, 100], a
    frequency_penalty outside [-2, 2]: each a 400 naming its field."""
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    text = {"prompt": "x", "max_tokens": 2}
    cases = [(chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be an integer in [0, 20]"),
             (chat, {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
             (chat, {"logprobs": 1}, "logprobs", "logprobs must be true or false"),
             (text, {"logprobs": 6}, "logprobs", "logprobs must be an integer in [0, 5]"),
             (text, {"logprobs": True}, "logprobs", "logprobs must be an integer"),
             (text, {"top_logprobs": 2}, "top_logprobs", "top_logprobs is not supported"),
             (chat, {"logit_bias": {"999999": 1}}, "logit_bias", "token id '999999' is not in the vocabulary [0, 501)"),
             (text, {"logit_bias": {"501": 1}}, "logit_bias", "token id '501'"),
             (text, {"logit_bias": {"-3": 1}}, "logit_bias", "token id '-3'"),
             (text, {"logit_bias": {"abc": 1}}, "logit_bias", "token id 'abc'"),
             (chat, {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300 entries, found 301"),
             (chat, {"logit_bias": {"5": 100.5}}, "logit_bias", "must be a number in [-100, 100]"),
             (text, {"logit_bias": {"5": "up"}}, "logit_bias", "must be a number in [-100, 100]"),
             (text, {"logit_bias": [5]}, "logit_bias", "logit_bias must be an object"),
             (chat, {"frequency_penalty": 2.5}, "frequency_penalty", "frequency_penalty must be a number in [-2.0, 2.0]"),
             (text, {"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be a number"),
             (text, {"frequency_penalty": "x"}, "frequency_penalty", "frequency_penalty must be a number")]
    for base, extra, param, message in cases:
        route = "/v1/chat/completions" if base is chat else "/v1/completions"
        status, answer = post(server + route, json.dumps({**base, **extra}).encode())
        assert status == 400 and answer["error"]["param"] == param and message in answer["error"]["message"], \
            (extra, answer)
    edge = {"logit_bias": {str(i): 100 if i % 2 else -100 for i in range(300)}, "frequency_penalty": -2,
            "logprobs": 5}
    assert post(server + "/v1/completions", json.dumps({**text, **edge}).encode())[0] == 200


def test_logit_bias_and_frequency_penalty_reach_the_sampler(client, server, local):
    """logit_bias +100 forces a token, -100 on the greedy token moves the greedy text off it; a request with
    a bias and a frequency penalty gets generate()'s text with the same arguments."""
    model, tokenizer = local
    prompt = "Tall pines sway"
    ids = tokenizer.encode(prompt)
    args = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    forced = client.completions.create(**args, logit_bias={"42": 100})
    assert forced.choices[0].text == "K" * 6
    greedy, _ = greedy_truth(model, ids, 6)
    banned = client.completions.create(**args, logprobs=0, logit_bias={str(greedy[0]): -100}).choices[0]
    assert banned.logprobs.tokens[0] != tokenizer.token_bytes(greedy[0]).decode("utf-8", "replace")
    for penalty in (0.8, -0.5):
        expected, _ = greedy_truth(model, ids, 12, logit_bias={42: 3.0}, frequency_penalty=penalty)
        answer = client.completions.create(**{**args, "max_tokens": 12}, logit_bias={"42": 3.0},
                                           frequency_penalty=penalty)
        assert answer.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True), penalty


def test_a_request_asking_for_logprobs_beside_others_changes_none_of_their_texts(client):
    """In one batch: a request with logprobs, one without, one with a logit bias and a frequency penalty;
    each gets exactly its solo text (the logprobs are the asking sequence's own selection graph)."""
    requests = [("Mossy stones", dict(temperature=0, max_tokens=16, logprobs=2)),
                ("Nightingales sing", dict(temperature=0, max_tokens=16)),
                ("Orchards in bloom", dict(temperature=0.8, seed=2, max_tokens=16, logit_bias={"300": 2.0},
                                           frequency_penalty=1.0))]
    solo = [streamed_text(client, prompt, **kwargs)[0] for prompt, kwargs in requests]
    together = concurrently([lambda p=p, k=k: streamed_text(client, p, **k) for p, k in requests])
    assert [text for text, _, _ in together] == solo
    assert solo[1] == client.completions.create(model=MODEL, prompt=requests[1][0], **requests[1][1]).choices[0].text


def test_a_reply_ending_mid_character_keeps_its_last_bytes():
    """A reply whose last token before its end token leaves a character unfinished (a lead byte): streamed and not,
    its text ends in U+FFFD as decode(ids) renders it, which is also how the next turn's cached history renders
    it (Scheduler.cache_next_turn); dropping the held bytes made the client's history miss that cache entry."""
    from qwen38_model.default_model import default_model_path
    from qwen38_model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    lead = next(i for i in range(tokenizer.tokenizer.get_vocab_size()) if tokenizer.token_bytes(i) == b"\xe4")
    eos = tokenizer.eos_token_ids[0]
    ids = tokenizer.encode("Hello there") + [lead, eos]
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert expected.endswith("\ufffd"), expected
    with scripted_server(max_context=512, eos=(eos,)) as (model, _, url):
        model.reply_ids = ids
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        args = dict(model="scripted", messages=[{"role": "user", "content": "Hi"}], max_tokens=32,
                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        answer = client.chat.completions.create(**args)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**args, stream=True)
                           if c.choices)
        completion = client.completions.create(model="scripted", prompt="Hi", max_tokens=32)
    assert answer.choices[0].finish_reason == "stop" and completion.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content == streamed == completion.choices[0].text == expected


def test_batch_invariant_off_reaches_the_engine_and_serves(client):
    """Server(batch_invariant=False), as `serve --batch-invariant off` builds it: the engine's step scratches are not
    rowwise (so from 8 rows the int8 GEMM runs on CUDA) and concurrent clients are served. On the CPU every product
    is its reference, so the texts still equal the solo runs; on CUDA they may differ (the flag's point)."""
    from qwen38_model import Qwen38ForCausalLM
    from qwen38_model.default_model import default_model_path
    from qwen38_model.server import Server
    from qwen38_model.tokenizer import load_tokenizer

    path = default_model_path()
    model = Qwen38ForCausalLM.from_pretrained(path, device="cpu")
    server = Server(model, load_tokenizer(path), MODEL, max_context=256, max_queue=2, cache_bytes=1 << 24,
                    max_batch=2, batch_invariant=False, log=sys.stdout)
    engine = server.scheduler.engine
    assert not engine.batch_invariant and not any(s.rowwise for s in engine.scratch.values())
    requests = [("Marbles rolling downhill", 6), ("Quiet harbour at dawn", 4), ("Frost on windows", 5)]
    solo = [client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0).choices[0].text
            for p, n in requests]
    with in_process(server) as url:
        other = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        together = concurrently([lambda p=p, n=n: streamed_text(other, p, max_tokens=n, temperature=0)
                                 for p, n in requests])
    assert [text for text, _, _ in together] == solo


def test_speculative_serves_concurrent_clients_through_one_engine(client):
    """--speculative mtp --max-batch 3: one BatchEngine whose step is the MTP step over its slots. Five concurrent
    greedy clients (different prompts, lengths, a stop string, a logit bias) on three slots, two of them waiting
    for a slot, each get the text of their solo run (the module server's: greedy speculative output is plain
    greedy's), streamed or not; n up to the slots; the prefix cache is shared; what the MTP step cannot do
    (logprobs, a constrained reply) is a 400 naming the field."""
    from qwen38_model import Qwen38ForCausalLM
    from qwen38_model.default_model import default_model_path
    from qwen38_model.server import Server
    from qwen38_model.tokenizer import load_tokenizer

    path = default_model_path()
    model = Qwen38ForCausalLM.from_pretrained(path, device="cpu")
    server = Server(model, load_tokenizer(path), MODEL, max_context=512, max_queue=2, cache_bytes=1 << 26,
                    max_batch=3, speculative="mtp", num_draft_tokens=2, log=sys.stdout)
    assert server.scheduler.engine.mtp is not None and server.max_batch == 3
    requests = [("Marbles rolling downhill", dict(max_tokens=12)), ("Quiet harbour at dawn", dict(max_tokens=5)),
                ("Yellow kites over fields", dict(max_tokens=9, stop=[" the"])),
                ("Copper wires humming", dict(max_tokens=11, logit_bias={"300": 2.0}, frequency_penalty=0.8)),
                ("Frost on windows", dict(max_tokens=7))]
    requests = [(prompt, dict(kwargs, temperature=0)) for prompt, kwargs in requests]
    solo = [client.completions.create(model=MODEL, prompt=prompt, **kwargs).choices[0].text
            for prompt, kwargs in requests]
    with in_process(server) as url:
        speculative = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        together = concurrently([lambda p=p, k=k: streamed_text(speculative, p, **k) for p, k in requests])
        assert [text for text, _, _ in together] == solo
        assert overlapped([(first, last) for _, first, last in together])  # decoded at once, not one by one
        assert server.scheduler.engine.mtp.policy.steps > 0  # (MTP steps ran)
        args = dict(model=MODEL, prompt=requests[0][0], **requests[0][1])
        answer = speculative.completions.create(**args)
        assert answer.choices[0].text == solo[0]
        assert answer.usage.prompt_tokens_details.cached_tokens >= answer.usage.prompt_tokens - 1  # the prefix cache
        assert [c.text for c in speculative.completions.create(**args, n=3).choices] == [solo[0]] * 3
        with pytest.raises(openai.BadRequestError) as several:
            speculative.completions.create(**args, n=4)
        assert several.value.param == "n"
        with pytest.raises(openai.BadRequestError) as no_logprobs:  # the MTP step reports none
            speculative.completions.create(**args, logprobs=1)
        assert no_logprobs.value.param == "logprobs"
        with pytest.raises(openai.BadRequestError) as unconstrained:  # the MTP step takes no token mask
            speculative.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                                response_format={"type": "json_object"})
        assert unconstrained.value.param == "response_format"


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{((?:[a-zA-Z_]+="(?:[^"\\]|\\.)*",?)*)\} (\S+)$')


def scrape(server: str) -> dict:
    """/metrics parsed, every line checked: {(name, frozenset of label pairs): value}."""
    with urllib.request.urlopen(server + "/metrics", timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            continue
        if line.startswith("# HELP "):
            continue
        match = SAMPLE.match(line)
        assert match, line
        labels = frozenset(re.findall(r'([a-zA-Z_]+)="((?:[^"\\]|\\.)*)"', match[2]))
        assert ("model_name", MODEL) in labels, line
        samples[match[1], labels - {("model_name", MODEL)}] = float(match[3])
    assert types["vllm:prompt_tokens_total"] == "counter" and types["vllm:num_requests_running"] == "gauge"
    assert types["vllm:e2e_request_latency_seconds"] == "histogram"
    return samples


def test_metrics_count_the_requests(client, server):
    """/metrics (no key needed): vLLM's counters grow by the usage the responses report, each request is
    one observation of the request histograms, one of the inter-token latency per token after the first."""
    before = scrape(server)
    usages = [client.completions.create(model=MODEL, prompt="Count to ten: one, two", max_tokens=5,
                                        temperature=0).usage,
              client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=3, temperature=0).usage]
    after = scrape(server)

    def grew(name: str, labels=frozenset()) -> float:
        return after[name, labels] - before.get((name, labels), 0.0)

    assert grew("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert grew("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert grew("vllm:prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages)
    assert grew("vllm:prefix_cache_hits_total") == sum(u.prompt_tokens_details.cached_tokens for u in usages)
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert grew(name + "_count") == 2 and grew(name + "_bucket", frozenset({("le", "+Inf")})) == 2
        assert grew(name + "_sum") > 0
    assert grew("vllm:inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    assert after["vllm:num_requests_running", frozenset()] == 0
    assert after["vllm:num_requests_waiting", frozenset()] == 0
    assert after["qwen38:state_bytes", frozenset({("tier", "device")})] > 0
    buckets = sorted((float(dict(k[1])["le"]), v) for k, v in after.items()
                     if k[0] == "vllm:e2e_request_latency_seconds_bucket")
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative


def test_serve_mistakes_are_one_line_before_the_load(capsys):
    """A port out of range (exit 2) or in use (exit 1, an OS error), a --max-context beyond the model: one line
    before the weights load, never "serving on" followed by uvicorn's traceback or 500s to every request."""
    from qwen38_model import cli

    def error(*args) -> tuple[int, str]:
        code = cli.main(["serve", *args])
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1, err
        return code, err

    assert error("--port", "99999") == (2, "error: --port must be in [1, 65535], found 99999")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert error("--port", str(port)) == (1, f"error: cannot listen on 127.0.0.1:{port}: port {port} is in use")
    # A subprocess: before the check, this server started and would have served (500s) until killed.
    result = subprocess.run([sys.executable, "-m", "qwen38_model", "serve", "--port", str(port), "--max-context",
                             "100000000"], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr.strip()) == \
        (2, "error: --max-context 100000000 exceeds the model's context of 262144 tokens"), result.stderr


def test_max_batch_sets_the_slots_and_a_mistake_is_one_line(capsys, built_servers):
    """--max-batch N: the engine's N slots (default on the CPU: 4, with --speculative too; N when given); one that
    does not fit the memory, or 0, is one line before the load (exit 2)."""
    from qwen38_model import cli

    servers, port = built_servers

    def error(*args) -> tuple[int, str]:
        code = cli.main(["serve", "--port", port, "--device", "cpu", *args])
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1, err
        return code, err

    code, err = error("--max-batch", "1000000")
    assert code == 2 and err.startswith("error: --max-batch 1000000: 1000000 slots of --max-context 8192 tokens "), err
    assert err.endswith(" GB available"), err
    assert error("--max-batch", "0") == (2, "error: --max-batch must be >= 1, found 0")
    code, err = error("--speculative", "mtp", "--max-batch", "1000000")
    assert code == 2 and err.endswith(" GB available") and "the verify's GDN states after each of its 4 tokens" in err
    assert not servers
    assert cli.main(["serve", "--port", port, "--device", "cpu", "--max-batch", "2", "--max-context", "256"]) == 0
    assert servers[-1].max_batch == 2 and "2 sequence slots of 256 tokens" in capsys.readouterr().err
    assert cli.main(["serve", "--port", port, "--device", "cpu", "--max-context", "256"]) == 0
    assert servers[-1].max_batch == 4
    serve = ["serve", "--port", port, "--device", "cpu", "--max-context", "256", "--speculative", "mtp"]
    assert cli.main(serve) == 0 and servers[-1].max_batch == 4 and servers[-1].scheduler.engine.mtp is not None
    assert cli.main([*serve, "--max-batch", "3"]) == 0
    assert servers[-1].max_batch == 3 and servers[-1].scheduler.engine.mtp is not None
    assert "3 sequence slots of 256 tokens (MTP speculative decoding)" in capsys.readouterr().err


def test_fields_a_request_leaves_out_take_the_checkpoint_settings():
    """As vLLM with a model's generation config: the checkpoint's sampling settings are the defaults of a
    request's fields, the request's own values win; without any, OpenAI's defaults (temperature 1, no top-k)."""
    from qwen38_model.server import Server

    def sampling(server, body):
        kwargs = server.generation_kwargs({"max_tokens": 4, **body}, prompt_tokens=3)
        return {k: kwargs[k] for k in ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")}

    plain = Server(None, None, "m", max_context=64, max_queue=1, cache_bytes=1 << 20)
    assert sampling(plain, {}) == dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                       repetition_penalty=1.0)
    released = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05}
    server = Server(None, None, "m", max_context=64, max_queue=1, cache_bytes=1 << 20, sampling=released)
    assert sampling(server, {}) == dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, min_p=0.0,
                                        repetition_penalty=1.05)
    assert sampling(server, {"temperature": 0, "top_p": 0.5}) == dict(do_sample=False, temperature=1.0, top_k=20,
                                                                      top_p=0.5, min_p=0.0, repetition_penalty=1.05)
    # vLLM's top_k (-1 or 0: none), min_p and repetition_penalty (over prompt and output) reach generate().
    assert sampling(server, {"top_k": -1, "min_p": 0.05, "repetition_penalty": 1.2}) == dict(
        do_sample=True, temperature=0.6, top_k=0, top_p=0.95, min_p=0.05, repetition_penalty=1.2)


@pytest.fixture
def built_servers(monkeypatch):
    """`serve` run for its start-up only: the Servers it builds (in order) and a free port to give it."""
    import uvicorn

    from qwen38_model import server

    servers = []

    class Recorded(server.Server):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            servers.append(self)

    monkeypatch.setattr(server, "Server", Recorded)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets: None)  # no serving: the server is built
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return servers, port


def test_serve_reads_the_checkpoint_sampling_settings(capsys, built_servers, tmp_path, oracle_dir):
    """`serve` hands the server the settings of the checkpoint's generation_config.json (checked before the
    load, as `generate` checks them), and says so."""
    import shutil

    from qwen38_model import cli

    folder = tmp_path / "hf"
    shutil.copytree(oracle_dir / "hf", folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, "temperature": 0.6,
                                                               "top_k": 20, "top_p": 0.95}))
    servers, port = built_servers
    assert cli.main(["serve", "--model", str(folder), "--port", port, "--device", "cpu"]) == 0
    (built,) = servers
    assert built.sampling == dict(temperature=0.6, top_k=20, top_p=0.95, min_p=0.0, repetition_penalty=1.0)
    assert "sampling fields a request leaves out: the checkpoint's top_k 20, top_p 0.95, temperature 0.6\n" in \
        capsys.readouterr().err
    (folder / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, "top_p": 0}))
    assert cli.main(["serve", "--model", str(folder), "--port", port, "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == "error: top_p must be in (0, 1], found 0.0"
    assert len(servers) == 1  # refused before the load


def test_serve_batch_invariant_option(capsys, built_servers, oracle_dir):
    """`serve --batch-invariant off` builds a server whose engine is not batch-invariant and says so at start;
    the default is on; another value is refused before the load."""
    from qwen38_model import cli

    servers, port = built_servers
    common = ["serve", "--model", str(oracle_dir / "hf"), "--port", port, "--device", "cpu", "--max-batch", "2"]
    assert cli.main(common) == 0
    assert cli.main([*common, "--batch-invariant", "off"]) == 0
    assert [s.scheduler.engine.batch_invariant for s in servers] == [True, False]
    assert ", not batch-invariant\n" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([*common, "--batch-invariant", "maybe"])
    assert len(servers) == 2
    for s in servers:
        s.close()


def test_nothing_is_silently_ignored(client, server):
    """A field the server does not implement is a 400 naming it, a model it does not serve a 404, as vLLM."""
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=4, temperature=0)
    for extra, param in [({"response_format": {"type": "json_schema"}}, "response_format"),
                         ({"logit_bias": {"5": 101}}, "logit_bias"), ({"guided_json": {}}, "guided_json"),
                         ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"top_k": -2}, "top_k"),
                         ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                         ({"stream_options": {"include_usage": True}}, "stream_options"),
                         ({"chat_template_kwargs": []}, "chat_template_kwargs")]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**chat, extra_body=extra)
        assert refused.value.param == param and param in refused.value.message, (extra, refused.value.message)
    assert post(server + "/v1/completions", b'{"prompt": "x", "stream": "yes"}')[1]["error"]["param"] == "stream"
    assert post(server + "/v1/completions", b'{"prompt": "x", "response_format": {"type": "json_object"}}'
                )[1]["error"]["param"] == "response_format"  # a chat's only
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(**{**chat, "model": "gpt-4o"})
    assert unknown.value.code == "model_not_found" and "gpt-4o" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as image:
        client.chat.completions.create(**{**chat, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}]})
    assert "only text parts" in image.value.message
    # The accepted ones are used: no-op values pass, text parts join, kwargs reach the template.
    plain = client.chat.completions.create(**chat, extra_body={"response_format": {"type": "text"}, "logit_bias": {},
                                                               "frequency_penalty": 0, "logprobs": False,
                                                               "top_logprobs": 0,
                                                               "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1})
    parts = client.chat.completions.create(**{**chat, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hel"}, {"type": "text", "text": "lo!"}]}]})
    joined = client.chat.completions.create(**{**chat, "messages": [{"role": "user", "content": "Hel\nlo!"}]})
    assert parts.choices[0].message.content == joined.choices[0].message.content
    assert parts.usage.prompt_tokens == joined.usage.prompt_tokens
    thinking_off = client.chat.completions.create(
        **chat, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert thinking_off.usage.prompt_tokens > plain.usage.prompt_tokens  # the template's empty <think></think>


def test_completion_prompt_as_token_ids(client):
    from qwen38_model.default_model import default_model_path
    from qwen38_model.tokenizer import load_tokenizer

    ids = load_tokenizer(default_model_path()).encode("The quick brown fox")
    args = dict(model=MODEL, max_tokens=4, temperature=0)
    text = client.completions.create(prompt="The quick brown fox", **args)
    for prompt in (ids, [ids], ["The quick brown fox"]):
        same = client.completions.create(prompt=prompt, **args)
        assert (same.choices[0].text, same.usage.prompt_tokens) == (text.choices[0].text, len(ids))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(prompt=[10**9], **args)


# Two prompts of their own first words (no request restores another's prefix but its own).
SEVERAL = ["Marbles rolled across the floor", "Nightingales sing in"]


def test_several_prompts_in_one_completion(client, server):
    """prompt as a list of P prompts (strings or token-id lists), n choices each: choice p * n + j is prompt p's
    sample j, the text of the request with prompt p alone (greedy; sampled, with the same seed: seed + j); usage
    sums each prompt's tokens once and every choice's; streamed, each chunk carries its choice's index."""
    from qwen38_model.default_model import default_model_path
    from qwen38_model.tokenizer import load_tokenizer

    args = dict(model=MODEL, max_tokens=8, temperature=0)
    alone = [client.completions.create(prompt=prompt, n=2, **args) for prompt in SEVERAL]
    whole = client.completions.create(prompt=SEVERAL, n=2, **args)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [(c.text, c.finish_reason) for c in whole.choices] == \
        [(c.text, c.finish_reason) for a in alone for c in a.choices]
    assert whole.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    # cached_tokens sums the prompts' (each goes on from a prompt a solo run cached: both are restored).
    longer = [prompt + " and on" for prompt in SEVERAL]
    both = client.completions.create(prompt=longer, **args)
    cached = both.usage.prompt_tokens_details.cached_tokens
    assert sum(a.usage.prompt_tokens - 1 for a in alone) <= cached < both.usage.prompt_tokens
    assert [c.text for c in both.choices] == [client.completions.create(prompt=p, **args).choices[0].text
                                              for p in longer]
    chunks = list(client.completions.create(prompt=SEVERAL, n=2, stream=True,
                                            stream_options={"include_usage": True}, **args))
    assert all(len(c.choices) == 1 for c in chunks[:-1]) and chunks[-1].choices == []
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text and mine[-1].finish_reason == choice.finish_reason
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
        (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    tokenizer = load_tokenizer(default_model_path())
    ids = client.completions.create(prompt=[tokenizer.encode(p) for p in SEVERAL], n=2, **args)
    assert [c.text for c in ids.choices] == [c.text for c in whole.choices]
    assert ids.usage.prompt_tokens == whole.usage.prompt_tokens
    sampled = dict(model=MODEL, max_tokens=8, temperature=0.9, seed=21, extra_body={"top_k": 40})
    together = client.completions.create(prompt=SEVERAL, n=2, **sampled)
    solo = [client.completions.create(prompt=p, **{**sampled, "seed": 21 + j}).choices[0].text
            for p in SEVERAL for j in range(2)]
    assert [c.text for c in together.choices] == solo
    # What is refused names prompt (or n): an empty list, mixed kinds, junk, more sequences than the slots.
    for prompt in ([], ["one", [1, 2]], [[1, 2], []], ["one", ""], [["one"]], [1, "two"], [None]):
        status, answer = post(server + "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 2}).encode())
        assert status == 400 and answer["error"]["param"] == "prompt", (prompt, answer)
    with pytest.raises(openai.BadRequestError) as too_many:
        client.completions.create(model=MODEL, prompt=["a", "b", "c"], n=2, max_tokens=2)
    assert too_many.value.param == "prompt" and "6 sequences" in too_many.value.message
    with pytest.raises(openai.BadRequestError) as large_n:
        client.completions.create(model=MODEL, prompt=["a", "b"], n=SLOTS + 1, max_tokens=2)
    assert large_n.value.param == "n"
    assert client.completions.create(model=MODEL, prompt=["a"] * SLOTS, max_tokens=2).usage.completion_tokens >= SLOTS


def test_stream_usage_only_when_asked_and_the_role_first(client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=4, temperature=0,
                stream=True)
    chunks = list(client.chat.completions.create(**args))
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.usage is None for c in chunks)
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    counted = list(client.chat.completions.create(**args, stream_options={"include_usage": True}))
    assert counted[-1].choices == [] and counted[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in counted[:-1]) and counted[-2].choices[0].finish_reason in ("stop", "length")
    text = list(client.completions.create(model=MODEL, prompt="Once", max_tokens=3, stream=True,
                                          stream_options={"include_usage": True}))
    assert text[-1].choices == [] and text[-1].usage.completion_tokens >= 1


def test_tokenize_and_detokenize(client, server):
    """vLLM's shapes: {"prompt"} or {"messages"} -> {"tokens", "count", "max_model_len"}; {"tokens"} -> {"prompt"}."""
    status, answer = post(server + "/tokenize", b'{"prompt": "The quick brown fox"}')
    assert status == 200 and answer["count"] == len(answer["tokens"]) > 0 and answer["max_model_len"] == 8192
    assert post(server + "/detokenize", json.dumps({"tokens": answer["tokens"]}).encode()) == \
        (200, {"prompt": "The quick brown fox"})
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    status, answer = post(server + "/tokenize", b'{"messages": [{"role": "user", "content": "Hi"}]}')
    assert status == 200 and answer["count"] == chat.usage.prompt_tokens
    for route, body in [("/tokenize", b'{"text": "x"}'), ("/tokenize", b'{"prompt": 3}'),
                        ("/detokenize", b'{"tokens": [-1]}'), ("/detokenize", b'{"tokens": "x"}')]:
        assert post(server + route, body)[0] == 400, (route, body)


def test_api_key_cors_log_and_sigterm(tmp_path):
    """QWEN38_API_KEY (or --api-key): every route but /health, /metrics needs the key, else 401 as OpenAI; CORS for
    --allowed-origins only; one stderr line per request; SIGTERM with a generation in flight exits 0."""
    import os
    import signal

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "stderr", "w+")
    process = subprocess.Popen([sys.executable, "-m", "qwen38_model", "serve", "--port", str(port),
                                "--served-model-name", "qwen", "--allowed-origins", "http://ui.example"],
                               stderr=log, text=True, env={**os.environ, "QWEN38_API_KEY": "secret"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5)  # /health needs no key
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
                time.sleep(0.3)
        for key in ("wrong", "none"):
            with pytest.raises(openai.AuthenticationError) as refused:
                openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0).models.list()
            assert refused.value.code == "invalid_api_key"
        assert post(url + "/tokenize", b'{"prompt": "x"}')[0] == 401
        assert urllib.request.urlopen(url + "/metrics", timeout=30).status == 200  # open, as in vLLM
        client = openai.OpenAI(base_url=url + "/v1", api_key="secret", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["qwen"]
        assert client.completions.create(model="qwen", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1

        def preflight(origin: str) -> tuple[int, str | None]:
            request = urllib.request.Request(url + "/v1/chat/completions", method="OPTIONS", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"})
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return response.status, response.headers.get("access-control-allow-origin")
            except urllib.error.HTTPError as e:
                return e.code, e.headers.get("access-control-allow-origin")

        assert preflight("http://ui.example") == (200, "http://ui.example")
        assert preflight("http://elsewhere.example")[1] is None
        host = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        host.request("POST", "/v1/completions", json.dumps({"prompt": "Once", "max_tokens": 6000, "min_tokens": 6000,
                                                             "stream": True}),
                     {"Content-Type": "application/json", "Authorization": "Bearer secret"})
        response = host.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")  # generating now
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        host.close()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    lines = (tmp_path / "stderr").read_text().splitlines()
    served = [line for line in lines if line.startswith("cmpl-")]
    assert len(served) == 2 and "POST /v1/completions: " in served[0], lines
    assert " 2 out, TTFT " in served[0] and "tok/s" in served[0] and "0 cached" in served[0], served
    assert "ended early" in served[1], served


def test_chat_template_file_replaces_the_checkpoint_one(built_servers, tmp_path, oracle_dir):
    """--chat-template FILE: a folder without a template can chat (without it: a 400)."""
    import shutil

    from qwen38_model import cli, server

    folder = tmp_path / "hf"
    shutil.copytree(oracle_dir / "hf", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]")
    servers, port = built_servers
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    assert cli.main(["serve", "--model", str(folder), "--port", port, "--device", "cpu"]) == 0
    with pytest.raises(server.RequestError, match="no chat template"):
        servers[-1].chat_prompt(body)
    assert cli.main(["serve", "--model", str(folder), "--port", port, "--device", "cpu", "--chat-template",
                     str(tmp_path / "t.jinja")]) == 0
    assert servers[-1].chat_prompt(body) == "[user] Hi\n[assistant]"
    assert cli.main(["serve", "--model", str(folder), "--port", port, "--chat-template", str(tmp_path / "no")]) == 2


def test_thinking_goes_to_reasoning_content():
    """As vLLM's qwen3 reasoning parser: with the template's thinking on (the prompt opens <think>), the reply's
    text before </think> is message.reasoning_content (delta.reasoning_content streamed), the rest content;
    with it off (enable_thinking false), a reply that opens <think> itself is split the same way. A scripted
    model (fixed tokens) in this process, so that the reply does hold a </think>."""
    from qwen38_model.chat_reply import ThinkingSplit

    with scripted_server(max_context=512) as (model, tokenizer, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        args = dict(model="scripted", messages=[{"role": "user", "content": "Hi"}], max_tokens=64)
        for reply, extra in [("I think so.</think>\n\nHello!", {}),
                             ("<think>I think so.</think>\n\nHello!", {"enable_thinking": False})]:
            model.reply = reply
            message = client.chat.completions.create(**args, extra_body={"chat_template_kwargs": extra}).choices[0]
            assert (message.message.reasoning_content, message.message.content) == ("I think so.", "\n\nHello!")
            deltas = [c.choices[0].delta for c in client.chat.completions.create(
                **args, stream=True, extra_body={"chat_template_kwargs": extra})]
            assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "I think so."
            assert "".join(d.content or "" for d in deltas) == "\n\nHello!"
            assert not any("think>" in (d.content or "") for d in deltas)
        model.reply = "Plain answer."  # thinking off, no <think>: all content, no reasoning_content
        message = client.chat.completions.create(
            **args, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
        assert message.content == "Plain answer." and getattr(message, "reasoning_content", None) is None
    split = ThinkingSplit(opened=True)  # a </think> split across pieces is held back, never shown as content
    pieces = [split.feed(p) for p in ("abc</th", "ink>def")] + [split.feed("", final=True)]
    assert pieces == [("abc", ""), ("", "def"), ("", "")]


def streamed_calls(deltas) -> list[tuple[str, str, str]]:
    """A stream's tool calls as (id, name, arguments): each call's first delta has its id, type and name (its
    index the next), the arguments its deltas' pieces joined."""
    calls = {}
    for d in [d for delta in deltas for d in delta.tool_calls or []]:
        if d.index not in calls:
            assert d.index == len(calls) and d.id.startswith("call_") and d.type == "function" and d.function.name
            calls[d.index] = [d.id, d.function.name, ""]
        else:
            assert d.id is None and d.function.name is None
        calls[d.index][2] += d.function.arguments or ""
    return [tuple(c) for c in calls.values()]


def test_tool_call_arguments_stream_as_they_arrive():
    """ToolCallSplit fed a character at a time (the finest stream): the call's name goes out once its block's
    head has come, its arguments piece by piece while the block is open, and they join to the arguments the
    whole reply parses to; a block whose JSON breaks after its head becomes content, as in the whole reply."""
    from qwen38_model.chat_reply import ToolCallSplit

    def fed(reply: str, pieces: list[str]):
        split, content, deltas = ToolCallSplit(), "", []
        for i, piece in enumerate(pieces):
            text, new = split.feed(piece, final=i == len(pieces) - 1)
            content, deltas = content + text, deltas + [(i, d) for d in new]
        return split, content, deltas

    call = '<tool_call>\n{"name": "search", "arguments": {"query": "a \\"quoted\\" {brace}", "n": [1, 2]}}\n</tool_call>'
    reply = "Let me look.\n" + call + "\n" + call.replace("search", "fetch")
    whole, whole_content, _ = fed(reply, [reply])
    split, content, deltas = fed(reply, list(reply) + [""])
    assert content == whole_content == "Let me look." and len(split.calls) == len(whole.calls) == 2
    for index, complete in enumerate(split.calls):
        mine = [(i, d) for i, d in deltas if d["index"] == index]
        assert mine[0][1]["function"]["name"] == complete["function"]["name"] and mine[0][1]["id"] == complete["id"]
        assert "".join(d["function"]["arguments"] for _, d in mine) == complete["function"]["arguments"] == \
            whole.calls[index]["function"]["arguments"] == '{"query": "a \\"quoted\\" {brace}", "n": [1, 2]}'
        assert len(mine) > 10  # piece by piece, before the block closed
        assert mine[-1][0] < reply.index("</tool_call>", reply.index(complete["function"]["name"]))
    broken = "Hm. " + call.replace('"n": [1, 2]}}', '"n": [1, 2}}')
    split, content, deltas = fed(broken, list(broken) + [""])
    whole, whole_content, _ = fed(broken, [broken])
    assert content == whole_content == broken and not split.calls and not whole.calls
    assert deltas and deltas[0][1]["function"]["name"] == "search"  # what went out before the JSON broke


def test_tool_calls_parsed_from_the_reply():
    """As vLLM's hermes parser reads Qwen's tool calls: with tools (rendered by the chat template), the reply's
    <tool_call> blocks are message.tool_calls (streamed: the name, then the arguments piece by piece, joining to
    the whole answer's), finish_reason tool_calls,
    the text outside them content (null when empty); a block that is not JSON stays content; tool_choice
    "none" parses nothing; a named function not among the tools is a 400; a tool message and an assistant's
    tool_calls reach the template. A scripted model (fixed tokens), as test_thinking_goes_to_reasoning_content
    ("required" and a named function constrain the reply: test_server_tool_choice.py, on the built-in model)."""
    with scripted_server(max_context=1024) as (model, tokenizer, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                   "parameters": {"type": "object",
                                                                  "properties": {"city": {"type": "string"}}}}}]
        args = dict(model="scripted", messages=[{"role": "user", "content": "Weather?"}], max_tokens=200, tools=tools,
                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'

        def both(reply: str):
            model.reply = reply
            whole = client.chat.completions.create(**args).choices[0]
            chunks = [c.choices[0] for c in client.chat.completions.create(**args, stream=True)]
            deltas = [c.delta for c in chunks]
            content = "".join(d.content or "" for d in deltas)
            assert (content or None) == whole.message.content and chunks[-1].finish_reason == whole.finish_reason
            assert [call[1:] for call in streamed_calls(deltas)] == [(c.function.name, c.function.arguments)
                                                                     for c in whole.message.tool_calls or []]
            return whole

        one = both(call % "Paris")
        assert one.finish_reason == "tool_calls" and one.message.content is None
        [parsed] = one.message.tool_calls
        assert parsed.id.startswith("call_") and parsed.type == "function" and parsed.function.name == "get_weather"
        assert json.loads(parsed.function.arguments) == {"city": "Paris"}
        two = both("Checking both.\n" + call % "Paris" + "\n" + call % "Rome")
        assert two.message.content == "Checking both." and two.finish_reason == "tool_calls"
        assert [json.loads(c.function.arguments)["city"] for c in two.message.tool_calls] == ["Paris", "Rome"]
        bad = '<tool_call>\n{"name": get_weather, "arguments": {"city": "Oslo"}}</tool_call>'
        malformed = both("Hm. " + bad)
        assert malformed.message.content == "Hm. " + bad and not malformed.message.tool_calls
        assert malformed.finish_reason == "length"  # the scripted model sends no end token
        model.reply = call % "Paris"
        none = client.chat.completions.create(**args, tool_choice="none").choices[0]
        assert none.message.content == call % "Paris" and not none.message.tool_calls
        with pytest.raises(openai.BadRequestError) as unknown:
            client.chat.completions.create(**args, tool_choice=dict(type="function", function=dict(name="other")))
        assert unknown.value.param == "tool_choice" and "not among the tools" in unknown.value.message
        # The round trip: the assistant's call (arguments a JSON string) and the tool's answer, rendered.
        history = [{"role": "user", "content": "Weather?"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": parsed.id, "type": "function",
                        "function": {"name": "get_weather", "arguments": parsed.function.arguments}}]},
                   {"role": "tool", "tool_call_id": parsed.id, "content": "Sunny, 21 C"}]
        status, tokenized = post(url + "/tokenize", json.dumps({"messages": history, "tools": tools}).encode())
        assert status == 200, tokenized
        prompt = post(url + "/detokenize", json.dumps({"tokens": tokenized["tokens"]}).encode())[1]["prompt"]
        assert '"name": "get_weather"' in prompt and "<tools>" in prompt  # the tools' block, in Qwen3's words
        assert 'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in prompt
        assert call % "Paris" in prompt and "<tool_response>\nSunny, 21 C\n</tool_response>" in prompt
        model.reply = "It is sunny."
        answer = client.chat.completions.create(**{**args, "messages": history}).choices[0]
        assert answer.message.content == "It is sunny." and answer.finish_reason == "length"


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                          "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


# The template's thinking off: a constrained reply after the thinking (structured.py) would first write the random
# model's thinking, which seldom ends.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def structured(client, schema: dict | None = None, stream: bool = False, **kwargs) -> list[tuple[str, str]]:
    """Each choice's (content, finish_reason) of a chat whose response_format is json_schema (json_object
    without a schema), the thinking off; streamed, each choice's deltas joined."""
    form = {"type": "json_object"} if schema is None else \
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    kwargs["extra_body"] = {**NO_THINKING, **kwargs.get("extra_body", {})}
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Who lives here? Answer in JSON."}],
                response_format=form, **kwargs)
    if not stream:
        return [(c.message.content, c.finish_reason) for c in client.chat.completions.create(**args).choices]
    chunks = [c.choices[0] for c in client.chat.completions.create(**args, stream=True) if c.choices]
    return [("".join(c.delta.content or "" for c in chunks if c.index == i),
             [c.finish_reason for c in chunks if c.index == i][-1]) for i in range(kwargs.get("n", 1))]


def test_response_format_constrains_the_reply_to_the_schema(client):
    """json_schema and json_object replies are constrained decoding (llguidance's mask on the logits, in the
    sequence's selection graph): every choice parses and validates, ends where the JSON does (finish_reason
    stop, no end token needed), streamed as not, n > 1 each with its own matcher (the thinking off:
    test_server_tool_choice.py has a constrained reply after the thinking)."""
    jsonschema = pytest.importorskip("jsonschema")
    sampled = dict(max_tokens=60, temperature=0.9, seed=11, n=2, extra_body={"top_k": 40})
    whole = structured(client, PERSON, **sampled)
    assert whole == structured(client, PERSON, stream=True, **sampled)
    greedy = structured(client, PERSON, max_tokens=60, temperature=0)
    for content, finish in whole + greedy:
        jsonschema.validate(json.loads(content), PERSON)
        assert finish == "stop"
    assert len({content for content, _ in whole}) == 2  # each choice samples with its own seed
    # json_object: any object. The random model writes long keys, so a bias makes it close one: {"": ...}.
    quote, brace = (tokenizer_id(client, text) for text in ('"', "}"))
    [(content, finish)] = structured(client, max_tokens=20, temperature=0, logit_bias={quote: 100, brace: 50})
    assert list(json.loads(content)) == [""] and finish == "stop"


def tokenizer_id(client, text: str) -> str:
    [token] = post(str(client.base_url).removesuffix("/v1/") + "/tokenize", json.dumps({"prompt": text}).encode()
                   )[1]["tokens"]
    return str(token)


def test_response_format_errors_name_it(client):
    """A schema the grammar library rejects, or a response_format of no known shape, is a 400 naming
    response_format (with llguidance's reason); so is a forced tool call beside it."""
    for form, says in [({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}, "wat"),
                       ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format must be"),
                       ({"type": "yaml"}, "response_format must be")]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                           response_format=form)
        assert refused.value.param == "response_format" and says in refused.value.message, refused.value.message
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as both:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       tools=tools, tool_choice="required", response_format={"type": "json_object"})
    assert both.value.param == "response_format"


def test_constrained_requests_beside_others_change_none_of_their_texts(client):
    """In one batch: two constrained chats (each waits for its token before its next mask) and two greedy
    completions; the completions get their solo texts, the constrained ones theirs."""
    plain = [("Quartz and granite", dict(temperature=0, max_tokens=20)),
             ("Rivers under ice", dict(temperature=0, max_tokens=14))]
    solo = [streamed_text(client, prompt, **kwargs)[0] for prompt, kwargs in plain]
    constrained = dict(max_tokens=60, temperature=0.7, seed=4)
    solo_json = structured(client, PERSON, **constrained)
    together = concurrently([lambda p=p, k=k: streamed_text(client, p, **k)[0] for p, k in plain] +
                            [lambda: structured(client, PERSON, **constrained)] * 2)
    assert together == solo + [solo_json] * 2


@pytest.mark.cuda
def test_gpu_100_streamed_requests_leak_nothing():
    """The server in this process (so that its GPU memory can be read) on the built-in model: after a warm-up
    request (engine, graph capture), 100 sequential streamed chats, each with another prompt, leave
    torch.cuda.memory_allocated() where it was. The prefix cache holds snapshots by design: it must stay in its
    budget (small here, so it evicts all along) and is emptied before both readings."""
    import gc

    from qwen38_model import Qwen38ForCausalLM
    from qwen38_model.server import Server
    from qwen38_model.default_model import default_model_path
    from qwen38_model.tokenizer import load_tokenizer

    path = default_model_path()
    model = Qwen38ForCausalLM.from_pretrained(path, device="cuda")
    server = Server(model, load_tokenizer(path), path.name, max_context=512, max_queue=4, cache_bytes=4 << 20)
    with in_process(server) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

        def streamed_chat(i: int) -> str:
            chunks = list(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Request {i}: say something."}], max_tokens=16,
                temperature=0, stream=True))
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        def allocated_without_cache() -> int:
            server.cache.entries.clear()
            server.cache.host.clear()
            gc.collect()
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()

        streamed_chat(-1)
        before = allocated_without_cache()
        for i in range(100):
            streamed_chat(i)
            assert server.cache.nbytes <= server.cache.max_bytes
        assert server.scheduler.engine.use_graph and server.scheduler.engine.step_graphs
        assert allocated_without_cache() == before


def test_the_prefix_cache_hits_at_message_boundaries(client, local):
    """States are cached where the templated prompt ends a message: a later request with the same system
    prompt and another question restores it (and its reply is the uncached greedy one); turn 2 of a chat
    restores all of its history but its new message: the reply as the template renders it back was cached."""
    model, tokenizer = local
    system = {"role": "system", "content": "You answer in one short line. Keep to the facts. " * 12 + "(b7)"}
    asks = [[system, {"role": "user", "content": "What is two and two?"}],
            [system, {"role": "user", "content": "Name a colour."}]]
    first, second = (client.chat.completions.create(model=MODEL, messages=m, max_tokens=6, temperature=0)
                     for m in asks)
    system_tokens = len(tokenizer.encode(tokenizer.apply_chat_template([system], add_generation_prompt=False)))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= system_tokens
    ids = tokenizer.encode(tokenizer.apply_chat_template(asks[1]))
    tokens = greedy_truth(model, ids, 6)[0]
    message = second.choices[0].message
    served = (message.reasoning_content or "") + (message.content or "")
    assert served.replace("\n", "") == tokenizer.decode(tokens, skip_special_tokens=True).replace(
        "<think>", "").replace("</think>", "").replace("\n", "")  # the restored prefix changed no token
    turn2 = asks[1] + [{"role": "assistant", "content": second.choices[0].message.content or ""},
                       {"role": "user", "content": "And another?"}]
    again = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=4, temperature=0)
    history = len(tokenizer.encode(tokenizer.apply_chat_template(turn2[:-1], add_generation_prompt=False)))
    assert again.usage.prompt_tokens_details.cached_tokens >= history > system_tokens  # the reply, rendered back


QWEN3_STYLE_TEMPLATE = __import__("pathlib").Path(__file__).parent / "data" / "qwen3_style_chat_template.jinja"


def test_the_prefix_cache_restores_the_history_under_a_qwen3_style_template(local):
    """Qwen3's templates write the reasoning block (an empty one too) into an assistant message after the last
    user message, the last one included, and an earlier assistant message as its content only. With such a
    template (the built-in one with that rule, tests/model/data) turns 2 and 3 of a chat restore exactly all of
    their history but the new user message (the reply cached as the next turn renders it, not as the last
    message), a few-shot prompt restores its last example (the boundary after an assistant message), and every
    reply is the one a server that caches nothing gives."""
    from qwen38_model.default_model import default_model_path
    from qwen38_model.server import Server, serving_in_thread
    from qwen38_model.tokenizer import load_tokenizer

    model = local[0]
    tokenizer = load_tokenizer(default_model_path())
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE.read_text(encoding="utf-8")
    off = {"enable_thinking": False}
    system = {"role": "system", "content": "You answer in one short line. Keep to the facts. " * 3}
    user = "<|im_start|>user\n"
    last = [{"role": "user", "content": "Two and two?"}, {"role": "assistant", "content": "Four."}]
    assert tokenizer.apply_chat_template([system] + last, add_generation_prompt=False).endswith(
        "assistant\n<think>\n\n</think>\n\nFour.<|im_end|>\n")  # the template's rule, as Qwen3's
    assert tokenizer.apply_chat_template([system] + last + [{"role": "user", "content": "Hm."}],
                                         add_generation_prompt=False).count("<think>") == 0

    def before_last_user(messages: list[dict]) -> int:
        """The prompt's tokens up to the start of its last (user) message: the history a cache can restore."""
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **off)
        ids, prefix = tokenizer.encode(text), tokenizer.encode(text[: text.rindex(user)])
        assert ids[: len(prefix)] == prefix
        return len(prefix)

    def run(cache_bytes: int) -> list[tuple[str, int, int, int]]:
        """(content, completion tokens, cached tokens, expected cached tokens) of each request: a 3-turn chat,
        then two few-shot requests sharing their examples."""
        server = Server(model, tokenizer, MODEL, max_context=1024, max_queue=1, cache_bytes=cache_bytes,
                        log=sys.stdout, max_batch=1)
        results = []
        with serving_in_thread(server) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

            def ask(messages: list[dict]) -> str:
                answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                        extra_body={"chat_template_kwargs": off})
                while server.scheduler.running or server.scheduler.waiting:  # the next turn's prefill done
                    time.sleep(0.01)
                content = answer.choices[0].message.content or ""
                results.append((content, answer.usage.completion_tokens,
                                answer.usage.prompt_tokens_details.cached_tokens, before_last_user(messages)))
                return content

            chat = [system]
            for question in ("What is two and two?", "And three and three?", "Name a colour."):
                chat.append({"role": "user", "content": question})
                chat.append({"role": "assistant", "content": ask(chat)})
            examples = [system]
            for question, reply in (("Capital of France?", "Paris."), ("Capital of Spain?", "Madrid.")):
                examples += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
            for question in ("Capital of Italy?", "Capital of Peru?"):
                ask(examples + [{"role": "user", "content": question}])
        return results

    cached, uncached = run(1 << 26), run(1)
    assert [(content, n) for content, n, _, _ in cached] == [(content, n) for content, n, _, _ in uncached]
    assert all(hit == 0 for _, _, hit, _ in uncached)  # the replay restored nothing: the comparison is real
    (_, _, hit1, _), (_, _, hit2, history2), (_, _, hit3, history3), (_, _, few1, _), (_, _, few2, shared) = cached
    assert hit1 == 0 and few1 > 0  # the system prompt, from the chat
    assert hit2 == history2 and hit3 == history3 > history2  # all but the new user message: the reply rendered back
    assert few2 == shared  # the last example's end: a boundary after an assistant message
