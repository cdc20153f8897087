"""The router's vocabulary: what a Generate asks and what it answers, as plain frozen dataclasses.

wire.py builds them from the Router messages (and the messages back from them) at the servicer's door;
the dispatcher, the callers' checks, the tokenizer client and the relay read only these.  The engine's own
messages are engines.py's to build and read.  Pure code, no protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.chat import Message
from mesh.clients.values import ServedBy, TokenLogprob
from mesh.sampling import Sampling

INTERACTIVE, BATCH = "interactive", "batch"          # a request's priority (the engine's scheduling class)


@dataclass(frozen=True)
class Chat:
    """A conversation for the model's chat template."""
    messages: tuple[Message, ...] = ()
    tools: str = ""                        # OpenAI's `tools` list as JSON text
    template_kwargs: str = ""              # the template's variables as a JSON object


@dataclass(frozen=True)
class RouterRequest:
    """One Generate.  Its input is one of `chat`, `prompt` (a raw completion prompt, "" included) and
    `prompt_ids` (already tokenized), or none (refused when tokenizing)."""
    request_id: str = ""
    model: str = ""                        # "": the default model (or a LoRA adapter's name)
    chat: Chat | None = None
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    sampling: Sampling = Sampling()
    session_id: str = ""
    pinned_replica: str = ""
    region: str = ""                       # the caller's, for region affinity
    priority: str = INTERACTIVE            # interactive | batch
    include_token_ids: bool = False
    model_version: str = ""                # a pinned version
    tenant: str = ""                       # whose request (sessions and prefix caches are namespaced by it)
    resume_ids: tuple[int, ...] = ()       # a stream taken over: the ids the client has already
    cache_class: str = ""                  # premium | standard | batch; "": the engine's own
    weight: float = 0.0                    # the tenant's fair-scheduling weight; 0: 1
    history_from: str = ""                 # with session_id: the stored conversation it continues
    caller_stores_turn: bool = False       # the caller stores the turn (StoreTurn), not the router

    @property
    def input(self) -> str | None:
        """Which input the request holds: "chat", "prompt", "prompt_ids" or None."""
        if self.chat is not None:
            return "chat"
        if self.prompt is not None:
            return "prompt"
        return "prompt_ids" if self.prompt_ids is not None else None

    @property
    def messages(self) -> tuple[Message, ...]:
        """The chat's messages; none for a prompt."""
        return self.chat.messages if self.chat is not None else ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0                 # prompt tokens served from a prefix cache


# A reply's finish reasons ("": not the last reply); the engine's, and a stop string's "stop".
STOP, LENGTH, ABORT, ERROR = "stop", "length", "abort", "error"


@dataclass(frozen=True)
class Reply:
    """One message of a Generate's stream.  The first names the replica and counts the prompt (`served_by`,
    `usage`); the last has a `finish_reason`, its usage and served_by too."""
    text: str = ""
    ids: tuple[int, ...] = ()              # with include_token_ids
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str = ""
    usage: Usage | None = None
    served_by: ServedBy | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()   # with Sampling.prompt_logprobs: the first reply only
    embedding: tuple[float, ...] = ()      # with Sampling.pooling: the last reply only
    reasoning: str = ""                    # a reasoning model's thoughts, apart from `text`


@dataclass(frozen=True)
class Tokenization:
    """A Tokenize: `chat` through the template, or `prompt` encoded (neither: refused)."""
    model: str = ""
    chat: Chat | None = None
    prompt: str | None = None
    add_special_tokens: bool = False       # a prompt's: the tokenizer's own (BOS, ...)
    add_generation_prompt: bool = False    # a chat's: end with the assistant's turn opening
    return_token_strs: bool = False


@dataclass(frozen=True)
class StoredTurn:
    """A StoreTurn: the turn a Generate with caller_stores_turn left to its caller."""
    tenant: str
    session_id: str
    history_from: str
    messages: tuple[Message, ...]
    answer: Message
