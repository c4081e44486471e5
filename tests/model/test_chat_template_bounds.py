"""Seeded adversarial chat templates: every render ends in a ChatTemplateError that names the bound it
hit (the render's byte budget, its time, its steps or a per-value bound), within a time and an address-space
limit asserted here. Each render runs in a child process under RLIMIT_AS (its address space at start plus
CHILD_EXTRA_BYTES) and a timeout, so a template that escapes the bounds fails its own case (a MemoryError
or a timeout) instead of taking the test run down.

Before the render budget (issue 24, item 7) the bounds were per value only: every case below grew until
the limit (MemoryError) or ran past the timeout.

Every case is a pure function of (SEED, case number): a failure names both and the template."""
import json
import random
import re
import subprocess
import sys
import time

import pytest

from qwen38_model import chat_template

SEED = 20261207
VARIANTS = 2  # seeded variants of each family
CHILD_EXTRA_BYTES = 768 << 20  # far above the budget (64 MB + 16x the input) and one value at the per-value bound
CHILD_SECONDS = chat_template.MAX_SECONDS + 20  # the time bound plus the child's start on a loaded machine
BOUND_MESSAGE = r"budget|more than \d+ s|steps|more than \d+|RecursionError"

CHILD = r"""
import json, resource, sys, time
from qwen38_model import chat_template
from qwen38_model.errors import ChatTemplateError
vm = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[2]), vm + int(sys.argv[2])))
start = time.perf_counter()
try:
    chat_template.render(sys.argv[1], messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    result = "rendered"
except ChatTemplateError as e:
    result = "ChatTemplateError: " + str(e)
except BaseException as e:
    result = type(e).__name__ + ": " + str(e)[:300]
print(json.dumps({"result": result, "seconds": time.perf_counter() - start}))
"""


def families(rng: random.Random):
    """(name, template) pairs; each template, unbounded, holds or computes far more than any bound."""
    big = rng.choice([100_000, 99_000, 80_000])  # one value: within the per-value bounds
    huge = rng.choice([30_000_000, 25_000_000, 20_000_000])
    count = rng.choice([100_000, 90_000, 70_000])
    return [
        ("10^5 values of 100 KB in a list",
         f"{{% set l = range({count})|map('string')|map('center', {big})|list %}}{{{{ l|length }}}}"),
        ("1000 strings of 30 MB",
         "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
         f"{{% set ns.l = ns.l + ['x' * {huge}] %}}{{% endfor %}}{{{{ ns.l|length }}}}"),
        ("nested loops building a block",
         f"{{% set s %}}{{% for i in range({count}) %}}{{% for j in range(10) %}}{{{{ 'x' * {big} }}}}"
         "{% endfor %}{% endfor %}{% endset %}{{ s|length }}"),
        ("nested loops building output of one held value",
         f"{{% set s = 'y' * {big} %}}{{% set b %}}{{% for i in range({count}) %}}{{{{ s }}}}{{% endfor %}}"
         "{% endset %}{{ b|length }}"),
        ("repetition via '*' then stringified",
         f"{{% set l = ['x' * {big}] * {count} %}}{{{{ l }}}}"),
        ("repetition via '*' then '~'",
         f"{{% set l = ['x' * {big}] * {count} %}}{{{{ (l ~ '')|length }}}}"),
        ("join of a huge range",
         f"{{{{ range({count})|map('string')|map('center', {big})|join }}}}"),
        ("join of nested lists",
         f"{{% set l = ['x' * {big}] * {count} %}}{{{{ [l, l]|join }}}}"),
        ("recursion via macros holding a value per level",
         f"{{% macro f(n) %}}{{% set s = 'x' * {huge} %}}{{{{ f(n + 1) }}}}{{{{ s|length }}}}{{% endmacro %}}"
         "{{ f(0) }}"),
        ("sum of lists: quadratic copying in one C call",
         f"{{{{ ([[1]] * {count})|sum(start=[])|length }}}}"),
        ("a long-running loop producing nothing",
         f"{{% set s = 'x' * {huge} %}}{{% for i in range({count}) %}}{{% for j in range({count}) %}}"
         "{% if s.count('y') %}{% endif %}{% endfor %}{% endfor %}"),
    ]


CASES = [(variant, number, name, template) for variant in range(VARIANTS)
         for number, (name, template) in enumerate(families(random.Random(SEED * 1000 + variant)))]


@pytest.mark.parametrize("variant,number,name,template", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_adversarial_template_ends_in_a_bound(variant, number, name, template):
    description = f"SEED {SEED} variant {variant} case {number} ({name}): {template!r}"
    start = time.perf_counter()
    try:
        child = subprocess.run([sys.executable, "-c", CHILD, template, str(CHILD_EXTRA_BYTES)],
                               capture_output=True, text=True, timeout=CHILD_SECONDS)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{description}: no result within {CHILD_SECONDS} s")
    assert child.returncode == 0, f"{description}: rc {child.returncode}\n{child.stderr[-3000:]}"
    outcome = json.loads(child.stdout.strip().splitlines()[-1])
    assert outcome["result"].startswith("ChatTemplateError: "), f"{description}: {outcome['result']}"
    assert "MemoryError" not in outcome["result"], f"{description}: {outcome['result']}"
    assert re.search(BOUND_MESSAGE, outcome["result"]), f"{description}: {outcome['result']}"
    assert outcome["seconds"] < chat_template.MAX_SECONDS + 3, f"{description}: {outcome['seconds']:.1f} s"
    print(f"{name}: {outcome['seconds']:.2f} s, {time.perf_counter() - start:.2f} s with the child: "
          f"{outcome['result'][:160]}")


def test_large_real_chats_render_as_transformers_renders_them():
    """The budget grows with the input: the built-in (Qwen-style) template renders a seeded chat of about
    4M characters (distinct non-ASCII contents, tools, reasoning) exactly as transformers renders it. Qwen3.5's own
    template built 4-5 bytes per input byte on such chats, this one about 2; the budget allows 16."""
    from conftest import require
    from qwen38_model.synthetic import SYNTHETIC_CHAT_TEMPLATE

    require("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template
    rng = random.Random(SEED)
    alphabet = "abc xyz\n\té🙂你好\x00<>&\"'\\"

    def text(n):
        return "".join(rng.choice(alphabet) for _ in range(n))

    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": f"tool{i}", "description": text(200), "parameters": schema}}
             for i in range(20)]
    messages = [{"role": "system", "content": text(1000)}]
    for _ in range(40):
        messages += [{"role": "user", "content": text(rng.randrange(1, 100_000))},
                     {"role": "assistant", "content": text(rng.randrange(1, 100_000)),
                      "reasoning_content": text(1000),
                      "tool_calls": [{"type": "function",
                                      "function": {"name": "tool1", "arguments": {"x": text(50)}}}]},
                     {"role": "tool", "content": text(1000)}]
    for options in ({"add_generation_prompt": True}, {"add_generation_prompt": True, "enable_thinking": False}):
        expected = render_jinja_template(conversations=[messages], tools=tools, chat_template=SYNTHETIC_CHAT_TEMPLATE,
                                         **options)[0][0]
        start = time.perf_counter()
        assert chat_template.render(SYNTHETIC_CHAT_TEMPLATE, messages=messages, tools=tools, **options) == expected
        assert time.perf_counter() - start < chat_template.MAX_SECONDS
