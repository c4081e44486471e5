"""The server's prefix cache on chat traces: how much of each prompt is restored instead of prefilled, the time to
first token it gives, and that the replies are those of a server without it (issue 23 item 4).

    python -m benchmarks.prefix_cache [--model PATH] [--json PATH] [--conversations 4] [--turns 8]
                                      [--user-tokens 100,300] [--max-tokens 64] [--system-tokens 650]
                                      [--fewshot-tokens 790] [--requests 16] [--document-tokens 6000]
                                      [--cache-gb 4] [--no-thinking-pass]
                                      [--send-reasoning] [--chat-template FILE] [--tiny]

The server (qwen38_model.server.Server, a BatchEngine of --max-batch slots of --max-context tokens, CUDA graphs,
the default KV dtype, a --cache-gb prefix cache as `qwen38 serve` has by default) runs in this process: uvicorn in
a thread on a free local port (server.serving_in_thread). The client is the official `openai` client (sync), one
streamed /v1/chat/completions request at a time (stream_options include_usage), temperature 0 (greedy), each
sent once the server is idle (the previous request's caching done: scheduler.running == 0), so that every TTFT is
the request's own. The user texts are random English words from a fixed list (seeded), cut to a token count
measured with the served tokenizer.

Traces, each run on a server with the prefix cache and then replayed, request for request (the same messages),
on a second server whose cache keeps nothing (Server(cache_bytes=1): PrefixCache.put keeps no snapshot larger
than its budget; `qwen38 serve` has no "off": --cache-gb must be > 0):
- chat: --conversations conversations of --turns user turns (each --user-tokens lo,hi tokens, drawn uniformly),
  --max-tokens per reply, interleaved (turn t of every conversation, then turn t + 1), each request carrying the
  whole history: the earlier user messages and the assistant's returned replies (`content` only, as an OpenAI
  client sends them back; Qwen's template drops the thinking of earlier turns; --send-reasoning also sends
  `reasoning_content` back). With enable_thinking off (chat_template_kwargs), and once more with it on where
  the template reads enable_thinking (--no-thinking-pass: not).
- system: a --system-tokens system prompt shared by --requests requests, each with its own user message;
- fewshot: a --fewshot-tokens shared prefix (a short system prompt and user/assistant example pairs, as
  earlier messages) before --requests different user messages.
- document: one user message of a --document-tokens document and a question after it (--user-tokens), a
  different question in each of --requests requests, then the first request again (an exact repeat): the shared
  prefix ends inside the message, where only the server's snapshots at a token stride (server.stride_breaks)
  can restore it; reachable, the last of the first request's snapshots (its strides and its message's end)
  inside the shared prefix, and for the repeat all of it (a prompt's end is cached with its last logits).

Per request: prompt tokens, `usage.prompt_tokens_details.cached_tokens`, the cacheable prefix (the tokens of
the request's messages but the last as the prompt renders them, cut at the last one's end as the server cuts a
message boundary, Server.history_ids: the earlier turns of a chat, the shared system prompt or prefix; 0 where
the server finds no such boundary), the history (the prompt's tokens before the last message's
text, its header included, whatever the template does), the hit fraction (cached / prompt) and the fractions of
the cacheable prefix and of the history restored, TTFT (request sent -> the first
streamed chunk with text, content or reasoning; also to the first content chunk), with the cache and without.
Totals from turn 2 on. Identity: every reply text (content and reasoning) and token count of the cached run
equal to the uncached replay's; the first request that differs.

Without --model the model is the 27B shape with synthetic Q8_0 weights (benchmarks/decode.py's build_model), its
tokenizer the built-in model's (synthetic.synthetic_tokenizer: byte-level BPE of 501 ids and its ChatML chat
template) with the ids above those as added tokens "<i>", so that every id the model can produce decodes, and
re-encodes, to itself. THE TEXT IS MEANINGLESS: only the cache's hits, the timing and the identity matter. With
--model the checkpoint's tokenizer and template are used. The model's end tokens are kept (replies may end
before --max-tokens: a chat's reply ends at its end token).

--tiny: the built-in default model on the CPU, a small trace (TINY): a smoke test of this script (its timings
mean nothing) that writes JSON only with --json.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import time

import torch

from benchmarks.ops.common import add_tiny_flag, default_result_path, env_info, parse_with_tiny, print_table, write_json
from benchmarks.serving import require_server_packages, serving_model

CACHE_GB = 4.0  # `qwen38 serve --cache-gb`'s default
TARGET_HIT = 0.9  # issue 23 item 4: from turn 2 on >= 90% of the prompt tokens cached
FEWSHOT_PAIRS = 3  # user/assistant examples of the few-shot prefix
TINY = dict(conversations=2, turns=3, user_tokens="10,20", max_tokens=6, system_tokens=40, fewshot_tokens=60,
            requests=3, document_tokens=1100, max_context=2048, max_batch=2)
WORDS = ("the a of to and in is it that for on with as was at by be this from or an are not have but what all were "
         "when we there can one your which their said if will each about how up out them then she many some so "
         "these would other into has more her two like him see time could no make than first been its who now "
         "people my made over did down only way find use may water long little very after words called just where "
         "most know get through back much go good new write our me man too any day same right look think also "
         "around another came come work three word must because does part even place well such here take why "
         "things help put years different away again off went old number great tell men say small every found "
         "still between name should home big give air line set own under read last never us left end along while "
         "might next sound below saw something thought both few those always looked show large often together "
         "asked house world going want school important until form food keep children feet land side without boy "
         "once animals life enough took sometimes four head above kind began almost live page got earth need far "
         "hand high year mother light parts country father let night following picture being study second eyes "
         "soon times story boys since white days ever paper hard near sentence better best across during today "
         "others however sure means knew trees money whole across river cache state model token prompt server "
         "reply history system message").split()


def chat_tokenizer(vocab_size: int):
    """The built-in model's tokenizer and ChatML template (synthetic.synthetic_tokenizer) over vocab_size ids:
    the ids past its own are added tokens "<i>" (not special), so that every id the model can produce decodes to
    text that encodes back to it (the reply, sent back in the history, is the same tokens). Meaningless text."""
    from tokenizers import AddedToken

    from qwen38_model.synthetic import synthetic_tokenizer
    from qwen38_model.tokenizer import Tokenizer

    bpe, template = synthetic_tokenizer()
    own = bpe.get_vocab_size()
    bpe.add_tokens([AddedToken(f"<{i}>", single_word=False, lstrip=False, rstrip=False, normalized=False,
                               special=False) for i in range(own, vocab_size)])
    assert bpe.get_vocab_size() == vocab_size and bpe.token_to_id(f"<{vocab_size - 1}>") == vocab_size - 1
    return Tokenizer(bpe, template, [], {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})


def text_of(tokenizer, rng: random.Random, tokens: int) -> str:
    """Random words (sentences of 6-14) until the text encodes to at least `tokens` tokens."""
    words, sentence = [], 0
    while True:
        if sentence == 0:
            sentence = rng.randint(6, 14)
            words.append(rng.choice(WORDS).capitalize())
        else:
            words.append(rng.choice(WORDS))
        sentence -= 1
        if sentence == 0:
            words[-1] += "."
        text = " ".join(words)
        if len(tokenizer.encode(text)) >= tokens:
            return text if text.endswith(".") else text + "."


def cacheable_prefix(server, messages: list[dict], kwargs: dict) -> tuple[int, int]:
    """(cacheable, history) of a request: cacheable, the tokens of messages[:-1] as a later message's render has
    them (Server.history_ids against this prompt, the server's rule for a message boundary, Server.message_breaks:
    what it can restore at best), else 0; history, the prompt's tokens before the last message's text (where the
    prompt and the prompt with that text replaced part: the earlier messages as this prompt renders them, and the
    last message's header, `<|im_start|>user\n` in ChatML), whatever the template does with the earlier turns."""
    tokenizer = server.tokenizer

    def ids(ms: list[dict]) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template(ms, add_generation_prompt=True, **kwargs))

    prompt = ids(messages)
    history = min(common_prefix(prompt, ids(messages[:-1] + [{**messages[-1], "content": other}]))
                  for other in ("Alpha", "Zulu"))
    if len(messages) < 2:
        return 0, history
    prefix = server.history_ids(messages[:-1], kwargs, followed=prompt)
    return (len(prefix) if prefix is not None and len(prefix) < len(prompt) and prompt[:len(prefix)] == prefix
            else 0), history


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def wait_idle(server, timeout: float = 600) -> None:
    """Until the scheduler has ended every request (its prefix-cache puts, the next turn's prefill, are done)."""
    deadline = time.monotonic() + timeout
    while server.scheduler.running or server.scheduler.waiting:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not go idle")
        time.sleep(0.002)


