"""The limits a generation request must respect, wherever it enters the mesh.

The edge checks them on OpenAI JSON fields (services/edge/requests.py, with the field named in each
error); the router checks the same limits on every native `Generate` (a gRPC caller skips the edge),
so a request the edge would refuse is refused there too.  Pure code, no protobuf.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

TEMPERATURE = (0.0, 2.0)
TOP_P = (0.0, 1.0)
MAX_STOP = 4
MAX_STOP_CHARS = 256            # the router's stop matcher holds back up to this much text
MAX_TOKENS = 1 << 20
MAX_TOP_LOGPROBS = 20           # chat top_logprobs; the engine's own limit (services/engine/request.py)
MAX_NAME_CHARS = 256            # model, user / session id, replica pin, messages[].name
PENALTY = (-2.0, 2.0)           # presence_penalty, frequency_penalty (OpenAI's range)
REPETITION_PENALTY = (0.0, 10.0)   # exclusive of 0; 1 is off
BIAS = (-100.0, 100.0)          # each logit_bias value (OpenAI's range)
MAX_LOGIT_BIAS = 1024           # entries in one logit_bias
MAX_WEIGHT = 1000.0             # a tier's weight in fair scheduling (services/engine/fairness.py); above 0


@dataclass(frozen=True)
class SamplingSettings:
    """A request's sampling settings as the limits read them (max_tokens, top_k: 0 is none)."""
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: Sequence[str]
    top_logprobs: int
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0


def sampling_problem(s: SamplingSettings) -> str | None:
    """Why these sampling settings are refused, or None when they are within the limits."""
    return _penalty_problem(s) or _range_problem(s)


def _penalty_problem(s: SamplingSettings) -> str | None:
    for name, value in (("presence_penalty", s.presence_penalty), ("frequency_penalty", s.frequency_penalty)):
        if not PENALTY[0] <= value <= PENALTY[1]:
            return f"{name} must be within {PENALTY[0]:g}-{PENALTY[1]:g}"
    if not REPETITION_PENALTY[0] < s.repetition_penalty <= REPETITION_PENALTY[1]:
        return f"repetition_penalty must be above {REPETITION_PENALTY[0]:g} and at most {REPETITION_PENALTY[1]:g}"
    if not 0.0 <= s.min_p <= 1.0:
        return "min_p must be within 0-1"
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        return f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens"
    if any(not BIAS[0] <= v <= BIAS[1] for v in s.logit_bias.values()):
        return f"logit_bias values must be within {BIAS[0]:g}-{BIAS[1]:g}"
    return None


def _range_problem(s: SamplingSettings) -> str | None:
    max_tokens, stop = s.max_tokens, s.stop
    if s.min_tokens > MAX_TOKENS or (max_tokens and s.min_tokens > max_tokens):
        return "min_tokens must be at most max_tokens"
    if not TEMPERATURE[0] <= s.temperature <= TEMPERATURE[1]:
        return f"temperature must be within {TEMPERATURE[0]:g}-{TEMPERATURE[1]:g}"
    if not TOP_P[0] <= s.top_p <= TOP_P[1]:
        return f"top_p must be within {TOP_P[0]:g}-{TOP_P[1]:g}"
    if s.top_k > MAX_TOKENS or max_tokens > MAX_TOKENS:
        return f"top_k and max_tokens are at most {MAX_TOKENS}"
    if len(stop) > MAX_STOP:
        return f"stop holds at most {MAX_STOP} sequences"
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        return f"each stop sequence is at most {MAX_STOP_CHARS} characters"
    if s.top_logprobs > MAX_TOP_LOGPROBS:
        return f"top_logprobs is at most {MAX_TOP_LOGPROBS}"
    return None


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
