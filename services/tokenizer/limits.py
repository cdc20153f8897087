"""InputLimits: how much text one request may hand the tokenizer, checked before any of it is tokenized.

Tokenizing is the one step whose memory grows with the caller's input: a 20 MB prompt became 5.2M
token ids and grew the process to 1.38 GB, which it never gave back.  No prompt that large can be
served anyway (the models' context is 8,192 tokens), so it is refused up front, by size alone.

The default, 768 KiB, is the largest prompt that could still fit a context: 8,192 tokens of the
vocabulary's longest token (81 bytes, SmolLM2's) is 648 KiB, rounded up.  Anything larger is
certain to be refused later for its token count; refusing it here costs one `len()`.  Below the
edge's 1 MiB body limit, so the gRPC interface (which skips the edge) is no looser than HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mesh.chat import Message
from mesh.errors import InvalidArgument

MAX_INPUT_BYTES = 768 * 1024
MAX_MESSAGES = 1_000                 # the edge's own --max-messages default


def _utf8_size(text: str, limit: int) -> int:
    """The UTF-8 size of `text`, or any number over `limit` once that is certain: a character is at
    least one byte, so an over-long string is refused without encoding it."""
    if len(text) > limit:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class InputLimits:
    max_input_bytes: int = MAX_INPUT_BYTES   # a prompt, or all of a chat's contents together, in UTF-8 bytes
    max_messages: int = MAX_MESSAGES         # messages in one chat

    def __post_init__(self) -> None:
        if self.max_input_bytes < 1024:
            raise ValueError(f"max_input_bytes must be at least 1024, got {self.max_input_bytes}")
        if self.max_messages < 1:
            raise ValueError(f"max_messages must be at least 1, got {self.max_messages}")

    def check_text(self, text: str) -> None:
        size = _utf8_size(text, self.max_input_bytes)
        if size > self.max_input_bytes:
            raise InvalidArgument(f"the prompt is over {self.max_input_bytes} bytes (at least {size}); "
                                  f"this tokenizer takes at most {self.max_input_bytes} (--max-input-bytes)")

    def check_messages(self, messages: Sequence[Message], tools: str = "") -> None:
        if len(messages) > self.max_messages:
            raise InvalidArgument(f"the chat holds {len(messages)} messages; this tokenizer takes at most "
                                  f"{self.max_messages} (--max-messages)")
        left = self.max_input_bytes
        for m in [*messages, Message("tools", tools)]:
            left -= _utf8_size(m.content, left) + _utf8_size(m.name, left) + _utf8_size(m.tool_calls, left)
            if left < 0:
                raise InvalidArgument(f"the chat's messages hold over {self.max_input_bytes} bytes of content "
                                      f"(tools and tool calls included); this tokenizer takes at most "
                                      f"{self.max_input_bytes} (--max-input-bytes)")
