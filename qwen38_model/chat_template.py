"""Chat templates (Jinja source from the checkpoint) rendered as transformers renders them, with bounds.

transformers' sandbox stops attribute tricks (`''.__class__`) but not a template that runs forever
(`{% for i in range(99999) %}{% for j in range(99999) %}`) or fills memory (`'x' * 10**10`). A template
from the internet gets, far above what real templates use (Qwen3.5's renders a 10-turn chat with tools
in about 2,000 steps, a few KB):
- MAX_STEPS lines of template code, counted by a trace function on the template's own frames;
- MAX_CHARS characters (or items) for the output, for every value a template reads from a namespace,
  list or dict, passes to or gets from a call or filter, and for the results of `*`, `+`, `%` and the
  amplifying filters and methods (replace, join, indent, ...), checked before they allocate;
- integer arguments (widths, counts, exponents) of at most MAX_INT_ARG, like the sandbox's range();
- and for the render as a whole (the bounds above are per value: 10^5 values of 100 KB each, or a macro
  recursing 1000 levels deep with 30 MB held per level, passed them all), a budget: MAX_BUILT_BYTES plus
  BUILT_PER_INPUT_BYTE times the bytes of the strings passed in, for the total of every value the template
  builds (results of operators, `~`, filters, calls, slices, macro and block output, stringified
  containers, the output itself), each checked before it allocates where its size can be predicted, and
  MAX_SECONDS of wall time, checked at each template line and at each Python call the render makes.
The budget counts what is built, not what is still held (a str cannot be watched for its release), so it
is an upper bound on the memory a render holds, and it also bounds the work of building it.
Everything that goes wrong while rendering is a ChatTemplateError.
"""
from __future__ import annotations

import functools
import json
import math
import re
import string
import sys
import threading
import time
from datetime import datetime

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.sandbox
import jinja2.utils

from .errors import ChatTemplateError

MAX_STEPS = 1_000_000
MAX_CHARS = 1 << 25
MAX_INT_ARG = jinja2.sandbox.MAX_RANGE  # 100000
MAX_SOURCE_CHARS = 1 << 20
# A real chat render builds KBs to a few MB: the template copies each message a few times (Qwen3.5's: the
# macro output, |trim, then one '+' chain per turn, about 8x its input in all). 64 MB is far above a
# render of any chat of ordinary size and still small next to the server's memory when several requests
# render at once; the per-input term keeps a long chat (a 262K-token context is 1-4 MB of text) from
# meeting the fixed part: what a template may build grows with what it was given, not with its loops.
MAX_BUILT_BYTES = 64 << 20
BUILT_PER_INPUT_BYTE = 16
# A real render takes milliseconds (Qwen3.5's template on a 10-turn chat with tools: about 2,000 steps);
# 5 s is a thousand times that on a loaded machine, and short enough that a server is not held up.
MAX_SECONDS = 5.0
# Stringifying a container (`{{ list }}`, `~`, join, tojson, |string, %s) walks it first to bound the
# string it would build; real templates stringify tool schemas and messages of at most thousands of items.
MAX_RENDERED_ITEMS = 1 << 20
# Filters that take containers as containers; every other filter given a container makes its str() (upper,
# trim, replace, safe, ...), so its container arguments are bounded as the string they would make.
CONTAINER_FILTERS = frozenset({
    "abs", "attr", "batch", "count", "d", "default", "dictsort", "first", "float", "groupby", "int", "items",
    "join", "last", "length", "list", "map", "max", "min", "pprint", "random", "reject", "rejectattr",
    "reverse", "select", "selectattr", "slice", "sort", "string", "sum", "tojson", "unique"})
TEMPLATE_FILE = "<template>"  # the file name jinja gives the code compiled from a string
# A %-format conversion: its width and precision may be literal digits or '*' (taken from the arguments).
PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d+|\*)?(?:\.(\d+|\*))?")


