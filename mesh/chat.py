"""Chat messages, shared by the edge, router, tokenizer and session store."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mesh.errors import InvalidArgument
from meshpb.v1 import tokenizer_pb2

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    name: str = ""
    tool_calls: str = ""         # an assistant's calls: OpenAI's `tool_calls` list as JSON text ("" for none)
    tool_call_id: str = ""       # a tool result's: the call it answers


def validate_messages(messages: Sequence[Message]) -> None:
    if not messages:
        raise InvalidArgument("messages must hold at least one message")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}")


def to_pb(m: Message) -> tokenizer_pb2.ChatMessage:
    return tokenizer_pb2.ChatMessage(role=m.role, content=m.content, name=m.name, tool_calls=m.tool_calls,
                                     tool_call_id=m.tool_call_id)


def from_pb(m: tokenizer_pb2.ChatMessage) -> Message:
    return Message(m.role, m.content, m.name, m.tool_calls, m.tool_call_id)
