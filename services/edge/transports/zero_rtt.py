"""0-RTT: which requests may run from TLS early data, and the session tickets that allow it.

Every handshake issues a session ticket; a client that comes back with one may send
its request in the first flight (TLS early data), which saves a round trip to the first
token. Early data can be replayed by anyone who captured that flight, so:
- tickets are single use (`SessionTicketStore.pop`): a replayed ClientHello finds no ticket,
  falls back to a full handshake and its early data is discarded. An on-path attacker who
  races the genuine flight can still get one copy served, so a request runs at most twice;
  the store lives in this process's memory, so tickets die with it and are never shared.
- a request received in early data runs at once only if `early_data_policy` says replaying
  it is harmless (default `replay_tolerable`: reads, and completions that name no session,
  whose replay costs compute but changes no state). Anything else waits until the handshake
  completes, which a replayed flight never does (RFC 8470 section 3, without a 425 round trip).
- a request the app sees before the handshake completed carries `early-data: 1`
  (RFC 8470 section 5.1), so the app can refine the policy; clients cannot forge it.

The QUIC adapter that applies this policy is services/edge/transports/http3.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from aioquic.tls import SessionTicket

from services.edge.transports.asgi import Scope

EarlyDataPolicy = Callable[[Scope, bytes], bool]  # (scope, whole body) -> may run before the handshake

_SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
_COMPLETION_PATHS = {"/v1/chat/completions", "/v1/completions"}


def replay_tolerable(scope: Scope, body: bytes) -> bool:
    """Default 0-RTT policy: may this request run before the handshake proves it is no replay?

    Reads, yes. Completions, yes, unless they name a session (`x-session-id`, or the OpenAI
    `user` field): a session turn is appended to the stored history, so a replay would
    duplicate it. A replayed plain completion costs one more generation and changes nothing.
    Any other write waits for the handshake.
    """
    if scope["method"] in _SAFE_METHODS:
        return True
    if scope["method"] != "POST" or scope["path"] not in _COMPLETION_PATHS:
        return False
    if any(name == b"x-session-id" for name, _ in scope["headers"]):
        return False
    try:
        payload = json.loads(body)
    except ValueError:
        return True  # the app rejects it with a 400 either way; nothing to replay
    return not (isinstance(payload, dict) and payload.get("user"))


class SessionTicketStore:
    """In-memory TLS session tickets, so returning clients resume and send 0-RTT early data.

    Tickets are popped on use: a ticket resumes (and carries early data) once, which is what
    stops a captured first flight from being replayed (see the module docstring).
    """

    def __init__(self, max_tickets: int = 10_000) -> None:
        self._tickets: dict[bytes, SessionTicket] = {}
        self._max = max_tickets

    def add(self, ticket: SessionTicket) -> None:
        # Every handshake issues a ticket; cap the store so a busy edge can't grow without
        # bound. dicts keep insertion order, so the first key is the oldest ticket.
        while len(self._tickets) >= self._max:
            self._tickets.pop(next(iter(self._tickets)))
        self._tickets[ticket.ticket] = ticket

    def pop(self, label: bytes) -> SessionTicket | None:
        return self._tickets.pop(label, None)