def render(source: str, **context) -> str:
    """The template rendered with `context`, within the bounds above."""
    template = _compile(source)
    budget = _Budget(MAX_BUILT_BYTES + BUILT_PER_INPUT_BYTE * _input_bytes(context), MAX_SECONDS)
    steps = 0

    def count_lines(frame, event, arg):
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > MAX_STEPS:
                raise ChatTemplateError(f"the chat template ran more than {MAX_STEPS} steps")
            budget.tick()
        return count_lines

    def trace(frame, event, arg):
        if frame.f_code.co_filename == TEMPLATE_FILE:
            return count_lines
        budget.tick()  # a call into jinja's runtime, a filter or a method: the time bound holds there too
        return None

    previous, outer = sys.gettrace(), getattr(_active, "budget", None)
    _active.budget = budget
    sys.settrace(trace)
    try:
        pieces, size = [], 0
        for piece in template.generate(**context):
            size += len(piece)
            _check_size(size, "output", reserve=False)
            budget.charge(sys.getsizeof(piece), "output")
            pieces.append(piece)
        budget.reserve(size, "output")
        return "".join(pieces)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:  # raise_exception() and jinja's own errors (undefined, security, ...)
        raise ChatTemplateError(f"chat template: {e}") from None
    except Exception as e:  # the template is foreign code: any failure is the template's
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {str(e)[:300]}") from None
    finally:
        sys.settrace(previous)
        _active.budget = outer


_active = threading.local()  # the budget of the render running on this thread (the environment is shared)


class _Budget:
    """One render's bounds on the bytes it builds and on its wall time."""

    def __init__(self, limit: int, seconds: float):
        self.limit, self.left, self.seconds = limit, limit, seconds
        self.deadline = time.monotonic() + seconds

    def reserve(self, nbytes: int, what: str) -> None:
        """Refuses, before it is built, a value of `nbytes` that would not fit in what is left."""
        if nbytes > self.left:
            raise ChatTemplateError(f"the chat template would build a {what} of {nbytes} bytes with "
                                    f"{max(self.left, 0)} bytes left of its budget of {self.limit}")

    def charge(self, nbytes: int, what: str) -> None:
        self.left -= nbytes
        if self.left < 0:
            raise ChatTemplateError(f"the chat template built more than its budget of {self.limit} bytes "
                                    f"(the last, a {what} of {nbytes} bytes)")
        self.tick()

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"the chat template ran more than {self.seconds:g} s")


def _reserve(nbytes: int, what: str) -> None:
    budget = getattr(_active, "budget", None)
    if budget is not None:
        budget.reserve(nbytes, what)


def _charge(value, what: str, *sources):
    """Charges `value` to the render's budget if it is a new str or container (not one of `sources`)."""
    budget = getattr(_active, "budget", None)
    if budget is not None and isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) \
            and not any(value is source for source in sources):
        budget.charge(sys.getsizeof(value), what)
    return value


def _input_bytes(context: dict) -> int:
    """The bytes of the strings in the render's arguments (messages, tools, ...)."""
    total, stack, seen = 0, list(context.values()), set()
    while stack:
        value = stack.pop()
        if isinstance(value, str):  # counted at each reference: a template may render each
            total += sys.getsizeof(value)
        elif isinstance(value, (list, tuple, dict, set, frozenset)) and id(value) not in seen:
            seen.add(id(value))
            stack.extend(value.values() if isinstance(value, dict) else value)
            if isinstance(value, dict):
                stack.extend(value.keys())
    return total


def _rendered_size(value, what: str) -> int:
    """An upper bound on the characters of str(value) or of its JSON (repr escapes a character of a
    non-printable or non-ASCII string into at most 10, json into at most 12), walking at most
    MAX_RENDERED_ITEMS items and stopping once the bound passes what any value may be (MAX_CHARS, or what
    is left of the budget): the walk costs at most about that many characters scanned."""
    if isinstance(value, str):
        return len(value)
    budget = _active_budget()
    limit = min(MAX_CHARS, budget.left) if budget is not None else MAX_CHARS
    total, stack, items = 0, [value], 0
    while stack and total <= limit:
        value = stack.pop()
        items += 1
        if items > MAX_RENDERED_ITEMS:
            raise ChatTemplateError(f"the chat template stringifies a {what} of more than {MAX_RENDERED_ITEMS} "
                                    f"items")
        if isinstance(value, str):
            total += (2 if value.isascii() and value.isprintable() else 12) * len(value) + 4
        elif isinstance(value, bytes):
            total += 4 * len(value) + 4
        elif isinstance(value, dict):
            total += 2 + 4 * len(value)
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset, type({}.keys()), type({}.values()),
                                type({}.items()))):
            total += 16 + 2 * len(value)
            stack.extend(value)
        elif isinstance(value, jinja2.utils.Namespace):
            stack.append(dict(value._Namespace__attrs))
            total += 16
        elif isinstance(value, int) and not isinstance(value, bool):
            total += 8 + value.bit_length() // 3
        else:
            total += 64
    return total


