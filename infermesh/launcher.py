"""`infermesh up`: start every service as its own process, wait until the mesh is ready,
relay their logs with a service prefix, and stop them all, in order, on SIGINT/SIGTERM.

The services talk mutual TLS by default: the mesh CA (mesh/pki.py, made once under the infermesh
home) signs a leaf per service kind, each service gets `--tls-dir <mesh-ca>/<kind>`, and this
process polls their health with the `client` leaf.  `--insecure-mesh` runs them in plaintext."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import re
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# grpc's fork support restarts its poller in a child between fork and exec (preexec_fn makes _start a real
# fork), where close_fds has already closed the poller's epoll fd: the child then aborts before exec ("epoll_wait
# error: Bad file descriptor", grpc/grpc#43055; seen once starting an edge).  This process forks only to exec,
# so it needs none (set before grpc starts here); the children get the caller's setting back (_start).
_FORK_SUPPORT = os.environ.get("GRPC_ENABLE_FORK_SUPPORT")
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "0"

from prometheus_client import start_http_server  # noqa: E402

from infermesh.supervise import supervise  # noqa: E402
from mesh import credentials  # noqa: E402
from mesh.grpcutil import check_health  # noqa: E402
from mesh.models import canonical, home, served_model  # noqa: E402
from mesh.pki import ensure_mesh_ca  # noqa: E402
from services.cache.config import EMBEDDED, redis_address  # noqa: E402

log = logging.getLogger("launcher")

ROUTER_PORT, TOKENIZER_PORT, CACHE_PORT, ENGINE_BASE_PORT = 50051, 50052, 50053, 50060
ROUTER_BASE_PORT, TOKENIZER_BASE_PORT = 50030, 50040     # router-i / tokenizer-i for i >= 1 (+ i)
HTTP_PORT, HTTP3_PORT = 8000, 8443
ENGINE_METRICS_BASE_PORT = 9100
ROUTER_METRICS_PORT = 9180
TOKENIZER_METRICS_PORT = 9181
CACHE_METRICS_PORT = 9182              # the edge serves /metrics on its HTTP port
LAUNCHER_METRICS_PORT = 9183           # the launcher's own: restarts (infermesh/supervise.py)
ROUTER_METRICS_BASE_PORT, TOKENIZER_METRICS_BASE_PORT = 9160, 9170   # router-i / tokenizer-i, i >= 1 (+ i)
FALLBACK_CONFIDENCE = 0.8


@dataclass(frozen=True)
class MeshConfig:
    engines: int = 1
    models: tuple[str, ...] = ("default",)   # engine i serves models[i % n]; the first is the fallback's
    dtype: str = "auto"
    discovery: str = "static"
    host: str = "127.0.0.1"
    port_offset: int = 0               # shifts every port, so two meshes can share a machine
    region: str = "local"
    kv_cache_mb: int = 1024            # per engine
    versions: tuple[str, ...] = ("1",)  # VERSION or VERSION=FOLDER; engine i serves versions[i % n]
    fallback_engines: int = 0          # engines of the level-3 fallback model (int8 of the first model)
    engine_threads: int = 0            # torch threads per engine; 0: the CPUs `up` may use, shared out
    ready_timeout_s: float = 300.0
    mesh_tls: bool = True              # mutual TLS between the services; False: plaintext (debugging)
    mesh_ca: str = ""                  # the mesh CA folder; "": <infermesh home>/mesh-ca
    restart: bool = True               # restart a child that dies (infermesh/supervise.py); False: report it
    routers: int = 1                   # router replicas: the edge spreads over them (mesh/clients/router_pool.py)
    tokenizers: int = 1                # tokenizer replicas: each router balances over them
    cache_dir: str = ""                # the cache service's disk tier and sessions; "": under home; "none": memory
    session_store: str = EMBEDDED      # the cache service's --session-store: embedded (in cache_dir) or redis://...
    draft_model: str = ""              # the first model's engines draft with it (--draft-model); "": prompt lookup

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError("--engines must be at least 1")
        if self.discovery not in ("static", "consul"):
            raise ValueError(f"--discovery {self.discovery!r} is not static or consul")
        if not self.models:
            raise ValueError("at least one --model is needed")
        if self.kv_cache_mb < 16:
            raise ValueError("--kv-cache-mb must be at least 16")
        if not 0 <= self.port_offset < 10_000:
            raise ValueError("--port-offset must be between 0 and 9999")
        if not self.versions:
            raise ValueError("at least one --version is needed")
        names = [v.partition("=")[0] for v in self.versions]
        for spec, name in zip(self.versions, names, strict=True):
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
                raise ValueError(f"--version {spec!r}: a version is letters, digits, '.', '_' or '-'")
        if len(set(names)) != len(names):
            raise ValueError(f"--version names a version twice: {', '.join(self.versions)}")
        if self.fallback_engines < 0:
            raise ValueError("--fallback-engines must be 0 or more")
        if self.engine_threads < 0:
            raise ValueError("--engine-threads must be 0 (the CPUs shared out among the engines) or more")
        if not 1 <= self.routers <= 9 or not 1 <= self.tokenizers <= 9:
            raise ValueError("--routers and --tokenizers must be between 1 and 9")
        need, kind = max((len(self.versions), "versions"), (len(self.models), "models"))   # an engine each
        if self.engines < need:
            raise ValueError(f"{need} {kind} need at least as many --engines (got {self.engines})")
        if min(len(self.models), len(self.versions)) > 1:
            raise ValueError("--version is for one --model; several models each serve their one version")
        redis_address(self.session_store)           # refused here, before any child starts

    def port(self, base: int) -> int:
        return base + self.port_offset

    def router_port(self, i: int) -> int:
        return self.port(ROUTER_PORT if i == 0 else ROUTER_BASE_PORT + i)

    def tokenizer_port(self, i: int) -> int:
        return self.port(TOKENIZER_PORT if i == 0 else TOKENIZER_BASE_PORT + i)

    def cache_folder(self) -> Path | None:
        """The cache service's state folder (cold KV tier and sessions), kept across its restarts."""
        if self.cache_dir == "none":
            return None
        return Path(self.cache_dir) if self.cache_dir else home() / "cache" / str(self.port(CACHE_PORT))

    def ca_root(self) -> Path:
        return Path(self.mesh_ca) if self.mesh_ca else home() / "mesh-ca"

    def tls(self, kind: str) -> list[str]:
        """`--tls-dir <mesh-ca>/<kind>` for a service's argv; nothing when the mesh runs in plaintext."""
        return ["--tls-dir", str(self.ca_root() / kind)] if self.mesh_tls else []


