"""Consul backend: services register with the local agent, the router follows blocking health queries.

Written against Consul's documented HTTP API through py-consul's synchronous (requests) client:
PUT /v1/agent/service/register and /v1/agent/service/deregister/:id, and blocking
GET /v1/health/service/:name?passing&index&wait. py-consul's asyncio variant (`consul.aio`) needs
aiohttp, which infermesh does not install, so the calls run off the event loop: registrations with
asyncio.to_thread (they take milliseconds), blocking queries in daemon threads (see _in_daemon_thread).
The pure pieces (address parsing, check and registration definitions, entry -> Endpoint, index
bookkeeping, backoff) are module functions so unit tests need no agent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, TypeVar

import consul
import requests

from mesh import credentials
from mesh.discovery.backend import Discovery, DiscoveryError
from mesh.discovery.endpoint import Endpoint, HealthCheck, check_weight, join_address, split_address

log = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_AGENT = "127.0.0.1:8500"                # Consul's own default for CONSUL_HTTP_ADDR
RESERVED_META = ("model", "model_version", "region", "replica_id", "weight")
_QUERY_ERRORS = (consul.ConsulException, requests.RequestException, OSError, ValueError)


def parse_agent_address(value: str, ssl: bool = False) -> tuple[str, str, int]:
    """CONSUL_HTTP_ADDR ("host:port", "http://host:port", "https://host:port") -> (scheme, host, port).

    As in Consul's CLI, CONSUL_HTTP_SSL=true (`ssl`) means https when the address names no scheme."""
    value = value.strip() or DEFAULT_AGENT
    scheme, sep, rest = value.partition("://")
    if not sep:
        scheme, rest = ("https" if ssl else "http"), value
    if scheme not in ("http", "https"):
        raise ValueError(f"CONSUL_HTTP_ADDR {value!r}: only http:// and https:// agents are supported")
    rest = rest.rstrip("/")
    if not rest or "/" in rest:
        raise ValueError(f"CONSUL_HTTP_ADDR {value!r} must look like [http[s]://]HOST[:PORT]")
    if rest.endswith("]") or rest.count(":") == 0:      # no port: Consul's HTTP port
        return scheme, rest.strip("[]"), 8500
    host, port = split_address(rest)
    return scheme, host, port


def go_duration(seconds: float) -> str:
    """Seconds -> a Go duration string as Consul parses them: 2 -> "2s", 0.5 -> "500ms"."""
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{max(1, round(seconds * 1000))}ms"


def check_definition(check: HealthCheck, name: str) -> dict[str, Any]:
    """A Consul check definition: GRPC ("host:port") or HTTP, with interval, timeout and
    DeregisterCriticalServiceAfter. py-consul writes Consul's snake_case aliases (grpc_use_tls).
    A process with mesh credentials serves mutual TLS only, so its gRPC check is TLS, verifying the
    mesh name; the agent presents its own mesh certificate (its tls.defaults cert_file/key_file)."""
    interval, timeout = go_duration(check.interval_s), go_duration(check.timeout_s)
    deregister = go_duration(check.deregister_after_s)
    if check.kind == "grpc":
        tls = credentials.current() is not None
        definition = consul.Check.grpc(check.target, interval, use_tls=tls, timeout=timeout, deregister=deregister)
        if tls:
            definition["TLSServerName"] = credentials.MESH_NAME
    else:
        definition = consul.Check.http(check.target, interval, timeout=timeout, deregister=deregister)
    return {"Name": name, **definition}


def registration(endpoint: Endpoint, check: HealthCheck) -> dict[str, Any]:
    """Keyword arguments for py-consul's `agent.service.register`.

    Meta carries what the router needs (model, model_version, region, replica_id, and weight when it is
    not the default 1) plus the endpoint's own meta; tags repeat model/version/region for people reading
    the Consul UI and for `tag` filters."""
    host, port = split_address(endpoint.address)
    meta = dict(endpoint.meta)
    clash = sorted(set(meta) & set(RESERVED_META))
    if clash:
        raise ValueError(f"endpoint meta must not set {', '.join(clash)}: they come from the Endpoint's fields")
    meta.update(model=endpoint.model, model_version=endpoint.model_version, region=endpoint.region,
                replica_id=endpoint.replica_id)
    if endpoint.weight != 1:
        meta["weight"] = f"{endpoint.weight:g}"
    tags = ["infermesh", f"region={endpoint.region}"]
    tags += [f"model={endpoint.model}"] if endpoint.model else []
    tags += [f"version={endpoint.model_version}"] if endpoint.model_version else []
    tags += [t for t in endpoint.tags if t not in tags]
    return {"name": endpoint.service, "service_id": endpoint.replica_id, "address": host, "port": port,
            "tags": tags, "meta": meta, "replace_existing_checks": True,
            "check": check_definition(check, f"{endpoint.service} {endpoint.replica_id} ({check.kind})")}


