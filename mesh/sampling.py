"""A request's sampling fields, defined once: their types, defaults and limits.

`Sampling` is the vocabulary every service speaks: the edge reads it from OpenAI JSON
(services/edge/surfaces/requests.py walks `FIELDS`), the OpenAPI document describes it (`json_schema`), the
protobuf message carries it (mesh/sampling_pb.py converts field by field), the router checks a native caller's
values at its door
(`problem`) and settles what needs the tokenizer (`at_tokenizer`), and the engine samples with it
(services/engine/core/request.py: SamplingParams adds the engine's default and its derived flags).  A field's limits
live in its `Spec`, beside its default: adding a field is a line here, one in proto/meshpb/v1/common.proto, and
its effect where it acts.

Pure code, no protobuf.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mesh.constraints import Constraint

MAX_TOKENS = 1 << 20
MAX_TOP_LOGPROBS = 20           # chat top_logprobs
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)    # int64 as OpenAI documents it, and the engine's uint64


@dataclass(frozen=True)
class Spec:
    """A sampling field's rules.  kind: number | integer | boolean | strings | token_ids | bias | id_lists
    (internal: token id sequences) | other (a value only code sets: constraint, pooling, ...).

    lo/hi bound a number (each value of a `bias`); `above`: lo itself is refused.  `items` / `chars` bound a
    list and its strings.  `unset_zero`: 0 (protobuf's unset value) means the default (top_p 0, repetition_penalty
    0, max_tokens 0: none) and is allowed inside the mesh though a JSON caller may not send it.  `json`: an OpenAI
    (or vLLM) request field the edge reads by this name.  `logits`: a value other than the default changes the
    logits before sampling (the engine then keeps the row's full logits and history).  `guard`: the engine checks
    it too, because a value out of range would break a kernel (a negative temperature, top_k, ...)."""
    kind: str
    lo: float | None = None
    hi: float | None = None
    above: bool = False
    items: int = 0
    chars: int = 0
    unset_zero: bool = False
    json: bool = True
    logits: bool = False
    guard: bool = False
    doc: str = ""
    unit: str = "entries"          # what a list holds, for its errors ("stop holds at most 4 sequences")


def _spec(kind: str, lo: float | None = None, hi: float | None = None, **rules: Any) -> dict[str, Spec]:
    return {"spec": Spec(kind, lo, hi, **rules)}


@dataclass(frozen=True)
class Sampling:
    """How to sample one answer (the defaults are OpenAI's; services/engine/core/request.py's SamplingParams samples
    greedily by default)."""
    temperature: float = field(default=1.0, metadata=_spec("number", 0.0, 2.0, guard=True))
    top_p: float = field(default=1.0, metadata=_spec("number", 0.0, 1.0, unset_zero=True, guard=True))
    top_k: int = field(default=0, metadata=_spec("integer", 0, MAX_TOKENS, guard=True, doc="0: off (extension)"))
    seed: int | None = field(default=None, metadata=_spec("integer", *SEED_RANGE))
    max_tokens: int = field(default=0, metadata=_spec("integer", 1, MAX_TOKENS, unset_zero=True, guard=True))
    ignore_eos: bool = field(default=False, metadata=_spec("boolean", doc="generate to max_tokens (extension)"))
    stop: tuple[str, ...] = field(default=(), metadata=_spec("strings", items=4, chars=256, unit="sequences"))
    logprobs: bool = field(default=False, metadata=_spec("boolean", json=False))
    top_logprobs: int = field(default=0, metadata=_spec("integer", 0, MAX_TOP_LOGPROBS, json=False, guard=True))
    model_defaults: tuple[str, ...] = ()   # fields the client left unset: the model's generation_config decides
    presence_penalty: float = field(default=0.0, metadata=_spec("number", -2.0, 2.0, logits=True))
    frequency_penalty: float = field(default=0.0, metadata=_spec("number", -2.0, 2.0, logits=True))
    repetition_penalty: float = field(default=1.0, metadata=_spec(
        "number", 0.0, 10.0, above=True, unset_zero=True, logits=True, doc="1: off (extension)"))
    min_p: float = field(default=0.0, metadata=_spec("number", 0.0, 1.0, doc="0: off (extension)"))
    logit_bias: tuple[tuple[int, float], ...] = field(default=(), metadata=_spec(
        "bias", -100.0, 100.0, items=1024, logits=True, unit="tokens",
        doc="token id -> bias added to its logit; -100 bans it"))
    min_tokens: int = field(default=0, metadata=_spec(
        "integer", 0, MAX_TOKENS, logits=True, doc="no end of sequence before this many tokens (extension)"))
    stop_token_ids: tuple[int, ...] = field(default=(), metadata=_spec(
        "token_ids", items=64, unit="ids", doc="token ids that end the answer (extension)"))
    bad_words: tuple[str, ...] = field(default=(), metadata=_spec(
        "strings", items=64, chars=256, unit="words", doc="words never generated (extension)"))
    bad_words_ids: tuple[tuple[int, ...], ...] = field(default=(), metadata=_spec(
        "id_lists", items=256, json=False, logits=True, unit="sequences"))    # bad_words' tokens: at_tokenizer
    truncate_prompt_tokens: int = field(default=0, metadata=_spec(
        "integer", 1, MAX_TOKENS, unset_zero=True, doc="keep only the prompt's last this many tokens (extension)"))
    constraint: Constraint | None = field(default=None, metadata=_spec("other", json=False, logits=True))
    prompt_logprobs: bool = False          # also the prompt tokens' logprobs (completions' echo)
    pooling: str = ""                      # an embedding: "mean", "cls" or "last" pooling of the prompt's hidden states

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small (below GREEDY_BELOW) that dividing float32 logits by it overflows:
        its limit, the most likely token (as vLLM treats temperatures under 1e-5)."""
        return self.temperature < GREEDY_BELOW

    @functools.cached_property
    def processed(self) -> bool:
        """Whether the logits are changed before sampling (penalties, bias, min_tokens, a grammar, ...): such a
        row needs its full logits and its own history, so it takes neither the greedy shortcut nor drafts."""
        return any(getattr(self, name) != default for name, _, default in LOGITS_FIELDS)

    @functools.cached_property
    def penalized(self) -> bool:
        """Whether the sampler's logits processing (services/engine/runtime/sampler.py: process) changes the logits:
        processed, a grammar aside (its masks are applied apart)."""
        return any(getattr(self, name) != default for name, _, default in LOGITS_FIELDS if name != "constraint")


GREEDY_BELOW = 1e-5     # temperatures below this sample greedily (Sampling.greedy)


def field_spec(name: str) -> dataclasses.Field[Any]:
    """A field of Sampling with its default and spec, for a subclass that changes only the default
    (services/engine/core/request.py: `temperature: float = field_spec("temperature")` with default 0)."""
    return Sampling.__dataclass_fields__[name]


FIELDS: tuple[tuple[str, Spec, Any], ...] = tuple(
    (f.name, f.metadata["spec"], f.default) for f in dataclasses.fields(Sampling) if "spec" in f.metadata)
SPECS: dict[str, Spec] = {name: spec for name, spec, _ in FIELDS}
JSON_FIELDS = tuple(entry for entry in FIELDS if entry[1].json)
LOGITS_FIELDS = tuple(entry for entry in FIELDS if entry[1].logits)


def _bounds(spec: Spec) -> str:
    lo, hi = spec.lo, spec.hi
    return f"above {lo:g} and at most {hi:g}" if spec.above else f"between {lo:g} and {hi:g}"


def value_problem(name: str, value: Any) -> str | None:
    """Why `value` breaks field `name`'s limits (the message names the field), or None."""
    spec = SPECS[name]
    if value is None or (spec.unset_zero and value == 0):
        return None
    if spec.kind in ("number", "integer"):
        assert spec.lo is not None and spec.hi is not None
        low_ok = value > spec.lo if spec.above else value >= spec.lo
        if not (low_ok and value <= spec.hi):         # (NaN is refused too)
            return f"'{name}' must be {_bounds(spec)}, got {value!r}"
    elif spec.kind in ("strings", "token_ids", "bias", "id_lists"):
        if spec.items and len(value) > spec.items:
            return f"'{name}' holds at most {spec.items} {spec.unit}, got {len(value)}"
        if spec.chars and any(len(s) > spec.chars for s in value):
            return f"each {name} {spec.unit[:-1]} is at most {spec.chars} characters"
        if spec.kind == "bias" and any(not spec.lo <= v <= spec.hi for _, v in value):     # type: ignore[operator]
            return f"'{name}' values must be between {spec.lo:g} and {spec.hi:g}"
    return None


def problem(s: Sampling, guards_only: bool = False) -> tuple[str, str] | None:
    """(field, why) for the first field of `s` out of its limits, or None.  guards_only: only the limits a
    kernel depends on (the engine's check: the doors, edge and router, check them all)."""
    for name, spec, _ in FIELDS:
        if guards_only and not spec.guard:
            continue
        why = value_problem(name, getattr(s, name))
        if why:
            return name, why
    if s.max_tokens and s.min_tokens > s.max_tokens and not guards_only:
        return "min_tokens", "'min_tokens' must be at most max_tokens"
    return None


def json_schema(spec: Spec, doc: str = "") -> dict[str, Any]:
    """The JSON Schema (OpenAPI 3.1) of a field the edge reads from JSON (null: left out)."""
    doc = doc or spec.doc
    rules: dict[str, Any] = {}
    if spec.kind in ("number", "integer"):
        rules = {"type": [spec.kind, "null"], "exclusiveMinimum" if spec.above else "minimum": spec.lo,
                 "maximum": spec.hi}
    elif spec.kind == "boolean":
        rules = {"type": ["boolean", "null"]}
    elif spec.kind == "strings":
        text = {"type": "string", "maxLength": spec.chars} if spec.chars else {"type": "string"}
        rules = {"anyOf": [{"type": "null"}, text, {"type": "array", "maxItems": spec.items, "items": text}]}
    elif spec.kind == "token_ids":
        rules = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": spec.items,
                                              "items": {"type": "integer", "minimum": 0}}]}
    elif spec.kind == "bias":
        rules = {"anyOf": [{"type": "null"}, {"type": "object", "maxProperties": spec.items, "additionalProperties": {
            "type": "number", "minimum": spec.lo, "maximum": spec.hi}}]}
    return {**rules, "description": doc} if doc else rules


def schemas() -> dict[str, dict[str, Any]]:
    """Every JSON field's schema, by name."""
    return {name: json_schema(spec) for name, spec, _ in JSON_FIELDS}


Encode = Callable[[str], Awaitable[Sequence[int]]]


async def at_tokenizer(s: Sampling, prompt_ids: list[int], encode: Encode) -> tuple[Sampling, list[int]]:
    """What a field settles where the prompt is tokenized (the router): the prompt ids as the request wants
    them, and the sampling with what the engine needs in token ids.  `encode`: a text's ids, no special tokens."""
    if s.truncate_prompt_tokens and len(prompt_ids) > s.truncate_prompt_tokens:
        prompt_ids = prompt_ids[-s.truncate_prompt_tokens:]           # vLLM's: the last k tokens (left truncation)
    if s.bad_words:
        # Each word as a text starts with it and as one word among others (after a space): its token sequences.
        ids = {tuple(await encode(text)) for word in s.bad_words for text in (word, " " + word.lstrip())}
        s = dataclasses.replace(s, bad_words_ids=tuple(sorted(seq for seq in ids if seq)))
    return s, prompt_ids
