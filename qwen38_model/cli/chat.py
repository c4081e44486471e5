"""`chat`: the multi-turn REPL; the conversation's state is kept, so a turn prefills only its own tokens."""
from __future__ import annotations

import argparse
import secrets
import sys

import torch

from ..errors import Qwen38Error
from .options import (SEED_LIMIT, HelpFormatter, add_generation_options, add_model_argument, check_generation_args,
                      generation_kwargs, report_sampling)
from .source import check_max_context, load_model, open_source
from .terminal import ReplyStreamer


def add_parser(sub) -> None:
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


def run(args: argparse.Namespace) -> None:
    """The REPL: each line a user message (or a /command), each reply streamed; the conversation's state
    is kept between turns, so a turn prefills only its own tokens."""
    from ..conversation import Conversation

    source = open_source(args)
    tokenizer = source.tokenizer
    sampling = check_generation_args(args, source.path, source.sampling())
    template = {"enable_thinking": False} if args.no_thinking else {}
    separator = turn_separator(tokenizer, template)  # a template that cannot continue a chat fails here
    check_max_context(args, source, source.device)
    model = load_model(args, source)
    check_max_context(args, source, model.device, model)
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
    from ..conversation import Conversation

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
