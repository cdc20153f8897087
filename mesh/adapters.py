"""LoRA adapter names and versions, as every service sees them.

A request names an adapter as its model; the answer's model is the adapter's name and its version the base
model's version with the adapter's folder folded in (`served_version`), so an answer kept by the edge's
response cache is never replayed for other weights loaded under the same name."""

from __future__ import annotations

import hashlib
import re

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
NAME_RULE = "use 1 to 128 letters, digits, '.', '_', ':', '-' (a letter or digit first)"


def served_version(base_version: str, path: str) -> str:
    """`base_version` of the base model with the adapter read from `path`: "1+lora.3fa2b1c0"."""
    return f"{base_version}+lora.{hashlib.blake2b(path.encode(), digest_size=4).hexdigest()}"