@dataclass
class Child:
    name: str
    argv: list[str]
    health: str                        # gRPC address, or an http:// URL for the edge
    env: dict[str, str] = field(default_factory=dict)   # added to the launcher's environment
    proc: asyncio.subprocess.Process | None = None
    relay: asyncio.Task[None] | None = field(default=None, repr=False)


def _die_with_parent() -> None:
    # If the launcher is killed outright, its children must not linger holding ports.
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def plan(config: MeshConfig) -> list[list[Child]]:
    """Start order, as stages: each stage's children start together once the one before is ready."""
    py = [sys.executable, "-m"]
    models = [a for m in config.models for a in ("--model", m)]
    tokenizer_addresses = [f"127.0.0.1:{config.tokenizer_port(i)}" for i in range(config.tokenizers)]
    tokenizer = ",".join(tokenizer_addresses)
    cache = f"127.0.0.1:{config.port(CACHE_PORT)}"
    cpus = len(os.sched_getaffinity(0))           # the CPUs this process may use (a container's cpuset, taskset)
    threads = config.engine_threads or max(1, cpus // (config.engines + config.fallback_engines))
    discovery = ["--discovery", config.discovery]
    engines = []
    fallback = []
    if config.fallback_engines:
        # Level 3: the same weights quantized to int8 under a name of their own, a cheaper model
        # the router turns to (degraded, confidence 0.8) when the primary has no usable replica.
        name, folder = served_model(config.models[0])
        fallback = [f"{name}-int8={folder}", f"{name}={name}-int8:{FALLBACK_CONFIDENCE}"]
        models += ["--model", fallback[0]]
    for i in range(config.engines):
        rid, port = f"engine-{i}", config.port(ENGINE_BASE_PORT + i)
        version, _, folder = config.versions[i % len(config.versions)].partition("=")
        model = f"{served_name(config.models[0])}={folder}" if folder else config.models[i % len(config.models)]
        # The draft shares the first model's tokenizer: only that model's engines take it.
        draft = ["--draft-model", config.draft_model] if config.draft_model and model in (
            config.models[0], f"{served_name(config.models[0])}={folder}") else []
        engines.append(Child(rid, [*py, "services.engine", "--replica-id", rid, "--port", str(port),
                                   "--model", model, "--model-version", version, "--dtype", config.dtype, "--region",
                                   config.region, "--threads", str(threads), "--kv-cache-mb",
                                   str(config.kv_cache_mb), "--metrics-port",
                                   str(config.port(ENGINE_METRICS_BASE_PORT + i)), "--cache", cache, *discovery,
                                   *draft, *config.tls("engine")],
                             f"127.0.0.1:{port}"))
    for j in range(config.fallback_engines):
        i = config.engines + j
        rid, port = f"fallback-{j}", config.port(ENGINE_BASE_PORT + i)
        engines.append(Child(rid, [*py, "services.engine", "--replica-id", rid, "--port", str(port),
                                   "--model", fallback[0], "--dtype", "int8", "--region", config.region,
                                   "--threads", str(threads), "--kv-cache-mb", str(config.kv_cache_mb),
                                   "--metrics-port", str(config.port(ENGINE_METRICS_BASE_PORT + i)), "--cache", cache,
                                   *discovery, *config.tls("engine")],
                             f"127.0.0.1:{port}"))
    routers = []
    for i in range(config.routers):
        router_port = config.router_port(i)
        metrics_port = config.port(ROUTER_METRICS_PORT if i == 0 else ROUTER_METRICS_BASE_PORT + i)
        routers.append(Child(
            f"router-{i}", [*py, "services.router", "--replica-id", f"router-{i}", "--port", str(router_port),
                            "--tokenizer", tokenizer, "--cache", cache, "--region", config.region,
                            "--default-version",
                            f"{served_name(config.models[0])}={config.versions[0].partition('=')[0]}",
                            *discovery, "--metrics-port", str(metrics_port), *config.tls("router"),
                            *(["--fallback", fallback[1]] if fallback else []),
                            # Ready (the edge's /health 200) only once every engine is known and healthy.
                            "--expect-engines", str(len(engines)),
                            # With Consul the router finds the engines there, as they register.
                            *(a for e in engines if config.discovery == "static"
                              for a in ("--engine", f"{e.name}={e.health}"))],
            f"127.0.0.1:{router_port}"))
    http_port = config.port(HTTP_PORT)
    edge = Child("edge-0", [*py, "services.edge", "--replica-id", "edge-0", "--host", config.host,
                            "--http-port", str(http_port), "--http3-port", str(config.port(HTTP3_PORT)),
                            "--router", ",".join(r.health for r in routers), "--cache-service", cache, *discovery,
                            *config.tls("edge")],
                 f"http://127.0.0.1:{http_port}/health" if config.host in ("127.0.0.1", "0.0.0.0", "localhost")
                 else f"http://{config.host}:{http_port}/health")
    kept = config.cache_folder()
    # The cache keeps its KV blocks' disk tier, sessions and stored objects here, so a restart loses none
    # (sessions in Redis stay there).  A Redis URL with a password goes by the environment: `ps`
    # shows every command line.
    state = ["--cold-dir", str(kept / "blocks"), "--objects-dir", str(kept)] if kept else []
    redis, secret = redis_address(config.session_store), {}
    if redis is not None and redis.password:
        secret = {"INFERMESH_CACHE_SESSION_STORE": config.session_store}
    elif redis is not None:
        state += ["--session-store", config.session_store]
    elif kept:
        state += ["--sessions-dir", str(kept)]
    tokenizers = [Child(f"tokenizer-{i}", [*py, "services.tokenizer", "--replica-id", f"tokenizer-{i}", "--port",
                                           str(config.tokenizer_port(i)), "--metrics-port",
                                           str(config.port(TOKENIZER_METRICS_PORT if i == 0
                                                           else TOKENIZER_METRICS_BASE_PORT + i)),
                                           *models, *discovery, *config.tls("tokenizer")], address)
                  for i, address in enumerate(tokenizer_addresses)]
    return [
        [Child("cache-0", [*py, "services.cache", "--replica-id", "cache-0", "--port",
                           str(config.port(CACHE_PORT)), "--metrics-port", str(config.port(CACHE_METRICS_PORT)),
                           # the local checkpoint store, for other regions' `model sync --from grpc://`
                           "--checkpoint-store", str(home() / "checkpoints"),
                           *state, *discovery, *config.tls("cache")], cache, secret),
         *tokenizers,
         *engines],
        routers,
        [edge],
    ]


def served_name(model: str) -> str:
    """The name clients use for `--model` (NAME, `default`, or NAME=FOLDER)."""
    return canonical(model.partition("=")[0])


async def _relay_logs(child: Child) -> None:
    assert child.proc is not None and child.proc.stdout is not None
    prefix = f"[{child.name}] ".encode()
    async for line in child.proc.stdout:
        sys.stdout.buffer.write(prefix + line)
        sys.stdout.buffer.flush()


async def _start(child: Child) -> None:
    env = {**os.environ, **child.env, "PYTHONUNBUFFERED": "1"}
    if _FORK_SUPPORT is None:
        env.pop("GRPC_ENABLE_FORK_SUPPORT", None)
    else:
        env["GRPC_ENABLE_FORK_SUPPORT"] = _FORK_SUPPORT
    child.proc = await asyncio.create_subprocess_exec(
        *child.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
        start_new_session=True, preexec_fn=_die_with_parent)
    child.relay = asyncio.create_task(_relay_logs(child))


def http_ok(url: str) -> bool:
    """True when `url` answers 200 (the edge's /health)."""
    try:
        with urllib.request.urlopen(url, timeout=1.0) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


async def _wait_ready(child: Child, deadline: float) -> None:
    assert child.proc is not None
    while time.monotonic() < deadline:
        if child.proc.returncode is not None:
            raise RuntimeError(f"{child.name} exited with code {child.proc.returncode} before it was ready")
        if child.health.startswith("http://"):
            ok = await asyncio.to_thread(http_ok, child.health)
        else:
            ok = await check_health(child.health)
        if ok:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{child.name} was not ready within the timeout")


async def _stop(child: Child, grace: float = 10.0) -> None:
    proc = child.proc
    if proc is None or proc.returncode is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), grace)
    except TimeoutError:
        log.warning("%s did not stop within %.0fs; killing it", child.name, grace)
        proc.kill()
        await proc.wait()
    if child.relay is not None:
        await asyncio.gather(child.relay, return_exceptions=True)


