"""A model's chat template, rendered as transformers 5 renders it in `apply_chat_template`, without importing
transformers (which imports torch: ~3.5 s of CPU at every start of this service).

The template is code from a model's files, so it runs in jinja2's immutable sandbox, in the environment
transformers gives it: `trim_blocks` and `lstrip_blocks`; `{% break %}` and `{% continue %}`;
`{% generation %}...{% endgeneration %}` renders its body; `tojson` keeps non-ASCII characters and takes
indent, separators and sort_keys; `raise_exception(message)`; `strftime_now(format)`; `dict(...)`; and a
`namespace(...)` that refuses names starting with an underscore.  The render sees the messages without their
None-valued keys, a message's reasoning under `reasoning_content` and `thinking` both, `tools` (None when
there are none), `documents` (None), `add_generation_prompt` and the named special tokens (`bos_token`,
`eos_token`, ...).  tests/security/test_tokenizer.py and tests/service/test_tokenizer.py compare the text
with transformers'.

A template's own error (`raise_exception("Conversation roles must alternate...")`, a message it cannot
read) is the caller's: InvalidArgument with the template's message."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace

from mesh.errors import InvalidArgument

# A message's reasoning, under the names templates read it by (the first is the standard one).
REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")


class _Generation(Extension):
    """`{% generation %}` marks the assistant's part for training masks; rendering, it is its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _refuse_private(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a chat template may not set {name!r} on a namespace (a name starting with '_')")


class _Namespace(Namespace):
    def __init__(*args: Any, **kwargs: Any) -> None:   # noqa: N805 (jinja's Namespace takes `self` this way)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _refuse_private(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _refuse_private(name)
        Namespace.__setitem__(self, name, value)


class _Dict:
    """`dict(...)` in a template: plain dicts only, nothing of the type object itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:   # noqa: A002 (the name templates call it with)
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env


class ChatTemplate:
    """One folder's template(s): a single template, or named ones ("default", and "tool_use" when the
    request has tools), as transformers keeps several."""

    def __init__(self, source: str | Mapping[str, str], special_tokens: Mapping[str, str]):
        templates = {"default": source} if isinstance(source, str) else dict(source)
        if "default" not in templates:
            raise ValueError(f"the chat templates are named {sorted(templates)}; none is named 'default'")
        env = _environment()
        try:
            self._compiled = {name: env.from_string(text) for name, text in templates.items()}
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from exc
        self.special_tokens = dict(special_tokens)

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
               add_generation_prompt: bool = True, variables: Mapping[str, Any] | None = None) -> str:
        """`variables`: a request's own (enable_thinking, ...), checked by the caller; never the names below."""
        name = "tool_use" if tools is not None and "tool_use" in self._compiled else "default"
        chat = [_with_reasoning_names({k: v for k, v in m.items() if v is not None}) for m in messages]
        try:
            return self._compiled[name].render(
                **(variables or {}), messages=chat, tools=tools, documents=None,
                add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise InvalidArgument(f"the model's chat template refused these messages: {exc}") from exc


def _with_reasoning_names(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in REASONING_NAMES if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}
