"""A chat reply's text split as the OpenAI API returns it: the reasoning (Qwen's `<think>` part, as vLLM's
qwen3 reasoning parser splits it) and the content, and the content's `<tool_call>` blocks (as vLLM's hermes
tool parser reads Qwen's JSON tool calls). Fed piece by piece, for streaming; plain text in, plain data out."""
from __future__ import annotations

import json
import re
import uuid


THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"


class ThinkingSplit:
    """A chat reply's text as (reasoning, content), as vLLM's qwen3 reasoning parser splits it: the text
    before `</think>` is the reasoning when the prompt opened `<think>` (the template's thinking on) or the
    reply opens it; the rest is the content. Fed piece by piece: a piece ending in what may start `</think>`
    (or, at the start, `<think>`) holds that back until the next one or the end."""

    def __init__(self, opened: bool):
        self.state = "reasoning" if opened else "start"
        self.held = ""
        self.reasoned = opened

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        text, self.held = self.held + piece, ""
        reasoning = ""
        if self.state == "start":
            if text.startswith(THINK_START):
                text, self.state, self.reasoned = text[len(THINK_START):], "reasoning", True
            elif THINK_START.startswith(text) and text and not final:
                self.held = text
                return "", ""
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = text.find(THINK_END)
            if end < 0:
                keep = 0 if final else next((n for n in range(min(len(text), len(THINK_END) - 1), 0, -1)
                                             if THINK_END.startswith(text[-n:])), 0)
                self.held = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            reasoning, text, self.state = text[:end], text[end + len(THINK_END):], "content"
        return reasoning, text


def parse_tool_call(body: str) -> dict | None:
    """A `<tool_call>` block's text as {"name", "arguments": object}, or None when it is not
    {"name": str, "arguments": object} JSON (its text is then content, as the hermes parser leaves it)."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or \
            not isinstance(call.get("arguments", {}), dict):
        return None
    return {"name": call["name"], "arguments": call.get("arguments", {})}


def tool_call(name: str, arguments: str) -> dict:
    """An OpenAI tool call (a new `call_...` id) of a function name and its arguments' JSON text."""
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}


# The start of a block as Qwen writes it, {"name": "...", "arguments": {, up to the arguments' opening brace:
# from there on the arguments stream as their text arrives.
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')


class ArgumentsScan:
    """Where a JSON object's text ends, found as the text arrives: brackets counted outside strings."""

    def __init__(self, start: int):
        self.start, self.scanned, self.end = start, start, None  # end: past the closing brace, once seen
        self.depth, self.in_string, self.escape = 0, False, False

    def feed(self, text: str) -> None:
        while self.end is None and self.scanned < len(text):
            c = text[self.scanned]
            self.scanned += 1
            if self.escape:
                self.escape = False
            elif self.in_string:
                self.escape, self.in_string = c == "\\", c != '"'
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.scanned


def held_prefix(text: str, marker: str) -> int:
    """How many characters at text's end may be the start of marker (held back until more text comes)."""
    return next((n for n in range(min(len(text), len(marker) - 1), 0, -1) if marker.startswith(text[-n:])), 0)


class ToolCallSplit:
    """A chat reply's content (after the thinking split) as (content, tool call deltas), as vLLM's hermes parser
    reads Qwen's `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks. Fed piece by piece:
    content until a block opens; then, as OpenAI and vLLM stream a call, a delta with its index, id, type and
    function name once the block's `{"name": ..., "arguments": ` has arrived, then `function.arguments` deltas
    as the arguments' text arrives, which join to the call's arguments string (the arguments' JSON text as the
    model wrote it). A block of other key order is one whole delta once complete. A block that is not such
    JSON, or is left unclosed at the end, is content text; where its call had begun streaming, the deltas sent
    cannot be taken back (the whole answer, fed at once, has only the content). `calls` holds the complete
    calls. Whitespace is held until more text follows it; at the end it is dropped when there were calls
    (content null when empty, as OpenAI), so that the streamed pieces join to what the whole reply parses to."""

    def __init__(self):
        self.buffer, self.space, self.in_call, self.calls = "", "", False, []
        self.started = 0  # calls whose deltas began (their indices), complete or not
        self.streaming: dict | None = None  # the call whose arguments stream: its index, name, id, scan, sent

    def text(self, piece: str) -> str:
        piece = self.space + piece
        kept = piece.rstrip()
        self.space = piece[len(kept):]
        return kept

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buffer += piece
        content, deltas = "", []
        while True:
            if self.in_call:
                end = self.buffer.find(TOOL_END)
                self.stream_arguments(deltas, end)
                if end < 0:
                    if final:  # unclosed (the reply ran out of tokens): its text is content
                        content += self.text(TOOL_START + self.buffer)
                        self.buffer, self.in_call, self.streaming = "", False, None
                    break
                body, self.buffer, self.in_call = self.buffer[:end], self.buffer[end + len(TOOL_END):], False
                content += self.end_call(body, deltas)
                continue
            start = self.buffer.find(TOOL_START)
            if start >= 0:
                content += self.text(self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start + len(TOOL_START):], True
                continue
            keep = 0 if final else held_prefix(self.buffer, TOOL_START)
            content += self.text(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        if final:
            if not self.calls:
                content += self.space
            self.space = ""
        return content, deltas

    def stream_arguments(self, deltas: list, end: int) -> None:
        """The open block's call delta once its head has come, then its arguments' text that has come (short of
        the block's end, or of what may be its start)."""
        if self.streaming is None:
            head = CALL_HEAD.match(self.buffer)
            if head is None or (0 <= end < head.end()):
                return
            call = tool_call(json.loads(head.group(1)), "")
            self.streaming = {"index": self.started, "call": call, "scan": ArgumentsScan(head.end()),
                              "sent": head.end()}
            self.started += 1
            deltas.append({"index": self.streaming["index"], **call, "function": dict(call["function"])})
        scan = self.streaming["scan"]
        scan.feed(self.buffer)
        limit = len(self.buffer) - held_prefix(self.buffer, TOOL_END) if end < 0 else end
        limit = min(limit, scan.end) if scan.end is not None else limit
        self.append_arguments(deltas, self.buffer[self.streaming["sent"]:limit])
        self.streaming["sent"] = max(self.streaming["sent"], limit)

    def append_arguments(self, deltas: list, text: str) -> None:
        if not text:
            return
        index = self.streaming["index"]
        if deltas and deltas[-1]["index"] == index:  # this feed's delta of the same call: one entry
            deltas[-1]["function"]["arguments"] += text
        else:
            deltas.append({"index": index, "function": {"arguments": text}})

    def end_call(self, body: str, deltas: list) -> str:
        """A closed block: a call (its last delta, or the whole call), or its text as content."""
        parsed, streaming, self.streaming = parse_tool_call(body), self.streaming, None
        if streaming is not None:
            scan = streaming["scan"]
            if parsed is None or scan.end is None or parsed["name"] != streaming["call"]["function"]["name"]:
                return self.text(TOOL_START + body + TOOL_END)
            call = streaming["call"]
            call["function"]["arguments"] = body[scan.start:scan.end]
            self.calls.append(call)
            return ""
        if parsed is None:
            return self.text(TOOL_START + body + TOOL_END)
        call = tool_call(parsed["name"], json.dumps(parsed["arguments"], ensure_ascii=False))
        self.calls.append(call)
        deltas.append({"index": self.started, **call})
        self.started += 1
        return ""
