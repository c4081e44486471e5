"""Structured output: a reply constrained by llguidance's grammar matcher, to JSON (OpenAI's response_format
`json_object` and `json_schema`) or to Qwen's tool calls (tool_choice "required" or a named function). The
matcher runs on the host: after each token it writes the bitmask of the tokens that may come next, which the
engine copies to the device and the sequence's selection applies to its logits (engine.py,
sampling.allowed_tokens). llguidance is imported only when a constraint is asked for (the serve extra
installs it).

A reply whose prompt leaves the thinking open (the template's `<think>\\n`) thinks first, unconstrained, and
the grammar's part begins after its `</think>\\n\\n`, as vLLM applies a structured output only once its reasoning
parser has seen the reasoning end: the model reasons as it was trained to, and the answer is constrained."""
from __future__ import annotations

import json

import torch

from .chat_reply import THINK_END, TOOL_END, TOOL_START

# llguidance's JSON options: no free whitespace between tokens, as vLLM's disable_any_whitespace (else a model may
# spend its tokens on whitespace runs the grammar allows forever), and json.dumps' separators ", " and ": ", as
# Qwen's template writes a tool call's arguments (llguidance's own are "," and ":"). A schema's own
# "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A JSON object of any content: OpenAI's json_object mode (the prompt should ask for JSON; the reply is one
# object whatever it says).
ANY_OBJECT = {"type": "object"}


def import_llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured output needs the llguidance package: python3 -m pip install llguidance") from None
    return llguidance


class TokenConstraint:
    """One sequence's grammar matcher, as the engine drives it (engine.Sequence.constraint)."""

    def __init__(self, matcher):
        self.matcher = matcher

    def fill(self, row: torch.Tensor) -> None:
        """The tokens allowed next, as a bitmask into row (int32 [ceil(V / 32)], contiguous, on the host)."""
        if row.dtype != torch.int32 or row.device.type != "cpu" or not row.is_contiguous():
            raise ValueError(f"the bitmask row must be contiguous int32 on the host, found {row.dtype} on {row.device}")
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def advance(self, token: int) -> bool:
        """Consume token; False when the grammar rejects it (error() says why)."""
        return self.matcher.consume_token(token)

    def complete(self) -> bool:
        """Whether the grammar is satisfied and allows nothing more but an end token."""
        return self.matcher.is_stopped()

    def error(self) -> str:
        return self.matcher.get_error()


class JsonConstraints:
    """Grammars of JSON replies and their matchers for one tokenizer (its llguidance view built once, on first
    use). A grammar is a Lark rule over named JSON-schema grammars (llguidance's `{"grammars": [...]}`), so that
    each schema keeps its own root (its "$ref"s to "#/$defs/..." stay valid)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, list(eos_token_ids)
        self._lltokenizer = None

    def lltokenizer(self):
        if self._lltokenizer is None:
            llguidance = import_llguidance()
            self._lltokenizer = llguidance.LLTokenizer(self.tokenizer.tokenizer.to_str(), n_vocab=self.vocab_size,
                                                       eos_token=self.eos or None)
        return self._lltokenizer

    def grammar(self, schema: dict, thinking: bool = False) -> str:
        """The grammar of a reply that is a JSON value schema allows (after the thinking, with thinking: the
        prompt leaves it open); a ValueError with llguidance's reason when it cannot compile the schema."""
        return self.compiled(f"start: {self.thought(thinking)}@answer", {"answer": self.schema_grammar(schema)})

    def tool_call_grammar(self, tools: list[tuple[str, dict]], several: bool, thinking: bool = False) -> str:
        """The grammar of a reply that is a Qwen tool call, `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n
        </tool_call>`, to one of tools ((name, schema_grammar(its parameters)) pairs), ARGS a JSON value of its
        schema; with several, one or more such calls, one per line (as Qwen writes them), else one. The call's
        head, up to its name, is one literal per tool: the Earley parser has a single alternative left once the
        name is written (llguidance's docs advise against alternatives that differ only inside their %json)."""
        start, end = self.literal(TOOL_START), self.literal(TOOL_END)
        heads = [json.dumps('\n{"name": ' + json.dumps(name) + ', "arguments": ') for name, _ in tools]
        close = json.dumps("}\n")
        calls = " | ".join(f"{start} {head} @args{i} {close} {end}" for i, head in enumerate(heads))
        repeat = ' ("\\n" call)*' if several else ""
        return self.compiled(f"start: {self.thought(thinking)}call{repeat}\ncall: {calls}",
                             {f"args{i}": schema for i, (_, schema) in enumerate(tools)})

    def schema_grammar(self, schema: dict) -> dict:
        """schema with JSON_OPTIONS (under its own "x-guidance"), as llguidance compiles it; a ValueError with
        llguidance's reason when it cannot."""
        llguidance = import_llguidance()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.lltokenizer())
        if error:
            raise ValueError(f"the JSON schema cannot be compiled to a grammar: {error}")
        return json.loads(grammar)["grammars"][0]["json_schema"]

    def compiled(self, lark: str, schemas: dict[str, dict]) -> str:
        grammar = json.dumps({"grammars": [{"lark_grammar": lark}] +
                                          [{"name": name, "json_schema": schema} for name, schema in schemas.items()]})
        error = import_llguidance().LLMatcher.validate_grammar(grammar, self.lltokenizer())
        if error:
            raise ValueError(f"the grammar cannot be compiled: {error}")
        return grammar

    def thought(self, thinking: bool) -> str:
        """The grammar's start for a reply that thinks first: any text up to the `</think>` token, then the blank
        line the template writes after it. (The token ends the thinking, as the model writes it: the text
        `</think>` spelled in other tokens is thinking text to the grammar.)"""
        if not thinking:
            return ""
        end = self.literal(THINK_END)
        if not end.startswith("<["):
            raise ValueError(f"a constrained reply after the thinking needs {THINK_END} as a token of its own in the "
                             "vocabulary, as Qwen's")
        return f'/(.|\\n)*/ {end} "\\n\\n" '

    def literal(self, text: str) -> str:
        """text as a Lark terminal for this tokenizer. Qwen's vocabulary has `<tool_call>`, `</tool_call>` and
        `</think>` as added tokens of their own, which llguidance takes as special (matched by id, never as
        text; the model writes them as those tokens); the built-in tokenizer spells `<tool_call>` in plain
        text tokens, matched as text."""
        ids = self.tokenizer.encode(text)
        if len(ids) == 1 and self.lltokenizer().is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def constraint(self, grammar: str) -> TokenConstraint:
        """A fresh matcher of grammar (one per sequence: it holds the sequence's progress)."""
        matcher = import_llguidance().LLMatcher(self.lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar cannot be compiled: {matcher.get_error()}")
        return TokenConstraint(matcher)