async def run(config: MeshConfig) -> int:
    """Run the mesh until SIGINT/SIGTERM.  Returns the exit code."""
    stages = plan(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    started: list[list[Child]] = []
    code = 0
    if config.discovery == "consul":
        from mesh.discovery import DiscoveryError
        from mesh.discovery.consul import ConsulDiscovery

        try:
            await ConsulDiscovery.from_env().leader()
        except DiscoveryError as exc:
            print(f"infermesh: {exc}", file=sys.stderr, flush=True)
            return 1
    try:      # the launcher's own /metrics (restarts), beside the services'
        start_http_server(config.port(LAUNCHER_METRICS_PORT), addr="127.0.0.1")
    except OSError as exc:
        log.warning("launcher metrics not served on port %d: %s", config.port(LAUNCHER_METRICS_PORT), exc)
    tls_note = "plaintext (--insecure-mesh)"
    if config.mesh_tls:
        # Made (or reused) before any service starts; this process polls health as the `client` kind.
        root = await asyncio.to_thread(ensure_mesh_ca, config.ca_root(), [config.host])
        credentials.configure(root / "client")
        tls_note = f"mutual TLS: {credentials.ENV_VAR}={root / 'client'}"
    try:
        deadline = time.monotonic() + config.ready_timeout_s
        for stage in stages:
            started.append(stage)
            for child in stage:
                await _start(child)
            waiting: asyncio.Future[Any] = asyncio.gather(*(_wait_ready(c, deadline) for c in stage))
            stopper: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
            await asyncio.wait([waiting, stopper], return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if stop.is_set():
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
                return 130
            waiting.result()
        edge = stages[-1][0]
        print(f"infermesh ready: http://{config.host}:{config.port(HTTP_PORT)} (HTTP/1.1), "
              f"https://{config.host}:{config.port(HTTP3_PORT)} (HTTP/3), "
              f"router grpc {', '.join(c.health for c in stages[1])} ({tls_note}); health {edge.health}", flush=True)
        await supervise([c for stage in started for c in stage], stop, _start, restart=config.restart,
                        log=lambda line: print(line, flush=True))
    except RuntimeError as exc:
        print(f"infermesh: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        # Front to back: the edge stops taking requests before the services behind it go.
        for stage in reversed(started):
            await asyncio.gather(*(_stop(c) for c in stage))
        print("infermesh stopped", flush=True)
    return code
