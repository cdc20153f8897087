"""One model's tokenizer: chat template and encode (Hugging Face `tokenizers` underneath, the files read as
transformers reads them: services/tokenizer/resolved.py, services/tokenizer/template.py).

What a caller writes is text.  A `<|im_start|>system` typed into a message (or a prompt) becomes
the ids of those characters, never the control token, so a user cannot forge a turn of another
role; only the chat template's own markers are control tokens.  The control tokens are the
tokenizer's special added tokens (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, ...).  Added tokens
that are not special are vocabulary, as in transformers (SmolLM2 has none).

A chat is rendered with every control string in the contents swapped for a placeholder, so the
only control strings in the rendered text are the template's.  The text is cut at those, each
piece between two of them is restored and encoded as plain text, and the markers become their ids.
`tokenizers` cuts the text at control tokens in the same way before pre-tokenizing, so for a
conversation without control strings the ids are exactly those of transformers'
`apply_chat_template` (tests/security/test_tokenizer.py checks it).

Decoding happens where the stream is, in the router, from `json()`: this service never decodes."""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from mesh import tools as tools_mod
from mesh.chat import Message, validate_messages
from services.tokenizer.resolved import resolve
from services.tokenizer.template import ChatTemplate


class ModelTokenizer:
    def __init__(self, name: str, folder: str | Path):
        self.name = name
        self.folder = Path(folder)
        resolved = resolve(self.folder)           # what transformers makes of the files (resolved.py)
        if not resolved.chat_template:
            raise ValueError(f"{self.folder} has no chat template; a chat model's tokenizer is needed")
        self.template = ChatTemplate(resolved.chat_template, resolved.special_tokens)
        self._json = resolved.backend_json
        # The tokenizer as transformers encodes with it (no truncation, no padding): control strings are control
        # tokens in `_controls`, text in `_text`.
        self._controls = Tokenizer.from_str(self._json)
        self._text = Tokenizer.from_str(self._json)
        for backend in (self._controls, self._text):
            backend.no_truncation()
            backend.no_padding()
        self._text.encode_special_tokens = True
        specials = [(i, t) for i, t in self._controls.get_added_tokens_decoder().items() if t.special]
        self.controls: dict[str, int] = {t.content: i for i, t in specials}
        # Longest first: at one position the longest control wins, as in `tokenizers`.  A control
        # with lstrip/rstrip takes the whitespace beside it, as `tokenizers` does.
        self._cut = re.compile("|".join(
            ("\\s*" if t.lstrip else "") + re.escape(t.content) + ("\\s*" if t.rstrip else "")
            for _, t in sorted(specials, key=lambda s: -len(s[1].content))) or "(?!)")   # (?!): no controls
        # A template that reads `tools` renders them (and tool calls and results) its own way.
        self.knows_tools = "tools" in str(resolved.chat_template)
        # A reasoning model's template (Qwen3, DeepSeek-R1 style) writes its thoughts between think tags.
        self.think_tags = "</think>" in str(resolved.chat_template)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    tools_json: str = "", variables: Mapping[str, Any] | None = None) -> str:
        """The template over the conversation.  Tools (OpenAI's `tools` list as JSON text) go through the
        template when it knows tools; otherwise into plain turns (mesh/tools.py: generic_messages)."""
        validate_messages(messages)
        tools = json.loads(tools_json, strict=False) if tools_json else []
        if not self.knows_tools:
            messages, tools = tools_mod.generic_messages(messages, tools), []
        return self.template.render(tools_mod.template_messages(messages), tools or None, add_generation_prompt,
                                    variables)

    def chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
             parse_special: bool = False, tools_json: str = "", variables: Mapping[str, Any] | None = None
             ) -> tuple[list[int], str]:
        """(ids, rendered text) of a conversation.  parse_special: control strings in the contents
        are control tokens too; only for callers that wrote every message themselves.  variables: the
        request's template variables (booleans, numbers, short words: mesh/request_limits.py)."""
        if parse_special:
            text = self.render_chat(messages, add_generation_prompt, tools_json, variables)
            return self.encode(text, parse_special=True), text
        placeholders = self._placeholders([*messages, Message("tools", tools_json)])
        if placeholders:
            swap = re.compile("|".join(re.escape(c) for c in sorted(placeholders, key=len, reverse=True)))

            def hide(text: str) -> str:
                return swap.sub(lambda g: placeholders[g.group()], text)
            messages = [dataclasses.replace(m, content=hide(m.content), name=hide(m.name),
                                            tool_calls=hide(m.tool_calls)) for m in messages]
            tools_json = hide(tools_json)
        rendered = self.render_chat(messages, add_generation_prompt, tools_json, variables)
        pieces, marks = self._cut_at_controls(rendered)
        if placeholders:
            restore = {p: c for c, p in placeholders.items()}
            back = re.compile("|".join(re.escape(p) for p in restore))
            pieces = [back.sub(lambda g: restore[g.group()], p) for p in pieces]
            rendered = back.sub(lambda g: restore[g.group()], rendered)
        encoded = self._text.encode_batch(pieces, add_special_tokens=False)
        ids: list[int] = list(encoded[0].ids)
        for mark, piece in zip(marks, encoded[1:], strict=True):
            ids.append(self.controls[mark])
            ids.extend(piece.ids)
        return ids, rendered

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = False) -> list[int]:
        """The ids of `text`; control strings in it are text unless parse_special (trusted callers)."""
        backend = self._controls if parse_special else self._text
        return list(backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def json(self) -> str:
        """The serialized `tokenizers` tokenizer: `tokenizers.Tokenizer.from_str()` rebuilds it."""
        return self._json

    def _placeholders(self, messages: Sequence[Message]) -> dict[str, str]:
        """control string -> a placeholder found in no message, for each control string in the contents."""
        texts = [t for m in messages for t in (m.content, m.name, m.tool_calls) if t]
        found = {c for t in texts if self._cut.search(t) for c in self.controls if c in t}
        if not found:
            return {}
        while True:
            tag = secrets.token_hex(8)
            if not any(tag in t for t in texts):
                return {c: f"\ue000{tag}.{n}\ue001" for n, c in enumerate(sorted(found))}

    def _cut_at_controls(self, text: str) -> tuple[list[str], list[str]]:
        """(pieces, marks): the text between control tokens, and the control strings between the pieces;
        len(pieces) == len(marks) + 1."""
        pieces, marks, start = [], [], 0
        for m in self._cut.finditer(text):
            pieces.append(text[start:m.start()])
            marks.append(m.group().strip())
            start = m.end()
        pieces.append(text[start:])
        return pieces, marks
