"""A checkpoint's chat template, rendered as HuggingFace transformers renders it.

transformers (`utils/chat_template_utils.py`, 5.x) compiles a template in a jinja2
`ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension and a `{% generation %}` block tag, a `tojson` filter that does not HTML-escape,
`raise_exception` and `strftime_now` globals and a `namespace` that refuses private names, and
renders it with `messages`, `tools`, `documents`, `add_generation_prompt` and the tokenizer's
named special tokens (`bos_token`, `eos_token`, ...) as variables. This module builds the same
environment (written from that description, not copied), so a conversation renders to the same
text, and tokenizing that text without added specials gives HF's `apply_chat_template` ids.

`assistant_spans` finds what each assistant turn adds to the text: the conversation up to the
turn with `add_generation_prompt=True`, then through the turn; what lies between is the turn's
text and its end-of-turn token, which training learns. A template whose text before a turn is
not how the whole conversation starts (not prefix-consistent) has no such span, and the record
is refused.

A template is code from a stranger, so beyond the sandbox its work is bounded (`_Bounds`): it
compiles and renders within `SECONDS` (a loop that never ends is stopped where it is), and no
string or list it makes, nor its output, grows past `budget(input)` characters: `*`, `**`, `+`
and `%` are checked before they compute (jinja folds none of them at compile time in a sandbox,
so `{{ 'x' * 3000000000 }}` costs nothing until it renders, and is refused then), as are the
arguments and results of every call and filter. Either ends as a TemplateError: the record is
refused (template_error), never the run.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import heapq
import inspect
import itertools
import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

SECONDS = 2.0  # to compile a template, or render one conversation (real ones take ~1 ms)
MAX_SOURCE = 1 << 20  # characters of template source
BASE_BUDGET = 1 << 20  # characters a template may make (a string, a list, its output) ...
PER_INPUT = 16  # ... plus this many per character of its input (messages, tools)
_SIZED = (str, bytes, list, tuple)
_SIZED_OR_DICT = (*_SIZED, dict)
_WIDTH = re.compile(r"\d{7,}")  # a format width of a million or more ('%999999999s', {:>1e9})


class TemplateError(ValueError):
    """A template that does not compile or render."""


class TemplateInconsistent(TemplateError):
    """A template whose assistant turns cannot be found in the whole conversation's text."""


class _Timeout(BaseException):  # noqa: N818  (BaseException: no `except Exception` inside
    """Raised in a thread whose template ran past its deadline."""  # jinja swallows it)


class _Watchdog:
    """One thread per process that raises _Timeout in a thread still inside a bounded region
    (`with _WATCHDOG.limit(seconds)`) at its deadline: CPython's asynchronous exception, which
    a Python loop sees at its next instruction, whatever thread it runs in."""

    def __init__(self):
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, int]] = []  # (deadline, token, thread id)
        self._live: dict[int, int] = {}  # token -> thread id, while its region runs
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def limit(self, seconds: float):
        token, tid = next(self._tokens), threading.get_ident()
        with self._cond:
            self._live[token] = tid
            heapq.heappush(self._heap, (time.monotonic() + seconds, token, tid))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="jaxmllm-template-limit", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:  # after this the region can no longer be interrupted ...
                fired = self._live.pop(token, None) is None
            if fired:  # ... and an exception set for it but not yet raised is withdrawn
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)  # (regions that ended in time)
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, token, tid = self._heap[0]
                if time.monotonic() < deadline:
                    self._cond.wait(deadline - time.monotonic())
                    continue
                heapq.heappop(self._heap)
                del self._live[token]
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(tid), ctypes.py_object(_Timeout)
                )


class _Bounds(threading.local):
    """The size budget of the render running in this thread (None outside one)."""

    budget: int | None = None


_BOUNDS = _Bounds()


def budget(*inputs: Any) -> int:
    """Characters a template may make when rendering `inputs`."""
    size = len(json.dumps(inputs, default=str, ensure_ascii=False))
    return BASE_BUDGET + PER_INPUT * size


def _check_size(value: Any, what: str) -> Any:
    limit = _BOUNDS.budget
    if limit is not None and isinstance(value, _SIZED_OR_DICT):
        if len(value) > limit:
            raise jinja2.exceptions.SecurityError(
                f"{what} makes {len(value)} items, over the template budget of {limit}"
            )
    return value


def _check_args(args: Sequence, kwargs: dict, what: str) -> None:
    """No int argument larger than the budget (a width, a count, a repeat) and no format
    string asking for such a width."""
    limit = _BOUNDS.budget or BASE_BUDGET
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > limit:
            raise jinja2.exceptions.SecurityError(f"{what}: argument {a} is over the budget")


