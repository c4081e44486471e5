"""A chat reply's text split as the OpenAI API returns it: the reasoning (Qwen's `<think>` part, as vLLM's
qwen3 reasoning parser splits it) and the content, and the content's `<tool_call>` blocks (as vLLM's hermes
tool parser reads Qwen's JSON tool calls). Fed piece by piece, for streaming; plain text in, plain data out."""
from __future__ import annotations

import json
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
    """A `<tool_call>` block's text as an OpenAI tool call, or None when it is not
    {"name": str, "arguments": object} JSON (its text is then content, as the hermes parser leaves it)."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or \
            not isinstance(call.get("arguments", {}), dict):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": call["name"],
                         "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False)}}


class ToolCallSplit:
    """A chat reply's content (after the thinking split) as (content, tool calls), as vLLM's hermes parser
    reads Qwen's `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks. Fed piece by piece:
    content until a block opens, then each call once its block is complete (a whole call per streamed delta:
    vLLM streams the arguments piece by piece, but one delta holding a call's whole arguments string is as
    valid an OpenAI stream). A block that is not such JSON, or is left unclosed at the end, is content text.
    Whitespace is held until more text follows it; at the end it is dropped when there were calls (content
    null when empty, as OpenAI), so that the streamed pieces join to what the whole reply parses to."""

    def __init__(self):
        self.buffer, self.space, self.in_call, self.calls = "", "", False, []

    def text(self, piece: str) -> str:
        piece = self.space + piece
        kept = piece.rstrip()
        self.space = piece[len(kept):]
        return kept

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buffer += piece
        content, calls = "", []
        while True:
            if self.in_call:
                end = self.buffer.find(TOOL_END)
                if end < 0:
                    if final:  # unclosed (the reply ran out of tokens): its text is content
                        content += self.text(TOOL_START + self.buffer)
                        self.buffer, self.in_call = "", False
                    break
                body, self.buffer, self.in_call = self.buffer[:end], self.buffer[end + len(TOOL_END):], False
                call = parse_tool_call(body)
                if call is None:
                    content += self.text(TOOL_START + body + TOOL_END)
                else:
                    self.calls.append(call)
                    calls.append({"index": len(self.calls) - 1, **call})
                continue
            start = self.buffer.find(TOOL_START)
            if start >= 0:
                content += self.text(self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start + len(TOOL_START):], True
                continue
            keep = 0 if final else next((n for n in range(min(len(self.buffer), len(TOOL_START) - 1), 0, -1)
                                         if TOOL_START.startswith(self.buffer[-n:])), 0)
            content += self.text(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        if final:
            if not self.calls:
                content += self.space
            self.space = ""
        return content, calls
