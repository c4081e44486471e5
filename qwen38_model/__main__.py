"""Command line: `qwen38 generate --prompt TEXT [--model PATH] ...` (or `python -m qwen38_model ...`).

Without --model it runs the built-in synthetic default model (created on first use), so the command
works on a fresh machine with or without a GPU. User mistakes are one line on stderr and exit code 2;
other OS errors exit 1, Ctrl-C 130 (also while torch loads), a closed stdout (`| head`) 141, quietly."""
from __future__ import annotations

import sys

try:  # a Ctrl-C while torch loads (a second or more) ends with a short message, not a traceback
    import argparse
    import errno
    import math
    import os
    import pathlib
    import resource
    import secrets
    import socket
    import time

    import torch

    from . import __version__
    from .errors import Qwen38Error
    from .files import folder_file, read_json
    from .state import KVCache, check_state_size
except KeyboardInterrupt:
    sys.stderr.write("\ninterrupted\n")
    sys.exit(130)

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What sampling uses where neither the command line nor the checkpoint sets a value: greedy, and
# transformers' defaults for the filters.
SAMPLING_DEFAULTS = {"temperature": 0.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
# llama.cpp's converter copies generation_config.json into these GGUF keys (llama.cpp's own defaults).
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                      "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}
SEED_LIMIT = 2**32  # the sampler keeps a seed's low 32 bits: a larger one would repeat a smaller one's run
SERVE_HINT = "python3 -m pip install starlette uvicorn"  # the serve extra's packages; keeps the installed torch
CPU_WARN_BYTES = 2e9  # above this the CPU reference path takes seconds or more per token
PREFILL_BAR_TOKENS = 1024  # longer prompts show a prefill progress bar on a terminal
# Control characters but tab, newline and carriage return (C0, DEL, C1), each shown as its \xNN escape on a
# terminal: a model can emit any byte (the built-in model's random weights do: bell, vertical tab, ...), and
# raw they ring the bell, move the cursor or start escape sequences, so generated text could drive the
# user's terminal. Piped or redirected output keeps the exact text.
TERMINAL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x09, 0x0A, 0x0D)}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (the help text says what happens)."""

    def _get_help_string(self, action):
        return action.help if action.default is None or action.default is False else super()._get_help_string(action)


def device_arg(text: str) -> torch.device:
    try:
        return torch.device(text)
    except RuntimeError as e:  # argparse turns ArgumentTypeError into a usage error (exit code 2)
        raise argparse.ArgumentTypeError(str(e).splitlines()[0]) from None


def program_name() -> str:
    """The usage line names the command as it was run: the console script or the module."""
    return "qwen38" if pathlib.Path(sys.argv[0]).name == "qwen38" else "python -m qwen38_model"


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="PATH",
                        help="a .gguf file or an HF folder (default: the built-in synthetic model)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=program_name(), formatter_class=HelpFormatter,
                                     description="Qwen3.8 (qwen35 / qwen3_5) from PyTorch: generate text, chat, "
                                                 "serve an OpenAI-compatible API, or run the GPU benchmarks.")
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    parser.add_argument("--version", action="version", version=f"qwen38 {__version__} (torch {torch.__version__}, {build})")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt, streamed", formatter_class=HelpFormatter,
                       description="Generate text from a prompt, streamed to stdout; statistics go to stderr.")
    add_model_argument(g)
    source = g.add_mutually_exclusive_group()
    source.add_argument("--prompt", metavar="TEXT", help="the prompt (default: --prompt-file, else read from standard input)")
    source.add_argument("--prompt-file", metavar="PATH", help="read the prompt from this file ('-': standard input)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template (the "
                   "reply is printed, not the templated prompt)")
    g.add_argument("--system", metavar="TEXT", help="a system message (implies --chat)")
    g.add_argument("--no-thinking", action="store_true", help="with --chat: enable_thinking=False")
    add_generation_options(g, max_new_tokens=64)
    c = sub.add_parser("chat", help="an interactive multi-turn chat, each turn prefilling only its own tokens",
                       formatter_class=HelpFormatter,
                       description="A multi-turn chat on standard input under the checkpoint's chat template. "
                                   "The conversation's state is kept between turns, so a turn processes only its "
                                   "new tokens. Commands: /reset, /save FILE, /load FILE, /quit. Ctrl-C stops the "
                                   "current reply (the conversation keeps it); Ctrl-D or /quit ends the chat.")
    add_model_argument(c)
    c.add_argument("--system", metavar="TEXT", help="a system message")
    c.add_argument("--no-thinking", action="store_true", help="enable_thinking=False")
    add_generation_options(c, max_new_tokens=512)
    v = sub.add_parser("serve", help=f"an OpenAI-compatible HTTP server (needs starlette and uvicorn: {SERVE_HINT})",
                       formatter_class=HelpFormatter,
                       description="/v1/chat/completions and /v1/completions (stream: true as server-sent events), "
                                   "/v1/models, /health. One sequence slot: requests wait FIFO; beyond --max-queue "
                                   "waiting they are answered 429. A prefix cache spares re-reading shared history. "
                                   f"Needs starlette and uvicorn: {SERVE_HINT}")
    add_model_argument(v)
    v.add_argument("--host", default="127.0.0.1", help="address to listen on")
    v.add_argument("--port", type=int, default=8000, help="port to listen on (1 to 65535)")
    v.add_argument("--max-context", type=int, default=8192, metavar="N", help="KV cache size in tokens: prompt + "
                   "max_tokens of a request must fit")
    v.add_argument("--max-queue", type=int, default=16, metavar="N", help="requests that may wait for the slot")
    v.add_argument("--cache-gb", type=float, default=4.0, metavar="GB", help="prefix cache budget")
    add_runtime_options(v)
    sub.add_parser("bench", help="GPU benchmarks at the 27B shape: decode (benchmarks/decode.py), or prefill "
                   "with --prefill (benchmarks/prefill.py); `bench [--prefill] --help` lists their options")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # everything after `bench` belongs to the benchmark's own parser
        return argparse.Namespace(command="bench", bench_args=argv[1:])
    return parser.parse_args(argv)


def add_generation_options(g: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """The options generate and chat share: token limits, sampling, stop strings, then the runtime options."""
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N", help="stop after N new tokens")
    g.add_argument("--min-new-tokens", type=int, default=0, metavar="N", help="no end-of-sequence before N tokens")
    g.add_argument("--max-context", type=int, metavar="N", help="KV cache size in tokens; prompt + new tokens must fit "
                   "(chat: the whole conversation) (default: prompt + max new tokens, at least 4096, at most the "
                   "model's context)")
    s = g.add_argument_group("sampling", "Unset values come from the checkpoint's generation_config.json (a "
                             "GGUF: its general.sampling.* keys), as transformers and llama.cpp read them; "
                             "else the defaults shown.")
    s.add_argument("--temperature", type=float, metavar="T", help=f"0 = greedy (default: {SAMPLING_DEFAULTS['temperature']})")
    s.add_argument("--top-k", type=int, metavar="K", help=f"0 = off (default: {SAMPLING_DEFAULTS['top_k']})")
    s.add_argument("--top-p", type=float, metavar="P", help=f"default: {SAMPLING_DEFAULTS['top_p']}")
    s.add_argument("--min-p", type=float, metavar="P", help=f"default: {SAMPLING_DEFAULTS['min_p']}")
    s.add_argument("--repetition-penalty", type=float, metavar="X", help=f"default: {SAMPLING_DEFAULTS['repetition_penalty']}")
    s.add_argument("--presence-penalty", type=float, default=0.0, metavar="X", help="subtracted once from every generated "
                   "token's logit (vLLM's meaning)")
    s.add_argument("--seed", type=int, metavar="N", help=f"0 to {SEED_LIMIT - 1} (default: a random seed, printed so "
                   "that the run can be repeated)")
    g.add_argument("--stop", action="append", metavar="TEXT", help="a stop string (repeatable): the output ends before "
                   "it (the stop string is not printed)")
    add_runtime_options(g)


def add_runtime_options(g: argparse.ArgumentParser) -> None:
    """The options of every command that runs the model (generate, chat, serve): device, dtypes, decoding."""
    g.add_argument("--device", type=device_arg, help="cuda or cpu (default: cuda when available)")
    g.add_argument("--dtype", choices=DTYPES, help="dense-weight dtype (default: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--quantize", choices=["q8_0"], help="quantize dense weights at load")
    g.add_argument("--lane", choices=["f32", "int8", "int8x2"], default="int8", help="Q8_0 activation lane")
    g.add_argument("--kv-dtype", choices=KV_DTYPES, help="KV cache dtype (default: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--eager", action="store_true", help="no CUDA graph: launch every kernel each step")
    g.add_argument("--speculative", choices=["mtp"], help="speculative decoding: the checkpoint's MTP block drafts, "
                   "one pass verifies (same output as without it)")
    g.add_argument("--num-draft-tokens", type=int, default=3, metavar="K", help="with --speculative: tokens drafted "
                   "per step (the most; fewer while drafts are rejected)")
    g.add_argument("--draft-vocab", type=int, metavar="N", help="with --speculative: draft only token ids below N "
                   "(a cheaper draft head; the output is the same)")


def bench(args: argparse.Namespace) -> None:
    """benchmarks/ lives beside the package in a source checkout (pip install -e .), not in a wheel."""
    root = pathlib.Path(__file__).resolve().parents[1]
    prefill = "--prefill" in args.bench_args
    name = "prefill" if prefill else "decode"
    if not (root / "benchmarks" / f"{name}.py").is_file():
        raise FileNotFoundError(f"benchmarks/{name}.py not found next to {root / 'qwen38_model'}: "
                                "`bench` needs a source checkout")
    bench_args = [a for a in args.bench_args if a != "--prefill"]
    if not torch.cuda.is_available() and not {"-h", "--help"} & set(bench_args):
        raise ValueError(f"the {name} benchmark needs a CUDA GPU (`bench{' --prefill' if prefill else ''} --help` "
                         "lists its options)")
    sys.path.insert(0, str(root))
    if prefill:
        from benchmarks.prefill import main as bench_main
    else:
        from benchmarks.decode import main as bench_main
    bench_main(bench_args, prog=f"{program_name()} bench{' --prefill' if prefill else ''}")


def progress_bar(label: str, unit: str, scale: float, decimals: int):
    """A progress bar (done/total and rate) on a terminal; silent in logs, where the summary line suffices."""
    start = time.perf_counter()

    def show(done: int, total: int) -> None:
        if not sys.stderr.isatty():
            return
        rate = done / scale / max(time.perf_counter() - start, 1e-9)
        bar = "#" * int(30 * min(done / total, 1.0)) if total else ""
        sys.stderr.write(f"\r{label} [{bar:<30}] {done / scale:.{decimals}f}/{total / scale:.{decimals}f} {unit}  "
                         f"{rate:.{decimals}f} {unit}/s")
        sys.stderr.flush()

    return show


class TerminalText:
    """A text stream for generated text: control characters escaped (TERMINAL_ESCAPES)."""

    def __init__(self, out):
        self.out = out

    def write(self, text: str) -> int:
        return self.out.write(text.translate(TERMINAL_ESCAPES))

    def flush(self) -> None:
        self.out.flush()


def text_output():
    """Where generated text goes: stdout, through TerminalText when it is a terminal."""
    return TerminalText(sys.stdout) if sys.stdout.isatty() else sys.stdout


def prefill_bar():
    """The prefill's progress on its own line of the terminal: a long prompt takes a while before the
    first token. None in logs."""
    if not sys.stderr.isatty():
        return None
    sys.stdout.flush()
    sys.stderr.write("\n")
    show = progress_bar("prefill", "tokens", 1, 0)

    def update(done: int, total: int) -> None:
        show(done, total)
        if done >= total:
            sys.stderr.write("\n")

    return update


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        prompt = args.prompt
    elif args.prompt_file not in (None, "-"):
        try:
            prompt = pathlib.Path(args.prompt_file).read_text()
        except OSError as e:
            raise ValueError(f"--prompt-file {args.prompt_file}: {e.strerror}") from None
    elif args.prompt_file is None and sys.stdin.isatty():
        raise ValueError("no prompt: give --prompt TEXT or --prompt-file PATH, or pipe it on standard input")
    else:
        prompt = sys.stdin.read()
    if not prompt:
        raise ValueError("the prompt is empty")
    return prompt


def checkpoint_sampling(path: pathlib.Path) -> dict:
    """Sampling settings the checkpoint was released with: an HF folder's generation_config.json, or a
    GGUF's general.sampling.* keys."""
    if path.is_dir():
        if not (path / "generation_config.json").exists():
            return {}
        config = read_json(folder_file(path, "generation_config.json"), "generation_config.json")
        return from_generation_config(config if isinstance(config, dict) else {})
    from .checkpoint import open_checkpoint

    return from_gguf_metadata(open_checkpoint(path).source.metadata)