def to_endpoint(service: str, entry: Mapping[str, Any]) -> Endpoint | None:
    """One /v1/health/service entry -> Endpoint; None when it names no usable address.

    The address is Service.Address, or the node's address when the service registered none (Consul's
    documented fallback); the replica id is Meta.replica_id, else the service ID; the weight is
    Meta.weight, else the service's own Weights.Passing (Consul's DNS weights, 1 unless set)."""
    svc = entry.get("Service") or {}
    node = entry.get("Node") or {}
    host = svc.get("Address") or node.get("Address") or ""
    port = svc.get("Port") or 0
    if not host or not isinstance(port, int) or not 0 < port < 65536:
        return None
    meta = {str(k): str(v) for k, v in (svc.get("Meta") or {}).items()}
    replica_id = meta.pop("replica_id", "") or str(svc.get("ID") or "")
    model, version = meta.pop("model", ""), meta.pop("model_version", "")
    region = meta.pop("region", "") or "local"
    weight = entry_weight(replica_id, meta.pop("weight", None), svc.get("Weights"))
    return Endpoint(service, replica_id, join_address(host, port), model, version, region,
                    tuple(sorted(meta.items())), tuple(str(t) for t in svc.get("Tags") or ()), weight)


def entry_weight(replica_id: str, meta_weight: str | None, weights: object) -> float:
    """A Consul entry's weight: Meta.weight, else Weights.Passing, else 1.  A malformed one is logged
    and read as 1: one bad registration must not blind the router's whole watch (it would otherwise
    fail every query), and serving the replica at the default beats dropping its capacity."""
    value: object = meta_weight
    if value is None and isinstance(weights, Mapping):
        value = weights.get("Passing")
    if value is None:
        return 1.0
    try:
        return check_weight(value, f"consul service {replica_id}")
    except ValueError as exc:
        log.warning("%s; using weight 1", exc)
        return 1.0


def to_endpoints(service: str, entries: Sequence[Mapping[str, Any]] | None) -> list[Endpoint]:
    endpoints = [e for e in (to_endpoint(service, entry) for entry in entries or []) if e is not None]
    return sorted(endpoints, key=lambda e: (e.replica_id, e.address))


def next_index(previous: int, returned: int) -> int:
    """The index for the next blocking query, per Consul's "Blocking Queries" implementation notes:
    an index that went backwards resets to 0 (the next query answers at once), and an index below 1
    becomes 1, so the next query blocks instead of spinning."""
    if returned < previous:
        return 0
    return max(returned, 1)


def backoff_s(failures: int, rand: float, base_s: float = 0.5, cap_s: float = 10.0) -> float:
    """Delay after the `failures`-th failed query in a row: exponential, capped, with equal jitter
    (`rand` in [0, 1)), so routers that lost the agent together do not come back in lockstep."""
    step = min(cap_s, base_s * 2 ** min(failures - 1, 30))
    return step / 2 + step / 2 * rand


