"""What a command writes to the terminal: generated text (escaped on a terminal), the streamed reply, progress bars."""
from __future__ import annotations

import sys
import time

import torch

# Control characters but tab, newline and carriage return (C0, DEL, C1), each shown as its \xNN escape on a
# terminal: a model can emit any byte (the built-in model's random weights do: bell, vertical tab, ...), and
# raw they ring the bell, move the cursor or start escape sequences, so generated text could drive the
# user's terminal. Piped or redirected output keeps the exact text.
TERMINAL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x09, 0x0A, 0x0D)}


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
