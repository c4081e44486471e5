"""Chat templates (Jinja source from the checkpoint) rendered as transformers renders them, with bounds.

transformers' sandbox stops attribute tricks (`''.__class__`) but not a template that runs forever
(`{% for i in range(99999) %}{% for j in range(99999) %}`) or fills memory (`'x' * 10**10`). A template
from the internet gets, far above what real templates use (Qwen3.5's renders a 10-turn chat with tools
in about 2,000 steps, a few KB):
- MAX_STEPS lines of template code, counted by a trace function on the template's own frames;
- MAX_CHARS characters (or items) for the output, for every value a template reads from a namespace,
  list or dict, passes to or gets from a call or filter, and for the results of `*`, `+`, `%` and the
  amplifying filters and methods (replace, join, indent, ...), checked before they allocate;
- integer arguments (widths, counts, exponents) of at most MAX_INT_ARG, like the sandbox's range().
Everything that goes wrong while rendering is a ChatTemplateError.
"""
from __future__ import annotations

import functools
import json
import math
import re
import string
import sys
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.sandbox

from .errors import ChatTemplateError

MAX_STEPS = 1_000_000
MAX_CHARS = 1 << 25
MAX_INT_ARG = jinja2.sandbox.MAX_RANGE  # 100000
MAX_SOURCE_CHARS = 1 << 20
TEMPLATE_FILE = "<template>"  # the file name jinja gives the code compiled from a string
# A %-format conversion: its width and precision may be literal digits or '*' (taken from the arguments).
PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d+|\*)?(?:\.(\d+|\*))?")


def render(source: str, **context) -> str:
    """The template rendered with `context`, within the bounds above."""
    template = _compile(source)
    steps = 0

    def count_lines(frame, event, arg):
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > MAX_STEPS:
                raise ChatTemplateError(f"the chat template ran more than {MAX_STEPS} steps")
        return count_lines

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: count_lines if frame.f_code.co_filename == TEMPLATE_FILE else None)
    try:
        pieces, size = [], 0
        for piece in template.generate(**context):
            size += len(piece)
            _check_size(size, "output")
            pieces.append(piece)
        return "".join(pieces)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:  # raise_exception() and jinja's own errors (undefined, security, ...)
        raise ChatTemplateError(f"chat template: {e}") from None
    except Exception as e:  # the template is foreign code: any failure is the template's
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {str(e)[:300]}") from None
    finally:
        sys.settrace(previous)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    if len(source) > MAX_SOURCE_CHARS:
        raise ChatTemplateError(f"the chat template has {len(source)} characters, more than {MAX_SOURCE_CHARS}")
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e.message} (line {e.lineno})") from None
    except (RecursionError, MemoryError) as e:
        raise ChatTemplateError(f"the chat template does not compile: {type(e).__name__}") from None


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    # Also keeps the compiler from folding these operators on constants at compile time, unchecked.
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, operator, left, right):
        if operator == "**":
            _check_power(left, right)
        elif operator == "*":
            _check_size(_len(left) * _int_or_zero(right) + _len(right) * _int_or_zero(left), "'*' result")
        elif operator == "+":
            _check_size(_len(left) + _len(right), "'+' result")
        elif operator == "%" and isinstance(left, str):
            _check_percent_format(left, right if isinstance(right, tuple) else (right,))
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        _check_arguments(args, kwargs)
        name = getattr(__obj, "__name__", "")
        subject = getattr(__obj, "__self__", None)
        if isinstance(subject, str):  # a str method: bound what it would build before it runs
            if name == "join" and args:
                _check_join(subject, args[0])
            else:
                _check_amplifier(name, subject, args, kwargs)
        return _checked(super().call(__context, __obj, *args, **kwargs), f"the result of {name or 'a call'}")

    def getattr(self, obj, attribute):
        if isinstance(obj, str) and attribute in ("format", "format_map"):  # the sandbox wraps these: check here
            _check_brace_format(obj)
        return _checked(super().getattr(obj, attribute), f"attribute {attribute!r}")

    def getitem(self, obj, argument):
        return _checked(super().getitem(obj, argument), "an item")


def _environment() -> jinja2.Environment:
    # transformers' environment: sandboxed, trim_blocks + lstrip_blocks, loop controls, its globals.
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.concat = _bounded_concat  # joins the output of macros and {% set %} blocks
    return env


