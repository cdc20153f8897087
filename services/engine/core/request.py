"""The engine's vocabulary: sampling parameters, requests and their states."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from mesh.errors import InvalidArgument
from mesh.sampling import Sampling, field_spec, problem
from services.engine.core.block_manager import BlockTable
from services.engine.core.speculate import Lookup
from services.engine.runtime.grammar import Matcher

if TYPE_CHECKING:
    import torch

    from services.engine.runtime.lora import Adapter


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


@dataclass(frozen=True)
class SamplingParams(Sampling):
    """The mesh's sampling fields (mesh/sampling.py, with their limits) as the engine runs them: greedy unless
    told otherwise.  The engine trusts the doors (the edge, the router) for the fields' ranges and checks only
    what a kernel relies on (`Spec.guard`) and the pooling's name."""
    temperature: float = field(default=0.0, metadata=field_spec("temperature").metadata)

    def __post_init__(self) -> None:
        broken = problem(self, guards_only=True)
        if broken:
            raise InvalidArgument(broken[1])
        if self.pooling not in POOLINGS:
            raise InvalidArgument(f"pooling {self.pooling!r} is not one of {', '.join(p for p in POOLINGS if p)} "
                                  "(or empty: none)")


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
    version: str = ""                     # the model version it runs on, to its end (runtime/versions.py)
    adapter: Adapter | None = None        # the LoRA adapter it runs with (runtime/lora.py); None: the base
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
    # Speculation (services/engine/core/speculate.py): this step's draft tokens, the n-gram index they come from
    # (and the adaptive draft length), and with a draft model the probabilities they were drawn with ((k, V);
    # None: a greedy request's, or prompt lookup's: one token, probability 1).
    draft: list[int] = field(default_factory=list)
    lookup: Lookup | None = None
    draft_q: torch.Tensor | None = None
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