def from_generation_config(config: dict) -> dict:
    """transformers' reading: without do_sample the decoding is greedy, whatever the temperature."""
    settings = {k: config[k] for k in ("top_k", "top_p", "min_p", "repetition_penalty") if config.get(k) is not None}
    settings["temperature"] = float(config.get("temperature") or 1.0) if config.get("do_sample") else 0.0
    return settings


def from_gguf_metadata(metadata: dict) -> dict:
    return {name: metadata[key] for key, name in GGUF_SAMPLING_KEYS.items() if key in metadata}


def sampling_settings(args: argparse.Namespace, path: pathlib.Path) -> dict:
    """Command line over checkpoint over SAMPLING_DEFAULTS, each of its default's type (top_k an int)."""
    given = {k: getattr(args, k) for k in SAMPLING_DEFAULTS if getattr(args, k) is not None}
    merged = {**SAMPLING_DEFAULTS, **checkpoint_sampling(path), **given}
    settings = {}
    for k, v in merged.items():
        kind = type(SAMPLING_DEFAULTS[k])
        source = "--" + k.replace("_", "-") if k in given else f"{k} in the checkpoint {path}"
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or kind(v) != v:
            raise ValueError(f"{source} must be a finite {kind.__name__}, found {v!r:.40}")
        if k == "temperature" and v < 0:
            raise ValueError(f"{source} must be >= 0 (0 = greedy), found {v}")
        settings[k] = kind(v)
    return settings