def _bounded_filter(name: str, f):
    skip = 1 if getattr(f, "jinja_pass_arg", None) else 0  # the context or environment jinja passes first

    @functools.wraps(f)  # keeps jinja's pass_context / pass_environment mark
    def run(*args, **kwargs):
        _check_arguments(args[skip:], kwargs)
        value, rest = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())
        if name == "join":
            _check_join(kwargs.get("d", rest[0] if rest else ""), value)
        elif name == "format" and isinstance(value, str):  # value % arguments
            _check_percent_format(value, rest)
        elif isinstance(value, str):
            _check_amplifier(name, value, rest, kwargs)
        return _checked(f(*args, **kwargs), f"the result of filter {name!r}")

    return run


def _check_amplifier(name: str, s: str, args: tuple, kwargs: dict) -> None:
    """Filters and str methods whose output can be far larger than their inputs (the integer arguments
    are already bounded by MAX_INT_ARG)."""
    def arg(i, key, default):
        return kwargs.get(key, args[i] if len(args) > i else default)

    if name == "replace":
        old, new = arg(0, "old", None), arg(1, "new", None)
        if isinstance(old, str) and isinstance(new, str):
            count = len(s) + 1 if old == "" else s.count(old)
            _check_size(len(s) + count * max(len(new) - len(old), 0), "replace() result")
    elif name == "expandtabs":
        _check_size(len(s) + s.count("\t") * _int_or_zero(arg(0, "tabsize", 8)), "expandtabs() result")
    elif name == "indent":
        width = arg(0, "width", 4)
        _check_size(len(s) + (s.count("\n") + 1) * (_len(width) or _int_or_zero(width)), "indent() result")
    elif name == "wordwrap":
        width = max(_int_or_zero(arg(0, "width", 79)), 1)
        _check_size(len(s) + (len(s) // width + 1) * _len(arg(2, "wrapstring", None) or "\n"), "wordwrap() result")


def _check_join(separator, items) -> None:
    if isinstance(items, (list, tuple)):
        _check_size(_len(separator) * len(items) + sum(map(_len, items)), "join() result")


def _check_percent_format(fmt: str, args: tuple) -> None:
    for width, precision in PERCENT_SPEC.findall(fmt):
        for field in (width, precision):
            if field.isdigit() and int(field) > MAX_INT_ARG:
                raise ChatTemplateError(f"the chat template formats with width {field}, more than {MAX_INT_ARG}")
    _check_arguments(args, {})  # '*' widths come from the arguments


def _check_brace_format(fmt: str) -> None:
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format raises the same error itself
    for _, _, spec, _ in fields:
        for number in re.findall(r"\d+", spec or ""):
            if int(number) > MAX_INT_ARG:
                raise ChatTemplateError(f"the chat template formats with width {number}, more than {MAX_INT_ARG}")


def _check_power(base, exponent) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1:
        bits = abs(exponent) * math.log2(abs(base))
        if bits > 64 * MAX_INT_ARG:
            raise ChatTemplateError(f"the chat template computes a power of about {bits:.3g} bits")


def _check_arguments(args: tuple, kwargs: dict) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT_ARG:
            raise ChatTemplateError(f"the chat template passes the integer {value:.3g} to a call; at most "
                                    f"{MAX_INT_ARG} is allowed")
        _check_size(_len(value), "call argument")


def _checked(value, what: str):
    _check_size(_len(value), what)
    return value


def _check_size(size: int, what: str) -> None:
    if size > MAX_CHARS:
        raise ChatTemplateError(f"the chat template builds a {what} of {size} characters or items, more than "
                                f"{MAX_CHARS}")


def _len(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _int_or_zero(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _bounded_concat(pieces) -> str:
    pieces = list(pieces)
    _check_size(sum(map(len, pieces)), "block")
    return "".join(pieces)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: plain json.dumps, no HTML escaping (jinja's own tojson escapes <, >, &, ').
    if _int_or_zero(indent) > 64 or _len(indent) > 64:  # repeated per line and nesting level
        raise ChatTemplateError(f"the chat template asks tojson for an indent of {indent!r:.20}; at most 64")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