def _join_size(items: list, sep: Any) -> int:
    return sum(len(str(x)) for x in items) + len(str(sep)) * max(0, len(items) - 1)


def _replace_size(s: Any, old: Any, new: Any) -> int:
    s, old, new = str(s), str(old), str(new)
    return len(s) + (len(s) + 1 if not old else len(s) // len(old)) * len(new)


def _over(size: int, what: str) -> None:
    """Refuses what would make more than the budget, before it is made."""
    if size > (_BOUNDS.budget or BASE_BUDGET):
        raise jinja2.exceptions.SecurityError(f"{what} would make {size} characters, over budget")


def _bounded_filter(func: Callable) -> Callable:
    """A filter whose int arguments, and whose result where it can grow past its inputs (join,
    replace), are checked against the budget before it runs, and its result after."""
    signature = inspect.signature(func)
    grows = func.__name__ in ("do_join", "do_replace", "do_format")

    @functools.wraps(func)  # (keeps jinja's pass_context / pass_environment marks)
    def filtered(*args, **kwargs):
        _check_args(args, kwargs, f"filter {func.__name__}")
        if grows:
            bound = signature.bind(*args, **kwargs)
            a = bound.arguments
            if func.__name__ == "do_join":
                a["value"] = list(a["value"])  # (a sandboxed range or a budgeted list)
                _over(_join_size(a["value"], a.get("d", "")), "join")
            elif func.__name__ == "do_replace":
                _over(_replace_size(a["s"], a["old"], a["new"]), "replace")
            elif _WIDTH.search(str(a["value"])):
                _over(1 << 62, "a format width")
            args, kwargs = bound.args, bound.kwargs
        return _check_size(func(*args, **kwargs), f"filter {func.__name__}")

    return filtered


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask markers): renders its body.

    transformers records where the body lands; here the spans come from `assistant_spans`, so
    templates with the tag only need it to parse."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace()` without private names: a sandboxed template cannot reach CPython
    internals through a namespace attribute."""

    def __init__(*args, **kwargs):  # noqa: B902 (jinja's signature, so `namespace(self=1)` works)
        self, args = args[0], args[1:]
        for name in dict(*args, **kwargs):
            _check_public(name)
        jinja2.utils.Namespace.__init__(self, *args, **kwargs)

    def __setitem__(self, name, value):
        _check_public(name)
        _check_size(value, f"namespace attribute {name!r}")  # (a string doubled in a loop)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_public(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is private")


class _DictMaker:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without exposing the dict type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes <, >, & and ' for HTML; chat templates want the plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with every operator, call and filter that can make something
    large checked against the render's budget before it does."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        limit = _BOUNDS.budget or BASE_BUDGET
        if operator == "+":
            if isinstance(left, _SIZED) and isinstance(right, _SIZED):
                if len(left) + len(right) > limit:
                    raise jinja2.exceptions.SecurityError("a concatenation over the budget")
                return left + right  # (the common case: strings joined, no more to check)
        elif operator == "*":
            seq, n = (left, right) if isinstance(left, _SIZED) else (right, left)
            if isinstance(seq, _SIZED) and isinstance(n, int) and len(seq) * n > limit:
                raise jinja2.exceptions.SecurityError(f"{len(seq)} x {n} is over the budget")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                if right * abs(left).bit_length() > 64 * limit:
                    raise jinja2.exceptions.SecurityError(f"{left} ** {right} is over the budget")
        elif operator == "%" and isinstance(left, str):
            _check_args(right if isinstance(right, tuple) else (right,), {}, "a % format")
            if _WIDTH.search(left):
                raise jinja2.exceptions.SecurityError("a % format width over the budget")
        return _check_size(super().call_binop(context, operator, left, right), operator)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None and _WIDTH.search(value.__self__):  # '{:>999999999}'.format
            return lambda *a, **k: _raise_exception("str.format: a width over the budget")
        return wrapped

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own names)
        name = getattr(__obj, "__name__", type(__obj).__name__)
        _check_args(args, kwargs, f"call of {name}")
        for a in (*args, *kwargs.values()):  # (a macro calling itself with its argument doubled)
            _check_size(a, f"an argument of {name}")
        text = getattr(__obj, "__self__", None)
        if isinstance(text, str) and name == "join" and len(args) == 1:
            args = (list(args[0]),)  # (a sandboxed range or a budgeted list: bounded)
            _over(_join_size(args[0], text), "str.join")
        elif isinstance(text, str) and name == "replace" and len(args) >= 2:
            _over(_replace_size(text, args[0], args[1]), "str.replace")
        return _check_size(super().call(__context, __obj, *args, **kwargs), f"call of {name}")


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    if len(source) > MAX_SOURCE:
        raise TemplateError(f"{len(source)} characters, over {MAX_SOURCE}")
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.filters = {k: _bounded_filter(f) for k, f in env.filters.items()}
    env.globals.update(raise_exception=_raise_exception, dict=_DictMaker(), namespace=_Namespace)
    try:
        with _WATCHDOG.limit(SECONDS):
            return env.from_string(source)
    except _Timeout:
        raise TemplateError(f"compiling took more than {SECONDS} s") from None


_WATCHDOG = _Watchdog()


class ChatTemplate:
    """A chat template with its tokenizer's special tokens, rendering as transformers does.

    Args:
      source: The jinja source.
      origin: Where it came from (a file name), for error messages.
      variables: The tokenizer's named special tokens (`bos_token`, `eos_token`, ...).
      now: The moment `strftime_now` formats (Llama 3.2 writes today's date into its system
        prompt); None = the current time, as transformers does.
    """

    def __init__(
        self,
        source: str,
        origin: str,
        variables: dict[str, str],
        now: datetime | None = None,
    ):
        self.source, self.origin, self.variables, self.now = source, origin, dict(variables), now
        try:
            self._template = _compile(source)
        except Exception as e:  # a syntax error, too deep a nesting, over the bounds
            detail = f"{type(e).__name__}: {e}"[:500]
            raise TemplateError(f"{origin}: the chat template does not compile: {detail}") from None

    def render(
        self,
        messages: Sequence[dict],
        *,
        add_generation_prompt: bool = False,
        tools: list[dict] | None = None,
        **kwargs,
    ) -> str:
        """The text of `messages` (HF message dicts); kwargs are extra template variables."""
        strftime: Callable[[str], str] = lambda fmt: (self.now or datetime.now()).strftime(fmt)
        limit = budget(list(messages), tools, kwargs)
        parts, size = [], 0
        _BOUNDS.budget = limit
        try:
            with _WATCHDOG.limit(SECONDS):
                for part in self._template.generate(
                    messages=list(messages),
                    tools=tools,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    strftime_now=strftime,
                    **{**self.variables, **kwargs},
                ):
                    size += len(part)
                    if size > limit:
                        raise TemplateError(f"its output passed the budget of {limit} characters")
                    parts.append(part)
        except _Timeout:
            raise TemplateError(
                f"{self.origin}: rendering took more than {SECONDS} s (a loop that does not end?)"
            ) from None
        except Exception as e:  # a template is code: any error is that template's
            raise TemplateError(f"{self.origin}: {type(e).__name__}: {e}"[:1000]) from None
        finally:
            _BOUNDS.budget = None
        return "".join(parts)

    def assistant_spans(
        self, messages: Sequence[dict], stops: Sequence[str]
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character span of each assistant turn in it.

        A span starts where the generation prompt before the turn ends and runs to the end of
        the last stop string (`stops`: end-of-turn tokens) the turn adds; what a template writes
        after it (ChatML's newline) is not the model's to predict. Where the whole conversation
        renders the turn differently (Qwen3 drops the reasoning of turns before the last user
        message), the span is what the conversation has there, up to its first stop string.
        Raises TemplateError when the text before a turn is not what the whole conversation
        starts with: that turn's tokens cannot be found.
        """
        text = self.render(messages)
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            head = self.render(messages[:i], add_generation_prompt=True)
            start = len(head)
            if not text.startswith(head) or start < (spans[-1][1] if spans else 0):
                raise TemplateInconsistent(
                    f"{self.origin}: the conversation before message {i} (assistant) renders "
                    "differently once later messages follow (the template is not "
                    "prefix-consistent), so that turn's tokens cannot be found"
                )
            turn = self.render(messages[: i + 1])
            end = _last_stop_end(turn, start, stops) if turn.startswith(head) else None
            if end is None or not text.startswith(turn[:end]):
                end = _first_stop_end(text, start, stops)
            if end is None:
                raise TemplateInconsistent(
                    f"{self.origin}: message {i} (assistant) renders differently once later "
                    f"messages follow, and no end-of-turn token ({', '.join(stops)}) ends it"
                )
            spans.append((start, end))
        return text, spans


def _last_stop_end(turn: str, start: int, stops: Sequence[str]) -> int:
    """End of the last stop string in turn[start:], or len(turn) when there is none."""
    ends = [turn.rfind(s, start) + len(s) for s in stops if s and turn.rfind(s, start) >= 0]
    return max(ends, default=len(turn))


def _first_stop_end(text: str, start: int, stops: Sequence[str]) -> int | None:
    """End of the first stop string in text[start:], or None."""
    found = [(text.find(s, start), s) for s in stops if s and text.find(s, start) >= 0]
    return min(found)[0] + len(min(found)[1]) if found else None