def chat(client, server, name: str, messages: list[dict], max_tokens: int, kwargs: dict) -> dict:
    """One streamed chat request, sent once the server is idle; what its client saw."""
    wait_idle(server)
    sent = time.perf_counter()
    stream = client.chat.completions.create(model=name, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"chat_template_kwargs": kwargs})
    first = first_content = None
    content = reasoning = ""
    usage = finish = None
    for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            thought = getattr(delta, "reasoning_content", None) or ""
            if (delta.content or thought) and first is None:
                first = now
            if delta.content:
                first_content = first_content or now
                content += delta.content
            reasoning += thought
            if choice.finish_reason:
                finish = choice.finish_reason
    end = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None)
    return dict(prompt_tokens=usage.prompt_tokens, cached_tokens=getattr(details, "cached_tokens", None),
                completion_tokens=usage.completion_tokens, finish=finish, content=content, reasoning=reasoning,
                ttft_s=None if first is None else first - sent,
                ttft_content_s=None if first_content is None else first_content - sent, e2e_s=end - sent)


def clear_cache(server) -> None:
    """Empty the prefix cache (the server idle), so that a warm-up or an earlier trace is never restored."""
    wait_idle(server)
    server.cache.entries.clear()
    server.cache.host.clear()


# ---- the traces: request records, each {"messages", "kwargs", "max_tokens", ...} ----------------------------

