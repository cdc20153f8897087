"""A Consul agent double for tests: the documented HTTP API endpoints infermesh uses, in one process.

No Consul agent can be installed where these tests run, so ConsulDiscovery is tested against this
stdlib HTTP server, written from Consul's HTTP API documentation:

- PUT /v1/agent/service/register: Name, ID, Address, Port, Tags, Meta, Check / Checks; keys are matched
  case-insensitively and snake_case aliases (grpc_use_tls, deregister_critical_service_after) are
  accepted, as the agent does; malformed registrations get 400 with a message.
- PUT /v1/agent/service/deregister/:id (404 for an unknown id), GET /v1/agent/services,
  GET /v1/agent/checks, GET /v1/status/leader.
- GET /v1/health/service/:name with passing, tag, index and wait: a blocking query holds the request
  until the service's index moves past `index` or `wait` (+ up to wait/16 of jitter, capped at 10m)
  elapses, and answers the documented shape [{Node, Service, Checks}] with an X-Consul-Index header.
- Checks really run: gRPC (grpc.health.v1 Check; SERVING is passing, anything else or an error is
  critical; GRPCUseTLS with TLSServerName presents the certificate in `tls_dir`, as an agent with
  tls.defaults ca_file/cert_file/key_file does), HTTP (2xx passing, 429 warning, else critical) and
  TCP, every Interval (at least 1s, as in Consul) after a random stagger; a new check starts critical
  unless the registration sets Status (re-registering keeps a check's status, as the agent does);
  DeregisterCriticalServiceAfter removes a service whose check stayed critical that long (Consul's
  floor of 1m, `reap_min_s`, can be lowered for tests). TTL checks keep the status they are given.
- stop() drops the listener and every open connection (in-flight blocking queries included), like a
  killed agent; start() again serves the same port with the services restored and their checks back
  at critical, as an agent restoring its persisted services does.

Not implemented (400 says so): script/docker checks, `filter` expressions, other datacenters.
Test-only: set_check_status(), rewind_index(), checks_of(), index, health_queries, query_indexes, tokens_seen.
"""

from __future__ import annotations

import json
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh.credentials import MeshTLS

STATUSES = ("passing", "warning", "critical")
MAX_WAIT_S = 600.0
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_META_KEY = re.compile(r"^[a-zA-Z0-9_-]+$")


class BadRequest(Exception):
    """Answered as 400 with this message, as the agent does for a malformed request."""


class ServerError(Exception):
    """Answered as 500 with this message."""


