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
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """A template that does not compile or render."""


class TemplateInconsistent(TemplateError):
    """A template whose assistant turns cannot be found in the whole conversation's text."""


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


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, dict=_DictMaker(), namespace=_Namespace)
    return env.from_string(source)


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
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise TemplateError(f"{origin}: the chat template does not compile: {e}") from None

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
        try:
            return self._template.render(
                messages=list(messages),
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                strftime_now=strftime,
                **{**self.variables, **kwargs},
            )
        except Exception as e:  # a template is code: any error is that template's
            raise TemplateError(f"{self.origin}: {type(e).__name__}: {e}") from None

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
