"""`serve`: the OpenAI-compatible HTTP server (qwen38_model.server) on one checkpoint, checked before the load."""
from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys

from ..sampling_defaults import check_settings
from ..state import available_memory, state_bytes
from .options import KV_DTYPES, HelpFormatter, add_model_argument, add_runtime_options, check_sampling, kv_dtype
from .source import check_max_context, load_model, open_source

SHUTDOWN_GRACE_S = 5  # on SIGTERM, what requests in flight get to finish before they are cancelled
SERVE_HINT = "python3 -m pip install starlette uvicorn"  # the serve extra's packages; keeps the installed torch


def add_parser(sub) -> None:
    v = sub.add_parser("serve", help=f"an OpenAI-compatible HTTP server (needs starlette and uvicorn: {SERVE_HINT})",
                       formatter_class=HelpFormatter,
                       description="/v1/chat/completions and /v1/completions (stream: true as server-sent events), "
                                   "/v1/models, /health, /metrics, /tokenize, /detokenize. Continuous batching: up "
                                   "to --max-batch sequences decode together, each with its own sampling settings, "
                                   "requests joining and leaving between steps; the rest wait in arrival order, and "
                                   "beyond --max-queue waiting they are answered 429. A prefix cache spares "
                                   "re-reading shared history. "
                                   "Sampling fields a request leaves out take the checkpoint's settings "
                                   "(generation_config.json; a GGUF: its general.sampling.* keys), as vLLM does. "
                                   f"Needs starlette and uvicorn: {SERVE_HINT}")
    add_model_argument(v)
    v.add_argument("--host", default="127.0.0.1", help="address to listen on")
    v.add_argument("--port", type=int, default=8000, help="port to listen on (1 to 65535)")
    v.add_argument("--max-context", type=int, default=8192, metavar="N", help="KV cache size in tokens: prompt + "
                   "max_tokens of a request must fit")
    v.add_argument("--max-batch", type=int, metavar="N", help="sequence slots: the sequences decoded at once, each "
                   "holding --max-context tokens of state (default: as many as fit the device's memory beside the "
                   "prefix cache, at most 64; 4 on the CPU; with --speculative its slots also hold the verify's "
                   "per-token GDN states)")
    v.add_argument("--max-queue", type=int, default=16, metavar="N", help="requests that may wait for a slot (a "
                   "request of n choices counts n)")
    v.add_argument("--cache-gb", type=float, default=4.0, metavar="GB", help="prefix cache budget")
    v.add_argument("--served-model-name", metavar="NAME", help="the model name of /v1/models and the one requests "
                   "may name (another is a 404 model_not_found); default: the checkpoint's file name")
    v.add_argument("--api-key", metavar="KEY", default=os.environ.get("QWEN38_API_KEY"),
                   help="every route but /health and /metrics needs `Authorization: Bearer KEY` (else 401); default: "
                   "$QWEN38_API_KEY, else none")
    v.add_argument("--allowed-origins", metavar="ORIGINS", default="", help="comma-separated origins a browser "
                   "may call from (CORS; * for any); default: none")
    v.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template replacing the checkpoint's")
    v.add_argument("--batch-invariant", choices=["on", "off"], default="on", help="on: every reply is bitwise what "
                   "it would be alone, whatever else is in the batch (each row's matrix products keep the bits of a "
                   "one-row call); off: from 8 rows a step's rows share the int8 GEMM, which sums in another order, "
                   "so a reply can change with its batch, for throughput at many sequences (H200, 27B shape, "
                   "benchmarks/batch.py: 888 against 615 tok/s at 16 sequences, 1610 against 670 at 64)")
    add_runtime_options(v)


