"""A tool call's arguments as they stream (mesh/tools.py's CallParser uses it), as OpenAI streams them: once
the call's head `{"name": N, "arguments": ` is read and N is one of the tools, the arguments' JSON text is
given out piece by piece as the model writes it, up to the end of the arguments' object (what follows it,
the call's closing `}` and tag, never goes out).  Pure code."""

from __future__ import annotations

import json
import re
from collections.abc import Set
from dataclasses import dataclass

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.){1,256})"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
MAX_HEAD_CHARS = 512        # a head not read by then is not one: the call is read whole at its end


@dataclass(frozen=True)
class CallFragment:
    """A piece of a streaming call: its id and name (the same in every piece) and this piece of its arguments'
    JSON text; `first` for the call's first piece."""

    id: str
    name: str
    arguments: str
    first: bool


class OpenCall:
    """The text of one call between its tags, fed as it grows (`feed` takes the whole text so far)."""

    def __init__(self, call_id: str, names: Set[str]):
        self.id, self.names = call_id, names
        self.name = ""
        self.start = -1             # where the arguments' object begins in the call's text
        self.given = 0              # characters of the arguments given out
        self.closed = False         # the arguments' object ended
        self.given_up = False       # not a call this reads: read whole at the end instead
        self._depth, self._in_string, self._escaped = 0, False, False

    @property
    def started(self) -> bool:
        return self.given > 0

    def feed(self, text: str) -> list[CallFragment]:
        if self.given_up or self.closed:
            return []
        if self.start < 0 and not self._head(text):
            return []
        end = self._scan(text)
        piece = text[self.start + self.given:end]
        if not piece:
            return []
        first = not self.started
        self.given += len(piece)
        return [CallFragment(self.id, self.name, piece, first)]

    def arguments(self, text: str) -> str:
        return text[self.start:self.start + self.given]

    def _head(self, text: str) -> bool:
        match = _HEAD.match(text)
        if match is None or match.end() >= len(text):
            self.given_up = len(text) > MAX_HEAD_CHARS or (match is None and not _may_open(text))
            return False
        try:
            name = json.loads(f'"{match.group(1)}"')
        except ValueError:
            name = ""
        if name not in self.names or text[match.end()] != "{":
            self.given_up = True
            return False
        self.name, self.start = name, match.end()
        return True

    def _scan(self, text: str) -> int:
        """Past the characters of the arguments' object read so far: where it ends (or the text's end)."""
        i = self.start + self.given
        while i < len(text):
            c = text[i]
            i += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.closed = True
                    return i
        return i


def _may_open(text: str) -> bool:
    """Whether the text could still grow into a call's head (blank, or an object opening)."""
    stripped = text.lstrip()
    return not stripped or stripped.startswith("{")