def _stringify(value, what: str):
    """str(value) for a container, its size bounded before it is built; other values as they are."""
    if isinstance(value, (str, int, float, bool, type(None))) or _active_budget() is None:
        return value
    if isinstance(value, (list, tuple, dict, set, frozenset, jinja2.utils.Namespace)) or \
            type(value).__name__ in ("dict_keys", "dict_values", "dict_items"):
        size = _rendered_size(value, what)
        _check_size(size, what)
        return _charge(str(value), what)
    return value


def _active_budget():
    return getattr(_active, "budget", None)


def _concat_values(values: tuple) -> str:
    """`a ~ b ~ ...`: every operand stringified, the total bounded before it is built."""
    size = sum(_rendered_size(v, "'~' operand") for v in values)
    _check_size(size, "'~' result")
    return _charge("".join(map(str, values)), "'~' result")


class _CodeGenerator(jinja2.compiler.CodeGenerator):
    def visit_Concat(self, node, frame) -> None:  # `~`: jinja's str_join, with the budget
        self.write("environment.concat_values((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


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
    code_generator_class = _CodeGenerator
    concat_values = staticmethod(_concat_values)  # what the generated code calls for `~`

    def call_binop(self, context, operator, left, right):
        if operator == "**":
            _check_power(left, right)
        elif operator == "*":
            _check_size(_len(left) * _int_or_zero(right) + _len(right) * _int_or_zero(left), "'*' result")
            _reserve(_nbytes_per_item(left) * _len(left) * _int_or_zero(right)
                     + _nbytes_per_item(right) * _len(right) * _int_or_zero(left), "'*' result")
        elif operator == "+":
            _check_size(_len(left) + _len(right), "'+' result")
            _reserve(_nbytes_per_item(left) * _len(left) + _nbytes_per_item(right) * _len(right), "'+' result")
        elif operator == "%" and isinstance(left, str):
            _check_percent_format(left, right if isinstance(right, tuple) else (right,))
        return _charge(super().call_binop(context, operator, left, right), f"{operator!r} result", left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        name = getattr(__obj, "__name__", "")
        subject = getattr(__obj, "__self__", None)
        _check_arguments(args, kwargs, stringified=isinstance(subject, str) and name in ("format", "format_map"))
        if isinstance(subject, str):  # a str method: bound what it would build before it runs
            if name == "join" and args:
                _check_join(subject, args[0])
            else:
                _check_amplifier(name, subject, args, kwargs)
        value = _checked(super().call(__context, __obj, *args, **kwargs), f"the result of {name or 'a call'}")
        if isinstance(__obj, jinja2.runtime.Macro):  # its output was charged when its body was joined
            return value
        return _charge(value, f"result of {name or 'a call'}", subject, *args, *kwargs.values())

    def getattr(self, obj, attribute):
        if isinstance(obj, str) and attribute in ("format", "format_map"):  # the sandbox wraps these: check here
            _check_brace_format(obj)
        return _checked(super().getattr(obj, attribute), f"attribute {attribute!r}")

    def getitem(self, obj, argument):
        value = _checked(super().getitem(obj, argument), "an item")
        return _charge(value, "slice", obj) if isinstance(argument, slice) else value  # a slice is a copy


def _environment() -> jinja2.Environment:
    # transformers' environment: sandboxed, trim_blocks + lstrip_blocks, loop controls, its globals.
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.concat = _bounded_concat  # joins the output of macros and {% set %} blocks
    env.finalize = lambda value: _stringify(value, "value output")  # `{{ list }}` is its str(), bounded first
    return env


def _bounded_filter(name: str, f):
    skip = 1 if getattr(f, "jinja_pass_arg", None) else 0  # the context or environment jinja passes first

    @functools.wraps(f)  # keeps jinja's pass_context / pass_environment mark
    def run(*args, **kwargs):
        _check_arguments(args[skip:], kwargs, stringified=name not in CONTAINER_FILTERS)
        value, rest = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())
        if name == "join":
            if not isinstance(value, (str, list, tuple, dict)) and hasattr(value, "__iter__"):
                value = list(value)  # as jinja's join does; each item is charged as it is made
                args = (*args[:skip], value, *rest)
            _check_join(kwargs.get("d", rest[0] if rest else ""), value)
        elif name == "sum" and isinstance(kwargs.get("start", rest[1] if len(rest) > 1 else 0), (list, tuple)):
            if not isinstance(value, (list, tuple)):
                value = list(value)
                args = (*args[:skip], value, *rest)
            # sum() of lists copies the running total at each item: quadratic, in one C call
            copied, total = 0, _len(kwargs.get("start", rest[1] if len(rest) > 1 else 0))
            for item in value:
                total += _len(item)
                copied += total
                _reserve(8 * copied, "sum() of lists")
        elif name in ("string", "tojson", "pprint") and value is not None:
            _check_size(_rendered_size(value, f"value for filter {name!r}"), f"value for filter {name!r}")
        elif name == "format" and isinstance(value, str):  # value % arguments
            _check_percent_format(value, rest)
        elif isinstance(value, str):
            _check_amplifier(name, value, rest, kwargs)
        return _charge(_checked(f(*args, **kwargs), f"the result of filter {name!r}"), f"result of filter {name!r}",
                       *args, *kwargs.values())

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
        _check_size(_len(separator) * len(items) + sum(_rendered_size(item, "join() item") for item in items),
                    "join() result")


def _check_percent_format(fmt: str, args: tuple) -> None:
    for width, precision in PERCENT_SPEC.findall(fmt):
        for field in (width, precision):
            if field.isdigit() and int(field) > MAX_INT_ARG:
                raise ChatTemplateError(f"the chat template formats with width {field}, more than {MAX_INT_ARG}")
    _check_arguments(args, {}, stringified=True)  # '*' widths come from the arguments; '%s' stringifies


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


def _check_arguments(args: tuple, kwargs: dict, stringified: bool = False) -> None:
    """Integer arguments within MAX_INT_ARG, values within MAX_CHARS, and containers that the call turns
    into strings within the bounds of the string they would make (the others are not walked: a filter such
    as `messages|length` must not cost a walk of the chat)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT_ARG:
            raise ChatTemplateError(f"the chat template passes the integer {value:.3g} to a call; at most "
                                    f"{MAX_INT_ARG} is allowed")
        _check_size(_len(value), "call argument", reserve=False)
        if stringified and isinstance(value, (list, tuple, dict, jinja2.utils.Namespace)):
            _check_size(_rendered_size(value, "call argument"), "stringified call argument")


def _checked(value, what: str):
    _check_size(_len(value), what, reserve=False)  # a value that exists: its bytes were charged if built here
    return value


def _check_size(size: int, what: str, reserve: bool = True) -> None:
    """A value of `size` characters or items (at least as many bytes): within the per-value bound and, one
    about to be built, within what is left of the render's budget."""
    if size > MAX_CHARS:
        raise ChatTemplateError(f"the chat template builds a {what} of {size} characters or items, more than "
                                f"{MAX_CHARS}")
    if reserve:
        _reserve(size, what)


def _nbytes_per_item(value) -> int:
    """Bytes per character or item of a str or container, an upper bound (4 for a non-ASCII str)."""
    if isinstance(value, str):
        return 1 if value.isascii() else 4
    return 8 if isinstance(value, (list, tuple)) else 1


def _len(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _int_or_zero(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _bounded_concat(pieces) -> str:
    pieces = list(pieces)
    _check_size(sum(map(len, pieces)), "block")
    return _charge("".join(pieces), "block")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: plain json.dumps, no HTML escaping (jinja's own tojson escapes <, >, &, ').
    if _int_or_zero(indent) > 64 or _len(indent) > 64:  # repeated per line and nesting level
        raise ChatTemplateError(f"the chat template asks tojson for an indent of {indent!r:.20}; at most 64")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
