"""The options the commands share (model, generation, runtime), their checks, and generate()'s arguments from them."""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch

from ..formats import ActFormat
from ..sampling_defaults import SAMPLING_DEFAULTS, check_settings

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SEED_LIMIT = 2**32  # the sampler keeps a seed's low 32 bits: a larger one would repeat a smaller one's run


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (the help text says what happens)."""

    def _get_help_string(self, action):
        return action.help if action.default is None or action.default is False else super()._get_help_string(action)


def program_name() -> str:
    """The usage line names the command as it was run: the console script or the module."""
    return "qwen38" if pathlib.Path(sys.argv[0]).name == "qwen38" else "python -m qwen38_model"


def device_arg(text: str) -> torch.device:
    try:
        return torch.device(text)
    except RuntimeError as e:  # argparse turns ArgumentTypeError into a usage error (exit code 2)
        raise argparse.ArgumentTypeError(str(e).splitlines()[0]) from None


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="PATH",
                        help="a .gguf file or an HF folder (default: the built-in synthetic model)")


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
    g.add_argument("--lane", choices=[f.value for f in ActFormat], default=ActFormat.INT8.value,
                   help="Q8_0 activation lane")
    g.add_argument("--kv-dtype", choices=KV_DTYPES, help="KV cache dtype (default: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--eager", action="store_true", help="no CUDA graph: launch every kernel each step")
    g.add_argument("--speculative", choices=["mtp"], help="speculative decoding: the checkpoint's MTP block drafts, "
                   "one pass verifies (same output as without it)")
    g.add_argument("--num-draft-tokens", type=int, default=3, metavar="K", help="with --speculative: tokens drafted "
                   "per step (the most; fewer while drafts are rejected)")
    g.add_argument("--draft-vocab", type=int, metavar="N", help="with --speculative: draft only token ids below N "
                   "(a cheaper draft head; the output is the same)")


def check_generation_args(args: argparse.Namespace, path: pathlib.Path, checkpoint: dict) -> dict:
    """The token limits, stop strings and sampling settings checked; returns the sampling settings.
    checkpoint: the checkpoint's own settings (sampling_defaults.checkpoint_sampling)."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, found {args.max_new_tokens}")
    if args.stop is not None and not all(args.stop):
        raise ValueError("--stop must not be empty (an empty stop string would end the output at once)")
    if args.seed is not None and not 0 <= args.seed < SEED_LIMIT:
        raise ValueError(f"--seed must be in [0, {SEED_LIMIT - 1}] (the sampler's seed is 32 bits), found {args.seed}")
    sampling = sampling_settings(args, path, checkpoint)
    check_sampling(sampling, args.presence_penalty, args.min_new_tokens)
    return sampling


def sampling_settings(args: argparse.Namespace, path: pathlib.Path, checkpoint: dict) -> dict:
    """Command line over checkpoint over SAMPLING_DEFAULTS, each of its default's type (top_k an int)."""
    given = {k: getattr(args, k) for k in SAMPLING_DEFAULTS if getattr(args, k) is not None}
    return check_settings({**SAMPLING_DEFAULTS, **checkpoint, **given},
                          lambda k: "--" + k.replace("_", "-") if k in given else f"{k} in the checkpoint {path}")


def check_sampling(sampling: dict, presence_penalty: float = 0.0, min_new_tokens: int = 0) -> None:
    """Every sampling value in range, checked before the possibly long load, as generate() will check it."""
    from ..sampling import SamplingConfig

    SamplingConfig(sampling["temperature"] > 0, sampling["temperature"] or 1.0, sampling["top_k"], sampling["top_p"],
                   sampling["min_p"], sampling["repetition_penalty"], presence_penalty, min_new_tokens)


def kv_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    """The KV cache's dtype on device: --kv-dtype, else generate()'s default (bfloat16 on CUDA, float32 on
    the CPU). Only the size check needs it resolved: generate() and the server get --kv-dtype or None."""
    from ..model import default_kv_dtype

    return KV_DTYPES[args.kv_dtype] if args.kv_dtype is not None else default_kv_dtype(device)


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
