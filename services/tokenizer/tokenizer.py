"""One model's tokenizer: chat template and encode (Hugging Face `tokenizers` underneath).

Decoding happens where the stream is, in the router, from `json()`: this service never decodes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mesh.chat import Message, validate_messages


class ModelTokenizer:
    def __init__(self, name: str, folder: str | Path):
        from transformers import AutoTokenizer

        self.name = name
        self.folder = Path(folder)
        self.hf: Any = AutoTokenizer.from_pretrained(str(self.folder))
        if not self.hf.chat_template:
            raise ValueError(f"{self.folder} has no chat template; a chat model's tokenizer is needed")

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        validate_messages(messages)
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        text = self.hf.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(text)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def json(self) -> str:
        """The serialized `tokenizers` tokenizer: `tokenizers.Tokenizer.from_str()` rebuilds it."""
        return str(self.hf.backend_tokenizer.to_str())
