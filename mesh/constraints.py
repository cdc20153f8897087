"""Structured-output constraints as every service speaks of them: what the generated text must be.

The edge builds them from `response_format`, the regex / grammar extensions and tool choices
(mesh/tools.py); the engine compiles them (services/engine/runtime/grammar.py).  Pure code.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.errors import InvalidArgument

KINDS = ("json_schema", "json_object", "regex", "grammar", "tool_calls")
MAX_CONSTRAINT_CHARS = 64 * 1024


@dataclass(frozen=True)
class Constraint:
    kind: str                    # one of KINDS
    # The JSON schema (JSON text), regex or EBNF grammar; "" for json_object; for tool_calls, OpenAI's
    # `tools` list as JSON text: free text, but a call (mesh/tools.py's format) must be a valid call of one.
    text: str = ""
    prefix: str = ""             # literal text before the constrained part (a tool call's opening tag)
    suffix: str = ""             # and after it

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"constraint kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kind != "json_object" and not self.text:
            raise InvalidArgument(f"a {self.kind} constraint needs its text")
        if len(self.text) + len(self.prefix) + len(self.suffix) > MAX_CONSTRAINT_CHARS:
            raise InvalidArgument(f"the {self.kind} constraint is longer than {MAX_CONSTRAINT_CHARS} characters")
