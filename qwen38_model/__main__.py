"""Command line: `python -m qwen38_model generate --prompt TEXT [--model PATH] ...`.

Without --model it runs the built-in synthetic default model (created on first use), so the command
works on a fresh machine with or without a GPU. User mistakes are one line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import sys
import time

import torch

from .errors import Qwen38Error

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m qwen38_model", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt, streamed")
    g.add_argument("--model", help="a .gguf file or an HF folder (default: the built-in synthetic model)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    g.add_argument("--no-thinking", action="store_true", help="with --chat: enable_thinking=False")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--min-new-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    g.add_argument("--dtype", choices=DTYPES, default=None, help="dense-weight dtype")
    g.add_argument("--quantize", choices=["q8_0"], default=None, help="quantize dense weights at load")
    g.add_argument("--lane", choices=["f32", "int8", "int8x2"], default="int8", help="Q8_0 activation lane")
    g.add_argument("--kv-dtype", choices=KV_DTYPES, default="float32")
    g.add_argument("--eager", action="store_true", help="no CUDA graph: launch every kernel each step")
    sub.add_parser("bench", help="decode benchmark at the 27B shape: benchmarks/decode.py (its own options)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # everything after `bench` belongs to benchmarks/decode.py
        return argparse.Namespace(command="bench", bench_args=argv[1:])
    return parser.parse_args(argv)


def bench(args: argparse.Namespace) -> None:
    """benchmarks/ lives beside the package in a source checkout (pip install -e .), not in a wheel."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    if not (root / "benchmarks" / "decode.py").is_file():
        raise FileNotFoundError(f"benchmarks/decode.py not found next to {root / 'qwen38_model'}: "
                                "`bench` needs a source checkout")
    if not torch.cuda.is_available():
        raise ValueError("the decode benchmark needs a CUDA GPU")
    sys.path.insert(0, str(root))
    from benchmarks.decode import main as decode_main

    decode_main(args.bench_args)


def progress_bar(start: float):
    """A loading bar (bytes, GB/s) on a terminal; silent in logs, where the summary line suffices."""
    def show(done: int, total: int) -> None:
        if not sys.stderr.isatty():
            return
        elapsed = max(time.perf_counter() - start, 1e-9)
        bar = "#" * int(30 * min(done / total, 1.0)) if total else ""
        sys.stderr.write(f"\rloading [{bar:<30}] {done / 1e9:6.2f}/{total / 1e9:.2f} GB  {done / 1e9 / elapsed:5.2f} GB/s")
        sys.stderr.flush()

    return show


def generate(args: argparse.Namespace) -> None:
    from .generation import TextStreamer
    from .model import Qwen38ForCausalLM
    from .synthetic import default_model_path
    from .tokenizer import load_tokenizer

    path = args.model or default_model_path()
    start = time.perf_counter()
    model = Qwen38ForCausalLM.from_pretrained(path, device=args.device, dtype=DTYPES.get(args.dtype),
                                              quantize=args.quantize, lane=args.lane,
                                              progress=progress_bar(start))
    seconds = time.perf_counter() - start
    sys.stderr.write(f"\rloaded {path} on {model.device}: {model.weight_bytes() / 1e9:.2f} GB in {seconds:.1f} s "
                     f"({model.weight_bytes() / 1e9 / seconds:.2f} GB/s)\n")
    tokenizer = load_tokenizer(path)
    prompt = args.prompt
    if args.chat:
        extra = {"enable_thinking": False} if args.no_thinking else {}
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], **extra)
    ids = torch.tensor([tokenizer.encode(prompt)])
    if ids.shape[1] == 0:
        raise ValueError("the prompt encodes to no tokens")
    sys.stdout.write(args.prompt if not args.chat else prompt)
    model.generate(ids, max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
                   do_sample=args.temperature > 0, temperature=args.temperature or 1.0, top_k=args.top_k,
                   top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                   presence_penalty=args.presence_penalty, seed=args.seed, stop_strings=args.stop or None,
                   tokenizer=tokenizer, streamer=TextStreamer(tokenizer), kv_dtype=KV_DTYPES[args.kv_dtype],
                   use_graph=False if args.eager else None)
    s = model.last_generation_stats
    mode = "CUDA graph" if s.graph else "eager"
    sys.stderr.write(f"prefill: {s.prompt_tokens} tokens, {s.prefill_tok_s:.1f} tok/s | decode ({mode}): "
                     f"{s.new_tokens} tokens, {s.decode_tok_s:.1f} tok/s\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "generate":
            generate(args)
        else:
            bench(args)
    except (Qwen38Error, ValueError, FileNotFoundError) as e:
        sys.stderr.write(f"\nerror: {e}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