def checkpoint_bytes(path: pathlib.Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size if path.is_file() else 0


def memory_line(model) -> str:
    """Weights, the decode state (KV caches + GDN states) and the peak: allocated on the GPU, the
    process's resident set on the CPU."""
    # The decode engine of the last generate() holds the state: fixed-size buffers, allocated once.
    state = model._engine.state
    kv = gdn = 0
    for layer in state.layers + ([state.mtp_cache] if state.mtp_cache is not None else []):
        size = sum(t.numel() * t.element_size() for t in state.tensors(layer))
        if isinstance(layer, KVCache):
            kv += size
        else:
            gdn += size
    if model.device.type == "cuda":
        peak, where = torch.cuda.max_memory_allocated(model.device), "allocated on the GPU"
    else:
        peak, where = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "resident"  # Linux: KiB
    return (f"memory: weights {model.weight_bytes() / 1e9:.2f} GB, KV cache {kv / 1e9:.3f} GB "
            f"({state.max_seq_len} tokens), GDN state {gdn / 1e9:.3f} GB, peak {peak / 1e9:.2f} GB {where}")


def encode_prompt(args: argparse.Namespace, tokenizer, chat: bool) -> torch.Tensor:
    """The prompt's ids [1, T]: as given, or under the chat template."""
    prompt = read_prompt(args)
    if chat:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        extra = {"enable_thinking": False} if args.no_thinking else {}
        prompt = tokenizer.apply_chat_template(system + [{"role": "user", "content": prompt}], **extra)
    ids = torch.tensor([tokenizer.encode(prompt)])
    if ids.shape[1] == 0:
        raise ValueError("the prompt encodes to no tokens")
    return ids


def generate(args: argparse.Namespace) -> None:
    # Every user mistake is reported before the (possibly long) load of the weights.
    path, device, tokenizer = model_source(args)
    chat = args.chat or args.system is not None
    ids = encode_prompt(args, tokenizer, chat)
    sampling = check_generation_args(args, path)
    if args.max_context is not None and ids.shape[1] + args.max_new_tokens > args.max_context:
        raise ValueError(f"context overflow: {ids.shape[1]} prompt tokens + --max-new-tokens {args.max_new_tokens} "
                         f"> --max-context {args.max_context}")
    check_max_context(args, path, device)
    model = load_model(args, path, device)
    check_max_context(args, path, model.device, model)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    report_sampling(dict(sampling, presence_penalty=args.presence_penalty), seed)
    if not chat:
        text_output().write(tokenizer.decode(ids[0].tolist()))  # a completion continues the prompt: show both
    model.generate(ids, **generation_kwargs(args, sampling, tokenizer), seed=seed,
                   streamer=ReplyStreamer(tokenizer, args.stop),
                   prefill_progress=prefill_bar() if ids.shape[1] > PREFILL_BAR_TOKENS else None)
    sys.stderr.write(f"{model.last_generation_stats}\n{memory_line(model)}\n")


def kv_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    """The KV cache's dtype on device: --kv-dtype, else generate()'s default (bfloat16 on CUDA, float32 on
    the CPU). Only the size check needs it resolved: generate() and the server get --kv-dtype or None."""
    from .model import default_kv_dtype

    return KV_DTYPES[args.kv_dtype] if args.kv_dtype is not None else default_kv_dtype(device)


def check_max_context(args: argparse.Namespace, path: pathlib.Path, device: torch.device, model=None) -> None:
    """--max-context within the model's context and the device's available memory, named as the option.
    Called before the weights load (model None: the config from the checkpoint's header; a state that
    cannot fit at all is refused at once) and after (the weights then take their share of the memory)."""
    from .checkpoint import open_checkpoint

    if args.max_context is None:
        return
    config = model.config if model is not None else open_checkpoint(path).config
    check_state_size(config, args.max_context, device, kv_dtype(args, device), config.num_mtp_layers > 0,
                     name="--max-context")


def model_source(args: argparse.Namespace):
    """The checkpoint's path, the device and the tokenizer (a CPU warning for a large checkpoint)."""
    from .synthetic import default_model_path
    from .tokenizer import load_tokenizer

    path = pathlib.Path(args.model) if args.model else default_model_path()
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and checkpoint_bytes(path) > CPU_WARN_BYTES:
        sys.stderr.write(f"warning: a {checkpoint_bytes(path) / 1e9:.1f} GB checkpoint on the CPU: the CPU path runs "
                         "the plain-PyTorch reference ops (exact, float64 inside), meant for tests and tiny models; "
                         "expect minutes per token\n")
    return path, device, load_tokenizer(path)


def check_generation_args(args: argparse.Namespace, path: pathlib.Path) -> dict:
    """The token limits, stop strings and sampling settings checked; returns the sampling settings."""
    from .sampling import SamplingConfig

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, found {args.max_new_tokens}")
    if args.stop is not None and not all(args.stop):
        raise ValueError("--stop must not be empty (an empty stop string would end the output at once)")
    if args.seed is not None and not 0 <= args.seed < SEED_LIMIT:
        raise ValueError(f"--seed must be in [0, {SEED_LIMIT - 1}] (the sampler's seed is 32 bits), found {args.seed}")
    sampling = sampling_settings(args, path)
    # Every sampling value checked (finite, in range) before the possibly long load, as generate() will.
    SamplingConfig(sampling["temperature"] > 0, sampling["temperature"] or 1.0, sampling["top_k"], sampling["top_p"],
                   sampling["min_p"], sampling["repetition_penalty"], args.presence_penalty, args.min_new_tokens)
    return sampling


def load_model(args: argparse.Namespace, path: pathlib.Path, device):
    from .model import Qwen38ForCausalLM

    start = time.perf_counter()
    model = Qwen38ForCausalLM.from_pretrained(path, device=device, dtype=DTYPES.get(args.dtype),
                                              quantize=args.quantize, lane=args.lane,
                                              progress=progress_bar("loading", "GB", 1e9, 2))
    seconds = time.perf_counter() - start
    sys.stderr.write(f"\rloaded {path} on {model.device}: {model.weight_bytes() / 1e9:.2f} GB in {seconds:.1f} s "
                     f"({model.weight_bytes() / 1e9 / seconds:.2f} GB/s)\n")
    return model


def report_sampling(sampling: dict, seed: int) -> None:
    settings = ", ".join(f"{k} {v:g}" for k, v in sampling.items())
    sys.stderr.write(f"sampling: {settings}, seed {seed}\n" if sampling["temperature"] > 0 else f"greedy: {settings}\n")


def generation_kwargs(args: argparse.Namespace, sampling: dict, tokenizer) -> dict:
    """generate()'s keyword arguments from the options (all but the seed, the streamer and progress)."""
    sampling = dict(sampling)
    temperature = sampling.pop("temperature")
    return dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, do_sample=temperature > 0,
                temperature=temperature or 1.0, **sampling, presence_penalty=args.presence_penalty,
                stop_strings=args.stop or None, tokenizer=tokenizer, max_seq_len=args.max_context,
                kv_dtype=KV_DTYPES.get(args.kv_dtype), use_graph=False if args.eager else None,
                speculative=args.speculative, num_draft_tokens=args.num_draft_tokens,
                draft_vocab_size=args.draft_vocab)


