"""Sessions in Redis (`--session-store redis://HOST:PORT/DB`), shared by every cache replica pointed at it.

A session is one Redis list, `infermesh:session:<id>`, of JSON messages
(`[role, content, name, tool_calls, tool_call_id]`, as the journal writes them), and the sliding TTL
is the key's own expiry: every read or write sets it again to the TTL, so Redis drops a session
nobody touched for that long.  An append is one Lua script (length check, RPUSH, PEXPIRE, LRANGE),
so two replicas appending to one session at once cannot take it past the message limit; a read is
LRANGE + PEXPIRE in one round trip.  The limit on the number of sessions is Redis's own (maxmemory
and its eviction policy), not `max_sessions`: a Redis that is full and may not evict refuses appends
(RESOURCE_EXHAUSTED) but still serves reads.

Redis unreachable: the RPC answers UNAVAILABLE naming the Redis address within about the socket
timeouts below (the router's call allows 5 s), and the pool reconnects by itself once Redis is back.
A command whose reply timed out is not retried: an append is not idempotent.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, NoPermissionError, OutOfMemoryError, ReadOnlyError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from mesh.chat import Message
from mesh.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.cache.config import RedisAddress
from services.cache.sessions import DEFAULT_TTL_S, MAX_SESSION_ID, Session

PREFIX = "infermesh:session:"
CONNECT_TIMEOUT_S = 1.0
REPLY_TIMEOUT_S = 1.5
RETRY_AFTER_S = 1

# KEYS[1]: the session; ARGV[1]: the message limit, ARGV[2]: the TTL (ms), ARGV[3...]: the new messages.
# nil: over the limit (nothing stored); otherwise the whole session.
_APPEND = """
local adding = #ARGV - 2
if redis.call('LLEN', KEYS[1]) + adding > tonumber(ARGV[1]) then return false end
if adding > 0 then redis.call('RPUSH', KEYS[1], unpack(ARGV, 3)) end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return redis.call('LRANGE', KEYS[1], 0, -1)
"""


def _encode(m: Message) -> str:
    return json.dumps([m.role, m.content, m.name, m.tool_calls, m.tool_call_id], ensure_ascii=False,
                      separators=(",", ":"))


def _decode(raw: str) -> Message:
    return Message(*json.loads(raw))


class RedisSessions:
    """The SessionBackend (session_backends.py) over one Redis database."""

    def __init__(self, address: RedisAddress, ttl_s: float = DEFAULT_TTL_S, max_messages: int = 1_000,
                 max_session_id: int = MAX_SESSION_ID, prefix: str = PREFIX):
        self.address = address
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.max_messages = max_messages
        self.max_session_id = max_session_id
        self.prefix = prefix
        # One retry, on a connection error only: a pooled connection Redis closed meanwhile (a
        # restart) is replaced, whereas a reply that timed out may mean the append was applied.
        self.client = redis.Redis(
            host=address.host, port=address.port, db=address.db, username=address.username or None,
            password=address.password or None, decode_responses=True, socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_timeout=REPLY_TIMEOUT_S, retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 1,
                                                        supported_errors=(RedisConnectionError,)),
            health_check_interval=10)
        self._append = self.client.register_script(_APPEND)

    def describe(self) -> str:
        return f"sessions kept in Redis at {self.address} (keys {self.prefix}*)"

    def _key(self, session_id: str) -> str:
        if not session_id:
            raise InvalidArgument("session_id is empty")
        if len(session_id) > self.max_session_id:
            raise InvalidArgument(f"session_id is longer than {self.max_session_id} characters")
        return self.prefix + session_id

    def _session(self, raw: list[str]) -> Session:
        return Session([_decode(r) for r in raw], time.monotonic() + self.ttl_ms / 1000)

    async def _call(self, what: str, command: Any) -> Any:
        """Await one Redis command, turning Redis's failures into the contract's errors."""
        try:
            return await command
        except (RedisConnectionError, RedisTimeoutError, InvalidResponse, ReadOnlyError, NoPermissionError) as exc:
            # Down, slow, not Redis at all, a read-only replica, or an ACL that forbids the commands:
            # the store's fault, not the request's, so the caller is told to come back.
            raise Unavailable(f"the session store, Redis at {self.address}, cannot {what} ({type(exc).__name__}: "
                              f"{exc}); retry in {RETRY_AFTER_S} s", retry_after_s=RETRY_AFTER_S) from None
        except OutOfMemoryError as exc:
            raise ResourceExhausted(f"the session store, Redis at {self.address}, is full (its maxmemory, "
                                    f"noeviction): {exc}") from None

    async def get(self, session_id: str) -> Session | None:
        key = self._key(session_id)

        async def read() -> list[Any]:
            # Not MULTI: Redis refuses to queue even reads in a transaction once it is over maxmemory,
            # and LRANGE then PEXPIRE need no atomicity (a key expiring in between stays expired).
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.lrange(key, 0, -1)
                pipe.pexpire(key, self.ttl_ms)
                result: list[Any] = await pipe.execute()
                return result

        raw, _ = await self._call("read a session", read())
        return self._session(raw) if raw else None

    async def append(self, session_id: str, messages: list[Message]) -> Session:
        key = self._key(session_id)
        too_many = ResourceExhausted(f"session {session_id!r} would exceed {self.max_messages} messages; "
                                     "delete it or start a new one")
        if len(messages) > self.max_messages:
            raise too_many                 # before Redis: also bounds the script's argument count
        raw = await self._call("store a turn", self._append(
            keys=[key], args=[self.max_messages, self.ttl_ms, *(_encode(m) for m in messages)]))
        if raw is None:
            raise too_many
        return self._session(raw)

    async def delete(self, session_id: str) -> bool:
        key = self._key(session_id)
        return bool(await self._call("delete a session", self.client.delete(key)))

    async def count(self) -> int:
        """Sessions under the prefix (a SCAN: this Redis may hold other keys too)."""
        async def scan() -> int:
            return sum([1 async for _ in self.client.scan_iter(match=f"{self.prefix}*", count=1000)])

        n: int = await self._call("count sessions", scan())
        return n

    async def ping(self) -> str:
        """"" when Redis answers; otherwise why not (the start-up log)."""
        try:
            await self._call("answer", self.client.ping())
        except (Unavailable, RedisError) as exc:
            return str(exc)
        return ""

    async def close(self) -> None:
        await self.client.aclose()
