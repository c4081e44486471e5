"""tool_choice "required" and a named function by constrained decoding, with the official openai client on the
built-in model (its own `serve` process, as test_server.py's): sampled at temperature 1 with several seeds (the
random model, unconstrained, writes no call at all), every reply is tool calls that parse, name one of the
functions allowed and have arguments that validate against that function's parameters; streamed deltas join
to the whole answer; with the template's thinking on the reply thinks first and the call follows its
`</think>`; a parameters schema the grammar library rejects is a 400 naming it. The grammar's two spellings of
`<tool_call>` (plain text in the built-in tokenizer, a token of its own in Qwen's) are checked on the matcher."""
import json
import random

import pytest
import torch

from test_server import MODEL, NO_THINKING, client, post, server, streamed_calls  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

# Bounded values keep the random model's arguments short (an unbounded integer may run to max_tokens).
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                        "unit": {"enum": ["C", "F"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object",
                                      "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                     "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                                      "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {  # a "$ref" into its own "$defs": the schema keeps its root in the grammar
        "name": "plan", "parameters": {
            "$defs": {"step": {"type": "object", "properties": {"done": {"type": "boolean"}}, "required": ["done"],
                               "additionalProperties": False}},
            "type": "object", "properties": {"steps": {"type": "array", "items": {"$ref": "#/$defs/step"},
                                                       "maxItems": 2}},
            "required": ["steps"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SEEDS = range(4)


def ask(client, tool_choice, seed: int, stream: bool = False, thinking: bool = False, **kwargs):
    extra = {} if thinking else NO_THINKING
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
        tool_choice=tool_choice, temperature=1.0, seed=seed, max_tokens=kwargs.pop("max_tokens", 400),
        stream=stream, extra_body={**extra, **kwargs.pop("extra_body", {})}, **kwargs)


def valid_calls(choice, names: set[str]) -> list[tuple[str, dict]]:
    """The choice's calls as (name, arguments), each checked: a name among names, arguments valid."""
    assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message)
    assert choice.message.content is None and choice.message.tool_calls
    calls = []
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_a_named_function_is_one_valid_call(client):
    """Each seed: exactly one call, to the function named, its arguments valid (n = 2: each choice its own
    matcher); streamed, the deltas join to the whole answer's call. Unconstrained (tool_choice auto) the same
    seeds give no call."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in SEEDS:
        for choice in ask(client, named, seed, n=2).choices:
            assert len(valid_calls(choice, {"get_weather"})) == 1
        assert not ask(client, "auto", seed).choices[0].message.tool_calls
    whole = ask(client, named, 7).choices[0].message.tool_calls
    chunks = [c.choices[0] for c in ask(client, named, 7, stream=True) if c.choices]
    assert [call[1:] for call in streamed_calls([c.delta for c in chunks])] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert chunks[-1].finish_reason == "tool_calls" and not "".join(c.delta.content or "" for c in chunks)


def test_required_is_one_or_more_valid_calls_to_any_tool(client):
    """Each seed: one call or more, each to one of the tools with valid arguments; over the seeds more than one
    function is called and some reply has several calls (the grammar allows them, one per line)."""
    names, counts = set(), set()
    for seed in range(8):
        calls = valid_calls(ask(client, "required", seed).choices[0], set(SCHEMAS))
        names.update(name for name, _ in calls)
        counts.add(len(calls))
    assert len(names) > 1 and max(counts) > 1, (names, counts)


def test_a_forced_call_after_the_thinking(client, server):
    """The template's thinking on (the prompt opens <think>): the reply thinks, unconstrained, and the call follows
    its </think> (the random model's thinking ends sooner with a bias on that token)."""
    [think_end] = post(server + "/tokenize", json.dumps({"prompt": "</think>"}).encode())[1]["tokens"]
    for seed in range(2):
        choice = ask(client, "required", seed, thinking=True, max_tokens=600,
                     logit_bias={str(think_end): 4}).choices[0]
        assert choice.message.reasoning_content, choice.message
        valid_calls(choice, set(SCHEMAS))


def test_a_parameters_schema_the_grammar_rejects_is_a_400_naming_it(client):
    """The function's parameters schema, when a forced call compiles it: one llguidance rejects, or one not of an
    object (a call's arguments are a JSON object); tool_choice auto compiles none."""
    for parameters, says in [({"type": "wat"}, "wat"), ({"type": "string"}, "must be an object schema")]:
        tools = TOOLS[:1] + [{"type": "function", "function": {"name": "bad", "parameters": parameters}}]
        for tool_choice in ("required", {"type": "function", "function": {"name": "bad"}}):
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=tools,
                                               tool_choice=tool_choice, max_tokens=4)
            assert refused.value.param == "tools[1].function.parameters" and says in refused.value.message
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=tools,
                                       tool_choice="auto", max_tokens=2)


def sampled_reply(constraints, grammar: str, tokenizer, seed: int, end: int) -> str:
    """A reply sampled uniformly among the tokens grammar allows (end: the end token): its tokens and text."""
    constraint, rng, tokens = constraints.constraint(grammar), random.Random(seed), []
    mask = torch.zeros((constraints.vocab_size + 31) // 32, dtype=torch.int32)
    while not constraint.complete():
        constraint.fill(mask)
        allowed = [t for t in range(constraints.vocab_size) if int(mask[t // 32]) >> (t % 32) & 1]
        token = rng.choice(allowed)
        if token == end:
            break
        assert constraint.advance(token), constraint.error()
        tokens.append(token)
    return tokens, tokenizer.decode(tokens)


def test_the_call_grammar_with_tool_call_as_a_token_of_its_own():
    """In Qwen's vocabulary <tool_call> and </tool_call> are added tokens, which llguidance matches by id only
    (never as text): the grammar names them so there, and spells them as text in the built-in tokenizer. Both
    give calls that parse and validate."""
    from tokenizers import AddedToken

    from qwen38_model.chat_reply import ToolCallSplit
    from qwen38_model.default_model import default_model_path
    from qwen38_model.structured import JsonConstraints
    from qwen38_model.tokenizer import load_tokenizer

    plain = load_tokenizer(default_model_path())
    qwen_like = load_tokenizer(default_model_path())
    qwen_like.tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                                    for t in ("<tool_call>", "</tool_call>")])
    [start] = qwen_like.encode("<tool_call>")
    [end] = plain.encode("<|im_end|>")
    for tokenizer, as_token in [(plain, False), (qwen_like, True)]:
        constraints = JsonConstraints(tokenizer, 512, (end,))
        functions = [(t["function"]["name"], constraints.schema_grammar(t["function"]["parameters"])) for t in TOOLS]
        grammar = constraints.tool_call_grammar(functions, several=True)
        assert (f"<[{start}]>" in grammar) == as_token
        for seed in range(3):
            tokens, text = sampled_reply(constraints, grammar, tokenizer, seed, end)
            assert (tokens[0] == start) == as_token
            split = ToolCallSplit()
            content, _ = split.feed(text, final=True)
            assert not content and split.calls, text
            for call in split.calls:
                jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