def chat(args: argparse.Namespace) -> None:
    """The REPL: each line a user message (or a /command), each reply streamed; the conversation's state
    is kept between turns, so a turn prefills only its own tokens."""
    from .conversation import Conversation

    path, device, tokenizer = model_source(args)
    sampling = check_generation_args(args, path)
    template = {"enable_thinking": False} if args.no_thinking else {}
    separator = turn_separator(tokenizer, template)  # a template that cannot continue a chat fails here
    check_max_context(args, path, device)
    model = load_model(args, path, device)
    check_max_context(args, path, model.device, model)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    report_sampling(dict(sampling, presence_penalty=args.presence_penalty), seed)
    sys.stderr.write("chat: /reset, /save FILE, /load FILE, /quit (or Ctrl-D); Ctrl-C stops a reply\n")
    enable_line_editing()
    kwargs = generation_kwargs(args, sampling, tokenizer)
    conversation = Conversation()
    turn = 0
    while (line := read_line()) is not None:
        if line.startswith("/"):
            try:
                if not chat_command(line, conversation, model, args):
                    return
            except (ValueError, OSError) as e:  # a bad file: the conversation goes on
                sys.stderr.write(f"error: {e}\n")
            continue
        if not line.strip():
            continue
        system = args.system if not conversation.tokens else None
        ids = turn_ids(tokenizer, conversation.tokens, line, system, separator, template)
        # Checked here to name the options: generate() would name its own max_seq_len.
        if args.max_context is not None and len(conversation.tokens) + len(ids) + args.max_new_tokens > args.max_context:
            sys.stderr.write(f"error: context full: {len(conversation.tokens)} tokens in the conversation + {len(ids)} "
                             f"in this turn + --max-new-tokens {args.max_new_tokens} > --max-context "
                             f"{args.max_context} (/reset starts over)\n")
            continue
        turn += 1
        chat_turn(model, conversation, ids, dict(kwargs, seed=(seed + turn) % SEED_LIMIT))