def run_chat_trace(client, server, name, tokenizer, args, thinking: bool, seed: int) -> list[dict]:
    """--conversations chats of --turns turns, interleaved; each next request carries the history with the
    replies as returned."""
    rng = random.Random(seed)
    lo, hi = args.user_tokens
    kwargs = {"enable_thinking": thinking}
    histories = [[] for _ in range(args.conversations)]
    records = []
    for turn in range(1, args.turns + 1):
        for c, history in enumerate(histories):
            history.append({"role": "user", "content": text_of(tokenizer, rng, rng.randint(lo, hi))})
            messages = [dict(m) for m in history]
            result = chat(client, server, name, messages, args.max_tokens, kwargs)
            record = dict(conversation=c, turn=turn, messages=messages, kwargs=kwargs,
                                max_tokens=args.max_tokens, **result)
            record["cacheable"], record["history"] = cacheable_prefix(server, messages, kwargs)
            records.append(record)
            reply = {"role": "assistant", "content": result["content"]}
            if args.send_reasoning and result["reasoning"]:
                reply["reasoning_content"] = result["reasoning"]
            history.append(reply)
    return records


def shared_prefix_requests(tokenizer, args, fewshot: bool, seed: int) -> list[list[dict]]:
    """--requests message lists sharing their messages but the last: a --system-tokens system prompt, or (fewshot)
    a short system prompt and user/assistant example pairs up to --fewshot-tokens tokens in all."""
    rng = random.Random(seed)
    lo, hi = args.user_tokens
    if not fewshot:
        shared = [{"role": "system", "content": text_of(tokenizer, rng, args.system_tokens)}]
    else:  # a system prompt of a quarter, FEWSHOT_PAIRS example pairs sharing the rest (~5 template tokens each)
        shared = [{"role": "system", "content": text_of(tokenizer, rng, max(1, args.fewshot_tokens // 4))}]
        example = max(1, (args.fewshot_tokens - args.fewshot_tokens // 4) // (2 * FEWSHOT_PAIRS) - 5)
        for _ in range(FEWSHOT_PAIRS):
            shared += [{"role": "user", "content": text_of(tokenizer, rng, example)},
                       {"role": "assistant", "content": text_of(tokenizer, rng, example)}]
    return [shared + [{"role": "user", "content": text_of(tokenizer, rng, rng.randint(lo, hi))}]
            for _ in range(args.requests)]


def run_shared_trace(client, server, name, tokenizer, args, fewshot: bool, seed: int) -> list[dict]:
    kwargs = {"enable_thinking": False}
    records = []
    for i, messages in enumerate(shared_prefix_requests(tokenizer, args, fewshot, seed)):
        result = chat(client, server, name, messages, args.max_tokens, kwargs)
        record = dict(request=i, messages=messages, kwargs=kwargs, max_tokens=args.max_tokens, **result)
        record["cacheable"], record["history"] = cacheable_prefix(server, messages, kwargs)
        records.append(record)
    return records


def run_document_trace(client, server, name, tokenizer, args, seed: int) -> list[dict]:
    """--requests questions after one --document-tokens document in the same user message, then the first again.
    Each record has the tokens its prompt shares with an earlier one's (the document and the message's header; the
    repeat: all of it) and the reachable part of them: the last stride snapshot of the first request inside them
    (server.stride_breaks, cut as the server cuts the first prompt), or for the repeat its whole prompt (the first
    request's end, cached with its last logits)."""
    from qwen38_model.server import stride_breaks

    rng = random.Random(seed)
    lo, hi = args.user_tokens
    document = text_of(tokenizer, rng, args.document_tokens)
    asks = [[{"role": "user", "content": document + "\n\n" + text_of(tokenizer, rng, rng.randint(lo, hi))}]
            for _ in range(args.requests)]
    kwargs = {"enable_thinking": False}
    requests = [server.chat_request(dict(messages=m, chat_template_kwargs=kwargs)) for m in asks]
    prompts = [tokenizer.encode(r.text) for r in requests]
    strides = stride_breaks(len(prompts[0]), server.message_breaks(requests[0], prompts[0]))
    records = []
    for i, messages in enumerate(asks + asks[:1]):
        prompt = prompts[i % len(asks)]
        shared = max((common_prefix(prompt, prompts[j]) for j in range(min(i, len(asks)))), default=0)
        reachable = shared if shared == len(prompt) else max((b for b in strides if b <= shared), default=0)
        result = chat(client, server, name, messages, args.max_tokens, kwargs)
        records.append(dict(request=i, repeat=i == len(asks), messages=messages, kwargs=kwargs,
                            max_tokens=args.max_tokens, cacheable=0, history=0, shared=shared, reachable=reachable,
                            strides=list(strides), **result))
    return records


def replay(client, server, name: str, records: list[dict]) -> list[dict]:
    """The same requests (messages, template arguments, max_tokens), in the same order."""
    return [chat(client, server, name, r["messages"], r["max_tokens"], r["kwargs"]) for r in records]


# ---- the report ---------------------------------------------------------------------------------------------

def fraction(a: int, b: int) -> float | None:
    return a / b if b else None


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def identity(records: list[dict], uncached: list[dict]) -> dict:
    differ = [i for i, (r, u) in enumerate(zip(records, uncached))
              if (r["content"], r["reasoning"], r["completion_tokens"]) != (u["content"], u["reasoning"],
                                                                           u["completion_tokens"])]
    first = None
    if differ:
        r, u = records[differ[0]], uncached[differ[0]]
        first = dict(index=differ[0], **{k: r[k] for k in ("conversation", "turn", "request") if k in r},
                     cached=dict(content=r["content"], reasoning=r["reasoning"], tokens=r["completion_tokens"]),
                     uncached=dict(content=u["content"], reasoning=u["reasoning"], tokens=u["completion_tokens"]))
    return dict(identical=not differ and len(records) == len(uncached), compared=len(records), differing=len(differ),
                first_difference=first)


def request_row(r: dict, u: dict) -> dict:
    return dict(prompt_tokens=r["prompt_tokens"], cached_tokens=r["cached_tokens"], cacheable_tokens=r["cacheable"],
                history_tokens=r["history"], hit_fraction=fraction(r["cached_tokens"], r["prompt_tokens"]),
                cacheable_restored=fraction(r["cached_tokens"], r["cacheable"]),
                history_restored=fraction(r["cached_tokens"], r["history"]),
                completion_tokens=r["completion_tokens"], finish=r["finish"], ttft_s=r["ttft_s"],
                ttft_content_s=r["ttft_content_s"], e2e_s=r["e2e_s"], uncached_prompt_tokens=u["prompt_tokens"],
                uncached_cached_tokens=u["cached_tokens"], uncached_ttft_s=u["ttft_s"],
                **{k: r[k] for k in ("conversation", "turn", "request") if k in r})


def chat_report(records: list[dict], uncached: list[dict], thinking: bool) -> dict:
    rows = [request_row(r, u) for r, u in zip(records, uncached)]
    turns = []
    for t in sorted({row["turn"] for row in rows}):
        of = [row for row in rows if row["turn"] == t]
        prompt, cached = sum(r["prompt_tokens"] for r in of), sum(r["cached_tokens"] for r in of)
        cacheable = sum(r["cacheable_tokens"] for r in of)
        history = sum(r["history_tokens"] for r in of)
        turns.append(dict(turn=t, requests=len(of), prompt_tokens=prompt, cached_tokens=cached,
                          cacheable_tokens=cacheable, history_tokens=history, hit_fraction=fraction(cached, prompt),
                          min_hit_fraction=min(r["hit_fraction"] for r in of),
                          cacheable_restored=fraction(cached, cacheable), history_restored=fraction(cached, history),
                          ttft_s=mean(r["ttft_s"] for r in of), uncached_ttft_s=mean(r["uncached_ttft_s"] for r in of)))
    later = [row for row in rows if row["turn"] >= 2]
    prompt, cached = sum(r["prompt_tokens"] for r in later), sum(r["cached_tokens"] for r in later)
    cacheable = sum(r["cacheable_tokens"] for r in later)
    history = sum(r["history_tokens"] for r in later)
    from_turn_2 = dict(requests=len(later), prompt_tokens=prompt, cached_tokens=cached, cacheable_tokens=cacheable,
                       history_tokens=history, history_restored=fraction(cached, history),
                       possible_hit_fraction=fraction(history, prompt), hit_fraction=fraction(cached, prompt),
                       min_hit_fraction=min((r["hit_fraction"] for r in later), default=None),
                       cacheable_restored=fraction(cached, cacheable),
                       all_cacheable_restored=all(r["cached_tokens"] >= r["cacheable_tokens"] for r in later),
                       requests_at_target=sum(r["hit_fraction"] >= TARGET_HIT for r in later),
                       ttft_s=mean(r["ttft_s"] for r in later), uncached_ttft_s=mean(r["uncached_ttft_s"] for r in later))
    return dict(thinking=thinking, turns=turns, from_turn_2=from_turn_2, identity=identity(records, uncached),
                requests=rows)


def shared_report(records: list[dict], uncached: list[dict]) -> dict:
    rows = [request_row(r, u) for r, u in zip(records, uncached)]
    shared = records[0]["cacheable"]  # the shared messages' end, where the template renders them as a prefix
    later = rows[1:]
    return dict(shared_prefix_tokens=shared, shared_history_tokens=min(r["history"] for r in records), requests=rows,
                first=dict(cached_tokens=rows[0]["cached_tokens"], ttft_s=rows[0]["ttft_s"]),
                later=dict(requests=len(later),
                           all_shared_cached=shared > 0 and all(r["cached_tokens"] >= shared for r in later),
                           min_cached_tokens=min((r["cached_tokens"] for r in later), default=None),
                           hit_fraction=fraction(sum(r["cached_tokens"] for r in later),
                                                 sum(r["prompt_tokens"] for r in later)),
                           ttft_s=mean(r["ttft_s"] for r in later),
                           uncached_ttft_s=mean(r["uncached_ttft_s"] for r in later)),
                identity=identity(records, uncached))


def document_report(records: list[dict], uncached: list[dict]) -> dict:
    rows = [dict(request_row(r, u), repeat=r["repeat"], shared_tokens=r["shared"], reachable_tokens=r["reachable"])
            for r, u in zip(records, uncached)]
    later, repeat = [row for row in rows[1:] if not row["repeat"]], rows[-1]
    return dict(document_tokens=min(row["shared_tokens"] for row in later), strides=records[0]["strides"],
                requests=rows, first=dict(cached_tokens=rows[0]["cached_tokens"], ttft_s=rows[0]["ttft_s"]),
                later=dict(requests=len(later),
                           all_reachable_cached=all(r["cached_tokens"] >= r["reachable_tokens"] > 0 for r in later),
                           hit_fraction=fraction(sum(r["cached_tokens"] for r in later),
                                                 sum(r["prompt_tokens"] for r in later)),
                           ttft_s=mean(r["ttft_s"] for r in later),
                           uncached_ttft_s=mean(r["uncached_ttft_s"] for r in later)),
                repeat=dict(prompt_tokens=repeat["prompt_tokens"], cached_tokens=repeat["cached_tokens"],
                            reachable_tokens=repeat["reachable_tokens"], ttft_s=repeat["ttft_s"],
                            uncached_ttft_s=repeat["uncached_ttft_s"]),
                identity=identity(records, uncached))


def traces(client, server, name, tokenizer, args, thinking_pass: bool, records: dict | None) -> dict:
    """Every trace on server: recorded (records None: the cached run) or replayed (records: its requests)."""
    out = {}
    plan = [("chat", lambda: run_chat_trace(client, server, name, tokenizer, args, False, 1))]
    if thinking_pass:
        plan.append(("chat_thinking", lambda: run_chat_trace(client, server, name, tokenizer, args, True, 1)))
    plan += [("system", lambda: run_shared_trace(client, server, name, tokenizer, args, False, 2)),
             ("fewshot", lambda: run_shared_trace(client, server, name, tokenizer, args, True, 3)),
             ("document", lambda: run_document_trace(client, server, name, tokenizer, args, 4))]
    for key, run in plan:
        clear_cache(server)  # each trace on its own (the thinking pass would restore the first pass's turn 1)
        out[key] = run() if records is None else replay(client, server, name, records[key])
    return out


def serve_traces(model, tokenizer, name, args, cache_bytes: int, records: dict | None,
                 thinking_pass: bool) -> tuple[dict, dict]:
    import openai

    from qwen38_model.server import Server, serving_in_thread

    start = time.perf_counter()
    server = Server(model, tokenizer, name, max_context=args.max_context, max_queue=4, cache_bytes=cache_bytes,
                    max_batch=args.max_batch, kv_dtype=args.kv_dtype, log=open(os.devnull, "w"))
    info = dict(server_start_s=time.perf_counter() - start, cache_bytes=cache_bytes)
    try:
        with serving_in_thread(server, keep_alive_s=3600) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
            start = time.perf_counter()
            rng = random.Random(99)  # warm-up: a two-turn chat of its own (prefill, decode, the next turn's prefill)
            warm = [{"role": "user", "content": text_of(tokenizer, rng, args.user_tokens[1])}]
            reply = chat(client, server, name, warm, args.max_tokens, {"enable_thinking": False})
            warm += [{"role": "assistant", "content": reply["content"]},
                     {"role": "user", "content": text_of(tokenizer, rng, args.user_tokens[0])}]
            chat(client, server, name, warm, args.max_tokens, {"enable_thinking": False})
            info["warmup_s"] = time.perf_counter() - start
            out = traces(client, server, name, tokenizer, args, thinking_pass, records)
            wait_idle(server)
            info.update(entries=len(server.cache.entries), device_bytes=server.cache.nbytes)
            client.close()
    finally:
        server.close()
        del server
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out, info


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a real checkpoint instead of the synthetic 27B shape")
    parser.add_argument("--json", help="write the results here (default benchmarks/results/<date>-<gpu>-<commit>-"
                                       "prefix_cache.json; with --tiny: nowhere)")
    parser.add_argument("--conversations", type=int, default=4, help="chats of the chat trace")
    parser.add_argument("--turns", type=int, default=8, help="user turns of each chat")
    parser.add_argument("--user-tokens", default="100,300", help="lo,hi: tokens of each user message (uniform)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument("--system-tokens", type=int, default=650, help="tokens of the shared system prompt")
    parser.add_argument("--fewshot-tokens", type=int, default=790, help="tokens of the shared few-shot prefix")
    parser.add_argument("--requests", type=int, default=16, help="requests of each shared-prefix trace")
    parser.add_argument("--document-tokens", type=int, default=6000, help="tokens of the document trace's document")
    parser.add_argument("--cache-gb", type=float, default=CACHE_GB, help="the prefix cache's budget (GB)")
    parser.add_argument("--max-context", type=int, default=8192, help="tokens of each slot (`qwen38 serve`'s)")
    parser.add_argument("--max-batch", type=int, default=2, help="the engine's slots (requests go one at a time)")
    parser.add_argument("--chat-template", metavar="FILE", help="replaces the tokenizer's chat template (as "
                        "`qwen38 serve --chat-template`)")
    parser.add_argument("--no-thinking-pass", action="store_true", help="no second chat pass with enable_thinking")
    parser.add_argument("--send-reasoning", action="store_true", help="the chat sends each reply's "
                        "reasoning_content back with its content")
    add_tiny_flag(parser, TINY)
    args = parse_with_tiny(parser, argv, TINY)
    try:
        args.user_tokens = tuple(int(x) for x in str(args.user_tokens).split(","))
        assert len(args.user_tokens) == 2 and 1 <= args.user_tokens[0] <= args.user_tokens[1]
    except (ValueError, AssertionError):
        raise SystemExit(f"--user-tokens must be lo,hi with 1 <= lo <= hi: found {args.user_tokens!r}") from None
    if min(args.conversations, args.turns, args.max_tokens, args.system_tokens, args.fewshot_tokens, args.requests,
           args.document_tokens, args.max_batch) < 1 or not args.cache_gb > 0:
        raise SystemExit("--conversations, --turns, --max-tokens, --system-tokens, --fewshot-tokens, --requests, "
                         "--document-tokens and --max-batch must be >= 1, --cache-gb > 0")
    require_server_packages("prefix_cache", args.tiny)

    from qwen38_model.model import default_kv_dtype

    env = env_info()
    start = time.perf_counter()
    model, tokenizer, name = serving_model(args.model, args.tiny, chat_tokenizer)
    if args.chat_template:
        with open(args.chat_template, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    if not tokenizer.chat_template:
        raise SystemExit("the checkpoint has no chat template (--chat-template FILE gives one)")
    load_s = time.perf_counter() - start
    args.kv_dtype = default_kv_dtype(model.device)
    cache_bytes = int(args.cache_gb * 1e9) if model.device.type == "cuda" else min(int(args.cache_gb * 1e9), 1 << 26)
    thinking_pass = not args.no_thinking_pass and "enable_thinking" in tokenizer.chat_template

    cached, cached_info = serve_traces(model, tokenizer, name, args, cache_bytes, None, thinking_pass)
    # The replay: a cache that keeps nothing (no snapshot fits in 1 byte), the same requests.
    uncached, uncached_info = serve_traces(model, tokenizer, name, args, 1, cached, thinking_pass)

    results = dict(env=env, model=args.model or ("built-in default (tiny)" if args.tiny else "synthetic 27B shape"),
                   tiny=args.tiny, device=str(model.device), load_s=load_s,
                   settings=dict(conversations=args.conversations, turns=args.turns, user_tokens=list(args.user_tokens),
                                 max_tokens=args.max_tokens, system_tokens=args.system_tokens,
                                 fewshot_tokens=args.fewshot_tokens, requests=args.requests,
                                 document_tokens=args.document_tokens,
                                 max_context=args.max_context, max_batch=args.max_batch,
                                 kv_dtype=str(args.kv_dtype).removeprefix("torch."), cache_bytes=cache_bytes,
                                 send_reasoning=args.send_reasoning, chat_template=args.chat_template, thinking_pass=thinking_pass,
                                 model_eos=list(model.config.eos_token_ids), target_hit_fraction=TARGET_HIT),
                   cached_server=cached_info, uncached_server=uncached_info,
                   chat=chat_report(cached["chat"], uncached["chat"], False))
    if thinking_pass:
        results["chat_thinking"] = chat_report(cached["chat_thinking"], uncached["chat_thinking"], True)
    results["system"] = shared_report(cached["system"], uncached["system"])
    results["fewshot"] = shared_report(cached["fewshot"], uncached["fewshot"])
    results["document"] = document_report(cached["document"], uncached["document"])
    traced = [k for k in ("chat", "chat_thinking", "system", "fewshot", "document") if k in results]
    results["identical"] = all(results[k]["identity"]["identical"] for k in traced)
    results["uncached_cached_tokens"] = sum(r["uncached_cached_tokens"] or 0 for k in traced
                                            for r in results[k]["requests"])
    if model.device.type == "cuda":
        results["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9

    where = f"{env.get('gpu', 'cpu')}{', tiny: timings mean nothing' if args.tiny else ''}"
    for key in ("chat", "chat_thinking"):
        if key not in results:
            continue
        report = results[key]
        rows = [dict(t) for t in report["turns"]]
        t2 = report["from_turn_2"]
        rows.append(dict(turn="2+", requests=t2["requests"], prompt_tokens=t2["prompt_tokens"],
                         cached_tokens=t2["cached_tokens"], cacheable_tokens=t2["cacheable_tokens"],
                         history_tokens=t2["history_tokens"], hit_fraction=t2["hit_fraction"],
                         min_hit_fraction=t2["min_hit_fraction"], history_restored=t2["history_restored"],
                         ttft_s=t2["ttft_s"],
                         uncached_ttft_s=t2["uncached_ttft_s"]))
        print_table(rows, ["turn", "requests", "prompt_tokens", "cached_tokens", "cacheable_tokens", "history_tokens",
                           "hit_fraction", "min_hit_fraction", "history_restored", "ttft_s", "uncached_ttft_s"],
                    title=f"chat trace ({'thinking on' if report['thinking'] else 'thinking off'}) on {where}: "
                          f"{args.conversations} chats x {args.turns} turns, identical to no cache: "
                          f"{report['identity']['identical']}")
    for key in ("system", "fewshot"):
        report = results[key]
        print_table(report["requests"], ["request", "prompt_tokens", "cached_tokens", "cacheable_tokens",
                                         "history_tokens", "hit_fraction", "ttft_s", "uncached_ttft_s"],
                    title=f"{key} trace: a {report['shared_prefix_tokens']}-token shared prefix, every later request "
                          f"has it cached: {report['later']['all_shared_cached']}, identical to no cache: "
                          f"{report['identity']['identical']}")
    report = results["document"]
    print_table(report["requests"], ["request", "repeat", "prompt_tokens", "shared_tokens", "reachable_tokens",
                                     "cached_tokens", "hit_fraction", "ttft_s", "uncached_ttft_s"],
                title=f"document trace: a {report['document_tokens']}-token shared prefix inside one message (the "
                      f"first prompt's snapshots at {report['strides']}), every later request has its reachable part "
                      f"cached: {report['later']['all_reachable_cached']}, identical to no cache: "
                      f"{report['identity']['identical']}")
    print(f"identical to the uncached replay: {results['identical']}")
    write_json(args.json or (None if args.tiny else default_result_path(env, "prefix_cache")), results)
    return results


if __name__ == "__main__":
    main()
