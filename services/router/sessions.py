"""Server-side chat sessions: how a request's messages combine with the stored history.

A client that names a session (`x-session-id` or the OpenAI `user` field) may send either the
whole conversation, OpenAI style, or only what is new; the router keeps the history in the
cache service's session store.  Pure code: the dispatcher fetches and appends (upstream.Sessions).

Sessions belong to a tenant (the caller the edge authenticated): the store's key is
`<tenant>/<session id>`, so two callers naming the same session never share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from mesh.chat import Message
from mesh.errors import InvalidArgument

NATIVE_TENANT = "grpc:"             # requests that name no tenant (native gRPC callers): a namespace of their own


def session_key(tenant: str, session_id: str) -> str:
    """The store's (and session affinity's) key for a caller's session; "" when it names none.

    A tenant may not contain "/": the key's tenant part ends at the first one, so no tenant
    and session id can spell another tenant's key."""
    if not session_id:
        return ""
    if "/" in tenant:
        raise InvalidArgument("tenant must not contain '/'")
    return f"{tenant or NATIVE_TENANT}/{session_id}"


class Merged(NamedTuple):
    conversation: list[Message]     # what the model sees
    new: list[Message]              # what the session store should append (before the reply)


def merge(history: Sequence[Message], incoming: Sequence[Message]) -> Merged:
    """Combine the stored history with a request's messages.

    - No history: the request is the whole conversation.
    - The request starts with the whole history (an OpenAI-style client resending everything):
      it is used as is; only its tail is new.
    - Otherwise the request holds only new messages and follows the history.  Leading system
      messages that repeat the history's own system messages are dropped, so a client that
      always sends its system prompt does not stack copies of it.
    """
    history, incoming = list(history), list(incoming)
    if not history:
        return Merged(incoming, incoming)
    if incoming[: len(history)] == history:
        return Merged(incoming, incoming[len(history):])
    stored_system = [m for m in history if m.role == "system"]
    start = 0
    while start < len(incoming) and incoming[start].role == "system" and incoming[start] in stored_system:
        start += 1
    new = incoming[start:]
    return Merged(history + new, new)
