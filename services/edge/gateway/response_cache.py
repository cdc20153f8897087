"""The response cache: a deterministic request asked again is answered without a model.

Cacheable: temperature 0 or a seed, no session (x-session-id, `user`), no pinned replica; answered
by the requested model (not degraded) with every choice ending in stop, length or tool_calls.  The key
is SHA-256 over the route, the caller's tenant (never shared across tenants), the pinned version
header and the request body without `stream` and `stream_options` (JSON with sorted keys: field order
does not matter).  Two tiers, each with the TTL (--response-cache-ttl, 5 minutes): this edge's memory
(LRU, --response-cache-mb), then the cache service (--cache-service; every edge shares it).  An entry
remembers the model version that made it; once the model's default version is another one (checked
against the router's model list, at most a second old), the entry is a miss; an answer to a request
that pinned a version (x-infermesh-model-version) is a miss once no replica serves that version.  A client skips the
cache with `Cache-Control: no-cache` or `x-infermesh-cache: bypass` (the fresh answer is stored).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from mesh.clients.router_client import GenerateSpec, ModelCard
from mesh.grpcutil import channel
from meshpb.v1 import cache_pb2, cache_pb2_grpc
from services.edge.gateway.safety import ContentPolicy
from services.edge.metrics import RESPONSE_CACHE

log = logging.getLogger(__name__)

CACHEABLE_FINISH = ("stop", "length", "tool_calls")
SHARED_TIMEOUT_S = 0.25         # a slow shared tier is a miss, never a slow answer
VERSIONS_MAX_AGE_S = 1.0


@dataclass(frozen=True)
class Entry:
    body: dict[str, Any]        # the whole (not streamed) answer, as first sent
    model: str                  # the model that served it
    version: str                # and its version


def bypassed(headers: dict[str, str]) -> bool:
    return (headers.get("x-infermesh-cache", "").strip().lower() == "bypass"
            or "no-cache" in headers.get("cache-control", "").lower())


def cache_key(chat: bool, tenant: str, body: dict[str, Any], spec: GenerateSpec, pinned_version: str
              ) -> bytes | None:
    """The request's key, or None when its answer must not be reused."""
    s = spec.sampling
    if not (s.temperature == 0 or s.seed is not None) or spec.session_id or spec.pinned_replica:
        return None
    shape = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    text = json.dumps([chat, tenant, pinned_version, shape], sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False)
    return hashlib.sha256(text.encode()).digest()


def storable(body: dict[str, Any]) -> bool:
    meta = body.get("infermesh") or {}
    return (not meta.get("degraded") and bool(body.get("choices"))
            and all(c.get("finish_reason") in CACHEABLE_FINISH for c in body["choices"]))


class ServedVersions:
    """Each model's default version and the versions its replicas serve, from the router's model list,
    at most VERSIONS_MAX_AGE_S old."""

    def __init__(self, fetch: Callable[[], Awaitable[list[ModelCard]]]):
        self.fetch = fetch
        self.defaults: dict[str, str] = {}
        self.served: dict[str, set[str]] = {}       # every version each model's replicas serve
        self.fetched_at = -1e9
        self._refreshing: asyncio.Task[None] | None = None

    def invalidate(self) -> None:
        """Read the model list again before the next answer from the cache (a default version changed)."""
        self.fetched_at = -1e9
        self.defaults, self.served = {}, {}

    async def refresh(self) -> None:
        try:
            cards = await self.fetch()
        except Exception as err:  # noqa: BLE001 - any failure: no version known, no cached answer served
            log.warning("response cache: the model list is unavailable (%s); cached answers are not served",
                        err.code().name if isinstance(err, grpc.aio.AioRpcError) else err)
            self.defaults, self.served, self.fetched_at = {}, {}, time.monotonic()
            return
        self.defaults = {c.name: c.version for c in cards}
        self.served = {c.name: {c.version, *c.versions} for c in cards}
        self.fetched_at = time.monotonic()

    async def _fresh(self) -> None:
        """A list at most VERSIONS_MAX_AGE_S old is used as it is; an older one is read again in the
        background and still used while at most 3x that old; past that (an edge idle for a while) the
        answer waits for the new list, so a version unloaded meanwhile is never taken for served."""
        age = time.monotonic() - self.fetched_at
        if age > VERSIONS_MAX_AGE_S:
            if self._refreshing is None or self._refreshing.done():
                self._refreshing = asyncio.ensure_future(self.refresh())
            if not self.defaults or age > 3 * VERSIONS_MAX_AGE_S:
                await asyncio.shield(self._refreshing)

    async def default(self, model: str) -> str | None:
        await self._fresh()
        return self.defaults.get(model)

    async def serves(self, model: str, version: str) -> bool:
        """Whether some replica still serves `version` of `model` (a pinned answer is replayed only then)."""
        await self._fresh()
        return version in self.served.get(model, ())


