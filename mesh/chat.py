"""Chat messages, shared by the edge, router, tokenizer and session store."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mesh.errors import InvalidArgument

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    name: str = ""


def validate_messages(messages: Sequence[Message]) -> None:
    if not messages:
        raise InvalidArgument("messages must hold at least one message")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}")