def run(args: argparse.Namespace) -> None:
    try:
        import uvicorn

        from ..scheduler import default_max_batch
        from ..server import REQUEST_DEFAULTS, Server
    except ImportError as e:
        raise ValueError(f"serve needs starlette and uvicorn: {SERVE_HINT} ({e})") from None
    for name in ("max_context", "max_queue"):
        if getattr(args, name) < (0 if name == "max_queue" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be >= {0 if name == 'max_queue' else 1}, "
                             f"found {getattr(args, name)}")
    if args.max_batch is not None and args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, found {args.max_batch}")
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in [1, 65535], found {args.port}")
    if not args.cache_gb > 0:
        raise ValueError(f"--cache-gb must be > 0, found {args.cache_gb}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key (or QWEN38_API_KEY) must not be empty")
    source = open_source(args)
    if args.chat_template is not None:
        try:
            template = open(args.chat_template, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {args.chat_template}: cannot read it: {e}") from None
        source.tokenizer.chat_template = template
    sampling = check_settings(source.sampling(), lambda k: f"{k} in the checkpoint {source.path}")
    check_sampling({**REQUEST_DEFAULTS, **sampling})  # in range, before the load
    check_max_context(args, source, source.device)
    check_max_batch(args, source.config(), source.device)
    with listening_socket(args.host, args.port) as sock:  # before the load: a port in use fails at once
        model = load_model(args, source)
        check_max_context(args, source, model.device, model)
        cache_bytes = int(args.cache_gb * 1e9)
        if args.max_batch is None:
            max_batch = default_max_batch(model, args.max_context, kv_dtype(args, model.device), cache_bytes,
                                          args.num_draft_tokens + 1 if args.speculative else 0)
        else:
            max_batch = args.max_batch
            check_max_batch(args, model.config, model.device)  # the weights now take their share
        name = args.served_model_name or source.path.name
        server = Server(model, source.tokenizer, name, args.max_context, args.max_queue, cache_bytes,
                        sampling=sampling, api_key=args.api_key,
                        allowed_origins=[o.strip() for o in args.allowed_origins.split(",") if o.strip()],
                        max_batch=max_batch, kv_dtype=KV_DTYPES.get(args.kv_dtype),
                        use_graph=False if args.eager else None, speculative=args.speculative,
                        num_draft_tokens=args.num_draft_tokens, draft_vocab_size=args.draft_vocab,
                        batch_invariant=args.batch_invariant == "on")
        if sampling:
            settings = ", ".join(f"{k} {v:g}" for k, v in sampling.items())
            sys.stderr.write(f"sampling fields a request leaves out: the checkpoint's {settings}\n")
        slots = f"{max_batch} sequence slot{'s' if max_batch > 1 else ''} of {args.max_context} tokens" + \
            (" (MTP speculative decoding)" if args.speculative else "") + \
            (", not batch-invariant" if args.batch_invariant == "off" else "")
        sys.stderr.write(f"serving {name} on http://{args.host}:{args.port}/v1: {slots}\n")
        # SIGTERM: uvicorn stops accepting, gives requests in flight SHUTDOWN_GRACE_S to finish, then cancels
        # them (their slots are freed at the scheduler's next iteration), and raises the signal again once it has restored the
        # handler it found: this one, so that the process exits 0 rather than being killed by its default.
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        try:
            uvicorn.Server(uvicorn.Config(server.app(), log_level="warning",
                                          timeout_graceful_shutdown=SHUTDOWN_GRACE_S)).run(sockets=[sock])
        finally:
            server.close()


def check_max_batch(args: argparse.Namespace, config, device) -> None:
    """--max-batch slots of --max-context tokens (and the engine's staging state, where a sequence is prefilled
    before it takes its slot) within the device's available memory: one line naming the option, before anything
    is allocated. Called before the load (the whole memory) and after (what the weights leave). With --speculative
    each slot also holds its GDN states after each of the verify's K+1 tokens (slots.SlotStates.keep_token_states)."""
    if args.max_batch is None:
        return
    dtype = kv_dtype(args, device)
    needed = (args.max_batch + 1) * state_bytes(config, args.max_context, dtype, mtp=False)
    holds = f"KV caches and GDN states, KV in {dtype}, and a staging state"
    if args.speculative:
        needed += args.max_batch * (args.num_draft_tokens + 1) * state_bytes(config, 0, dtype, mtp=False)
        holds += f", and the verify's GDN states after each of its {args.num_draft_tokens + 1} tokens"
    available = available_memory(device)
    if available is not None and needed > available:
        raise ValueError(f"--max-batch {args.max_batch}: {args.max_batch} slots of --max-context {args.max_context} "
                         f"tokens ({holds}) need {needed / 1e9:.2f} GB, {device} has {available / 1e9:.2f} GB "
                         "available")


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (uvicorn listens on it): an address that cannot be bound, a port in use
    above all, is an OSError of one line (exit 1, as other OS errors), not uvicorn's log after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn: an IPv6 address has colons
    sock = socket.socket(family, socket.SOCK_STREAM)
    # As uvicorn sets it: a restarted server can bind while its old connections linger in TIME_WAIT (another
    # process listening on the port still makes bind fail on Linux).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        reason = f"port {port} is in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise OSError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock
