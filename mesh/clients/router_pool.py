"""RouterPool: the edge's way to every router, with the RouterClient interface.

Requests are spread over the routers (fewest of this edge's calls in flight, ties in turn) that answer their
health checks; a probe every `probe_interval_s` follows each one, and with Consul the list itself follows the
`router` registrations.  When a router dies mid-stream (its process gone, or silent past the channel's
keepalive), the stream goes on through another router from the prompt and the token ids the client already
has (`resume_ids`), on the same model version: the caller sees one stream, no token lost or repeated, exactly
as a router resumes a stream when an engine dies.  A status the router itself answered (it carries
grpcutil.ANSWERED) is the answer about the request and is raised as it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh.clients.router_client import (
    Delta,
    GenerateSpec,
    LoraCard,
    Message,
    ModelCard,
    ModelRouting,
    RouterClient,
    ServedBy,
    TokenizeSpec,
    Tokens,
    VersionLoaded,
)
from mesh.discovery import Discovery
from mesh.grpcutil import answered

log = logging.getLogger(__name__)

# How a call fails when its router, not the request, is the problem (and no status was answered).
_TRANSPORT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                        grpc.StatusCode.CANCELLED})


def router_failed(err: grpc.aio.AioRpcError) -> bool:
    """True when `err` says the router went away, not that it refused the request."""
    return err.code() in _TRANSPORT and not answered(err)


# Health probes missed in a row before a router counts as down: its waiting streams move, new calls avoid it.
DOWN_AFTER = 2


@dataclasses.dataclass
class _Router:
    client: RouterClient
    misses: int = 0                    # health probes missed in a row
    in_flight: int = 0

    @property
    def up(self) -> bool:
        return self.misses < DOWN_AFTER


class _RouterDown(Exception):
    """The router a call waits on stopped answering its health probes (a hung process)."""


class RouterPool:
    def __init__(self, addresses: Sequence[str], discovery: Discovery | None = None, probe_interval_s: float = 1.0,
                 max_attempts: int = 3, on_failover: Callable[[str], None] | None = None):
        if not addresses and discovery is None:
            raise ValueError("the edge needs at least one router address (--router) or Consul discovery")
        self._routers: dict[str, _Router] = {a: _Router(RouterClient(a)) for a in addresses}
        self._discovery = discovery
        self._probe_interval_s = probe_interval_s
        self._max_attempts = max_attempts
        self._on_failover = on_failover or (lambda address: None)
        self._turn = 0
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def address(self) -> str:
        return ",".join(self._routers)

    def start(self) -> None:
        """Follow the routers' health (and Consul's list); call on the event loop."""
        if not self._tasks:
            self._tasks.append(asyncio.create_task(self._probe()))
            if self._discovery is not None:
                self._tasks.append(asyncio.create_task(self._follow(self._discovery)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(r.client.close() for r in self._routers.values()), return_exceptions=True)

    async def _follow(self, discovery: Discovery) -> None:
        async for endpoints in discovery.watch("router"):
            found = {e.address for e in endpoints}
            for address in found - set(self._routers):
                self._routers[address] = _Router(RouterClient(address))
                log.info("router %s joined", address)
            for address in set(self._routers) - found:
                if found:                       # an empty list is an outage of the registry, not of every router
                    gone = self._routers.pop(address)
                    log.info("router %s left", address)
                    self._tasks.append(asyncio.create_task(_close_later(gone.client, 60.0)))

    async def _probe(self) -> None:
        while True:
            await asyncio.gather(*(self._check(r) for r in list(self._routers.values())))
            await asyncio.sleep(self._probe_interval_s)

    async def _check(self, router: _Router) -> None:
        was = router.up
        serving = await _serving(router.client, timeout=max(0.5, self._probe_interval_s))
        router.misses = 0 if serving else router.misses + 1
        if was != router.up:
            log.warning("router %s is %s", router.client.address, "back" if router.up else "not answering")

    def _pick(self, avoid: set[str]) -> _Router | None:
        """The router with the fewest calls in flight, among those up and not failed for this call;
        when none is up, any not yet failed (a probe may lag behind a restart)."""
        candidates = [r for a, r in self._routers.items() if a not in avoid]
        usable = [r for r in candidates if r.up] or candidates
        if not usable:
            return None
        self._turn += 1
        least = min(r.in_flight for r in usable)
        tied = [r for r in usable if r.in_flight == least]
        return tied[self._turn % len(tied)]

    async def healthy(self) -> bool:
        """True when a router reports SERVING (the mesh behind it is ready)."""
        replies = await asyncio.gather(*(_serving(r.client) for r in list(self._routers.values())))
        return any(replies)

    async def generate(self, spec: GenerateSpec, timeout: float | None = None,
                       extra_metadata: Sequence[tuple[str, str]] = ()) -> AsyncIterator[Delta]:
        """RouterClient.generate over the pool, resuming on another router when one dies mid-call."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        sent: list[int] = []
        served: ServedBy | None = None
        failed: set[str] = set()
        while True:
            router = self._pick(failed)
            if router is None:
                raise _no_router(failed)
            call = spec if not failed else _resumed(spec, served, len(failed))
            left = None if deadline is None else max(0.001, deadline - loop.time())
            router.in_flight += 1
            deltas = router.client.generate(call, timeout=left, extra_metadata=extra_metadata, resume_ids=sent)
            try:
                while True:
                    try:
                        delta = await _next(deltas, router)
                    except StopAsyncIteration:
                        return
                    sent.extend(delta.ids)
                    served = delta.served_by or served
                    yield delta
            except (grpc.aio.AioRpcError, _RouterDown) as exc:
                why = "stopped answering its health checks" if isinstance(exc, _RouterDown) else \
                    f"failed ({exc.code().name}: {exc.details()})"
                if isinstance(exc, grpc.aio.AioRpcError) and not router_failed(exc) or \
                        len(failed) + 1 >= self._max_attempts:
                    raise
                address = router.client.address
                failed.add(address)
                router.misses = max(router.misses, DOWN_AFTER)
                self._on_failover(address)
                log.warning("request %s: router %s %s after %d token(s); resuming on another router",
                            spec.request_id, address, why, len(sent))
            finally:
                router.in_flight -= 1
                await deltas.aclose()

    async def _first(self, what: Callable[[RouterClient], Any]) -> Any:
        """`what(client)` from the first router that answers (up ones first)."""
        routers = sorted(self._routers.values(), key=lambda r: not r.up)
        last: grpc.aio.AioRpcError | None = None
        for router in routers:
            try:
                return await what(router.client)
            except grpc.aio.AioRpcError as err:
                if not router_failed(err) and err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                last = err
        if last is None:
            raise _no_router(set())
        raise last

    async def state(self, timeout: float = 2.0) -> dict[str, Any]:
        """A ready router's view of the mesh (RouterClient.state), plus every router's own state."""
        routers = list(self._routers.values())
        states = await asyncio.gather(*(r.client.state(timeout) for r in routers), return_exceptions=True)
        listed = [{"address": r.client.address,
                   "state": ("ready" if s["ready"] else "not ready") if isinstance(s, dict)
                   else f"unreachable: {s.code().name}" if isinstance(s, grpc.aio.AioRpcError) else "unreachable"}
                  for r, s in zip(routers, states, strict=True)]
        views = [s for s in states if isinstance(s, dict)]
        if not views:
            raise next((s for s in states if isinstance(s, grpc.aio.AioRpcError)), None) or _no_router(set())
        view = next((s for s in views if s["ready"]), views[0])
        events = sorted((e for s in views for e in s.get("events", [])), key=lambda e: e["unix_ms"])[-100:]
        return {**view, "ready": any(s["ready"] for s in views), "routers": listed, "events": events}

    async def models(self, timeout: float = 5.0) -> list[ModelCard]:
        result: list[ModelCard] = await self._first(lambda c: c.models(timeout))
        return result

    async def tokenize(self, spec: TokenizeSpec, timeout: float = 30.0) -> Tokens:
        result: Tokens = await self._first(lambda c: c.tokenize(spec, timeout))
        return result

    async def detokenize(self, model: str, ids: Sequence[int], timeout: float = 30.0) -> str:
        result: str = await self._first(lambda c: c.detokenize(model, ids, timeout))
        return result

    async def store_turn(self, spec: GenerateSpec, answer: Message, timeout: float = 10.0) -> None:
        await self._first(lambda c: c.store_turn(spec, answer, timeout))

    async def forget_conversation(self, session_id: str, tenant: str = "", timeout: float = 10.0) -> bool:
        result: bool = await self._first(lambda c: c.forget_conversation(session_id, tenant, timeout))
        return result

    async def model_routing(self, model: str, timeout: float = 5.0) -> ModelRouting:
        result: ModelRouting = await self._first(lambda c: c.model_routing(model, timeout))
        return result

    async def load_model_version(self, model: str, version: str, source: str, activate: bool = True,
                                 ) -> VersionLoaded:
        """One router loads the version on every engine; then every other router takes the new default."""
        loaded: VersionLoaded = await self._first(lambda c: c.load_model_version(model, version, source, activate))
        if activate:
            await self.set_model_routing(model, version)
        return loaded

    async def lora_adapters(self, key: str = "") -> list[LoraCard]:
        """`key`, on these three: an API or admin key for a caller other than the edge (`infermesh lora`)."""
        result: list[LoraCard] = await self._first(lambda c: c.lora_adapters(key=key))
        return result

    async def load_lora_adapter(self, name: str, path: str, model: str = "", replica: str = "", key: str = ""
                                ) -> list[LoraCard]:
        """One router loads the adapter on a replica; then every router knows it (to load it elsewhere later)."""
        cards: list[LoraCard] = await self._first(lambda c: c.load_lora_adapter(name, path, model, replica, key=key))
        holder = next((c.replicas[0] for c in cards if c.name == name and c.replicas), replica)
        await self._everywhere(lambda c: c.load_lora_adapter(name, path, model, holder, key=key))
        return cards

    async def unload_lora_adapter(self, name: str, key: str = "") -> list[LoraCard]:
        """Every router forgets the adapter and unloads it from the replicas it knows hold it; NOT_FOUND when
        no router knew it, and another refusal as it is."""
        routers = list(self._routers.values())
        replies = await asyncio.gather(*(r.client.unload_lora_adapter(name, key=key) for r in routers),
                                       return_exceptions=True)
        for reply in replies:
            if isinstance(reply, grpc.aio.AioRpcError) and not router_failed(reply) \
                    and reply.code() != grpc.StatusCode.NOT_FOUND:
                raise reply
        done: list[list[LoraCard]] = [r for r in replies if not isinstance(r, BaseException)]
        if not done:
            raise next(r for r in replies if isinstance(r, BaseException))
        return min(done, key=len)

    async def drain_replica(self, replica_id: str) -> int:
        """Every router stops sending to the replica and drops it once its engine has drained."""
        finished: int = max(await self._everywhere(lambda c: c.drain_replica(replica_id)))
        return finished

    async def add_replica(self, replica_id: str, address: str, region: str = "") -> None:
        await self._everywhere(lambda c: c.add_replica(replica_id, address, region))

    async def _everywhere(self, what: Callable[[RouterClient], Any]) -> list[Any]:
        """`what(client)` on every router at once; a router that cannot be reached is skipped with a
        warning, a refusal is raised, and so is the last failure when no router answered."""
        routers = list(self._routers.values())
        replies = await asyncio.gather(*(what(r.client) for r in routers), return_exceptions=True)
        for r, reply in zip(routers, replies, strict=True):
            if isinstance(reply, grpc.aio.AioRpcError) and not router_failed(reply):
                raise reply
            if isinstance(reply, BaseException):
                log.warning("router %s missed an admin change: %s", r.client.address, reply)
        done = [reply for reply in replies if not isinstance(reply, BaseException)]
        if not done:
            raise next(r for r in replies if isinstance(r, BaseException))
        return done

    async def set_model_routing(self, model: str, default_version: str = "", canary: dict[str, float] | None = None,
                                timeout: float = 5.0, shadow: tuple[str, float] | None = None) -> ModelRouting:
        """Every router takes the change (each keeps its own routing table); one that cannot be
        reached is skipped with a warning, and the change is refused only when none took it."""
        done: list[ModelRouting] = await self._everywhere(
            lambda c: c.set_model_routing(model, default_version, canary, timeout, shadow))
        return done[0]


async def _next(deltas: AsyncIterator[Delta], router: _Router) -> Delta:
    """The call's next delta; _RouterDown if its router goes down (by its probes) while we wait."""
    pending = asyncio.ensure_future(deltas.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=0.5)
            if done:
                return pending.result()
            if not router.up:
                raise _RouterDown
    finally:
        if not pending.done():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)


def _resumed(spec: GenerateSpec, served: ServedBy | None, retry: int) -> GenerateSpec:
    """The call that continues `spec` elsewhere: on the model version that produced the tokens sent,
    without the prompt's logprobs (they went out with the first message), under a request id of its
    own (the dead router's engine call may not have ended yet; an engine refuses an id in flight)."""
    changed: dict[str, Any] = {"request_id": f"{spec.request_id}~{retry}" if spec.request_id else ""}
    if served is not None:
        changed.update(sampling=dataclasses.replace(spec.sampling, prompt_logprobs=False), model=served.model,
                       model_version=served.model_version)
    return dataclasses.replace(spec, **changed)


async def _close_later(client: RouterClient, delay_s: float) -> None:
    """Close a departed router's channel once the calls still on it have had time to end."""
    await asyncio.sleep(delay_s)
    await client.close()


async def _serving(client: RouterClient, timeout: float = 1.0) -> bool:
    try:
        reply = await health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.aio.AioRpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _no_router(failed: set[str]) -> grpc.aio.AioRpcError:
    why = f"every router failed for this request ({', '.join(sorted(failed))})" if failed else "no router is known"
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details=f"{why}; retry shortly")


Routers = RouterClient | RouterPool      # what the edge calls: one router (tests, tools) or the pool
