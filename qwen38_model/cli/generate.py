"""`generate`: text from one prompt (or one chat turn), streamed to stdout; statistics and memory to stderr.

Under torchrun (`torchrun --nproc-per-node N -m qwen38_model generate ...`, WORLD_SIZE > 1) it runs tensor
parallel over the N ranks (tensor_parallel.py): every rank runs this with the same arguments and loads its
share of the weights; rank 0 reads the prompt, draws the seed and writes all the output, the others follow."""
from __future__ import annotations

import argparse
import pathlib
import resource
import os
import secrets
import sys

import torch
import torch.distributed as dist

from ..state import KVCache
from .options import (HelpFormatter, add_generation_options, add_model_argument, check_generation_args,
                      generation_kwargs, report_sampling)
from .source import check_max_context, load_model, open_source
from .terminal import ReplyStreamer, prefill_bar, text_output

PREFILL_BAR_TOKENS = 1024  # longer prompts show a prefill progress bar on a terminal


def add_parser(sub) -> None:
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


def run(args: argparse.Namespace) -> None:
    ranks = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's: tensor parallel over its processes
    # Every user mistake is reported before the (possibly long) load of the weights.
    source = open_source(args)
    if ranks > 1:
        if args.draft_vocab is not None:
            raise ValueError("--draft-vocab is not available under tensor parallelism (the vocabulary rows are "
                             "divided among the ranks)")
        from ..tensor_parallel import init_tensor_parallel

        source.device = init_tensor_parallel(ranks, args.device)
    leader = ranks == 1 or dist.get_rank() == 0
    chat = args.chat or args.system is not None
    ids = encode_prompt(args, source.tokenizer, chat) if leader else None
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    if ranks > 1:  # rank 0's prompt (standard input is its alone) and seed; a rank 0 that failed ends the run
        shared = [ids, seed]
        dist.broadcast_object_list(shared, 0)
        ids, seed = shared
    sampling = check_generation_args(args, source.path, source.sampling())
    if args.max_context is not None and ids.shape[1] + args.max_new_tokens > args.max_context:
        raise ValueError(f"context overflow: {ids.shape[1]} prompt tokens + --max-new-tokens {args.max_new_tokens} "
                         f"> --max-context {args.max_context}")
    check_max_context(args, source, source.device)
    model = load_model(args, source, ranks)
    check_max_context(args, source, model.device, model)
    tokenizer = source.tokenizer
    if leader:
        report_sampling(dict(sampling, presence_penalty=args.presence_penalty), seed)
        if not chat:
            text_output().write(tokenizer.decode(ids[0].tolist()))  # a completion continues the prompt: show both
    model.generate(ids, **generation_kwargs(args, sampling, tokenizer), seed=seed,
                   streamer=ReplyStreamer(tokenizer, args.stop) if leader else None,
                   prefill_progress=prefill_bar() if leader and ids.shape[1] > PREFILL_BAR_TOKENS else None)
    if leader:
        per_rank = f"rank 0 of {ranks}: " if ranks > 1 else ""
        sys.stderr.write(f"{model.last_generation_stats}\n{per_rank}{memory_line(model)}\n")
    if ranks > 1:
        dist.destroy_process_group()


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


def memory_line(model) -> str:
    """Weights, the decode state (KV caches + GDN states) and the peak: allocated on the GPU, the
    process's resident set on the CPU."""
    # The engine of the last generate() holds the state: fixed-size buffers, allocated once (slot 0 is the
    # sequence's).
    state = model._engine.slots.slot(0)
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
