"""`qwen38 serve`: an OpenAI-compatible HTTP server (the optional extra `serve`: starlette + uvicorn).

Continuous batching: one scheduler thread (scheduler.py) owns a BatchEngine of --max-batch slots and runs all
the GPU work; requests join the running batch as slots free up. Beyond the slots, requests wait in a bounded
queue (429 when full). Tokens stream back to the event loop as the scheduler reads them; a client that goes
away frees its slot at the scheduler's next iteration.
Prompts share one PrefixCache, so a chat that comes back with its history prefills only its new tokens.
Sampling fields a request leaves out take the checkpoint's settings, as vLLM takes a model's generation
config. Every bad request is an OpenAI-style JSON error, never a traceback; a field the server does not
implement is one, never ignored. A chat reply's `<think>` part is its reasoning_content and, with `tools`, its
`<tool_call>` blocks are message.tool_calls (chat_reply.py). A chat's response_format json_object / json_schema
constrains its reply to that JSON, and tool_choice "required" or a named function to tool calls whose arguments
match the function's parameters (structured.py)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import math
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import torch
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import chat_page
from .arguments import SEED_LIMIT
from .chat_reply import THINK_END, THINK_START, ThinkingSplit, ToolCallSplit
from .conversation import PrefixCache
from .engine import BatchEngine
from .errors import Qwen38Error
from .generation import resolve_seed
from .model import default_kv_dtype
from .sampling import TOP_LOGPROBS, SamplingConfig
from .scheduler import PREFILL_INTERLEAVE, Job, Scheduler, default_max_batch
from .speculative import Speculation
from .structured import ANY_OBJECT, JsonConstraints

# A request's sampling fields left out take the checkpoint's settings, else these: OpenAI's temperature and
# top_p, and no top-k, min-p or repetition penalty (the OpenAI API has none of them).
REQUEST_DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
# Message boundaries of a chat prompt the prefill snapshots for the prefix cache, besides the first (the system
# prompt's end): the last this many, where the earlier turns of a continued chat end.
BREAK_MESSAGES = 4
# Snapshots inside a long message (or a completion's prompt) besides its boundaries, so that requests sharing a
# long prefix that ends inside it (a document with different questions after it in one message, a completion
# prompt with different endings, the same prompt again) restore most of it: at the last STRIDE_BREAKS multiples
# of BREAK_STRIDE tokens inside the prompt's last message (stride_breaks). A multiple of the prefill chunk
# (PREFILL_INTERLEAVE) ends a chunk anyway: no chunk more, and a prefix restored there gives the rest of the
# prompt the float order of a full prefill. The last few only: a snapshot holds the KV of all its tokens (157
# MB of GDN state + 65.5 KB a token at the 27B shape), so one at every stride of a 16k-token message would be 15
# snapshots, 10.4 GB put into the cache by one prompt, 2.6x the default 4 GB (each evicting the others and the
# earlier requests' states), while two are at most twice the prompt's own snapshot. A stride of 1024: a hit prefills at most 1023 tokens past its snapshot (~0.3 s at the
# 27B's 3567 tok/s in 512-token chunks), and the two reach 1024-2047 tokens back from the message's end, enough
# for a question after a document; 2048 would double both, 512 halve them (a question over ~512 tokens missed).
BREAK_STRIDE, STRIDE_BREAKS = 2 * PREFILL_INTERLEAVE, 2
# The user message history_ids renders after a conversation so that the template writes its last message as an
# earlier one (what a next request, which goes on from it, renders); its text is never part of a cached prefix.
HISTORY_SENTINEL = "(the next message)"


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


# The fields each route reads; any other is a 400 naming it (nothing is silently ignored). NO_OP: fields the
# server does not implement, accepted only with the value that asks for nothing (OpenAI's default).
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "min_tokens", "n", "seed", "stop",
                 "stream", "stream_options", "user"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "chat_template_kwargs", "tools", "tool_choice",
                               "top_logprobs", "response_format"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
NO_OP = {"echo": (None, False), "suffix": (None, ""), "best_of": (None, 1)}
COMPLETION_NO_OP = {**NO_OP, "response_format": (None, {"type": "text"})}  # (a chat's is implemented)
# logit_bias: OpenAI's bounds (at most 300 entries, each bias in [-100, 100]). Logprobs: a chat's top_logprobs at
# most 20 (TOP_LOGPROBS, what the selection computes), a completion's logprobs at most 5 (OpenAI's legacy bound).
LOGIT_BIAS_ENTRIES, LOGIT_BIAS_LIMIT = 300, 100.0
CHAT_TOP_LOGPROBS, COMPLETION_LOGPROBS = TOP_LOGPROBS, 5
# A logprob that is not a finite number (never from finite logits) is reported as vLLM reports -inf.
LOGPROB_FLOOR = -9999.0
# reasoning_content: an assistant turn's thinking (Qwen3's template); tool_calls: its calls; tool_call_id, name:
# a tool message's.
MESSAGE_KEYS = {"role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name"}
def error_response(status: int, message: str, param=None, code=None) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
            429: "rate_limit_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


OPEN_PATHS = ("/health", "/metrics", "/")  # no key needed (vLLM: /metrics unauthenticated; /: chat_page.py says why)


class Histogram:
    """A Prometheus histogram: cumulative counts per upper bound `le`, the sum and the count."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1


# vLLM's buckets for these histograms (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    """What /metrics reports, in Prometheus' text format under vLLM's names (a qwen38: name where vLLM has
    none). Updated on the event loop only, at the end of each request."""

    def __init__(self):
        self.prompt_tokens = self.generation_tokens = self.cache_queries = self.cache_hits = 0
        self.ttft, self.itl, self.e2e = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS), Histogram(E2E_BUCKETS)

    def text(self, model_name: str, running: int, waiting: int, state_bytes: dict[str, int]) -> str:
        name = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        label = f'model_name="{name}"'
        lines = []

        def head(metric: str, kind: str, help_text: str) -> None:
            lines.extend([f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}"])

        for metric, value, help_text in (
                ("vllm:num_requests_running", running, "Number of requests currently running."),
                ("vllm:num_requests_waiting", waiting, "Number of requests waiting to be processed.")):
            head(metric, "gauge", help_text)
            lines.append(f"{metric}{{{label}}} {value}")
        for metric, value, help_text in (
                ("vllm:prompt_tokens_total", self.prompt_tokens, "Number of prefill tokens processed."),
                ("vllm:generation_tokens_total", self.generation_tokens, "Number of generation tokens processed."),
                ("vllm:prefix_cache_queries_total", self.cache_queries,
                 "Prefix cache queries, in terms of number of queried tokens."),
                ("vllm:prefix_cache_hits_total", self.cache_hits,
                 "Prefix cache hits, in terms of number of cached tokens.")):
            head(metric, "counter", help_text)  # the classic text format: TYPE names the _total sample
            lines.append(f"{metric}{{{label}}} {value}")
        for metric, hist, help_text in (
                ("vllm:time_to_first_token_seconds", self.ttft, "Histogram of time to first token in seconds."),
                ("vllm:inter_token_latency_seconds", self.itl, "Histogram of inter-token latency in seconds."),
                ("vllm:e2e_request_latency_seconds", self.e2e, "Histogram of e2e request latency in seconds.")):
            head(metric, "histogram", help_text)
            for bound, count in zip(hist.buckets, hist.counts):
                lines.append(f'{metric}_bucket{{{label},le="{bound}"}} {count}')
            lines.append(f'{metric}_bucket{{{label},le="+Inf"}} {hist.count}')
            lines.append(f"{metric}_sum{{{label}}} {hist.sum!r}")
            lines.append(f"{metric}_count{{{label}}} {hist.count}")
        head("qwen38:state_bytes", "gauge", "Bytes of the cached KV and recurrent state snapshots (prefix cache), "
             "per tier.")
        for tier, value in state_bytes.items():
            lines.append(f'qwen38:state_bytes{{{label},tier="{tier}"}} {value}')
        return "\n".join(lines) + "\n"


class ApiKey:
    """ASGI middleware: every route but /health and /metrics needs `Authorization: Bearer KEY`, else a 401
    in OpenAI's shape (pure ASGI, not BaseHTTPMiddleware: the handlers' receive() still sees a client go
    away). /metrics is open as in vLLM, whose --api-key guards only /v1: Prometheus scrapes it without a
    key, and it shows counts and timings, no request content."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "Incorrect or missing API key: send Authorization: Bearer KEY",
                                          code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclass
class ChatPrompt:
    """A chat request's messages and template arguments as the template takes them, and its prompt text;
    opened: the template's prompt opens the thinking."""

    messages: list[dict]
    kwargs: dict
    text: str
    opened: bool


class Server:
    def __init__(self, model, tokenizer, model_name: str, max_context: int, max_queue: int, cache_bytes: int,
                 sampling: dict | None = None, api_key: str | None = None, allowed_origins=(), log=None,
                 max_batch: int | None = None, kv_dtype: torch.dtype | None = None, use_graph: bool | None = None,
                 speculative: str | None = None, num_draft_tokens: int = 3, draft_vocab_size: int | None = None,
                 batch_invariant: bool = True, engine=None):
        """sampling: the checkpoint's settings (sampling_defaults.checkpoint_sampling, checked), over
        REQUEST_DEFAULTS; api_key: every route but /health and /metrics needs it; allowed_origins: the CORS
        origins ("*": any); log: where one line per request goes (stderr). max_batch: the BatchEngine's slots
        (sequences decoded at once; default default_max_batch), each of max_context tokens, KV in kv_dtype
        (default: the model's device's), use_graph as generate() takes it; its step graphs are captured here,
        before serving. speculative="mtp" (num_draft_tokens, draft_vocab_size as generate() takes them): the
        engine's step is the MTP step over all its slots (each slot also holds the verify's per-token GDN states,
        which the default max_batch counts). batch_invariant: the engine's (BatchEngine: False lets a step's rows
        share the int8 GEMM, so a reply may depend on its batch). engine: a ready engine (tests). With neither a
        model nor an engine nothing runs (the request checks only)."""
        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.api_key, self.allowed_origins, self.log = api_key, list(allowed_origins), log or sys.stderr
        self.sampling = {**REQUEST_DEFAULTS, **(sampling or {})}
        self.max_context, self.max_queue = max_context, max_queue
        self.cache = PrefixCache(cache_bytes)
        self.metrics = Metrics()
        self.created = int(time.time())
        self.eos_ids = tuple(model.config.eos_token_ids) if model is not None else ()
        self.eos = frozenset(self.eos_ids)
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)  # the logits' width: the bitmask's
        self.json_constraints = JsonConstraints(tokenizer, vocab, self.eos_ids) if isinstance(vocab, int) else None
        self.message_start = self.template_message_start() if tokenizer is not None else None
        if speculative not in (None, "mtp"):
            raise ValueError(f"speculative must be None or 'mtp', found {speculative!r}")
        self.scheduler = None
        if engine is not None or model is not None:
            if engine is None:
                kv_dtype = kv_dtype or default_kv_dtype(model.device)
                if max_batch is None:
                    max_batch = default_max_batch(model, max_context, kv_dtype, cache_bytes,
                                                  num_draft_tokens + 1 if speculative else 0)
                speculation = Speculation(num_draft_tokens, draft_vocab_size) if speculative else None
                engine = BatchEngine(model, max_batch, max_context, kv_dtype, use_graph, name="--max-context",
                                     batch_invariant=batch_invariant, speculation=speculation)
                with torch.no_grad():
                    engine.capture()  # every bucket's step graph (CUDA), while no sequence is active
            self.scheduler = Scheduler(model, engine, self.cache, tokenizer, max_queue)
        if self.scheduler is not None:
            self.scheduler.start()

    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch if self.scheduler is not None else 1

    def close(self) -> None:
        """Stops the scheduler thread (after uvicorn has stopped: no request is in flight any more)."""
        if self.scheduler is not None:
            self.scheduler.close()

    def speculative(self) -> bool:
        """Whether the engine's step is the MTP step (--speculative): what it cannot do is a 400."""
        return self.scheduler is not None and getattr(self.scheduler.engine, "mtp", None) is not None

    def app(self) -> Starlette:
        middleware = []  # the first is the outermost: CORS answers a preflight (no key) before ApiKey
        if self.allowed_origins:
            middleware.append(Middleware(CORSMiddleware, allow_origins=self.allowed_origins, allow_methods=["*"],
                                         allow_headers=["*"]))
        if self.api_key:
            middleware.append(Middleware(ApiKey, key=self.api_key))
        return Starlette(routes=[
            chat_page.route(),  # GET /: the web chat page
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ], middleware=middleware,
            exception_handlers={404: self.not_found, 405: self.not_found, 500: self.internal_error})

    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's /tokenize: {"prompt": text} or {"messages": [...], "chat_template_kwargs"?} (rendered by
        the chat template) -> {"tokens", "count", "max_model_len"}."""
        try:
            body = await read_json(request)
            model = body.get("model")
            if model is not None and model != self.model_name:
                raise RequestError(404, f"The model `{model}` does not exist", "model", "model_not_found")
            extra = set(body) - {"model", "prompt", "messages", "chat_template_kwargs", "tools"}
            if extra or ("prompt" in body) == ("messages" in body):
                raise RequestError(400, "/tokenize takes {\"prompt\": text} or {\"messages\": [...]}"
                                        + (f", not {sorted(extra)}" if extra else ""),
                                   sorted(extra)[0] if extra else None)
            if "tools" in body and "messages" not in body:
                raise RequestError(400, "tools go with messages", "tools")
            if "messages" in body:
                ids = self.tokenizer.encode(self.chat_prompt(body))
            elif isinstance(body["prompt"], str):
                ids = self.tokenizer.encode(body["prompt"])
            else:
                raise RequestError(400, "prompt must be a string", "prompt")
        except RequestError as e:
            return error_response(e.status, str(e), e.param, e.code)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.max_context})

    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
        try:
            body = await read_json(request)
            tokens, vocab = body.get("tokens"), len(self.tokenizer)
            if set(body) - {"model", "tokens"} or not isinstance(tokens, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
                raise RequestError(400, f"/detokenize takes {{\"tokens\": [ids in [0, {vocab})]}}", "tokens")
        except RequestError as e:
            return error_response(e.status, str(e), e.param, e.code)
        return JSONResponse({"prompt": self.tokenizer.decode(tokens)})

    async def not_found(self, request: Request, exc) -> JSONResponse:
        return error_response(404, f"no route {request.method} {request.url.path}")

    async def internal_error(self, request: Request, exc) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    def gauges(self) -> tuple[int, int, tuple[int, int, int]]:
        """The scheduler's requests running and waiting, and its prefix cache's (device bytes, host bytes,
        entries), as the scheduler thread last wrote them."""
        s = self.scheduler
        return (0, 0, (0, 0, 0)) if s is None else (s.running, s.waiting, s.cache_state)

    async def health(self, request: Request) -> JSONResponse:
        running, waiting, (_, _, entries) = self.gauges()
        return JSONResponse({"status": "ok", "running": running, "waiting": waiting, "slots": self.max_batch,
                             "cached_prefixes": entries})

    async def metrics_text(self, request: Request) -> Response:
        running, waiting, (device, host, _) = self.gauges()
        text = self.metrics.text(self.model_name, running, waiting, {"device": device, "host": host})
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                         "created": self.created, "owned_by": "qwen38"}]})

    async def chat_completions(self, request: Request):
        return await self.handle(request, chat=True)

    async def completions(self, request: Request):
        return await self.handle(request, chat=False)

    async def handle(self, request: Request, chat: bool):
        try:
            body = await read_json(request)
            self.check_fields(body, chat)
            prompt = self.chat_request(body) if chat else None
            prompts = self.prompt_ids(body, prompt)
            ids = prompts[0]  # a chat's one prompt
            kwargs = self.generation_kwargs(body, max(len(p) for p in prompts))
            if len(prompts) * kwargs["n"] > self.max_batch:
                raise RequestError(400, f"prompt: {len(prompts)} prompts x n {kwargs['n']} choices are "
                                        f"{len(prompts) * kwargs['n']} sequences, more than the {self.max_batch} "
                                        "this server decodes at once", "prompt")
            logprobs = request_logprobs(body, chat)
            if logprobs is not None and self.speculative():
                raise RequestError(400, "logprobs are not available with --speculative (the MTP step reports none)",
                                   "logprobs")
            cfg = self.sampling_config(kwargs, logprobs is not None)
            constraints = self.constraints(body, prompt, kwargs["n"]) if chat else None
            if constraints:
                cfg = dataclasses.replace(cfg, token_mask=True)
        except RequestError as e:
            self.log.write(f"- POST {request.url.path} {e.status}: {e}\n")
            return error_response(e.status, str(e), e.param, e.code)
        if self.scheduler is None:
            return error_response(503, "this server has no model to run")
        if not self.scheduler.has_room(len(prompts) * kwargs["n"]):
            waiting = self.scheduler.waiting
            self.log.write(f"- POST {request.url.path} 429: {waiting} waiting\n")
            busy = error_response(429, f"the server is busy: {waiting} requests already wait for one of its "
                                       f"{self.max_batch} sequence slots", code="queue_full")
            busy.headers["Retry-After"] = "1"
            return busy
        breaks = self.message_breaks(prompt, ids) if chat else ()
        next_turn = self.next_turn(prompt, body) if chat else None  # where the template renders the reply back
        # Several prompts: each its own Job (they batch together), all with the request's one seed, so that choice
        # p * n + j (prompt p, sample j) samples with seed + j as the request with prompt p alone does (as vLLM
        # runs each prompt of a list with the request's sampling parameters, its seed among them).
        seed, loop, events = resolve_seed(kwargs["seed"], None), asyncio.get_running_loop(), asyncio.Queue()
        jobs = [Job(ids, kwargs, cfg, seed, loop, events=PromptEvents(events, p), logprobs=logprobs,
                    breaks=stride_breaks(len(ids), breaks), next_turn=next_turn, constraints=constraints,
                    message_start=self.message_start if chat else None)
                for p, ids in enumerate(prompts)]
        reply = Reply(self, jobs, events, request, chat, body.get("stream") is True,
                      (body.get("stream_options") or {}).get("include_usage") is True,
                      parse_tools=chat and bool(body.get("tools")) and body.get("tool_choice") != "none")
        return StreamingResponse(reply.events(), media_type="text/event-stream") if reply.stream else \
            await reply.whole()

    def check_fields(self, body: dict, chat: bool) -> None:
        """The model named (404 model_not_found unless the served one, as vLLM) and no field the server
        would ignore: an unknown one, or one it does not implement asking for something (400 naming it)."""
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(404, f"The model `{model}` does not exist (this server serves {self.model_name})",
                               "model", "model_not_found")
        known, no_op = (CHAT_FIELDS, NO_OP) if chat else (COMPLETION_FIELDS, COMPLETION_NO_OP)
        for name, value in body.items():
            if name in no_op:
                # A bool matches only itself (False == 0 in Python: logprobs=0 must not pass as false).
                if not any(value is v if bool in (type(value), type(v)) else value == v for v in no_op[name]):
                    raise RequestError(400, f"{name} is not supported by this server (found {value!r})", name)
            elif name not in known:
                raise RequestError(400, f"{name} is not supported by this server", name)
        if not isinstance(body.get("stream", False), bool):
            raise RequestError(400, f"stream must be true or false, found {body['stream']!r}", "stream")
        options = body.get("stream_options")
        if options is not None:
            if body.get("stream") is not True:
                raise RequestError(400, "stream_options is only allowed with stream: true", "stream_options")
            if not isinstance(options, dict) or set(options) - {"include_usage"} or \
                    not isinstance(options.get("include_usage", False), bool):
                raise RequestError(400, f"stream_options must be {{\"include_usage\": bool}}, found {options!r}",
                                   "stream_options")

    def prompt_ids(self, body: dict, chat: ChatPrompt | None) -> list[list[int]]:
        """The token ids of each prompt: a chat's rendered prompt (chat_request), else the completion's prompt
        or prompts, as OpenAI takes them: a string, a list of token ids, or a non-empty list of strings or of
        token-id lists (not both)."""
        if chat is not None:
            texts = [chat.text]
        else:
            prompt = body.get("prompt")
            if is_token_ids(prompt):
                prompts = [prompt]
            elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                          or all(is_token_ids(p) for p in prompt)):
                prompts = prompt  # several prompts (or one in a list)
            else:
                prompts = [prompt]
            if not all(is_token_ids(p) or (isinstance(p, str) and p) for p in prompts):
                raise RequestError(400, "prompt must be a non-empty string, a list of token ids, or a non-empty "
                                        "list of strings or of token-id lists", "prompt")
            vocab = len(self.tokenizer)
            if not all(0 <= t < vocab for p in prompts if is_token_ids(p) for t in p):
                raise RequestError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
            if all(is_token_ids(p) for p in prompts):
                return prompts
            texts = prompts
        out = [self.tokenizer.encode(text) for text in texts]
        if not all(out):
            raise RequestError(400, "the prompt encodes to no tokens", "prompt")
        return out

    def chat_prompt(self, body: dict) -> str:
        return self.chat_request(body).text

    def chat_request(self, body: dict) -> ChatPrompt:
        """The chat template's text for the request's messages (content as a string or a list of text parts,
        joined by newlines as vLLM joins them) and its chat_template_kwargs (enable_thinking, ...), rendered
        once."""
        messages, kwargs = self.chat_messages(body)
        if forced_tools(body, kwargs.get("tools", [])) and response_schema(body) is not None:
            raise RequestError(400, "response_format constrains the reply, a forced tool call (tool_choice "
                                    f"{body['tool_choice']!r:.80}) makes it a call: ask for one of them",
                               "response_format")
        text = self.render(messages, kwargs)
        return ChatPrompt(messages, kwargs, text, text.rfind(THINK_START) > text.rfind(THINK_END))

    def render(self, messages: list[dict], kwargs: dict, add_generation_prompt: bool = True) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        except ValueError as e:
            raise RequestError(400, f"the chat template rejected the messages: {e}", "messages") from None

    def template_message_start(self) -> int | None:
        """The token every message of the chat template's render begins with (ChatML's <|im_start|>): the first
        token of a one-message render, found once per message in a three-message one; None for a template that
        does not start each message with one token, or no template. A chat's prefill ends a chunk before each
        (scheduler.message_starts): its message boundaries, where the cache snapshots, are there, so a prefix
        restored at an earlier request's boundary was prefilled in chunks that every later prompt ends too. (With
        None, a chat restored from a prefix older than the last BREAK_MESSAGES messages sums in another order
        than a full prefill: the same math, other bits.)"""
        chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
        try:
            one = self.tokenizer.encode(self.render(chat[:1], {}, add_generation_prompt=False))
            three = self.tokenizer.encode(self.render(chat, {}, add_generation_prompt=False))
        except RequestError:
            return None
        return one[0] if one and three.count(one[0]) == 3 and three[0] == one[0] else None

    def message_breaks(self, prompt: ChatPrompt, ids: list[int]) -> tuple[int, ...]:
        """Where the request's templated prompt ends a message (after the first, the system prompt as a rule,
        and after each of the last BREAK_MESSAGES, the last one included: its end without the generation
        prompt is where the next turn of the chat goes on), as token counts: the prefill snapshots the state
        there for the prefix cache, so a shared system prompt and the earlier turns of a chat are restored, not
        prefilled, by the requests that share them. Each boundary is the end of messages[:k] as the template
        renders them with a message after them (history_ids; the prompt itself is that render, the rest of the
        messages and the generation prompt after them), and counts only where that is a prefix of the whole
        prompt, tokens included (a template may render history differently once more follows, e.g. Qwen's
        drops old thinking)."""
        messages, kwargs = prompt.messages, prompt.kwargs
        ends = sorted({1} | set(range(max(1, len(messages) - BREAK_MESSAGES + 1), len(messages) + 1)))
        breaks = []
        for k in ends:
            try:
                prefix = self.history_ids(messages[:k], kwargs, followed=ids)
            except RequestError:  # a template may refuse a prefix (one that must end on a user message)
                continue
            if prefix is not None and 0 < len(prefix) < len(ids) and ids[: len(prefix)] == prefix:
                breaks.append(len(prefix))
        return tuple(sorted(set(breaks)))

    def history_ids(self, messages: list[dict], kwargs: dict, followed: list[int] | None = None) -> list[int] | None:
        """The token ids of messages as the template renders them with another message after them, up to the
        end of the last one: the prefix a later request that goes on from them shares. Not simply the
        render of messages alone, without the generation prompt: a template may write its last message
        otherwise than an earlier one. Qwen3's writes a reasoning block, even an empty one
        (`<think>\\n\\n</think>\\n\\n`), into an assistant message after the last user message, an earlier
        one as its content only, so that messages ending on an assistant reply render as no prefix of the
        next request's prompt, which has a user message after the reply. So they are rendered once alone
        (the last message's end, as the template writes it last) and once with a user message after them
        (HISTORY_SENTINEL): where the two part, the rest of the first (the last message as written last, e.g.
        its think block, then its text and end) is matched by its longest tail that the second goes on with
        (its text and end, the think block gone): the last message ends there. A template that writes the
        last message as an earlier one renders the first as a prefix of the second: all of it. None where
        no tail matches; the render alone where the template refuses the one with a message after it.
        followed: the ids of a render with more after messages, when the caller has one (the prompt that goes on
        from them), in place of the sentinel's."""
        alone = self.tokenizer.encode(self.render(messages, kwargs, add_generation_prompt=False))
        if followed is None:
            try:
                followed = self.tokenizer.encode(self.render(
                    messages + [{"role": "user", "content": HISTORY_SENTINEL}], kwargs, add_generation_prompt=False))
            except RequestError:
                return alone
        parted = 0
        while parted < min(len(alone), len(followed)) and alone[parted] == followed[parted]:
            parted += 1
        rest = alone[parted:]
        if parted == len(followed):  # no template writes more of a conversation alone than with a message after
            return None
        for n in range(len(rest), 0, -1):  # the longest tail of rest that followed goes on with at `parted`
            if rest[len(rest) - n] == followed[parted] and followed[parted: parted + n] == rest[len(rest) - n:]:
                return followed[: parted + n]
        return alone if not rest else None

    def next_turn(self, prompt: ChatPrompt, body: dict):
        """For a chat request: the function from its reply's text to the token ids of its history with the reply
        as a next request renders it (the thinking split off, which Qwen's template drops from the history;
        tool calls as message.tool_calls; the reply written as an earlier message, not as the last one:
        history_ids), up to the reply's end; None where the template refuses it."""
        messages, kwargs = prompt.messages, prompt.kwargs
        parse_tools = bool(kwargs.get("tools")) and body.get("tool_choice") != "none"

        def ids_after(reply: str) -> list[int] | None:
            _, content = ThinkingSplit(prompt.opened).feed(reply, final=True)
            calls = []
            if parse_tools:
                split = ToolCallSplit()
                content, _ = split.feed(content, final=True)
                calls = split.calls
            message = {"role": "assistant", "content": content or ""}
            if calls:
                message["tool_calls"] = message_tool_calls(calls, len(messages))
            try:  # rendered as the next request renders it, a message after the reply (history_ids)
                return self.history_ids(messages + [message], kwargs)
            except RequestError:
                return None

        return ids_after

    def chat_messages(self, body: dict) -> tuple[list[dict], dict]:
        """The request's messages as the template takes them, and the template's keyword arguments; 400s for
        what it cannot take."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise RequestError(400, "messages must be a non-empty list of {role, content} with string "
                                    "values", "messages")
        rendered = []
        for i, m in enumerate(messages):
            for key in m:
                if key not in MESSAGE_KEYS:
                    raise RequestError(400, f"messages[{i}].{key} is not supported by this server",
                                       f"messages[{i}].{key}")
            for key in ("reasoning_content", "tool_call_id", "name"):
                if not isinstance(m.get(key, ""), str):
                    raise RequestError(400, f"messages[{i}].{key} must be a string", f"messages[{i}].{key}")
            message = dict(m)
            if "tool_calls" in m:
                if m["role"] != "assistant":
                    raise RequestError(400, f"messages[{i}].tool_calls: only an assistant message has tool calls",
                                       f"messages[{i}].tool_calls")
                message["tool_calls"] = message_tool_calls(m["tool_calls"], i)
            # An assistant message with tool calls may have no content (null), as OpenAI's.
            content = m.get("content")
            message["content"] = "" if content is None and m["role"] == "assistant" else message_text(content, i)
            rendered.append(message)
        kwargs = body.get("chat_template_kwargs")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs) or \
                {"messages", "tools"} & set(kwargs):
            raise RequestError(400, "chat_template_kwargs must be an object of keyword arguments to the chat "
                                    "template (not messages or tools)", "chat_template_kwargs")
        tools = request_tools(body)
        if tools:  # rendered by the checkpoint's template, whatever tool_choice says (as vLLM)
            kwargs = {**kwargs, "tools": tools}
        return rendered, kwargs

    def vocab_size(self) -> int | None:
        """The token ids a request may name (logit_bias): the tokenizer's, within the model's logits."""
        sizes = [len(self.tokenizer)] if self.tokenizer is not None else []
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if isinstance(vocab, int):
            sizes.append(vocab)
        return min(sizes, default=None)

    def generation_kwargs(self, body: dict, prompt_tokens: int) -> dict:
        """The request's generation parameters as generate()'s arguments (temperature 0: greedy; sampling
        fields it leaves out from self.sampling), and n, its number of choices."""
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 256))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(400, f"max_tokens must be an integer >= 1, found {max_tokens!r}", "max_tokens")
        if prompt_tokens + max_tokens > self.max_context:
            raise RequestError(400, f"{prompt_tokens} prompt tokens + max_tokens {max_tokens} > the server's context "
                                    f"of {self.max_context} tokens", "messages", "context_length_exceeded")
        defaults = self.sampling
        temperature = number(body, "temperature", defaults["temperature"], 0.0, 2.0)
        top_k = body.get("top_k")
        if top_k is None:
            top_k = defaults["top_k"]
        elif isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
            raise RequestError(400, f"top_k must be an integer >= 1, or -1 or 0 (no top-k), found {top_k!r}",
                               "top_k")
        kwargs = dict(max_new_tokens=max_tokens, do_sample=temperature > 0, temperature=temperature or 1.0,
                      top_p=number(body, "top_p", defaults["top_p"], 0.0, 1.0), top_k=max(top_k, 0),
                      min_p=number(body, "min_p", defaults["min_p"], 0.0, 1.0),
                      repetition_penalty=number(body, "repetition_penalty", defaults["repetition_penalty"], 0.0,
                                                math.inf),
                      presence_penalty=number(body, "presence_penalty", 0.0, -2.0, 2.0),
                      frequency_penalty=number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                      logit_bias=request_logit_bias(body, self.vocab_size()),
                      min_new_tokens=integer(body, "min_tokens", 0))
        for name in ("top_p", "repetition_penalty"):
            if kwargs[name] <= 0:
                raise RequestError(400, f"{name} must be > 0", name)
        if kwargs["min_new_tokens"] > max_tokens:
            raise RequestError(400, f"min_tokens {kwargs['min_new_tokens']} must be <= max_tokens {max_tokens}",
                               "min_tokens")
        n = body.get("n")
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.max_batch:
            raise RequestError(400, f"n must be an integer in [1, {self.max_batch}] (the sequences this server "
                                    f"decodes at once), found {n!r}", "n")
        kwargs["n"] = n
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT):
            raise RequestError(400, f"seed must be an integer in [0, {SEED_LIMIT - 1}], found {seed!r}", "seed")
        kwargs["seed"] = seed
        stop = body.get("stop")
        if stop is not None:
            stop = [stop] if isinstance(stop, str) else stop
            if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
                raise RequestError(400, "stop must be a non-empty string or a list of at most 4", "stop")
            kwargs["stop_strings"] = stop
        return kwargs

    def constraints(self, body: dict, prompt: ChatPrompt, n: int) -> list | None:
        """One constraint per choice of a chat whose reply is constrained (None otherwise): to its
        response_format's JSON schema, or, for a tool_choice that forces a call, to tool calls of the functions
        it allows (forced_tools). Where the prompt leaves the thinking open, the reply thinks first and the
        constraint begins after its `</think>` (structured.py, as vLLM). A 400 naming the field where the
        grammar library rejects a schema (response_format, or tools[i].function.parameters), or where nothing
        can apply it."""
        schema, tools = response_schema(body), prompt.kwargs.get("tools", [])
        forced = forced_tools(body, tools)
        if schema is None and not forced:
            return None
        field = "response_format" if schema is not None else "tool_choice"
        if self.speculative():
            raise RequestError(400, f"{field} is not available with --speculative (the MTP step takes no token "
                                    "mask: it constrains nothing)", field)
        if self.json_constraints is None:
            raise RequestError(503, "this server has no model to run")
        json_constraints = self.json_constraints
        try:
            if schema is not None:
                grammar = json_constraints.grammar(schema, prompt.opened)
            else:
                functions = []
                for i in forced:
                    function, param = tools[i]["function"], f"tools[{i}].function.parameters"
                    try:
                        functions.append((function["name"],
                                          json_constraints.schema_grammar(function_parameters(function, param))))
                    except ValueError as e:
                        raise RequestError(400, f"{param}: {e}", param) from None
                grammar = json_constraints.tool_call_grammar(functions, several=body["tool_choice"] == "required",
                                                             thinking=prompt.opened)
            return [json_constraints.constraint(grammar) for _ in range(n)]
        except ValueError as e:
            raise RequestError(400, f"{field}: {e}", field) from None

    def sampling_config(self, kwargs: dict, logprobs: bool = False) -> SamplingConfig:
        """generation_kwargs' sampling fields as the engine's per-sequence SamplingConfig (as generate() builds
        it, the checkpoint's end tokens among them); logprobs: the request asks for them."""
        try:
            return SamplingConfig(kwargs["do_sample"], kwargs["temperature"], kwargs["top_k"], kwargs["top_p"],
                                  kwargs["min_p"], kwargs["repetition_penalty"], kwargs["presence_penalty"],
                                  kwargs["min_new_tokens"], self.eos_ids,
                                  frequency_penalty=kwargs.get("frequency_penalty", 0.0),
                                  logit_bias=kwargs.get("logit_bias") is not None, logprobs=logprobs)
        except ValueError as e:
            raise RequestError(400, str(e)) from None

class Choice:
    """One choice of a reply (one sequence): its text so far, what of it was sent, how it finished, and, in a
    chat, the splits of its text into reasoning, content and tool calls."""

    def __init__(self, index: int, reply: "Reply", job: Job, j: int, opened: bool, parse_tools: bool):
        """index: the choice's in the answer (p * n + j: prompt p's job, its sequence j)."""
        self.index, self.chat, self.job, self.j = index, reply.chat, job, j
        self.stop_strings = job.kwargs.get("stop_strings") or []
        self.decoder = reply.server.tokenizer.stream_decoder(skip_special_tokens=True)
        self.text, self.sent, self.count, self.finish = "", 0, 0, "length"
        self.thinking = ThinkingSplit(opened) if self.chat else None
        self.tool_split = ToolCallSplit() if parse_tools else None  # tools given, tool_choice not "none"
        self.role_sent = False  # streamed chat: the first chunk's delta carries the role
        self.constraint = job.constraints[j] if job.constraints else None  # response_format, a forced call
        self.last_token = None
        self.tokenizer = reply.server.tokenizer
        self.top = job.logprobs  # alternatives per token with logprobs; None: no logprobs asked
        # With logprobs: (token, its text's offset in the choice's text, TokenLogprobs) per token fed, and how
        # many of them went out in an answer already.
        self.logprobs, self.logprobs_sent = [], 0

    def feed(self, token: int, eos, logprobs=None) -> bool:
        """One token of the sequence (with its TokenLogprobs when the request asks for them); whether the
        choice stops at it (an end token, or a stop string)."""
        self.count += 1
        if self.top is not None and logprobs is not None:
            self.logprobs.append((token, len(self.text), logprobs))
        self.text += self.decoder.feed(token)
        if token in eos:  # the end token completes no character: what the decoder holds is the reply's, as
            self.text += self.decoder.flush()  # decode(ids) gives it (the next turn's cached history renders it so)
        if token in eos or self.stopped():
            self.finish = "stop"
        return self.finish == "stop"

    def token_entry(self, token: int, logprob: float) -> dict:
        """A token in a chat's logprobs: its text (vLLM's: a piece of a character is U+FFFD), logprob, bytes."""
        raw = self.tokenizer.token_bytes(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": finite_logprob(logprob), "bytes": list(raw)}

    def logprob_part(self) -> dict | None:
        """The logprobs of the tokens fed since the last answer part, in OpenAI's shape (chat:
        {"content": [...]}; completion: tokens, token_logprobs, top_logprobs, text_offset); None when the
        request asks for no logprobs."""
        if self.top is None:
            return None
        entries, self.logprobs_sent = self.logprobs[self.logprobs_sent:], len(self.logprobs)
        if self.chat:
            return {"content": [{**self.token_entry(token, lp.logprob),
                                 "top_logprobs": [self.token_entry(t, v) for t, v in lp.top[: self.top]]}
                                for token, _, lp in entries]}
        top = []
        for token, _, lp in entries:
            alternatives = {self.token_entry(t, v)["token"]: finite_logprob(v) for t, v in lp.top[: self.top]}
            alternatives.setdefault(self.token_entry(token, lp.logprob)["token"], finite_logprob(lp.logprob))
            top.append(alternatives)  # OpenAI's: the top `logprobs` and always the chosen token
        return {"tokens": [self.token_entry(token, 0.0)["token"] for token, _, _ in entries],
                "token_logprobs": [finite_logprob(lp.logprob) for _, _, lp in entries],
                "top_logprobs": top, "text_offset": [offset for _, offset, _ in entries]}

    def stopped(self) -> bool:
        cut = min((self.text.find(s) for s in self.stop_strings if s in self.text), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]  # OpenAI leaves the stop string out
        return cut >= 0

    def ready(self, final: bool = False) -> str:
        """Text not sent yet, less what could still turn out to start a stop string."""
        hold = 0 if final or self.finish == "stop" else max((len(s) - 1 for s in self.stop_strings), default=0)
        end = max(self.sent, len(self.text) - hold)
        piece, self.sent = self.text[self.sent:end], end
        return piece

    def choice(self, text: str, finish, delta: bool) -> dict | None:
        """The choice for text (all of it, or a streamed piece); a streamed chat piece the thinking split
        holds back entirely is None (no chunk)."""
        if not self.chat:
            return {"index": self.index, "text": text, "logprobs": self.logprob_part(), "finish_reason": finish}
        reasoning, text = self.thinking.feed(text, final=finish is not None)
        calls = []
        if self.tool_split is not None:
            text, calls = self.tool_split.feed(text, final=finish is not None)
            if finish is not None and self.tool_split.calls:
                finish = "tool_calls"
        if not delta:
            calls = self.tool_split.calls if self.tool_split is not None else []
            message = {"role": "assistant", "content": text or (None if calls else text)}
            if self.thinking.reasoned:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = calls
            return {"index": self.index, "message": message, "logprobs": self.logprob_part(), "finish_reason": finish}
        content = {} if self.role_sent else {"role": "assistant"}
        if reasoning:
            content["reasoning_content"] = reasoning
        if text or not (reasoning or calls):
            content["content"] = text
        if calls:
            content["tool_calls"] = calls
        if finish is None and not reasoning and not text and not calls and self.role_sent:
            return None
        self.role_sent = True
        return {"index": self.index, "delta": content, "logprobs": self.logprob_part(), "finish_reason": finish}


class Reply:
    """One request's answer: the whole JSON body, or its server-sent events; one Choice per sequence. A
    completion of several prompts is one Job per prompt (events: their shared queue, PromptEvents), its
    choices in order p * n + j (prompt p, its choice j), as OpenAI and vLLM index them."""

    def __init__(self, server: Server, jobs: list[Job], events: asyncio.Queue, request: Request, chat: bool,
                 stream: bool, include_usage: bool = False, parse_tools: bool = False):
        self.server, self.jobs, self.queue, self.request = server, jobs, events, request
        self.chat, self.stream, self.include_usage = chat, stream, include_usage
        opened = False
        if chat:  # the prompt ends inside <think> (the template's thinking on): the reply starts reasoning
            tail = server.tokenizer.decode(jobs[0].ids[-16:])
            opened = tail.rfind(THINK_START) > tail.rfind(THINK_END)
        self.choices = [Choice(p * job.n + j, self, job, j, opened, parse_tools)
                        for p, job in enumerate(jobs) for j in range(job.n)]
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.started, self.first_token, self.gaps = time.monotonic(), None, []

    @property
    def count(self) -> int:
        return sum(c.count for c in self.choices)

    async def tokens(self):
        """Submits the job; yields (choice index, text piece) as its tokens arrive and (index, None) once that
        choice's sequence has ended (its finish reason set). Each choice ends when the scheduler says so, after
        the prefix cache and the gauges have it: at its end token, max_tokens, the stop string the engine sees, or
        a stop string the reply sees first, which has the scheduler free its slot. Whatever is left of the jobs
        when this ends (the client gone, or one prompt's job failed) is dropped."""
        server = self.server
        for job in self.jobs:
            server.scheduler.submit(job)
        watcher = asyncio.create_task(self.watch_disconnect())
        done = False
        try:
            running = set(range(len(self.choices)))
            while running:
                p, (j, value) = await self.queue.get()
                if isinstance(value, BaseException):
                    raise value
                job = self.jobs[p]
                i = p * job.n + j
                choice = self.choices[i]
                if value is None:
                    if choice.finish != "stop":
                        choice.text += choice.decoder.flush()
                        if choice.constraint is not None and choice.constraint.complete():
                            choice.finish = "stop"  # the grammar ended it (the JSON, or the call, is complete)
                    running.discard(i)
                    if piece := choice.ready(final=True):
                        yield i, piece
                    yield i, None
                    continue
                if choice.finish == "stop":  # what the engine read past a stop the reply saw first
                    continue
                arrived = time.monotonic()
                if self.first_token is None:
                    self.first_token = arrived
                if choice.last_token is not None:
                    self.gaps.append(arrived - choice.last_token)
                choice.last_token = arrived
                token, logprobs = value if isinstance(value, tuple) else (value, None)
                if choice.feed(token, server.eos, logprobs):
                    server.scheduler.stop(job, j)  # a no-op when the engine ended it at the same token
                if piece := choice.ready():
                    yield i, piece
            done = True
        finally:
            watcher.cancel()
            for job in self.jobs:  # no await here: a task cancelled by the ASGI stack (the client left) is
                server.scheduler.cancel(job)  # cancelled again at every await of its cleanup
            self.write_log(", ".join(c.finish for c in self.choices) if done else "ended early (cancelled or failed)")
            self.record(any(job.started for job in self.jobs))

    async def watch_disconnect(self) -> None:
        """The body has been read: the next ASGI message is the client going away (the server's writes to
        a closed connection may not fail, so this is what notices)."""
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        for job in self.jobs:
            self.server.scheduler.cancel(job)  # its slots are freed at the scheduler's next iteration

    def cached(self) -> int:
        return sum(job.cached or 0 for job in self.jobs)

    def prompt_tokens(self) -> int:
        """Each prompt's tokens once (its n choices share them), summed over the prompts."""
        return sum(len(job.ids) for job in self.jobs)

    def write_log(self, finish: str) -> None:
        """One line on the server's log: id, route, tokens in (cached) and out, time to first token, tok/s."""
        now, path = time.monotonic(), self.request.url.path
        prompt, count = self.prompt_tokens(), self.count
        cached = "? cached" if any(job.cached is None for job in self.jobs) else f"{self.cached()} cached"
        if self.first_token is None:
            timing = "no token"
        else:
            rate = (count - 1) / (now - self.first_token) if count > 1 and now > self.first_token else 0.0
            timing = f"TTFT {self.first_token - self.started:.3f} s, {rate:.1f} tok/s"
        n = self.jobs[0].n
        choices = (f" ({len(self.jobs)} prompts)" if len(self.jobs) > 1 else "") + (f" x {n} choices" if n > 1 else "")
        self.server.log.write(f"{self.id} POST {path}: {prompt} tokens in ({cached}){choices}, {count} out, {timing}, "
                              f"{finish}\n")
        self.server.log.flush()

    def record(self, ran: bool) -> None:
        """The request into the server's metrics (as vLLM: every request that ran, finished or not)."""
        if not ran:
            return
        metrics, now, prompt = self.server.metrics, time.monotonic(), self.prompt_tokens()
        metrics.prompt_tokens += prompt
        metrics.generation_tokens += self.count
        metrics.cache_queries += prompt
        metrics.cache_hits += self.cached()
        metrics.e2e.observe(now - self.started)
        if self.first_token is not None:
            metrics.ttft.observe(self.first_token - self.started)
        for gap in self.gaps:
            metrics.itl.observe(gap)

    def usage(self) -> dict:
        prompt, count = self.prompt_tokens(), self.count
        return {"prompt_tokens": prompt, "completion_tokens": count, "total_tokens": prompt + count,
                "prompt_tokens_details": {"cached_tokens": self.cached()}}

    def body(self, choices: list, usage: dict | None = None) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        body = {"id": self.id, "object": kind + (".chunk" if self.stream and self.chat else ""),
                "created": int(time.time()), "model": self.server.model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    async def whole(self) -> JSONResponse:
        try:
            async for _ in self.tokens():
                pass
        except Exception as e:  # the generation failed: the answer says why, the server goes on
            return error_response(*failure(e))
        return JSONResponse(self.body([c.choice(c.text, c.finish, delta=False) for c in self.choices], self.usage()))

    async def events(self):
        try:
            async for i, piece in self.tokens():
                choice = self.choices[i]
                # A choice's last chunk carries its finish reason (and what the splits held back).
                if chunk := choice.choice(piece or "", choice.finish if piece is None else None, delta=True):
                    yield sse(self.body([chunk]))
        except Exception as e:  # mid-stream: the error is the last event
            yield sse(json.loads(error_response(*failure(e)).body))
            return
        if self.include_usage:  # as OpenAI: a last chunk with no choices and the usage, only when asked
            yield sse(self.body([], self.usage()))
        yield "data: [DONE]\n\n"


def stride_breaks(length: int, breaks: tuple[int, ...]) -> tuple[int, ...]:
    """breaks (a chat's message boundaries in its prompt of length tokens, Server.message_breaks; a completion
    has none) with the last STRIDE_BREAKS multiples of BREAK_STRIDE inside the prompt's last span: between its
    last two boundaries (a chat's last message; the last boundary stays the last break, where the next turn
    goes on), or from the start to the end of a prompt without any (a completion)."""
    end = max(breaks, default=length)
    begin = max((b for b in breaks if b < end), default=0)
    strides = range((begin // BREAK_STRIDE + 1) * BREAK_STRIDE, end, BREAK_STRIDE)
    return tuple(sorted({*breaks, *strides[-STRIDE_BREAKS:]}))


def response_schema(body: dict) -> dict | None:
    """The JSON schema a chat's response_format constrains its reply to: json_object any object, json_schema
    its json_schema.schema (OpenAI's {"name", "schema", "description"?, "strict"?}); None for text or none."""
    form = body.get("response_format")
    if form is None or form == {"type": "text"}:
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if kind == "json_object" and set(form) == {"type"}:
        return ANY_OBJECT
    spec = form.get("json_schema") if kind == "json_schema" and set(form) == {"type", "json_schema"} else None
    if not (isinstance(spec, dict) and set(spec) <= {"name", "schema", "description", "strict"}
            and isinstance(spec.get("name"), str) and isinstance(spec.get("schema", {}), dict)
            and isinstance(spec.get("strict", False), (bool, type(None)))):
        raise RequestError(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                "{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\"?, \"description\"?, "
                                f"\"strict\"?}}}}, found {form!r:.120}", "response_format")
    return spec.get("schema", {})


def request_tools(body: dict) -> list:
    """The request's OpenAI function tools (checked), and its tool_choice (forced_tools says what each
    means)."""
    tools = body.get("tools")
    tools = [] if tools is None else tools
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and set(t) <= {"type", "function"}
            and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            and isinstance(t["function"].get("parameters", {}), dict) for t in tools):
        raise RequestError(400, "tools must be a list of {\"type\": \"function\", \"function\": {\"name\", "
                                "\"description\"?, \"parameters\"?}}", "tools")
    forced_tools(body, tools)  # checks tool_choice
    return tools


def forced_tools(body: dict, tools: list) -> list[int]:
    """The tools (their indices) a reply must call for the request's tool_choice: "none" (the tools rendered,
    no call parsed, as vLLM) and "auto" none; "required" all of them (one call or more), a named function
    (`{"type": "function", "function": {"name": ...}}`, one of the tools) that one (one call). The reply is then
    constrained to such calls (Server.constraints)."""
    choice = body.get("tool_choice")
    if choice in (None, "none", "auto"):
        return []
    if not tools:
        raise RequestError(400, f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice == "required":
        return list(range(len(tools)))
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise RequestError(400, "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                f"\"function\": {{\"name\": ...}}}}, found {choice!r:.100}", "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        raise RequestError(400, f"tool_choice names {name!r:.100}, which is not among the tools", "tool_choice")
    return [names.index(name)]


def function_parameters(function: dict, param: str) -> dict:
    """A function tool's parameters schema (none: no arguments, an empty object), typed as an object where it
    names no type: a call's arguments are a JSON object (Qwen's template and the tool-call parser read one);
    a 400 naming param for a schema of another type."""
    parameters = function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
    kind = parameters.get("type", "object")
    if kind != "object":
        raise RequestError(400, f"{param} must be an object schema (a call's arguments are a JSON object), found "
                                f"type {kind!r:.40}", param)
    return {"type": "object", **parameters}


def message_tool_calls(calls, index: int) -> list[dict]:
    """An assistant message's tool calls as transformers passes them to the template: each
    function.arguments (OpenAI's JSON string) parsed back to a mapping, as Qwen's template expects."""
    param = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise RequestError(400, f"{param} must be a list", param)
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str) and call.get("type", "function") == "function"):
            raise RequestError(400, f"{param}: each is {{\"id\", \"type\": \"function\", \"function\": "
                                    "{\"name\", \"arguments\": JSON string}}", param)
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise RequestError(400, f"{param}: function.arguments must be a JSON object, found "
                                    f"{function['arguments']!r:.80}", param)
        out.append({**call, "type": "function", "function": {**function, "arguments": arguments}})
    return out


def message_text(content, index: int) -> str:
    """A message's content: a string, or a list of text parts joined by newlines; other parts are a 400."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                    and set(part) <= {"type", "text"}):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(400, f"messages[{index}].content: only text parts are supported, found "
                                        f"{kind!r}", f"messages[{index}].content")
        return "\n".join(part["text"] for part in content)
    raise RequestError(400, f"messages[{index}].content must be a string or a list of text parts", "messages")


def failure(e: Exception) -> tuple[int, str]:
    """A failed generation as (status, message): the request's fault (400) or the server's (500)."""
    if isinstance(e, ValueError) and not isinstance(e, Qwen38Error):
        return 400, str(e)
    return 500, f"generation failed: {type(e).__name__}: {e}"


def finite_logprob(value: float) -> float:
    """A logprob as JSON can hold it: a non-finite one (never from finite logits) as LOGPROB_FLOOR."""
    return value if math.isfinite(value) else LOGPROB_FLOOR


def sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def read_json(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    return body


def number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(400, f"{name} must be a number in [{low}, {high}], found {value!r}", name)
    return float(value)


def request_logit_bias(body: dict, vocab: int | None) -> dict[int, float] | None:
    """OpenAI's logit_bias {"token id": bias in [-100, 100]} (at most LOGIT_BIAS_ENTRIES) as {id: bias}; None
    when left out or empty."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise RequestError(400, f"logit_bias must be an object of token id -> bias, found {bias!r:.80}", "logit_bias")
    if len(bias) > LOGIT_BIAS_ENTRIES:
        raise RequestError(400, f"logit_bias may hold at most {LOGIT_BIAS_ENTRIES} entries, found {len(bias)}",
                           "logit_bias")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None
        if token is None or (vocab is not None and token >= vocab):
            raise RequestError(400, f"logit_bias: token id {key!r} is not in the vocabulary [0, {vocab})",
                               "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise RequestError(400, f"logit_bias[{key!r}] must be a number in [-{LOGIT_BIAS_LIMIT:g}, "
                                    f"{LOGIT_BIAS_LIMIT:g}], found {value!r}", "logit_bias")
        out[token] = float(value)
    return out or None


def request_logprobs(body: dict, chat: bool) -> int | None:
    """The alternatives per token a request wants with each token's logprob, None when it asks for no logprobs:
    a chat's `logprobs: true` with `top_logprobs` 0..20 (default 0), a completion's `logprobs` 0..5."""
    logprobs = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise RequestError(400, f"logprobs must be true or false, found {logprobs!r}", "logprobs")
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= CHAT_TOP_LOGPROBS:
                raise RequestError(400, f"top_logprobs must be an integer in [0, {CHAT_TOP_LOGPROBS}], found {top!r}",
                                   "top_logprobs")
            if top and logprobs is not True:  # (0 asks for nothing: accepted without logprobs)
                raise RequestError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if logprobs else None
    if logprobs is None:
        return None
    if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= COMPLETION_LOGPROBS:
        raise RequestError(400, f"logprobs must be an integer in [0, {COMPLETION_LOGPROBS}] (a completion's: the "
                                f"alternatives per token), found {logprobs!r}", "logprobs")
    return logprobs


def is_token_ids(prompt) -> bool:
    """Whether a completion's prompt is a non-empty list of token ids."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in prompt)


class PromptEvents:
    """A Job's events queue (what the scheduler pushes (i, value) into, on the event loop) as prompt p's part of
    the request's one queue: its items arrive there as (p, (i, value)), so one Reply reads every prompt's."""

    def __init__(self, queue: asyncio.Queue, p: int):
        self.queue, self.p = queue, p

    def put_nowait(self, item) -> None:
        self.queue.put_nowait((self.p, item))


def integer(body: dict, name: str, default: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError(400, f"{name} must be an integer >= 0, found {value!r}", name)
    return value


@contextlib.contextmanager
def serving_in_thread(server: "Server", keep_alive_s: int = 5):
    """server on a free local port, uvicorn in a thread of this process (tests, benchmarks, a notebook): yields
    its URL; stops it, and its scheduler thread, after. keep_alive_s: how long an idle client connection stays
    open (a benchmark whose clients never retry keeps it longer than its pauses)."""
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    listener = uvicorn.Server(uvicorn.Config(server.app(), host="127.0.0.1", port=port, log_level="warning",
                                             timeout_keep_alive=keep_alive_s))
    thread = threading.Thread(target=listener.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not listener.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        listener.should_exit = True
        thread.join(timeout=30)
        server.close()
