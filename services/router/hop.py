"""What one request carries through the router's dispatcher (dispatch.py), from attempt to attempt."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from mesh.chat import Message
from mesh.sampling import Sampling
from services.router.lora import Lora
from services.router.policies import RouteRequest
from services.router.relay import Stream
from services.router.request import RouterRequest
from services.router.shadow import Deadline


@dataclass(frozen=True)
class Hop:
    """What a request carries through the dispatcher, attempt after attempt: the request and its chat
    (session history merged), the model and version it runs on ("": any), its session key ("" for a
    mirror), the call (a mirror's Deadline: only the time left is read of it), the text already sent
    (a resumed stream's: _prepare), whether it is interactive, not a mirror (level 3 by latency:
    failover/latency.py), `admit` (see `Dispatcher.generate`) and its LoRA adapter, if any."""
    request: RouterRequest
    request_id: str
    model: str
    version: str
    conversation: list[Message]
    key: str
    context: grpc.aio.ServicerContext | Deadline
    sent: list[str] = field(default_factory=list)
    interactive: bool = True
    admit: Callable[[int], None] | None = None
    lora: Lora | None = None          # the LoRA adapter the request names as its model (lora.py)

    def adapter(self, model: str) -> Lora | None:
        """The adapter to run with on `model`: the hop's, on its own model only (a fallback runs without)."""
        return self.lora if model == self.model else None


@dataclass(frozen=True)
class Prompt:
    """A request's prompt for one model: its token ids, the client stream, the routing request and the sampling
    as the engine runs it (what needs the tokenizer settled: mesh/sampling.py at_tokenizer)."""
    ids: list[int]
    stream: Stream
    route: RouteRequest
    sampling: Sampling


def mirror_hop(hop: Hop, request_id: str, model: str, version: str) -> Hop:
    """A mirror's own hop: a copy of the request that stores nothing and follows no session, with the
    served call's time left, not interactive and admitted already."""
    return Hop(dataclasses.replace(hop.request, session_id=""), request_id, model, version, hop.conversation, "",
               Deadline(hop.context.time_remaining()), [], False, lora=hop.lora)
