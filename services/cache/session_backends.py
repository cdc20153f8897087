"""Where the session RPCs keep sessions: this process (EmbeddedSessions) or Redis (redis_sessions.py).

The servicer (server.py) sees only `SessionBackend`; `--session-store` picks one in __main__.
"""

from __future__ import annotations

import time
from typing import Protocol

from mesh.chat import Message
from services.cache.journal import SessionJournal
from services.cache.sessions import Session, SessionStore


class SessionBackend(Protocol):
    """A session store with a sliding TTL: every read or write extends the session's life.

    Contract, the same for every backend: a session id that is empty or too long raises
    InvalidArgument; an append that would take a session past its message limit raises
    ResourceExhausted and stores nothing; a store that cannot be reached raises Unavailable with
    a message naming it.  Returned sessions carry `expires_at` on the monotonic clock.
    """

    def describe(self) -> str:
        """Where sessions are kept, for the start-up log."""

    async def get(self, session_id: str) -> Session | None: ...

    async def append(self, session_id: str, messages: list[Message]) -> Session:
        """Add `messages` to the session (created when new) and return it whole."""

    async def delete(self, session_id: str) -> bool:
        """True when the session was there."""

    async def count(self) -> int:
        """Live sessions (GetStats)."""

    async def close(self) -> None: ...


class EmbeddedSessions:
    """This process's SessionStore, written through to a journal (--sessions-dir) when there is one."""

    def __init__(self, store: SessionStore, journal: SessionJournal | None = None):
        self.store = store
        self.journal = journal           # None: memory only, sessions end with the process

    def describe(self) -> str:
        if self.journal is None:
            return "sessions kept in memory only"
        return f"sessions kept in {self.journal.path} ({len(self.store)} brought back)"

    async def get(self, session_id: str) -> Session | None:
        return self.store.get(session_id, time.monotonic())

    async def append(self, session_id: str, messages: list[Message]) -> Session:
        now = time.monotonic()
        session = self.store.append(session_id, messages, now)
        if self.journal is not None:
            self.journal.appended(self.store, session_id, messages, now)
        return session

    async def delete(self, session_id: str) -> bool:
        now = time.monotonic()
        found = self.store.delete(session_id, now)
        if found and self.journal is not None:
            self.journal.deleted(self.store, session_id, now)
        return found

    async def count(self) -> int:
        self.store.expire(time.monotonic())
        return len(self.store)

    async def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