async def _in_daemon_thread(call: Callable[[], T]) -> T:
    """Run a blocking call in a daemon thread and await its result.

    Not asyncio.to_thread: a blocking query holds its thread for up to `wait`, and asyncio.run()
    joins the default executor's threads on exit, so a stopping router would hang that long. A
    cancelled query's daemon thread is abandoned; it ends when the agent answers or the timeout hits."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (call(), None)
        except BaseException as exc:  # noqa: BLE001  (handed to the awaiting task)
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:
            pass                        # the loop has closed: nobody is waiting any more

    threading.Thread(target=run, name="consul-query", daemon=True).start()
    return await future


class ConsulDiscovery(Discovery):
    """Discovery through a Consul agent's HTTP API (normally the local agent on 127.0.0.1:8500)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8500, scheme: str = "http", token: str | None = None,
                 *, wait_s: float = 30.0, timeout_s: float = 5.0, min_query_interval_s: float = 0.1,
                 rng: Callable[[], float] = random.random):
        if wait_s <= 0 or timeout_s <= 0 or min_query_interval_s < 0:
            raise ValueError("wait_s and timeout_s must be positive, min_query_interval_s not negative")
        self.agent_url = f"{scheme}://{join_address(host, port)}"
        self._host, self._port, self._scheme, self._token = host, port, scheme, token
        self._wait, self._timeout_s = go_duration(wait_s), timeout_s
        self._min_query_interval_s = min_query_interval_s
        self._rng = rng
        self._agent = self._client()
        self._known: dict[str, list[Endpoint]] = {}
        self._registered: set[str] = set()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **kw: Any) -> ConsulDiscovery:
        """The agent named by CONSUL_HTTP_ADDR (default 127.0.0.1:8500), token CONSUL_HTTP_TOKEN."""
        ssl = environ.get("CONSUL_HTTP_SSL", "").lower() in ("1", "true")
        scheme, host, port = parse_agent_address(environ.get("CONSUL_HTTP_ADDR", ""), ssl=ssl)
        return cls(host, port, scheme, environ.get("CONSUL_HTTP_TOKEN") or None, **kw)

    def _client(self) -> consul.Consul:
        # Note: py-consul lets a CONSUL_HTTP_TOKEN in the environment win over `token`.
        # One client (one requests.Session) per caller thread family: sessions are not meant to be
        # shared between threads. py-consul adds a blocking query's wait (+1/16) to this timeout.
        return consul.Consul(host=self._host, port=self._port, scheme=self._scheme, token=self._token,
                             connections_timeout=self._timeout_s)

    async def leader(self) -> str:
        """The cluster leader's address ("" while there is none): a cheap check that the agent answers."""
        try:
            return str(await asyncio.to_thread(self._agent.status.leader))
        except _QUERY_ERRORS as exc:
            raise DiscoveryError(f"no Consul agent answers at {self.agent_url} (set CONSUL_HTTP_ADDR, or start "
                                 f"one with `consul agent -dev`): {exc}") from exc

    async def register(self, endpoint: Endpoint, check: HealthCheck | None = None) -> None:
        kwargs = registration(endpoint, check or HealthCheck.grpc(endpoint.address))
        try:
            ok = await asyncio.to_thread(lambda: self._agent.agent.service.register(**kwargs))
        except _QUERY_ERRORS as exc:
            raise DiscoveryError(f"cannot register {endpoint.service} {endpoint.replica_id} with the Consul "
                                 f"agent at {self.agent_url}: {exc}") from exc
        if not ok:
            raise DiscoveryError(f"the Consul agent at {self.agent_url} did not accept {endpoint.replica_id}")
        self._registered.add(endpoint.replica_id)
        log.info("registered %s %s (%s) with consul at %s", endpoint.service, endpoint.replica_id,
                 endpoint.address, self.agent_url)

    async def deregister(self, replica_id: str) -> None:
        self._registered.discard(replica_id)
        try:
            known = await asyncio.to_thread(self._agent.agent.service.deregister, replica_id)
        except _QUERY_ERRORS as exc:
            # Not fatal: the agent drops a replica whose check stays critical (deregister_after).
            log.warning("could not deregister %s from consul at %s: %s", replica_id, self.agent_url, exc)
            return
        if not known:                   # 404: the agent had already dropped it
            log.info("%s was not registered in consul at %s", replica_id, self.agent_url)

    async def close(self) -> None:
        if self._registered:
            log.warning("closing with %s still registered in consul", ", ".join(sorted(self._registered)))
        self._agent.http.session.close()

    def endpoints(self, service: str) -> list[Endpoint]:
        return list(self._known.get(service, []))

    async def watch(self, service: str) -> AsyncIterator[list[Endpoint]]:
        client = self._client()        # its own session: the query thread outlives a cancellation
        index, failures, last = 0, 0, None
        started = -math.inf
        while True:
            # Consul's docs ask clients to rate-limit blocking queries: a flapping check bumps the
            # index often, and without a floor this loop would spin with it.
            pause = self._min_query_interval_s - (time.monotonic() - started)
            if pause > 0:
                await asyncio.sleep(pause)
            started = time.monotonic()
            try:
                query = functools.partial(client.health.service, service, passing=True, index=index or None,
                                          wait=self._wait)
                returned, entries = await _in_daemon_thread(query)
                endpoints = to_endpoints(service, entries)
                returned = int(returned)
            except _QUERY_ERRORS as exc:
                failures += 1
                if failures == 1:
                    log.warning("consul at %s is not answering (%s); keeping the last %d %s endpoint(s) and "
                                "retrying", self.agent_url, exc, len(last or []), service)
                # After an outage, ask for the current list at once instead of blocking on an index
                # that may mean nothing to a restarted agent.
                index = 0
                await asyncio.sleep(backoff_s(failures, self._rng()))
                continue
            if failures:
                log.info("consul at %s answers again after %d failed queries", self.agent_url, failures)
                failures = 0
            index = next_index(index, returned)
            if endpoints != last:
                self._known[service] = last = endpoints
                yield list(endpoints)
