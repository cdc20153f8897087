"""The limits of a request's names and template variables, wherever it enters the mesh (the sampling
fields' own are in mesh/sampling.py).

The edge checks them on OpenAI JSON fields (services/edge/surfaces/fields.py, with the field named in each error); the
router checks the same limits on every native `Generate` (a gRPC caller skips the edge), so a request the edge
would refuse is refused there too.  Pure code, no protobuf.
"""

from __future__ import annotations

import re

MAX_NAME_CHARS = 256            # model, user / session id, replica pin, messages[].name
MAX_WEIGHT = 1000.0             # a tier's weight in fair scheduling (services/engine/core/fairness.py); above 0


def name_problem(what: str, value: str) -> str | None:
    """Why an identifier (session id, replica pin, model name) is refused, or None."""
    if len(value) > MAX_NAME_CHARS:
        return f"{what} is at most {MAX_NAME_CHARS} characters (got {len(value)})"
    return None


MAX_TEMPLATE_KWARGS = 16
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token",
                                     "eos_token", "pad_token", "unk_token", "raise_exception", "strftime_now"})
_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_KWARG_WORD = re.compile(r"[A-Za-z0-9_.-]{0,64}")


def template_kwargs_problem(kwargs: object) -> str | None:
    """Why `chat_template_kwargs` (variables for the chat template, e.g. enable_thinking) is refused, or None.
    Values are booleans, numbers or short words only: a template writes them into the prompt, where free text
    could forge the template's control tokens."""
    if not isinstance(kwargs, dict):
        return "chat_template_kwargs must be an object of template variables"
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        return f"chat_template_kwargs holds at most {MAX_TEMPLATE_KWARGS} variables"
    for key, value in kwargs.items():
        if not isinstance(key, str) or not _KWARG_NAME.fullmatch(key) or key in RESERVED_TEMPLATE_NAMES:
            return f"chat_template_kwargs: {str(key)[:64]!r} is not a variable a request may set"
        word = isinstance(value, str) and _KWARG_WORD.fullmatch(value) is not None
        if not (word or isinstance(value, bool | int | float)):
            return (f"chat_template_kwargs.{key} must be a boolean, a number or a word of up to 64 letters, digits, "
                    "'_', '.' or '-'")
    return None
