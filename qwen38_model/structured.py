"""Structured output: a reply constrained to JSON (OpenAI's response_format `json_object` and `json_schema`) by
llguidance's grammar matcher. The matcher runs on the host: after each token it writes the bitmask of the
tokens that may come next, which the engine copies to the device and the sequence's selection applies to its
logits (engine.py, sampling.allowed_tokens). llguidance is imported only when a constraint is asked for (the
serve extra installs it)."""
from __future__ import annotations

import torch

# llguidance's JSON options: no free whitespace between tokens (its ", " and ": " separators only), as vLLM's
# disable_any_whitespace; else a model may spend its tokens on whitespace runs the grammar allows forever. A
# schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False}
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
    """JSON grammars and their matchers for one tokenizer (its llguidance view built once, on first use)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, list(eos_token_ids)
        self._lltokenizer = None

    def lltokenizer(self):
        if self._lltokenizer is None:
            llguidance = import_llguidance()
            self._lltokenizer = llguidance.LLTokenizer(self.tokenizer.tokenizer.to_str(), n_vocab=self.vocab_size,
                                                       eos_token=self.eos or None)
        return self._lltokenizer

    def grammar(self, schema: dict) -> str:
        """The grammar of the JSON values schema allows; a ValueError with llguidance's reason when it cannot
        compile the schema."""
        llguidance = import_llguidance()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.lltokenizer())
        if error:
            raise ValueError(f"the JSON schema cannot be compiled to a grammar: {error}")
        return grammar

    def constraint(self, grammar: str) -> TokenConstraint:
        """A fresh matcher of grammar (one per sequence: it holds the sequence's progress)."""
        matcher = import_llguidance().LLMatcher(self.lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the JSON schema cannot be compiled to a grammar: {matcher.get_error()}")
        return TokenConstraint(matcher)