def chat_turn(model, conversation, ids: list[int], kwargs: dict) -> None:
    """One reply, streamed. A Ctrl-C keeps the message and the reply so far in the history (the state
    stays the one before the turn: the next turn prefills them)."""
    from .errors import Qwen38Error

    history = list(conversation.tokens)
    streamer = ReplyStreamer(kwargs["tokenizer"], kwargs["stop_strings"])
    try:
        model.generate(torch.tensor([ids]), streamer=streamer, conversation=conversation, **kwargs)
    except KeyboardInterrupt:
        conversation.tokens = history + ids + streamer.tokens
        sys.stdout.write("\n")
        sys.stderr.write(f"[stopped: {len(streamer.tokens)} tokens kept]\n")
        return
    except (Qwen38Error, ValueError) as e:  # e.g. the context is full: the conversation is as it was
        sys.stderr.write(f"error: {e}\n")
        return
    stats = model.last_generation_stats
    sys.stderr.write(f"[prefill {stats.prompt_tokens} tokens in {stats.prefill_s:.2f} s | reply {stats.new_tokens} "
                     f"tokens, {stats.decode_tok_s:.1f} tok/s | context {len(conversation.tokens)} tokens]\n")


def chat_command(line: str, conversation, model, args: argparse.Namespace) -> bool:
    """Run a /command; False ends the chat."""
    from .conversation import Conversation

    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit"):
        return False
    if name == "/reset":
        conversation.reset()
        sys.stderr.write("[conversation cleared]\n")
    elif name in ("/save", "/load") and not arg:
        sys.stderr.write(f"error: {name} needs a file name\n")
    elif name == "/save":
        conversation.save(arg)
        sys.stderr.write(f"[saved {len(conversation.tokens)} tokens to {arg}]\n")
    elif name == "/load":
        loaded = Conversation.load(arg, model)
        # A turn needs at least one token of its own and room for the reply.
        if args.max_context is not None and len(loaded.tokens) + 1 + args.max_new_tokens > args.max_context:
            raise ValueError(f"{arg}: its conversation of {len(loaded.tokens)} tokens leaves no room for a turn and "
                             f"--max-new-tokens {args.max_new_tokens} within --max-context {args.max_context}")
        conversation.tokens, conversation.snapshot = loaded.tokens, loaded.snapshot
        sys.stderr.write(f"[loaded {len(conversation.tokens)} tokens from {arg}]\n")
    else:
        sys.stderr.write(f"error: unknown command {name} (/reset, /save FILE, /load FILE, /quit)\n")
    return True


