"""The router client's values: what the edge, the CLI and tests hand to RouterClient / RouterPool and get back,
as plain frozen dataclasses (no protobuf).  mesh/clients/router_client.py re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mesh.chat import Message
from mesh.sampling import Sampling


@dataclass(frozen=True)
class GenerateSpec:
    """What to generate, as the edge understood the client's request."""

    model: str
    sampling: Sampling
    messages: tuple[Message, ...] = ()     # chat; or
    prompt: str | None = None              # a raw completion prompt; or
    prompt_ids: tuple[int, ...] | None = None   # a prompt already tokenized
    session_id: str = ""
    history_from: str = ""                 # with session_id: continue the conversation stored under this one
    caller_stores_turn: bool = False       # with session_id: the router stores no turn; the caller does (store_turn)
    pinned_replica: str = ""
    request_id: str = ""
    model_version: str = ""                # pin a version (also `model@version`)
    tenant: str = ""                       # who asks (never a secret): sessions are namespaced by it
    tools: str = ""                        # chat: OpenAI's `tools` list as JSON text, for the chat template
    template_kwargs: str = ""              # chat: the template's variables as a JSON object (enable_thinking, ...)
    # The answer's shape, for the edge (the router sees one prompt and one choice per call):
    n: int = 1                             # choices per prompt
    prompts: tuple[str, ...] = ()          # completions: every prompt (`prompt` is the first)
    echo: bool = False                     # completions: the prompt before each choice's text
    prompt_only: bool = False              # completions: echo with max_tokens 0 (the generated token dropped)
    tool_calls: str = ""                   # read tool calls out of the answer: "", "single" or "parallel"
    # The caller's tier (services/edge/gateway/tenants.py): scheduling class and share in the engine, KV-cache
    # eviction class.
    priority: str = "interactive"          # interactive | batch
    cache_class: str = ""                  # premium | standard | batch; "": the engine's own
    weight: float = 0.0                    # the tier's weight in fair scheduling between tenants; 0: 1


@dataclass(frozen=True)
class ServedBy:
    replica: str
    model: str
    model_version: str
    region: str
    degraded: bool
    confidence: float
    confidence_source: str = ""       # degraded: configured | offline | shadow | offline+shadow ...
    degraded_by: str = ""             # degraded: capacity | latency

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"replica": self.replica, "model_version": self.model_version,
                                  "region": self.region, "degraded": self.degraded,
                                  "confidence": round(self.confidence, 4)}
        if self.degraded:
            out.update(degraded_by=self.degraded_by, confidence_source=self.confidence_source)
        return out


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str                  # the token's own text (the router decodes it alone)
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob under the unmodified distribution, and its top alternatives."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Delta:
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    served_by: ServedBy | None = None
    ids: tuple[int, ...] = field(default=())
    logprobs: tuple[TokenLogprob, ...] = ()     # the tokens behind this delta, when Sampling.logprobs
    prompt_logprobs: tuple[TokenLogprob, ...] = ()   # first delta, with Sampling.prompt_logprobs (first: NaN)
    embedding: tuple[float, ...] = ()           # the last delta, with Sampling.pooling (not normalized)
    reasoning: str = ""                         # a reasoning model's thoughts (think tags), apart from `text`


@dataclass(frozen=True)
class ModelCard:
    name: str
    version: str
    replicas: int
    max_context: int
    versions: tuple[str, ...] = ()
    parent: str = ""                   # a LoRA adapter's base model ("": a model of its own)


@dataclass(frozen=True)
class Tokens:
    """A prompt or conversation as the model's tokenizer sees it (router Tokenize)."""
    model: str
    ids: tuple[int, ...]
    max_context: int
    token_strs: tuple[str, ...] | None = None     # with return_token_strs


@dataclass(frozen=True)
class TokenizeSpec:
    """What to tokenize: `messages` (with `tools`, OpenAI's list as JSON text) or `prompt`."""
    model: str = ""
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    tools: str = ""
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    return_token_strs: bool = False


@dataclass(frozen=True)
class ModelRouting:
    model: str
    default_version: str
    canary: dict[str, float]
    versions: tuple[str, ...]
    shadow: dict[str, Any] | None = None   # {"version", "share", "mirrored", "matched", ...} while shadowing

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"model": self.model, "default_version": self.default_version,
                                  "canary": {v: round(s, 6) for v, s in sorted(self.canary.items())},
                                  "versions": list(self.versions)}
        if self.shadow is not None:
            out["shadow"] = self.shadow
        return out


@dataclass(frozen=True)
class LoraCard:
    """A LoRA adapter (router ListLoraAdapters): its base model, folder and the replicas holding it."""

    name: str
    model: str
    path: str
    replicas: tuple[str, ...]

    def as_dict(self) -> dict[str, object]:
        return {"lora_name": self.name, "model": self.model, "lora_path": self.path, "replicas": list(self.replicas)}


@dataclass(frozen=True)
class VersionLoaded:
    """A hot swap's outcome: each replica's versions, and the model's routing after it."""

    replicas: tuple[dict[str, Any], ...]
    routing: ModelRouting

    def as_dict(self) -> dict[str, object]:
        return {"replicas": list(self.replicas), "routing": self.routing.as_dict()}
