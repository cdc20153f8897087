"""The engine's vocabulary: sampling parameters, requests and their states."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from mesh.constraints import Constraint
from mesh.errors import InvalidArgument
from services.engine.block_manager import BlockTable
from services.engine.grammar import Matcher
from services.engine.speculate import Lookup

if TYPE_CHECKING:
    import torch

    from services.engine.lora import Adapter


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"       # the model failed while running the request (the server fails the call)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


POOLINGS = ("", "model", "mean", "cls", "last")     # "model": the model's own (mesh/models/folder.py: pooling_mode)
GREEDY_BELOW = 1e-5     # temperatures below this sample greedily (SamplingParams.greedy)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 0            # 0: up to the context limit
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    # Logits processing before temperature / top-k / top-p (services/engine/sampler.py: process):
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    constraint: Constraint | None = None     # structured output (services/engine/grammar.py)
    prompt_logprobs: bool = False            # also each prompt token's logprob (completions' echo)
    pooling: str = ""                        # an embedding: "mean", "cls" or "last" of the prompt's hidden states

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidArgument(f"temperature {self.temperature} must be between 0 and 100")
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidArgument(f"top_p {self.top_p} must be between 0 and 1")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k {self.top_k} must be >= 0")
        if self.max_tokens < 0:
            raise InvalidArgument(f"max_tokens {self.max_tokens} must be >= 0")
        if not 0 <= self.top_logprobs <= 20:
            raise InvalidArgument(f"top_logprobs {self.top_logprobs} must be between 0 and 20")
        if not (-2.0 <= self.presence_penalty <= 2.0 and -2.0 <= self.frequency_penalty <= 2.0):
            raise InvalidArgument("presence_penalty and frequency_penalty must be between -2 and 2")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidArgument(f"repetition_penalty {self.repetition_penalty} must be above 0 and at most 10")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"min_p {self.min_p} must be between 0 and 1")
        if any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            raise InvalidArgument("logit_bias values must be between -100 and 100")
        if self.min_tokens < 0 or (self.max_tokens and self.min_tokens > self.max_tokens):
            raise InvalidArgument(f"min_tokens {self.min_tokens} must be between 0 and max_tokens")
        if self.pooling not in POOLINGS:
            raise InvalidArgument(f"pooling {self.pooling!r} is not one of {', '.join(p for p in POOLINGS if p)} "
                                  "(or empty: none)")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small (below GREEDY_BELOW) that dividing float32 logits by it overflows:
        its limit, the most likely token (as vLLM treats temperatures under 1e-5)."""
        return self.temperature < GREEDY_BELOW

    @property
    def processed(self) -> bool:
        """Whether the logits are changed before sampling (penalties, bias, min_tokens, a grammar): such a
        row needs its full logits and its own history, so it takes neither the greedy shortcut nor drafts."""
        return self.penalized or self.constraint is not None

    @property
    def penalized(self) -> bool:
        """Whether services/engine/sampler.py: process changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)


@dataclass(frozen=True)
class EngineTokenLogprob:
    """One token's logprob and its top alternatives, by token id (the router client's TokenLogprob,
    mesh/clients/router_client.py, carries the text too)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class StagedBlock(NamedTuple):
    """KV of one prompt block, fetched from the shared cache before the request was added.

    The scheduler imports it at admission if it directly follows the local prefix hit and its
    hash is the prompt's own; it only moves the tensor, which the engine copies into the KV cache."""

    position: int               # the block's index in the prompt (0: the first block)
    hash: bytes                 # its chained hash (mesh.prefix)
    kv: torch.Tensor            # (layers, 2, block_size, kv_heads, head_dim), the runner's KV dtype


class Owner(NamedTuple):
    """Whom a request serves, as the scheduler reads it: its class, its tenant and the tenant's weight."""

    priority: int = 0                     # 0 interactive, 1 batch
    tenant: str = ""                      # "": the common tenant
    weight: float = 1.0                   # the tenant's share relative to others' (its tier's weight)


COMMON = Owner()                          # an interactive request of the common tenant


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int                       # resolved: never 0
    # Tokens streamed by another replica before a failover; they extend the prompt.
    resume_ids: list[int] = field(default_factory=list)
    cache_salt: bytes = b""             # prefix-cache namespace: only equal salts share cached blocks
    cache_class: str = ""               # eviction class of the blocks it publishes; "": the engine's own
    version: str = ""                     # the model version it runs on, to its end (services/engine/versions.py)
    adapter: Adapter | None = None        # the LoRA adapter it runs with (services/engine/lora.py); None: the base
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    priority: int = 0                     # 0 interactive, 1 batch
    tenant: str = ""                      # whose request (fair scheduling between tenants; "": the common one)
    weight: float = 1.0                   # the tenant's share relative to others' (its tier's weight)
    arrival: int = 0                      # set by the scheduler
    served: int = 0                       # the scheduler's step that last ran a chunk of it
    num_computed: int = 0                 # tokens whose KV is in the cache
    num_cached_tokens: int = 0            # prompt tokens served by the prefix cache, local or shared
    num_preemptions: int = 0
    table: BlockTable = field(default_factory=BlockTable)
    staged: list[StagedBlock] = field(default_factory=list)   # in position order; emptied at admission
    # Speculation (services/engine/speculate.py): this step's draft tokens, and the n-gram index they come from.
    draft: list[int] = field(default_factory=list)
    lookup: Lookup | None = None
    matcher: Matcher | None = None        # the grammar's state when sampling.constraint is set (set by the server)
    # With sampling.prompt_logprobs: entry k is prompt token k's (entry 0's logprob is NaN), filled by the runner.
    prompt_logprobs: list[EngineTokenLogprob] = field(default_factory=list)
    # With sampling.pooling: the sum of the pooled rows' final hidden states (float32), filled by the runner.
    pooled: torch.Tensor | None = None
    pooled_rows: int = 0

    def __post_init__(self) -> None:
        # prompt + resumed + generated tokens, kept as one list: the scheduler reads it every step.
        self.all_ids: list[int] = self.prompt_ids + self.resume_ids + self.output_ids

    def embedding(self) -> tuple[float, ...]:
        """The pooled hidden state (the mean of the pooled rows; not normalized); () without pooling."""
        if self.pooled is None or not self.pooled_rows:
            return ()
        return tuple((self.pooled / self.pooled_rows).tolist())

    def append(self, token: int) -> None:
        self.output_ids.append(token)
        self.all_ids.append(token)

    @property
    def num_generated(self) -> int:
        """Tokens generated for this request, counting those streamed before a failover."""
        return len(self.resume_ids) + len(self.output_ids)


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_ids: tuple[int, ...]
    logprobs: tuple[EngineTokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: tuple[EngineTokenLogprob, ...] = ()     # the request's first output only
    embedding: tuple[float, ...] = ()                        # with sampling.pooling: the final output only