def parse_duration(value: Any) -> float:
    """A Go duration ("2s", "1m30s", "500ms") or a number of nanoseconds -> seconds."""
    if isinstance(value, bool):
        raise BadRequest(f"Request decode failed: time: invalid duration {value!r}")
    if isinstance(value, int | float):
        return float(value) / 1e9
    text = str(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", text)
    if text in ("0", ""):
        return 0.0
    if not parts or "".join(n + u for n, u in parts) != text:
        raise BadRequest(f'Request decode failed: time: invalid duration "{text}"')
    return sum(float(n) * _UNITS[u] for n, u in parts)


def _norm(obj: Any) -> dict[str, Any]:
    # The agent matches field names case-insensitively and translates snake_case aliases.
    if not isinstance(obj, dict):
        raise BadRequest(f"Request decode failed: expected an object, got {type(obj).__name__}")
    return {k.lower().replace("_", ""): v for k, v in obj.items()}


@dataclass
class Check:
    check_id: str
    name: str
    service_id: str
    service_name: str
    kind: str                      # grpc, http, tcp, ttl
    target: str
    interval_s: float
    timeout_s: float
    deregister_after_s: float | None
    use_tls: bool = False          # GRPCUseTLS
    tls_server_name: str = ""      # TLSServerName: the name to verify instead of the address
    status: str = "critical"
    output: str = ""
    critical_since: float | None = None
    create_index: int = 0
    modify_index: int = 0
    stop: threading.Event = field(default_factory=threading.Event, repr=False)

    def json(self, node: str, tags: list[str]) -> dict[str, Any]:
        return {"Node": node, "CheckID": self.check_id, "Name": self.name, "Status": self.status, "Notes": "",
                "Output": self.output, "ServiceID": self.service_id, "ServiceName": self.service_name,
                "ServiceTags": tags, "Type": self.kind, "Interval": f"{self.interval_s:g}s" if self.interval_s else "",
                "Timeout": f"{self.timeout_s:g}s", "ExposedPort": 0, "Definition": {},
                "CreateIndex": self.create_index, "ModifyIndex": self.modify_index}


@dataclass
class Service:
    id: str
    name: str
    address: str
    port: int
    tags: list[str]
    meta: dict[str, str]
    create_index: int
    modify_index: int
    check_ids: list[str] = field(default_factory=list)

    def json(self) -> dict[str, Any]:
        return {"ID": self.id, "Service": self.name, "Tags": self.tags, "Address": self.address, "Meta": self.meta,
                "Port": self.port, "Weights": {"Passing": 1, "Warning": 1}, "EnableTagOverride": False,
                "CreateIndex": self.create_index, "ModifyIndex": self.modify_index}


def _parse_check(raw: Any, service: Service, number: int, total: int, min_interval_s: float) -> Check:
    c = _norm(raw)
    kinds = [k for k in ("grpc", "http", "tcp", "ttl") if c.get(k)]
    if any(c.get(k) for k in ("args", "script", "dockercontainerid", "h2ping", "udp", "aliasservice")):
        raise BadRequest("Invalid check: the Consul double runs only gRPC, HTTP, TCP and TTL checks")
    if len(kinds) != 1:
        raise BadRequest("Invalid check: exactly one of GRPC, HTTP, TCP or TTL must be set")
    kind = kinds[0]
    interval = parse_duration(c.get("interval", 0))
    ttl = parse_duration(c["ttl"]) if kind == "ttl" else 0.0
    if kind != "ttl" and interval <= 0:
        raise BadRequest("Invalid check: Interval must be > 0 for Script, HTTP, H2PING, TCP, UDP or GRPC checks")
    if kind == "ttl" and ttl <= 0:
        raise BadRequest("Invalid check: TTL must be > 0 for TTL checks")
    status = c.get("status") or "critical"
    if status not in STATUSES:
        raise BadRequest("Status for checks must 'passing', 'warning', 'critical'")
    if kind == "grpc" and not re.fullmatch(r"[^/\s]+:\d+(/\S*)?", str(c["grpc"])):
        raise BadRequest(f"Invalid check: GRPC must be HOST:PORT[/SERVICE], got {c['grpc']!r}")
    dcsa = parse_duration(c["deregistercriticalserviceafter"]) if c.get("deregistercriticalserviceafter") else None
    default_id = f"service:{service.id}" + (f":{number}" if total > 1 else "")
    return Check(check_id=str(c.get("checkid") or c.get("id") or default_id),
                 name=str(c.get("name") or f"Service '{service.name}' check"), service_id=service.id,
                 service_name=service.name, kind=kind, target=str(c[kind]),
                 interval_s=max(interval, min_interval_s) if kind != "ttl" else 0.0,
                 timeout_s=parse_duration(c["timeout"]) if c.get("timeout") else 10.0,
                 deregister_after_s=dcsa, use_tls=bool(c.get("grpcusetls")),
                 tls_server_name=str(c.get("tlsservername") or ""), status=status)


def _parse_service(body: bytes, index: int) -> tuple[Service, list[Any]]:
    try:
        s = _norm(json.loads(body or b"null"))
    except json.JSONDecodeError as exc:
        raise BadRequest(f"Request decode failed: {exc}") from None
    name = s.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest("Missing service name")
    port = s.get("port", 0)
    if not isinstance(port, int) or isinstance(port, bool):
        raise BadRequest(f"Request decode failed: Port: cannot decode {port!r} as an integer")
    if not 0 <= port < 65536:
        raise BadRequest(f"Invalid service port {port}")
    tags, meta = s.get("tags") or [], s.get("meta") or {}
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise BadRequest("Request decode failed: Tags must be a list of strings")
    if not isinstance(meta, dict) or len(meta) > 64:
        raise BadRequest("Invalid Service Meta: Meta must be an object of at most 64 pairs")
    for k, v in meta.items():
        if not _META_KEY.match(k) or len(k) > 128 or k.startswith("consul-"):
            raise BadRequest(f"Invalid Service Meta: Key {k!r} is invalid")
        if not isinstance(v, str) or len(v) > 512:
            raise BadRequest(f"Invalid Service Meta: Value for key {k!r} must be a string of at most 512 characters")
    checks = ([s["check"]] if s.get("check") else []) + list(s.get("checks") or [])
    sid = s.get("id") or name
    return Service(str(sid), name, str(s.get("address") or ""), port, tags, dict(meta), index, index), checks


def _grpc_channel(address: str, check: Check, tls: MeshTLS | None) -> grpc.Channel:
    if not check.use_tls:
        return grpc.insecure_channel(address)
    creds = grpc.ssl_channel_credentials(tls.root, tls.key, tls.cert) if tls else grpc.ssl_channel_credentials()
    options = [("grpc.ssl_target_name_override", check.tls_server_name)] if check.tls_server_name else []
    return grpc.secure_channel(address, creds, options=options)


def probe(check: Check, tls: MeshTLS | None = None) -> tuple[str, str]:
    """Run one check the way the agent does -> (status, output); `tls` is the agent's own certificate."""
    if check.kind == "grpc":
        address, _, service = check.target.partition("/")
        try:
            with _grpc_channel(address, check, tls) as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=check.timeout_s)
        except grpc.RpcError as err:
            return "critical", f"gRPC check {check.target}: failed: rpc error: {err.code()}"  # type: ignore[attr-defined]
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            return "passing", f"gRPC check {check.target}: success"
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return "critical", f"gRPC check {check.target}: failed: status {name}"
    if check.kind == "http":
        try:
            with urllib.request.urlopen(check.target, timeout=check.timeout_s) as reply:
                code = reply.status
        except urllib.error.HTTPError as err:
            code = err.code
        except OSError as exc:
            return "critical", f"Get {check.target}: {exc}"
        status = "passing" if 200 <= code < 300 else "warning" if code == 429 else "critical"
        return status, f"HTTP GET {check.target}: {code}"
    host, _, port = check.target.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=check.timeout_s).close()
    except OSError as exc:
        return "critical", f"dial tcp {check.target}: {exc}"
    return "passing", f"TCP connect {check.target}: Success"