class ResponseCache:
    def __init__(self, ttl_s: float, max_bytes: int, versions: ServedVersions, shared_address: str = ""):
        self.ttl_s, self.max_bytes = ttl_s, max_bytes
        self.versions = versions
        self._memory: OrderedDict[bytes, tuple[Entry, float, int]] = OrderedDict()
        self.bytes = 0
        self._channel = channel(shared_address) if shared_address else None
        self._shared = cache_pb2_grpc.CacheStub(self._channel) if self._channel else None
        self._puts: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    async def close(self) -> None:
        for task in list(self._puts):
            task.cancel()
        if self._channel is not None:
            await self._channel.close()

    async def get(self, key: bytes, pinned_version: str) -> Entry | None:
        now = time.monotonic()
        tier = "memory"
        found = self._memory.get(key)
        entry: Entry | None = None
        if found is not None and found[1] > now:
            self._memory.move_to_end(key)
            entry = found[0]
        elif found is not None:
            self._drop(key)
        if entry is None and self._shared is not None:
            tier, (entry, shared_size) = "shared", await self._get_shared(key)
            if entry is not None:
                self._remember(key, entry, now, shared_size)
        if entry is None:
            RESPONSE_CACHE.labels("miss").inc()
            return None
        # An answer is replayed only while its version is what the request would get: the model's
        # default, or the pinned version while some replica still serves it (else the request's 404).
        current = (await self.versions.serves(entry.model, pinned_version) if pinned_version
                   else await self.versions.default(entry.model) == entry.version)
        if not current:
            self._drop(key)
            RESPONSE_CACHE.labels("stale_version").inc()
            return None
        RESPONSE_CACHE.labels(f"hit_{tier}").inc()
        return entry

    def put(self, key: bytes, entry: Entry) -> None:
        """Keep an answer in memory now, and in the shared tier in the background."""
        value = json.dumps({"body": entry.body, "model": entry.model, "version": entry.version}).encode()
        self._remember(key, entry, time.monotonic(), len(value))
        RESPONSE_CACHE.labels("stored").inc()
        if self._shared is not None:
            task = asyncio.ensure_future(self._put_shared(key, value))
            self._puts.add(task)
            task.add_done_callback(self._puts.discard)

    def _remember(self, key: bytes, entry: Entry, now: float, size: int) -> None:
        """size: the entry's JSON bytes (as stored in the shared tier)."""
        if key in self._memory:
            self._drop(key)
        if size > self.max_bytes:
            return
        self._memory[key] = (entry, now + self.ttl_s, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._memory)))

    def _drop(self, key: bytes) -> None:
        _, _, size = self._memory.pop(key)
        self.bytes -= size

    async def _get_shared(self, key: bytes) -> tuple[Entry | None, int]:
        """The shared tier's entry and its size in bytes, or (None, 0)."""
        assert self._shared is not None
        try:
            reply = await self._shared.GetResponse(cache_pb2.GetResponseRequest(key=key), timeout=SHARED_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            RESPONSE_CACHE.labels("shared_error").inc()
            log.debug("response cache: shared tier %s", err.code().name)
            return None, 0
        if not reply.found:
            return None, 0
        with contextlib.suppress(ValueError, KeyError, TypeError):
            raw = json.loads(reply.value)
            return Entry(raw["body"], raw["model"], raw["version"]), len(reply.value)
        return None, 0

    async def _put_shared(self, key: bytes, value: bytes) -> None:
        assert self._shared is not None
        try:
            await self._shared.PutResponse(cache_pb2.PutResponseRequest(key=key, value=value, ttl_s=self.ttl_s),
                                           timeout=2.0)
        except grpc.aio.AioRpcError as err:
            RESPONSE_CACHE.labels("shared_error").inc()
            log.debug("response cache: shared tier store %s", err.code().name)


def blocked_by(policy: ContentPolicy, entry: Entry) -> bool:
    """A cached answer the output rules now in force would cut: answered afresh (and cut) instead."""
    if not policy.output:
        return False
    texts = [c.get("text") or (c.get("message") or {}).get("content") or "" for c in entry.body["choices"]]
    texts += [(c.get("message") or {}).get("reasoning_content") or "" for c in entry.body["choices"]]
    texts += [t for c in entry.body["choices"] for t in _alternatives(c.get("logprobs"))]
    return any(policy.first_match(t, policy.output) for t in texts)


def _alternatives(logprobs: dict[str, Any] | None) -> list[str]:
    """The top_logprobs alternatives' texts of a cached choice (chat's or completions' shape)."""
    if not logprobs:
        return []
    if "content" in logprobs:
        return [t["token"] for e in logprobs["content"] or [] for t in e.get("top_logprobs") or []]
    return [t for top in logprobs.get("top_logprobs") or [] if top for t in top]