def turn_separator(tokenizer, template: dict) -> str:
    """What the chat template writes between an assistant's reply and the next user message (Qwen's:
    '<|im_end|>\\n'), found by rendering a two-turn chat around marker characters."""
    user = tokenizer.apply_chat_template([{"role": "user", "content": "\x01"}], **template)
    both = tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}, {"role": "assistant", "content": "\x02"},
                                          {"role": "user", "content": "\x01"}], **template)
    if "\x02" not in both or not both.endswith(user):
        raise ValueError("the checkpoint's chat template does not render a later user turn as it renders a first "
                         "one: chat cannot continue a conversation turn by turn with it")
    return both[both.index("\x02") + 1 : len(both) - len(user)]


def turn_ids(tokenizer, history: list[int], message: str, system: str | None, separator: str,
             template: dict) -> list[int]:
    """The tokens of one user turn: the first under the template (with the system message), a later one
    after the separator that closes the previous reply (less the end-of-turn token the reply ended with)."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": message}]
    text = tokenizer.apply_chat_template(messages, **template)
    if history:
        last = tokenizer.decode(history[-1:])
        closed = history[-1] in tokenizer.eos_token_ids and separator.startswith(last)
        text = (separator[len(last):] if closed else separator) + text
    return tokenizer.encode(text)


class ReplyStreamer:
    """Prints the new text as it comes (special tokens left out) and keeps its tokens. The output ends
    before the first stop string, as the server's and the OpenAI API's do (generate() returns the tokens
    through the one that completes it, as transformers does): the last len(stop) - 1 characters are held
    back until they cannot start one."""

    def __init__(self, tokenizer, stop_strings: list[str] | None = None):
        self.decoder = tokenizer.stream_decoder(skip_special_tokens=True)
        self.stop_strings = stop_strings or []
        self.hold = max((len(s) - 1 for s in self.stop_strings), default=0)
        self.tokens: list[int] = []
        self.pending = ""  # decoded, not printed yet: where a stop string may begin
        self.stopped = False
        self.seen_prompt = False
        self.out = text_output()

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        for token in value.reshape(-1).tolist():
            self.tokens.append(token)
            self.show(self.decoder.feed(token), final=False)
        self.out.flush()

    def end(self) -> None:
        self.show(self.decoder.flush(), final=True)
        self.out.write("\n")
        self.out.flush()

    def show(self, text: str, final: bool) -> None:
        """Print what precedes any stop string, less what could still begin one (nothing once stopped)."""
        if self.stopped:
            return
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, end = True, cut
        else:
            end = len(self.pending) if final else max(len(self.pending) - self.hold, 0)
        self.out.write(self.pending[:end])
        self.pending = self.pending[end:]


def enable_line_editing() -> None:
    """Line editing and history (up arrow) for input(), where the platform has readline."""
    try:
        import readline  # noqa: F401 (importing it is what hooks it into input())
    except ImportError:
        pass


def read_line() -> str | None:
    """The next line typed (None at end of input); a Ctrl-C at the prompt just clears the line."""
    while True:
        try:
            return input("> ")
        except EOFError:
            sys.stdout.write("\n")
            return None
        except KeyboardInterrupt:
            sys.stdout.write("\n")


def serve(args: argparse.Namespace) -> None:
    try:
        import uvicorn

        from .server import Server
    except ImportError as e:
        raise ValueError(f"serve needs starlette and uvicorn: {SERVE_HINT} ({e})") from None
    for name in ("max_context", "max_queue"):
        if getattr(args, name) < (0 if name == "max_queue" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be >= {0 if name == 'max_queue' else 1}, "
                             f"found {getattr(args, name)}")
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in [1, 65535], found {args.port}")
    if not args.cache_gb > 0:
        raise ValueError(f"--cache-gb must be > 0, found {args.cache_gb}")
    path, device, tokenizer = model_source(args)
    check_max_context(args, path, device)
    with listening_socket(args.host, args.port) as sock:  # before the load: a port in use fails at once
        model = load_model(args, path, device)
        check_max_context(args, path, model.device, model)
        server = Server(model, tokenizer, path.name, args.max_context, args.max_queue, int(args.cache_gb * 1e9),
                        kv_dtype=KV_DTYPES.get(args.kv_dtype), use_graph=False if args.eager else None,
                        speculative=args.speculative, num_draft_tokens=args.num_draft_tokens,
                        draft_vocab_size=args.draft_vocab)
        sys.stderr.write(f"serving {path.name} on http://{args.host}:{args.port}/v1\n")
        uvicorn.Server(uvicorn.Config(server.app(), log_level="warning")).run(sockets=[sock])


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


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "generate":
            generate(args)
        elif args.command == "chat":
            chat(args)
        elif args.command == "serve":
            serve(args)
        else:
            bench(args)
    except (Qwen38Error, ValueError, FileNotFoundError) as e:
        sys.stderr.write(f"\nerror: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return 130
    except BrokenPipeError:  # the reader of stdout is gone (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return 141
    except OSError as e:
        sys.stderr.write(f"\nerror: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