class ConsulDouble:
    """One agent (node `consul-double`, datacenter dc1, itself the leader). Use as a context manager."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, min_interval_s: float = 1.0,
                 reap_min_s: float = 60.0, required_token: str | None = None, tls_dir: str = ""):
        self.host, self.port = host, port
        self.tls_dir = tls_dir             # ca.crt, tls.crt, tls.key for GRPCUseTLS checks; read at each run
        self.node, self.datacenter = "consul-double", "dc1"
        self.min_interval_s, self.reap_min_s = min_interval_s, reap_min_s
        self.required_token = required_token
        self.tokens_seen: list[str] = []
        self.health_queries = 0            # GET /v1/health/service requests received
        self.query_indexes: list[int] = []  # ...and the `index` each one asked for
        self._cond = threading.Condition()
        self._index = 10
        self._service_index: dict[str, int] = {}
        self._services: dict[str, Service] = {}
        self._checks: dict[str, Check] = {}
        self._server: ThreadingHTTPServer | None = None
        self._serving = False
        self._connections: set[socket.socket] = set()

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> ConsulDouble:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def start(self) -> None:
        handler = type("Handler", (_Handler,), {"double": self})
        server = ThreadingHTTPServer((self.host, self.port), handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        with self._cond:
            self._server, self._serving = server, True
            for check in self._checks.values():    # a restarted agent's restored checks start over
                if check.kind != "ttl":
                    self._set_status(check, "critical", "restored; not run yet")
                self._start_runner(check)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                         name="consul-double").start()

    def stop(self) -> None:
        with self._cond:
            server, self._server, self._serving = self._server, None, False
            for check in self._checks.values():
                check.stop.set()
            connections = list(self._connections)
            self._cond.notify_all()
        if server is None:
            return
        server.shutdown()
        server.server_close()
        for conn in connections:            # like a killed agent: in-flight requests get a reset
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- test-only views and controls ----------------------------------------------------------
    @property
    def index(self) -> int:
        with self._cond:
            return self._index

    def checks_of(self, service_id: str) -> list[Check]:
        with self._cond:
            return [c for c in self._checks.values() if c.service_id == service_id]

    def set_check_status(self, check_id: str, status: str, output: str = "set by test") -> None:
        with self._cond:
            self._set_status(self._checks[check_id], status, output)

    def rewind_index(self, to: int) -> None:
        """Move the raft index backwards, as restoring a snapshot or a reset cluster does."""
        with self._cond:
            self._index = to
            self._service_index = {k: min(v, to) for k, v in self._service_index.items()}

    # -- state (callers hold self._cond) ---------------------------------------------------------
    def _bump(self, service_name: str) -> int:
        self._index += 1
        self._service_index[service_name] = self._index
        self._cond.notify_all()
        return self._index

    def _set_status(self, check: Check, status: str, output: str) -> None:
        if status != "critical":
            check.critical_since = None
        elif check.critical_since is None:
            check.critical_since = time.monotonic()
        check.output = output
        if status != check.status:          # like the agent, only a status change is a catalog write
            check.status = status
            check.modify_index = self._bump(check.service_name)

    def _start_runner(self, check: Check) -> None:
        if check.kind == "ttl":
            return
        check.stop = stop = threading.Event()     # the previous runner, if any, holds the old (set) one
        threading.Thread(target=self._run_check, args=(check, stop), daemon=True,
                         name=f"check-{check.check_id}").start()

    def _run_check(self, check: Check, stop: threading.Event) -> None:
        if stop.wait(random.uniform(0, check.interval_s)):   # the agent staggers first runs
            return
        while True:
            try:
                status, output = probe(check, MeshTLS.load(self.tls_dir) if self.tls_dir and check.use_tls else None)
            except OSError as exc:
                status, output = "critical", f"agent TLS: {exc}"
            with self._cond:
                if stop.is_set():
                    return
                self._set_status(check, status, output)
                since, limit = check.critical_since, check.deregister_after_s
                if since is not None and limit is not None and time.monotonic() - since > max(limit, self.reap_min_s):
                    self._deregister(check.service_id)
                    return
            if stop.wait(check.interval_s):
                return

    def _register(self, body: bytes) -> None:
        with self._cond:
            service, raw_checks = _parse_service(body, self._index + 1)
            checks = [_parse_check(raw, service, i + 1, len(raw_checks), self.min_interval_s)
                      for i, raw in enumerate(raw_checks)]
            old = self._services.get(service.id)
            previous: dict[str, Check] = {}
            if old is not None:
                service.create_index = old.create_index
                for cid in old.check_ids:
                    previous[cid] = self._checks.pop(cid)
                    previous[cid].stop.set()
            index = self._bump(service.name)
            service.modify_index = index
            for check in checks:
                check.create_index = check.modify_index = index
                if check.check_id in previous:     # the agent restores a re-registered check's state
                    prev = previous[check.check_id]
                    check.status, check.output = prev.status, prev.output
                    check.create_index = prev.create_index
                self._checks[check.check_id] = check
                service.check_ids.append(check.check_id)
                if check.status == "critical":
                    check.critical_since = time.monotonic()
                if self._serving:
                    self._start_runner(check)
            self._services[service.id] = service

    def _deregister(self, service_id: str) -> bool:
        service = self._services.pop(service_id, None)
        if service is None:
            return False
        for cid in service.check_ids:
            self._checks.pop(cid).stop.set()
        self._bump(service.name)
        return True

    def _health(self, name: str, passing: bool, tags: list[str]) -> list[dict[str, Any]]:
        node = {"ID": "0b5cf2b6-4b07-4a8e-9a0c-6f1d6ab1c9e1", "Node": self.node, "Address": self.host,
                "Datacenter": self.datacenter, "TaggedAddresses": {"lan": self.host, "wan": self.host},
                "Meta": {"consul-network-segment": ""}, "CreateIndex": 5, "ModifyIndex": 5}
        serf = {"Node": self.node, "CheckID": "serfHealth", "Name": "Serf Health Status", "Status": "passing",
                "Notes": "", "Output": "Agent alive and reachable", "ServiceID": "", "ServiceName": "",
                "ServiceTags": [], "Type": "", "CreateIndex": 5, "ModifyIndex": 5}
        entries = []
        for service in sorted(self._services.values(), key=lambda s: s.id):
            if service.name != name or not all(t in service.tags for t in tags):
                continue
            checks = [serf] + [self._checks[cid].json(self.node, service.tags) for cid in service.check_ids]
            if passing and any(c["Status"] != "passing" for c in checks):
                continue
            entries.append({"Node": node, "Service": service.json(), "Checks": checks})
        return entries

    def _blocking_health(self, name: str, query: dict[str, list[str]]) -> tuple[int, list[dict[str, Any]]] | None:
        """None when the agent stopped while the query was held."""
        if query.get("filter"):
            raise BadRequest("the Consul double does not implement filter expressions")
        dc = query.get("dc", [self.datacenter])[0]
        if dc != self.datacenter:
            raise ServerError("No path to datacenter")
        passing_arg = query.get("passing", ["false"])[0].lower()
        passing = passing_arg in ("", "1", "t", "true")
        try:
            min_index = int(query.get("index", ["0"])[0])
        except ValueError:
            raise BadRequest("Invalid index") from None
        with self._cond:
            self.health_queries += 1
            self.query_indexes.append(min_index)
        wait = parse_duration(query["wait"][0]) if "wait" in query else 300.0
        wait = min(wait, MAX_WAIT_S)
        deadline = time.monotonic() + wait + random.uniform(0, wait / 16)
        with self._cond:
            while min_index > 0 and self._service_index.get(name, self._index) <= min_index and self._serving:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            if not self._serving:
                return None
            return self._service_index.get(name, self._index), self._health(name, passing, query.get("tag", []))


class _Handler(BaseHTTPRequestHandler):
    double: ConsulDouble
    protocol_version = "HTTP/1.1"          # keep-alive, as requests uses it

    def setup(self) -> None:
        super().setup()
        with self.double._cond:
            self.double._connections.add(self.connection)

    def finish(self) -> None:
        with self.double._cond:
            self.double._connections.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, code: int, body: Any = None, *, text: str = "", index: int | None = None) -> None:
        data = (json.dumps(body) if body is not None else text).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json" if body is not None else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        if index is not None:
            self.send_header("X-Consul-Index", str(index))
            self.send_header("X-Consul-KnownLeader", "true")
            self.send_header("X-Consul-LastContact", "0")
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        double = self.double
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        token = self.headers.get("X-Consul-Token", "")
        if token:
            double.tokens_seen.append(token)
        if double.required_token is not None and token != double.required_token:
            return self._reply(403, text="ACL not found")
        route = url.path
        try:
            if method == "PUT" and route == "/v1/agent/service/register":
                double._register(body)
                return self._reply(200)
            if method == "PUT" and route.startswith("/v1/agent/service/deregister/"):
                sid = urllib.parse.unquote(route.rsplit("/", 1)[1])
                with double._cond:
                    found = double._deregister(sid)
                if not found:
                    return self._reply(404, text=f'Unknown service ID "{sid}". Ensure that the service ID is '
                                                 "passed, not the service name.")
                return self._reply(200)
            if method == "GET" and route.startswith("/v1/health/service/"):
                answer = double._blocking_health(urllib.parse.unquote(route.rsplit("/", 1)[1]), query)
                if answer is None:          # stopped while blocking: drop the connection unanswered
                    self.close_connection = True
                    return None
                return self._reply(200, answer[1], index=answer[0])
            if method == "GET" and route == "/v1/agent/services":
                with double._cond:
                    services = {s.id: {**s.json(), "Datacenter": double.datacenter}
                                for s in double._services.values()}
                return self._reply(200, services)
            if method == "GET" and route == "/v1/agent/checks":
                with double._cond:
                    checks = {c.check_id: c.json(double.node, double._services[c.service_id].tags)
                              for c in double._checks.values()}
                return self._reply(200, checks)
            if method == "GET" and route == "/v1/status/leader":
                return self._reply(200, f"{double.host}:8300")
        except BadRequest as exc:
            return self._reply(400, text=str(exc))
        except ServerError as exc:
            return self._reply(500, text=str(exc))
        return self._reply(404, text="404 page not found")

    def do_GET(self) -> None:
        self._handle("GET")

    def do_PUT(self) -> None:
        self._handle("PUT")
