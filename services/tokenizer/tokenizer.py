"""One model's tokenizer: chat template, encode, decode (Hugging Face `tokenizers` underneath)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mesh import model_store
from mesh.chat import Message, validate_messages
from mesh.errors import InvalidArgument


class ModelTokenizer:
    def __init__(self, name: str, folder: str | Path):
        from transformers import AutoTokenizer

        self.name = name
        self.folder = Path(folder)
        self.hf: Any = AutoTokenizer.from_pretrained(str(self.folder))
        if not self.hf.chat_template:
            raise ValueError(f"{self.folder} has no chat template; a chat model's tokenizer is needed")
        eos = set(model_store.eos_token_ids(self.folder))
        if self.hf.eos_token_id is not None:
            eos.add(self.hf.eos_token_id)
        self.eos_token_ids = sorted(eos)
        config = json.loads((self.folder / "config.json").read_text())
        self.max_context = int(config.get("max_position_embeddings", 2048))

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        validate_messages(messages)
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        text = self.hf.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(text)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [list(e.ids) for e in self.hf.backend_tokenizer.encode_batch(
            list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        vocab = len(self.hf)
        for i in ids:
            if i >= vocab:
                raise InvalidArgument(f"token id {i} is outside the vocabulary (size {vocab})")
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))
