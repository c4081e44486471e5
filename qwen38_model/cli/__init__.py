"""Command line: `qwen38 generate|chat|serve [--model PATH] ...` (or `python -m qwen38_model ...`).

Without --model it runs the built-in synthetic default model (created on first use), so the command
works on a fresh machine with or without a GPU. User mistakes are one line on stderr and exit code 2;
other OS errors exit 1, Ctrl-C 130 (also while torch loads), a closed stdout (`| head`) 141, quietly.
One module per command (generate.py, chat.py, serve.py), each with its parser and its run(); the options
they share are in options.py, the checkpoint they open in source.py, what they print in terminal.py."""
from __future__ import annotations

import sys

try:  # a Ctrl-C while torch loads (a second or more) ends with a short message, not a traceback
    import argparse
    import os

    import torch

    from .. import __version__
    from ..errors import Qwen38Error
    from . import chat, generate, serve
    from .options import HelpFormatter, program_name
except KeyboardInterrupt:
    sys.stderr.write("\ninterrupted\n")
    sys.exit(130)

COMMANDS = {"generate": generate, "chat": chat, "serve": serve}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=program_name(), formatter_class=HelpFormatter,
                                     description="Qwen3.8 (qwen35 / qwen3_5) from PyTorch: generate text, chat, "
                                                 "or serve an OpenAI-compatible API.")
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    parser.add_argument("--version", action="version", version=f"qwen38 {__version__} (torch {torch.__version__}, {build})")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        ranks = int(os.environ.get("WORLD_SIZE", 1))
        if ranks > 1 and args.command != "generate":  # each rank would load the whole model and run it alone
            raise ValueError(f"under torchrun (WORLD_SIZE={ranks}) only `generate` runs tensor parallel; `{args.command}`"
                             " is single-GPU: run it without torchrun")
        COMMANDS[args.command].run(args)
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
