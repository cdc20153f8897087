"""Session context: a session's message history with a sliding TTL.  Pure: callers pass `now`."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from mesh.chat import Message
from mesh.errors import InvalidArgument, ResourceExhausted

DEFAULT_TTL_S = 30 * 60.0
# The router's keys are `<tenant>/<session id>`: a tenant ("key:" + 16 hex digits, "addr:" + an IPv6
# address) in front of the 256 characters the edge allows a session id.
MAX_SESSION_ID = 320


@dataclass
class Session:
    messages: list[Message] = field(default_factory=list)
    expires_at: float = 0.0


class SessionStore:
    """Sessions expire `ttl_s` after their last read or write (a sliding TTL).

    Bounded: at most `max_sessions` (the least recently used goes first) and at most
    `max_messages` per session, so one chatty client cannot exhaust the service.
    """

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_sessions: int = 100_000,
                 max_messages: int = 1_000, max_session_id: int = MAX_SESSION_ID):
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_messages = max_messages
        self.max_session_id = max_session_id
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def _check_id(self, session_id: str) -> None:
        if not session_id:
            raise InvalidArgument("session_id is empty")
        if len(session_id) > self.max_session_id:
            raise InvalidArgument(f"session_id is longer than {self.max_session_id} characters")

    def _live(self, session_id: str, now: float) -> Session | None:
        session = self._sessions.get(session_id)
        if session is None:
            return None
        if session.expires_at <= now:
            del self._sessions[session_id]
            return None
        return session

    def _touch(self, session_id: str, session: Session, now: float) -> None:
        session.expires_at = now + self.ttl_s
        self._sessions.move_to_end(session_id)

    def get(self, session_id: str, now: float) -> Session | None:
        self._check_id(session_id)
        session = self._live(session_id, now)
        if session is not None:
            self._touch(session_id, session, now)
        return session

    def append(self, session_id: str, messages: list[Message], now: float) -> Session:
        self._check_id(session_id)
        session = self._live(session_id, now) or Session()
        if len(session.messages) + len(messages) > self.max_messages:
            raise ResourceExhausted(
                f"session {session_id!r} would exceed {self.max_messages} messages; delete it or start a new one")
        session.messages.extend(messages)
        self._sessions[session_id] = session
        self._touch(session_id, session, now)
        self.expire(now)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return session

    def restore(self, session_id: str, messages: list[Message], expires_at: float) -> None:
        """Bring back a session kept on disk (services/cache/journal.py), as the most recently used."""
        self._sessions[session_id] = Session(list(messages), expires_at)
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def items(self, now: float) -> list[tuple[str, Session]]:
        """The live sessions, least recently used first."""
        self.expire(now)
        return list(self._sessions.items())

    def delete(self, session_id: str, now: float) -> bool:
        self._check_id(session_id)
        found = self._live(session_id, now) is not None
        self._sessions.pop(session_id, None)
        return found

    def expire(self, now: float) -> int:
        """Drop expired sessions; the oldest-touched sit first, so stop at the first live one."""
        dropped = 0
        while self._sessions:
            sid, session = next(iter(self._sessions.items()))
            if session.expires_at > now:
                break
            del self._sessions[sid]
            dropped += 1
        return dropped
