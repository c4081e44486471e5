"""Many streamed clients at once against the OpenAI-compatible server on one GPU (the 27B shape).

`qwen38 serve`'s continuous batching: aggregate and per-client speed, time to first token, inter-token latency.

    python -m benchmarks.serve [--model PATH] [--json PATH] [--clients 1,4,16,64] [--prompt-tokens 512]
                               [--new-tokens 256] [--join-decoders 15] [--join-prompt-tokens 4096]
                               [--join-after 32] [--check-solo 4] [--batch-invariant on|off] [--tiny]

The server (qwen38_model.server.Server, one BatchEngine of max(clients, join decoders + 1) slots, CUDA graphs,
bf16 KV, a 4 GB prefix cache as `qwen38 serve` has by default) runs in this process: uvicorn in a thread on a
free local port (qwen38_model.server.serving_in_thread). The clients are the official `openai`
client (AsyncOpenAI, one asyncio loop in the main thread), streamed /v1/completions requests whose prompts are
token ids: random ids, --prompt-tokens each, max_tokens --new-tokens, temperature 0 (greedy).

Without --model the model is the 27B shape with synthetic Q8_0 weights (benchmarks/decode.py's build_model)
and its tokenizer is one made here: 248320 tokens, id i the text "<i>" (WordLevel, byte-level decoder), so
that every id the model can produce decodes and each streamed chunk is one token. THE TEXT IS MEANINGLESS:
only the timing matters (and, for the correctness check, that distinct tokens are distinct text). With --model
the checkpoint's own tokenizer is used.

End tokens are ignored: the server has no `ignore_eos` field (every field it does not implement is a 400), so
the model's config is given no end tokens (`eos_token_ids=()`, which the server reads when it is built; the
synthetic model has none anyway) and every request runs to exactly max_tokens. The request's `min_tokens =
max_tokens` (a field the server has) would do the same per request, through the end-token mask. Each run
reports how many requests had exactly that many tokens (stream_options include_usage).

Measured in ONE run, after a warm-up (a long prompt's prefill chunks; every slot's greedy selection graph),
with the prefix cache emptied between runs (prompts are fresh random ids anyway: no request hits it):
- for each N in --clients: N clients started together (one asyncio.gather); aggregate generated tok/s (all
  tokens / the wall time from the first request sent to the last one finished), each request's time to first
  token (sent -> first streamed chunk) and decode tok/s ((tokens - 1) / first to last chunk), and the
  inter-token latency (every gap between two streamed chunks of one request, all requests pooled) p50 / p99;
- the correctness claim, in the same run: at N = 16 (else the largest N), --check-solo of its prompts are
  first run alone, each on the idle server; the count whose greedy text in the N-client run equals it;
- a join: --join-decoders clients decoding (started together), and once the last of them has streamed
  --join-after tokens a --join-prompt-tokens prompt joins; the decoders' ITL before the join (their gaps after
  all are steady), during it (gaps ending between the joiner being sent and its first token: the server
  prefills a joining prompt in chunks of scheduler.PREFILL_INTERLEAVE tokens between decode steps) and after;
  the joiner's TTFT, beside the TTFT of a prompt of that length on the idle server.

The clients share the process (and the GIL) with the server's event loop and scheduler thread: their parsing
of each streamed chunk is in the figures, as a client on the same host would be (not measured apart).

--tiny: the built-in default model on the CPU, its own tokenizer, clients 1,2, prompt 16, new 8, a join of
one decoder and a 48-token prompt after 4 tokens: a smoke test of this script (its figures mean nothing)
that writes JSON only with --json.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time

import torch

from benchmarks.ops.common import add_tiny_flag, default_result_path, env_info, parse_with_tiny, print_table, write_json
from benchmarks.serving import require_server_packages, serving_model

VOCAB_27B = 248320
CACHE_BYTES = int(4e9)  # `qwen38 serve --cache-gb`'s default
JOIN_AFTER = 32  # tokens the last-admitted decoder has streamed before the joiner is sent
JOIN_NEW = 16  # the joiner's max_tokens
CHECK_AT = 16  # the client count of the correctness check (else the largest one run)
WARM_PROMPT = 8  # tokens of each warm-up request that fills every slot
TINY = dict(clients="1,2", prompt_tokens=16, new_tokens=8, join_decoders=1, join_prompt_tokens=48, join_after=4,
            join_new=4, check_solo=2)


def benchmark_tokenizer(vocab_size: int):
    """A tokenizer of vocab_size tokens, id i the text "<i>": every id the model can produce decodes (to text
    of its own, so that equal text is equal tokens), one streamed chunk a token. Meaningless text."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders
    from tokenizers.models import WordLevel

    from qwen38_model.tokenizer import Tokenizer

    # "<", ">" and the digits are their own characters in the byte-level alphabet: token_bytes gives "<i>".
    tokenizer = HFTokenizer(WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tokenizer.decoder = decoders.ByteLevel()
    return Tokenizer(tokenizer, None, [])


def clear_cache(server) -> None:
    """Empty the server's prefix cache (only while no request is in flight: the scheduler thread is idle),
    so that one run's prompts are never restored in another (the correctness check reruns its prompts)."""
    server.cache.entries.clear()
    server.cache.host.clear()


@dataclasses.dataclass
class Record:
    """One streamed request as its client saw it (perf_counter seconds)."""

    sent: float = 0.0
    arrivals: list = dataclasses.field(default_factory=list)  # each chunk with text
    text: str = ""
    tokens: int = 0  # usage.completion_tokens
    cached: int = 0  # usage.prompt_tokens_details.cached_tokens
    finish: str | None = None
    end: float = 0.0


async def stream_one(client, model_name: str, ids: list[int], max_tokens: int, record: Record | None = None,
                     on_chunk=None) -> Record:
    record = record or Record()
    record.sent = time.perf_counter()
    stream = await client.completions.create(model=model_name, prompt=ids, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            record.tokens = chunk.usage.completion_tokens
            details = getattr(chunk.usage, "prompt_tokens_details", None)
            record.cached = getattr(details, "cached_tokens", None) or 0
        for choice in chunk.choices:
            if choice.text:
                record.arrivals.append(now)
                record.text += choice.text
                if on_chunk is not None:
                    on_chunk()
            if choice.finish_reason:
                record.finish = choice.finish_reason
    record.end = time.perf_counter()
    if on_chunk is not None:
        on_chunk()
    return record


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return dict(p50=percentile(values, 50), p99=percentile(values, 99), mean=sum(values) / len(values),
                min=min(values), max=max(values), count=len(values))


def gaps(record: Record, after: float = float("-inf"), until: float = float("inf")) -> list[float]:
    """The gaps between the record's consecutive chunks that end in (after, until]."""
    a = record.arrivals
    return [b - x for x, b in zip(a, a[1:]) if after < b <= until]


def decode_rate(record: Record) -> float | None:
    a = record.arrivals
    return (record.tokens - 1) / (a[-1] - a[0]) if len(a) > 1 and a[-1] > a[0] else None


def summary(records: list[Record], new_tokens: int) -> dict:
    start, end = min(r.sent for r in records), max(r.end for r in records)
    total = sum(r.tokens for r in records)
    rates = [x for x in map(decode_rate, records) if x is not None]
    return dict(clients=len(records), wall_s=end - start, tokens=total, aggregate_tok_s=total / (end - start),
                ttft_s=spread([r.arrivals[0] - r.sent for r in records if r.arrivals]),
                itl_s=spread([g for r in records for g in gaps(r)]),
                per_request_tok_s=spread(rates), e2e_s=spread([r.end - r.sent for r in records]),
                exact_new_tokens=sum(r.tokens == new_tokens for r in records),
                cached_tokens=sum(r.cached for r in records))


async def join_run(client, name: str, decoders: list[list[int]], joiner: list[int], new_tokens: int,
                   join_after: int, join_new: int) -> tuple[list[Record], Record, float, float]:
    """The decoders started together; the joiner sent once the last of them has join_after chunks (or one has
    ended). Returns the decoders' records, the joiner's, when every decoder was steady (the last one's third
    chunk: the gap of its admission is behind the others by then) and when the joiner was sent."""
    records = [Record() for _ in decoders]
    ready = asyncio.Event()

    def check() -> None:
        if not ready.is_set() and (min(len(r.arrivals) for r in records) >= join_after
                                   or any(r.end for r in records)):
            ready.set()

    async def join() -> Record:
        await ready.wait()
        return await stream_one(client, name, joiner, join_new)

    *done, joined = await asyncio.gather(*(stream_one(client, name, ids, new_tokens, r, check)
                                           for ids, r in zip(decoders, records)), join())
    last = max(records, key=lambda r: r.arrivals[0] if r.arrivals else float("inf"))
    steady = last.arrivals[min(2, len(last.arrivals) - 1)] if last.arrivals else joined.sent
    return done, joined, steady, joined.sent


async def drive(url: str, server, name: str, args, vocab: int) -> dict:
    import openai

    generator = torch.Generator().manual_seed(0)

    def prompts(count: int, length: int) -> list[list[int]]:
        return torch.randint(0, vocab, (count, length), generator=generator).tolist()

    async def together(batch: list[list[int]], max_tokens: int) -> list[Record]:
        return list(await asyncio.gather(*(stream_one(client, name, ids, max_tokens) for ids in batch)))

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    results = dict(runs=[])
    start = time.perf_counter()
    # Warm-up: a long prompt's chunks (the join's), then every slot at once (its greedy selection graph).
    await stream_one(client, name, prompts(1, args.join_prompt_tokens)[0], args.join_new)
    await together(prompts(server.max_batch, WARM_PROMPT), server.max_batch + 2)
    clear_cache(server)
    results["warmup_s"] = time.perf_counter() - start

    check_at = CHECK_AT if CHECK_AT in args.clients else max(args.clients)
    for n in args.clients:
        batch = prompts(n, args.prompt_tokens)
        solo = []
        if n == check_at and args.check_solo:
            for ids in batch[:args.check_solo]:
                solo.append(await stream_one(client, name, ids, args.new_tokens))
            clear_cache(server)
        records = await together(batch, args.new_tokens)
        clear_cache(server)
        run = summary(records, args.new_tokens)
        if solo:
            matched = sum(s.text == r.text and s.tokens == r.tokens for s, r in zip(solo, records))
            run["correctness"] = dict(checked=len(solo), matched=matched,
                                      solo_ttft_s=spread([s.arrivals[0] - s.sent for s in solo if s.arrivals]),
                                      solo_tok_s=spread([x for x in map(decode_rate, solo) if x is not None]))
            results["correctness"] = dict(clients=n, checked=len(solo), matched=matched)
        results["runs"].append(run)

    # The join: the joining prompt's TTFT alone first (another prompt of its length), then among decoders.
    alone = await stream_one(client, name, prompts(1, args.join_prompt_tokens)[0], args.join_new)
    clear_cache(server)
    decoders, joiner, steady, sent = await join_run(client, name, prompts(args.join_decoders, args.prompt_tokens),
                                                    prompts(1, args.join_prompt_tokens)[0], args.new_tokens,
                                                    args.join_after, args.join_new)
    clear_cache(server)
    first = joiner.arrivals[0] if joiner.arrivals else joiner.end
    results["join"] = dict(
        decoders=args.join_decoders, join_prompt_tokens=args.join_prompt_tokens, join_after=args.join_after,
        joiner_max_tokens=args.join_new, joiner_ttft_s=first - joiner.sent,
        joiner_alone_ttft_s=alone.arrivals[0] - alone.sent if alone.arrivals else None,
        joiner_tokens=joiner.tokens, sent_after_s=sent - min(r.sent for r in decoders),
        decoders_outlived_join=all(r.arrivals and r.arrivals[-1] > first for r in decoders),
        itl_before_s=spread([g for r in decoders for g in gaps(r, steady, sent)]),
        itl_during_s=spread([g for r in decoders for g in gaps(r, sent, first)]),
        itl_after_s=spread([g for r in decoders for g in gaps(r, first)]),
        decoders_run=summary(decoders, args.new_tokens))
    await client.close()
    return results


def ms(s: dict | None, key: str) -> float | str:
    return "" if s is None else s[key] * 1e3


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a real checkpoint instead of the synthetic 27B shape")
    parser.add_argument("--json", help="write the results here (default benchmarks/results/<date>-<gpu>-<commit>-"
                                       "serve.json; with --tiny: nowhere)")
    parser.add_argument("--clients", default="1,4,16,64", help="concurrent client counts (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens of each client's prompt")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens each client asks for (max_tokens)")
    parser.add_argument("--join-decoders", type=int, default=15, help="clients decoding when the long prompt joins")
    parser.add_argument("--join-prompt-tokens", type=int, default=4096, help="tokens of the joining prompt")
    parser.add_argument("--join-after", type=int, default=JOIN_AFTER, help="chunks the last decoder has streamed "
                        "before the long prompt is sent")
    parser.add_argument("--join-new", type=int, default=JOIN_NEW, help="the joining request's max_tokens")
    parser.add_argument("--check-solo", type=int, default=4, help=f"prompts of the N = {CHECK_AT} run also run "
                        "alone first, their greedy texts compared (0: no check)")
    parser.add_argument("--batch-invariant", choices=["on", "off"], default="on", help="`qwen38 serve`'s option of "
                        "the name (off: a step's rows share the int8 GEMM; the solo check may then find differences)")
    add_tiny_flag(parser, TINY)
    args = parse_with_tiny(parser, argv, TINY)
    args.clients = [int(c) for c in str(args.clients).split(",")]
    if min(args.clients) < 1 or min(args.prompt_tokens, args.new_tokens, args.join_decoders,
                                    args.join_prompt_tokens, args.join_new) < 1:
        raise SystemExit("--clients, --prompt-tokens, --new-tokens, --join-decoders, --join-prompt-tokens and "
                         "--join-new must be >= 1")
    if not 1 <= args.join_after < args.new_tokens:
        raise SystemExit(f"--join-after must be in [1, --new-tokens): found {args.join_after}")
    check_at = CHECK_AT if CHECK_AT in args.clients else max(args.clients)
    args.check_solo = max(0, min(args.check_solo, check_at))
    require_server_packages("serve", args.tiny)

    from qwen38_model.model import default_kv_dtype
    from qwen38_model.scheduler import PREFILL_INTERLEAVE, default_max_batch
    from qwen38_model.server import Server, serving_in_thread

    env = env_info()
    start = time.perf_counter()
    model, tokenizer, name = serving_model(args.model, args.tiny, benchmark_tokenizer)
    load_s = time.perf_counter() - start
    eos = tuple(model.config.eos_token_ids)
    model.config = dataclasses.replace(model.config, eos_token_ids=())  # every request runs to max_tokens
    vocab = min(len(tokenizer), model.config.vocab_size)
    max_batch = max(max(args.clients), args.join_decoders + 1)
    max_context = max(args.prompt_tokens + args.new_tokens, args.join_prompt_tokens + args.join_new,
                      WARM_PROMPT + max_batch + 2)
    kv_dtype = default_kv_dtype(model.device)
    cache_bytes = CACHE_BYTES if model.device.type == "cuda" else 1 << 26
    fits = default_max_batch(model, max_context, kv_dtype, cache_bytes)
    if fits < max_batch:
        print(f"warning: {max_batch} slots of {max_context} tokens are more than `qwen38 serve` would choose here "
              f"({fits}, beside a {cache_bytes / 1e9:g} GB prefix cache and its headroom): the run may run out of "
              "memory", file=sys.stderr)
    start = time.perf_counter()
    server = Server(model, tokenizer, name, max_context=max_context, max_queue=max_batch, cache_bytes=cache_bytes,
                    max_batch=max_batch, kv_dtype=kv_dtype, log=open(os.devnull, "w"),
                    batch_invariant=args.batch_invariant == "on")
    server_s = time.perf_counter() - start
    results = dict(env=env, model=args.model or ("built-in default (tiny)" if args.tiny else "synthetic 27B shape"),
                   tiny=args.tiny, device=str(model.device), load_s=load_s, server_start_s=server_s,
                   settings=dict(clients=args.clients, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                                 max_batch=max_batch, default_max_batch=fits, max_context=max_context,
                                 kv_dtype=str(kv_dtype).removeprefix("torch."), cache_bytes=cache_bytes,
                                 prefill_interleave=PREFILL_INTERLEAVE,
                                 batch_invariant=server.scheduler.engine.batch_invariant,
                                 use_graph=server.scheduler.engine.use_graph, model_eos_ignored=list(eos)))
    with serving_in_thread(server, keep_alive_s=3600) as url:  # idle connections stay between the runs
        results.update(asyncio.run(drive(url, server, name, args, vocab)))
    if model.device.type == "cuda":
        results["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9

    where = f"{env.get('gpu', 'cpu')}{', tiny: figures mean nothing' if args.tiny else ''}"
    rows = [dict(clients=r["clients"], tok_s=r["aggregate_tok_s"], per_req=r["per_request_tok_s"]["p50"]
                 if r["per_request_tok_s"] else "", ttft_p50_s=r["ttft_s"]["p50"], ttft_p99_s=r["ttft_s"]["p99"],
                 itl_p50_ms=ms(r["itl_s"], "p50"), itl_p99_ms=ms(r["itl_s"], "p99"), wall_s=r["wall_s"],
                 exact=f"{r['exact_new_tokens']}/{r['clients']}") for r in results["runs"]]
    print_table(rows, ["clients", "tok_s", "per_req", "ttft_p50_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms",
                       "wall_s", "exact"],
                title=f"serving N streamed clients on {where} ({args.prompt_tokens}-token prompts, "
                      f"{args.new_tokens} new tokens each, {max_batch} slots)")
    j = results["join"]
    print_table([dict(window=w, gaps=(j[f"itl_{w}_s"] or {}).get("count", 0), itl_p50_ms=ms(j[f"itl_{w}_s"], "p50"),
                      itl_p99_ms=ms(j[f"itl_{w}_s"], "p99"), itl_max_ms=ms(j[f"itl_{w}_s"], "max"))
                 for w in ("before", "during", "after")], ["window", "gaps", "itl_p50_ms", "itl_p99_ms", "itl_max_ms"],
                title=f"{j['decoders']} decoding clients while a {j['join_prompt_tokens']}-token prompt joins")
    alone = j["joiner_alone_ttft_s"]
    print(f"the joiner's TTFT: {j['joiner_ttft_s']:.3f} s among {j['decoders']} decoders, "
          f"{'?' if alone is None else f'{alone:.3f}'} s on the idle server"
          f"{'' if j['decoders_outlived_join'] else ' (some decoders ended before it: --new-tokens too small)'}")
    if "correctness" in results:
        c = results["correctness"]
        print(f"correctness: {c['matched']} of {c['checked']} clients' greedy texts at N = {c['clients']} equal "
              f"their solo runs")
    write_json(args.json or (None if args.tiny else default_result_path(env, "serve")), results)
    return results


if __name__ == "__main__":
    main()
