"""The engine's vocabulary: sampling parameters, requests and their states."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from mesh.errors import InvalidArgument
from services.engine.block_manager import BlockTable
from services.engine.speculate import Lookup

if TYPE_CHECKING:
    import torch


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"       # the model failed while running the request (the server fails the call)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TokenLogprob:
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


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int                       # resolved: never 0
    # Tokens streamed by another replica before a failover; they extend the prompt.
    resume_ids: list[int] = field(default_factory=list)
    cache_salt: bytes = b""             # prefix-cache namespace: only equal salts share cached blocks
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    priority: int = 0                     # 0 interactive, 1 batch
    arrival: int = 0                      # set by the scheduler
    num_computed: int = 0                 # tokens whose KV is in the cache
    num_cached_tokens: int = 0            # prompt tokens served by the prefix cache, local or shared
    num_preemptions: int = 0
    table: BlockTable = field(default_factory=BlockTable)
    staged: list[StagedBlock] = field(default_factory=list)   # in position order; emptied at admission
    # Speculation (services/engine/speculate.py): this step's draft tokens, and the n-gram index they come from.
    draft: list[int] = field(default_factory=list)
    lookup: Lookup | None = None

    def __post_init__(self) -> None:
        # prompt + resumed + generated tokens, kept as one list: the scheduler reads it every step.
        self.all_ids: list[int] = self.prompt_ids + self.resume_ids + self.output_ids

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
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
